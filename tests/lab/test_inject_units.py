"""The lab's injected delays without an engine: the spec, the selection rule, the kv.ready hold-back,
the switch, the CLI check and the benchmark's paired-neighbour estimate."""
from __future__ import annotations

import types

import labkit
import pytest

from pdtrace.connector.lab import inject, paired


@pytest.fixture
def spec(monkeypatch):
    def set_spec(s):
        monkeypatch.setattr(inject, "_spec", inject.parse(s))
        monkeypatch.setattr(inject, "_done", set())
    yield set_spec


def test_parse_units_and_errors():
    assert inject.parse("handoff.prep=40ms, kv.ready=0.025s,router.dispatch=30") == {
        "handoff.prep": 40.0, "kv.ready": 25.0, "router.dispatch": 30.0}
    assert inject.parse("") == {} and inject.parse(None) == {}
    for bad in ("prefill.compute=10ms", "handoff.prep", "handoff.prep=abc", "kv.ready=-1ms",
                "kv.ready=5ms,kv.ready=6ms"):
        with pytest.raises(inject.InjectSpecError):
            inject.parse(bad)


def test_selection_is_deterministic_about_half_and_independent_per_stage():
    ids = [f"lab-{k:016x}" for k in range(2000)]
    a = [inject.selected("handoff.prep", x) for x in ids]
    b = [inject.selected("kv.ready", x) for x in ids]
    assert a == [inject.selected("handoff.prep", x) for x in ids]
    assert 0.45 < sum(a) / len(a) < 0.55
    both = sum(x and y for x, y in zip(a, b)) / len(ids)
    assert 0.2 < both < 0.3  # independent: about a quarter get both


def test_delay_only_for_selected_requests_once(spec):
    spec("dest.register=15ms")
    on = next(f"lab-{k:016x}" for k in range(100) if inject.selected("dest.register", f"lab-{k:016x}"))
    off = next(f"lab-{k:016x}" for k in range(100) if not inject.selected("dest.register", f"lab-{k:016x}"))
    internal = f"cmpl-{on}-0-1a2b3c4d"  # the engines' internal id maps to the same base id
    assert inject.delay_ms("dest.register", internal, once_key=internal) == 15.0
    assert inject.delay_ms("dest.register", internal, once_key=internal) == 0.0  # once per request
    assert inject.delay_ms("dest.register", off) == 0.0
    assert inject.delay_ms("kv.ready", on) == 0.0  # a stage not in the spec


def test_kv_ready_is_held_back_then_released(spec, monkeypatch):
    spec("kv.ready=25ms")
    ids = [f"cmpl-lab-{k:016x}-0-1a2b3c4d" for k in range(40)]
    sel = {r for r in ids if inject.selected("kv.ready", inject._split(r)[0])}
    now = [1_000_000_000]
    monkeypatch.setattr(inject.time, "monotonic_ns", lambda: now[0])
    conn = types.SimpleNamespace()
    got = inject._hold(conn, set(ids))
    assert got == set(ids) - sel and sel  # the selected ids wait
    now[0] += 10_000_000
    assert inject._hold(conn, set()) == set()  # 10 ms later: still held
    now[0] += 16_000_000
    assert inject._hold(conn, set()) == sel  # 26 ms after first seen: reported
    assert inject._hold(conn, set()) == set()


def test_unset_installs_nothing(monkeypatch):
    """(The lab's sitecustomize running install() in a fresh interpreter: tests/lab/test_amx_units.py.)"""
    monkeypatch.setattr(inject, "_spec", None)
    monkeypatch.delenv(inject.ENV_SWITCH, raising=False)
    assert inject.install() is False


