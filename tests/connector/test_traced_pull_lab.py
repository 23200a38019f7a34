"""Traced pull connector on real engines (the lab's launcher and router): ≥ 20 real-trace requests.

Three labs, each started once for the module and stopped before the next:

1. traced (``PDTRACE_DIR`` = the run directory, sampling 1): a first request
   (first contact: the handshake), then 20 Azure-conversation requests replayed
   open-loop through the router, then greedy prompts; vLLM's ``vllm:nixl_*``
   counters are read from D before the lab stops (engines flush on shutdown).
   Most checks read this one trace.
2. tracing off (same traced classes, no ``PDTRACE_DIR``): the same greedy
   prompts -> outputs must be identical.
3. traced at ``PDTRACE_SAMPLE=0.5``: 20 requests; router, P and D keep exactly
   the same request ids, which are those the sampling rule selects.
"""
from __future__ import annotations

import asyncio
import json
import math
import urllib.request
from pathlib import Path

import pytest

from pdtrace.connector.lab import env as lab_env
from pdtrace.connector.lab import metrics, replay, workload
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model, model_info

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]

MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"
N_REPLAY = 20
BLOCK_TOKENS = 128  # vLLM's CPU block size (the lab's engines)


def _post(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _traced_cfg(model: Path, run_dir: Path, trace: bool, env: dict | None = None) -> LabConfig:
    return LabConfig(model=model, mode="pull", run_dir=run_dir, trace_dir=(run_dir.resolve() if trace else None),
                     connector_class="TracedNixlPullConnector", connector_module="pdtrace.connector.traced",
                     extra_args=["--middleware", MIDDLEWARE], extra_env=env or {})


def _greedy(lab: Lab, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        r = _post(lab.router_url + "/v1/completions",
                  {"model": "lab", "prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                   "logprobs": 0, "return_tokens_as_token_ids": True})
        out.append(r["choices"][0]["logprobs"]["tokens"])
    return out


def _replay(lab: Lab, wl) -> list:
    recs = asyncio.run(replay.replay(wl, lab.router_url, timeout_s=300, progress=False))
    bad = [(r.request_index, r.status, r.http_status, r.error_type) for r in recs if not r.ok]
    assert not bad, bad
    return recs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    found = lab_env.problems(import_check=False)
    if found:
        import os
        msg = "lab environment not ready: " + "; ".join(p.what for p in found)
        if os.environ.get("PDTRACE_LAB_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return make_model("default")  # the shared model cache (built once per machine)


@pytest.fixture(scope="module")
def wl(model_dir):
    from pdtrace.connector.data import AZURE_CONV
    return workload.build("azure-conv", AZURE_CONV, vocab_size=model_info(model_dir)["vocab_size"],
                          length_scale=0.25, rate_scale=1.0, max_requests=N_REPLAY, max_model_len=8192)


@pytest.fixture(scope="module")
def greedy_prompts(wl):
    return [r.prompt for r in wl.requests[:4]]


@pytest.fixture(scope="module")
def traced_run(model_dir, wl, greedy_prompts, tmp_path_factory):
    """The traced lab's run: trace dir, client records, D's nixl counters, greedy outputs."""
    run_dir = tmp_path_factory.mktemp("traced")
    with Lab(_traced_cfg(model_dir, run_dir, trace=True)) as lab:
        first = _post(lab.router_url + "/v1/completions",
                      {"model": "lab", "prompt": wl.requests[0].prompt[:40], "max_tokens": 2, "ignore_eos": True})
        assert first["choices"][0]["text"] is not None
        recs = _replay(lab, wl)
        greedy = _greedy(lab, greedy_prompts)
        d_metrics = metrics.scrape(lab.decodes[0].url)
        stats = metrics.router_stats(lab.router_url)
    from pdtrace.analysis import db
    tr = db.open_trace(run_dir, cache=run_dir / "analysis.duckdb")
    yield {"dir": run_dir, "tr": tr, "recs": recs, "greedy": greedy, "d_metrics": d_metrics, "stats": stats,
           "kv_bytes_per_token": model_info(model_dir)["kv_bytes_per_token"]}
    tr.close()


def _q(run, sql, params=None):
    return run["tr"].query(sql, params)


def test_every_request_has_one_router_root_and_joined_engine_spans(traced_run):
    recs = traced_run["recs"]
    ids = {r.router_request_id for r in recs}
    assert len(ids) == N_REPLAY and None not in ids
    rows = _q(traced_run, """
        SELECT request_id,
               count(*) FILTER (WHERE stage = 'router.request') AS roots,
               count(*) FILTER (WHERE role = 'prefill') AS p_spans,
               count(*) FILTER (WHERE role = 'decode') AS d_spans
        FROM spans WHERE request_id IS NOT NULL GROUP BY request_id""")
    by = {r["request_id"]: r for r in rows}
    for x in ids:
        r = by.get(x)
        assert r is not None, f"{x}: no span at all"
        assert r["roots"] == 1 and r["p_spans"] > 0 and r["d_spans"] > 0, r
    # every id an engine recorded is a router id (internal ids stripped back to X on both engines);
    # besides the replay: the first (handshake) request and the greedy prompts
    assert all(r["roots"] == 1 for r in by.values()), [r for r in by.values() if r["roots"] != 1]
    assert len(by) == N_REPLAY + 1 + len(traced_run["greedy"]), len(by)
    req = {r["request_id"]: r for r in _q(traced_run, "SELECT * FROM requests")}
    assert all(req[x]["status"] == "complete" and req[x]["ttft_ms"] > 0 for x in ids)


STAGES_ONCE = ("prefill.frontend", "prefill.queue", "decode.queue", "handoff.prep", "handoff.descriptors",
               "kv.transfer", "kv.ready", "decode.first_step", "decode.block_reserve", "prefill.block_hold")


def test_every_stage_once_per_attempt_and_rank(traced_run):
    ids = [r.router_request_id for r in traced_run["recs"]]
    rows = _q(traced_run, """
        SELECT request_id, stage, attempt, coalesce(tp_rank, -1) AS rank, count(*) AS n,
               count(*) FILTER (WHERE attr_str['frontend.part'] = 'in') AS n_in,
               count(*) FILTER (WHERE attr_str['frontend.part'] = 'out') AS n_out,
               count(*) FILTER (WHERE parent_span_id IS NULL) AS n_top
        FROM spans WHERE request_id IS NOT NULL GROUP BY ALL""")
    got = {}
    for r in rows:
        got.setdefault(r["request_id"], {})[(r["stage"], r["attempt"], r["rank"])] = r
    for x in ids:
        st = got[x]
        for stage in STAGES_ONCE + ("decode.frontend",):
            hits = [v for (s, a, k), v in st.items() if s == stage]
            assert hits, f"{x}: {stage} missing"
            assert all(h["attempt"] == 0 for h in hits), (x, stage)
            if stage.endswith("frontend"):
                assert [(h["n_in"], h["n_out"]) for h in hits] == [(1, 1)], (x, stage, hits)
            else:
                assert all(h["n"] == 1 for h in hits), (x, stage, hits)
        # prefill.compute: one top-level span (+ one child per chunk)
        pc = [v for (s, a, k), v in st.items() if s == "prefill.compute"]
        assert len(pc) == 1 and pc[0]["n_top"] == 1 and pc[0]["n"] >= 2, (x, pc)
        assert ("router.request", 0, -1) in st and st[("router.request", 0, -1)]["n"] == 1
    bad = _q(traced_run, "SELECT stage, request_id FROM spans WHERE raw_end_ns < raw_start_ns")
    assert not bad, bad


def test_causal_order(traced_run):
    ids = [r.router_request_id for r in traced_run["recs"]]
    rows = _q(traced_run, """
        SELECT request_id,
               max(end_ns) FILTER (WHERE stage = 'prefill.compute') AS p_compute_end,
               max(end_ns) FILTER (WHERE stage = 'kv.transfer') AS xfer_end,
               min(start_ns) FILTER (WHERE stage = 'kv.transfer') AS xfer_start,
               min(start_ns) FILTER (WHERE stage = 'kv.ready') AS ready_start,
               min(start_ns) FILTER (WHERE stage = 'decode.first_step') AS first_step_start,
               min(end_ns) FILTER (WHERE stage = 'handoff.prep') AS prep_end,
               min(start_ns) FILTER (WHERE stage = 'router.request') AS arrival
        FROM spans WHERE request_id IS NOT NULL GROUP BY request_id""")
    by = {r["request_id"]: r for r in rows}
    for x in ids:
        r = by[x]
        assert r["arrival"] <= r["p_compute_end"] < r["xfer_end"], r
        assert r["prep_end"] <= r["xfer_start"] + 1_000_000, r  # post ends prep; raw clocks of one host
        assert r["ready_start"] <= r["first_step_start"], r
        assert r["xfer_end"] <= r["first_step_start"], r


def test_transfer_bytes_are_blocks_times_block_bytes(traced_run):
    block_bytes = BLOCK_TOKENS * traced_run["kv_bytes_per_token"]
    ids = [r.router_request_id for r in traced_run["recs"]]
    rows = _q(traced_run, """
        SELECT t.request_id, t.bytes, t.blocks, q.prompt_tokens
        FROM transfers t JOIN requests q USING (rkey)""")
    by = {r["request_id"]: r for r in rows}
    for x in ids:
        r = by[x]
        assert r["blocks"] and r["bytes"] == r["blocks"] * block_bytes, r
        n = r["prompt_tokens"]
        assert r["blocks"] in (math.ceil((n - 1) / BLOCK_TOKENS), math.ceil(n / BLOCK_TOKENS)), r


def test_transfer_totals_equal_vllm_nixl_counters(traced_run):
    m = traced_run["d_metrics"]
    prom_count = metrics.total(m, "vllm:nixl_xfer_time_seconds_count")
    prom_bytes = metrics.total(m, "vllm:nixl_bytes_transferred_sum")
    prom_time = metrics.total(m, "vllm:nixl_xfer_time_seconds_sum")
    t = _q(traced_run, """SELECT count(*) AS n, sum(attr_int['kv.bytes']) AS b, sum(attr_int['kv.xfer_ns']) AS ns
                          FROM spans WHERE stage = 'kv.transfer'""")[0]
    print(f"kv.transfer: {t['n']} spans, {t['b']} B, {t['ns'] / 1e9:.4f} s; vLLM: {prom_count:.0f}, "
          f"{prom_bytes:.0f} B, {prom_time:.4f} s")
    assert prom_count >= N_REPLAY + 4
    assert abs(t["n"] - prom_count) <= 0.01 * prom_count
    assert abs(t["b"] - prom_bytes) <= 0.01 * prom_bytes
    assert abs(t["ns"] / 1e9 - prom_time) <= 0.01 * prom_time + 1e-6


def test_handshake_only_on_the_first_request_per_pair_and_rank(traced_run):
    hs = _q(traced_run, """
        SELECT s.request_id, s.engine_id, s.tp_rank, s.attr_str['peer.engine_id'] AS peer, q.arrival_ns
        FROM spans s JOIN requests q USING (rkey) WHERE s.stage = 'handoff.handshake'""")
    assert len(hs) == 1, hs
    first = _q(traced_run, "SELECT request_id FROM requests ORDER BY arrival_ns LIMIT 1")[0]["request_id"]
    assert hs[0]["request_id"] == first
    ids = {r.router_request_id for r in traced_run["recs"]}
    assert hs[0]["request_id"] not in ids
    fc = _q(traced_run, "SELECT request_id FROM spans WHERE stage = 'handoff.prep' AND attr_int['kv.first_contact'] = 1")
    assert [r["request_id"] for r in fc] == [first]


def test_unattributed_share_and_breakdown(traced_run):
    ids = [r.router_request_id for r in traced_run["recs"]]
    rows = _q(traced_run, "SELECT * FROM ttft_breakdown")
    by = {r["request_id"]: r for r in rows}
    shares = []
    for x in ids:
        b = by[x]
        assert b["queue_ns"] + b["compute_ns"] + b["transfer_ns"] + b["coordination_ns"] == b["ttft_ns"], b
        assert b["compute_ns"] > 0, b
        shares.append(b["unattributed_ns"] / b["ttft_ns"])
    shares.sort()
    med = shares[len(shares) // 2]
    print(f"unattributed share of TTFT: median {med:.4f}, max {shares[-1]:.4f}")
    assert med <= 0.05


def test_every_pull_request_has_transfer_on_its_critical_path(traced_run):
    by = {r["request_id"]: r for r in _q(traced_run, "SELECT * FROM ttft_breakdown")}
    for x in [r.router_request_id for r in traced_run["recs"]]:
        assert by[x]["transfer_ns"] > 0, by[x]


def test_no_tracing_errors_logged(traced_run):
    logs = "".join(p.read_text(errors="replace") for p in (traced_run["dir"] / "logs").glob("*.log"))
    assert "pdtrace: tracing error" not in logs


@pytest.fixture(scope="module")
def untraced_greedy(model_dir, greedy_prompts, traced_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("untraced")
    with Lab(_traced_cfg(model_dir, run_dir, trace=False)) as lab:
        out = _greedy(lab, greedy_prompts)
    assert not list(run_dir.glob("*.parquet"))
    return out


def test_greedy_outputs_equal_with_tracing_off(traced_run, untraced_greedy):
    assert traced_run["greedy"] == untraced_greedy


def test_sampling_half_keeps_the_same_ids_everywhere(model_dir, wl, traced_run, tmp_path_factory, monkeypatch):
    from pdtrace.analysis import db
    from pdtrace.instrument import ids as _ids

    run_dir = tmp_path_factory.mktemp("sampled")
    monkeypatch.setenv("PDTRACE_SAMPLE", "0.5")  # inherited by the router and the engines
    with Lab(_traced_cfg(model_dir, run_dir, trace=True)) as lab:
        recs = _replay(lab, wl)
    sent = {r.router_request_id for r in recs}
    with db.open_trace(run_dir, cache=run_dir / "analysis.duckdb") as tr:
        rows = tr.query("""SELECT role, list(DISTINCT request_id) AS ids FROM spans
                           WHERE request_id IS NOT NULL GROUP BY role""")
    by = {r["role"]: set(r["ids"]) for r in rows}
    kept = by["router"] & sent
    print(f"PDTRACE_SAMPLE=0.5: {len(kept)} of {len(sent)} requests kept")
    assert 0 < len(kept) < len(sent)
    assert by["router"] == by["prefill"] == by["decode"]
    assert kept == {x for x in sent if _ids.is_sampled(x, 0.5)}
