"""``pdtrace check`` on the session's lab stores (real vLLM engines, traced connectors, middleware, router).

Here beside the dashboard tests only to share their session-scoped lab stores
(``lab_stores`` in conftest.py: pull and push, the traced lab modules' runs or
labs of the dashboard's own, stopped before the tests read them), so no lab is
started for it. The
labs have stopped, so ages are measured from the trace end (``--at-end``).
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pdtrace.cli.main import main

pytestmark = pytest.mark.lab


def _clock_evidence(d) -> list[tuple]:
    """The router<->engine messages per (src, dst, kind): count, and how many lack a send or a receipt
    (what a clock problem is made of; printed with a failure so that it can be diagnosed)."""
    from pdtrace.analysis import db

    with db.open_trace(d, cache=None) as tr:
        return [tuple(r.values()) for r in tr.query("""
            SELECT src, dst, kind, count(*) AS n, count(*) FILTER (WHERE sent_ns IS NULL) AS no_send,
                   count(*) FILTER (WHERE recv_ns IS NULL) AS no_recv
            FROM _clock_request_msgs('_mat_clock_router_part') GROUP BY ALL ORDER BY ALL""")]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_check_lab_store(lab_stores, mode):
    d = lab_stores[mode]["dir"]
    res = CliRunner().invoke(main, ["check", "--no-cache", "--at-end", "--format", "json", str(d)],
                             catch_exceptions=False)
    data = json.loads(res.output)
    if data["problems"]:
        pytest.fail(f"problems: {data['problems']}; clock evidence (src, dst, kind, n, no send, no receipt): "
                    f"{_clock_evidence(d)}; clock rows: {data['clock']}")
    assert res.exit_code == 0
    procs = data["processes"]
    # a router process per router start (the traced push run restarts its router), none with an engine id;
    # each engine: its API server (middleware) and its engine processes (connector)
    assert sorted({p["role"] for p in procs}) == ["decode", "prefill", "router"]
    routers = [p["engine_id"] for p in procs if p["role"] == "router"]
    assert set(routers) == {None} and len(routers) == lab_stores[mode]["router_starts"], routers
    # live (flushed within a minute of the trace end): every engine process and the last router started (an
    # earlier router start stopped when the lab restarted its router, maybe minutes before the end)
    last_router = max((p for p in procs if p["role"] == "router"), key=lambda p: p["last_flush_ns"] or 0)
    for role in ("prefill", "decode"):
        mine = [p for p in procs if p["role"] == role]
        assert len({p["engine_id"] for p in mine}) == 1 and mine[0]["engine_id"] is not None
        assert [p["service_name"] for p in mine if p["connector"] is None] == [f"pdtrace-{role}-api"]
        engine = [p for p in mine if p["connector"] is not None]
        assert engine and {p["connector"] for p in engine} == {f"TracedNixl{mode.capitalize()}Connector"}
        assert all(p["vllm_version"] for p in engine)
    assert len({(p["host"], p["pid"]) for p in procs}) == len(procs)
    for p in procs:
        assert p["last_flush_ns"] is not None
        assert p["live"] or (p["role"] == "router" and p is not last_router), p
        assert p["dropped"] == 0 and p["write_errors"] == 0 and p["dropped_attributes"] == 0
        assert p["written"] > 0 and p["sample"] == 1.0
    assert data["files"]["skipped"] == [] and data["files"]["read"] > 0
    assert {(c["clock_a"], c["clock_b"]) for c in data["clock"]} >= {
        ("router", next(p["engine_id"] for p in procs if p["role"] == r)) for r in ("prefill", "decode")}