def test_cli_rejects_a_bad_spec_before_starting_anything(tmp_path):
    from click.testing import CliRunner

    from pdtrace.cli.main import main
    res = CliRunner().invoke(main, ["lab", "--inject", "prefill.compute=10ms", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--inject" in res.output
    assert not (tmp_path / "x").exists()


def test_paired_neighbour_delta_recovers_a_step():
    mod = labkit.benchmark("inject_attribution")
    rows = []
    for i in range(30):
        inj = {"kv.ready": 25.0} if i % 2 else {}
        base = 100.0 + i  # a slow drift the neighbours cancel
        rows.append({"injected": inj, "ttft_ms": base + (25.0 if inj else 0.0),
                     "exposed": {"kv.ready": 2.0 + (25.0 if inj else 0.0)}, "hidden": {}, "rule": set(inj)})
    m, lo, hi, n = mod.paired_delta(rows, "kv.ready", lambda r: r["ttft_ms"])
    assert n == 15 and m == pytest.approx(25.0, abs=0.1) and lo <= 25.0 <= hi + 0.1
    res = mod.evaluate(rows, {"kv.ready": 25.0}, "pull")
    assert res[0]["path"] == "on" and res[0]["ok"] and abs(res[0]["error_ms"]) < 0.1
    # off the path: the stage's time is hidden, TTFT flat
    for r in rows:
        r["ttft_ms"] = 100.0
        r["hidden"] = {"kv.ready": 25.0 if r["injected"] else 0.0}
        r["exposed"] = {"kv.ready": 0.0}
    res = mod.evaluate(rows, {"kv.ready": 25.0}, "push")
    assert res[0]["path"] == "off" and res[0]["ok"]


def test_ttft_delta_is_matched_on_the_other_stages_injections():
    """Two stages injected independently (a factorial design): each request's TTFT carries both delays.
    Unmatched, a treated request's nearest controls may carry the other stage's 40 ms where it does not
    (or the reverse), so one pair is off by 40 ms; matched on the other stage, every pair is exact."""
    mod = labkit.benchmark("inject_attribution")
    pattern = [(0, 0), (1, 1), (0, 1), (1, 0), (1, 1), (0, 0), (1, 0), (0, 1)] * 6   # (kv.ready, handoff.prep)
    rows = []
    for i, (a, b) in enumerate(pattern):
        inj = {**({"kv.ready": 25.0} if a else {}), **({"handoff.prep": 40.0} if b else {})}
        rows.append({"request_id": f"r{i}", "injected": inj, "rule": set(inj), "hidden": {},
                     "ttft_ms": 100.0 + 25.0 * a + 40.0 * b,
                     "exposed": {"kv.ready": 25.0 * a, "handoff.prep": 40.0 * b}})
    diffs, _ = paired.neighbour_differences([bool(a) for a, _ in pattern], [r["ttft_ms"] for r in rows])
    assert any(abs(d - 25.0) >= 20.0 for d in diffs)  # unmatched: the other stage's delay leaks into pairs
    for stage, inj in (("kv.ready", 25.0), ("handoff.prep", 40.0)):
        m, lo, hi, n = mod.paired_delta(rows, stage, lambda r: r["ttft_ms"],
                                        match=mod.same_other_injections(rows, stage))
        assert n == 24 and (m, lo, hi) == (inj, inj, inj)
    res = {r["stage"]: r for r in mod.evaluate(rows, {"kv.ready": 25.0, "handoff.prep": 40.0}, "pull")}
    assert res["kv.ready"]["ttft_ms"] == 25.0 and res["handoff.prep"]["ttft_ms"] == 40.0
    assert res["kv.ready"]["ttft_ci"] == (25.0, 25.0) and res["kv.ready"]["ttft_ok"]


def test_prefill_frontend_sleeps_inside_the_middleware_on_prefill_only(spec, monkeypatch):
    """The delay runs after the middleware's span started and before the wrapped app (vLLM) sees the request."""
    import asyncio

    spec("prefill.frontend=20ms")
    x = next(f"lab-{k:016x}" for k in range(100) if inject.selected("prefill.frontend", f"lab-{k:016x}"))
    order = []

    class FakeMiddleware:
        def __init__(self, app, role="prefill"):
            self.app, self.role = app, role

    mod = types.SimpleNamespace(FrontendMiddleware=FakeMiddleware, _PATHS=("/v1/completions",))
    inject._patch_middleware(mod)
    inject._patch_middleware(mod)  # idempotent

    async def app(scope, receive, send):
        order.append("app")

    async def fake_sleep(stage, rid, once_key=None):
        order.append((stage, rid))
    monkeypatch.setattr(inject, "asleep", fake_sleep)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"x-request-id", x.encode())]}
    asyncio.run(FakeMiddleware(app).app(scope, None, None))
    assert order == [("prefill.frontend", x), "app"]
    assert FakeMiddleware(app, role="decode").app is app  # D's frontend is left alone
