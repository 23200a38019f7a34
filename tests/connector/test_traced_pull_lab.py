"""Traced pull connector on real engines (the lab's launcher and router): ≥ 20 real-trace requests.

Two labs, each started once for the module and stopped before the next:

1. traced by the production recipe: vLLM's stock serving command (connector
   ``NixlPullConnector``, no module path, no ``--middleware``) plus
   ``PDTRACE_DIR`` = the run directory (sampling 1), so pdtrace's vLLM plugin
   does the tracing: a first request (first contact: the handshake), then 20
   Azure-conversation requests replayed open-loop through the router, then
   greedy prompts (their tokens go to the session's ``traced_greedy_record``:
   ``tests/lab/test_pull.py`` checks that its untraced lab, the same stock
   command without ``PDTRACE_DIR``, gives the same tokens and runs no pdtrace
   thread or sink); vLLM's ``vllm:nixl_*`` counters are read from D before the
   lab stops (engines flush on shutdown). Most checks read this one trace; the
   dashboard tests show it (``traced_lab_stores``).
2. pdtrace's explicit class names (``TracedNixlPullConnector`` + module path,
   ``--middleware``) at ``PDTRACE_SAMPLE=0.5``: 20 requests; router, P and D
   keep exactly the same request ids, which are those the sampling rule
   selects; every process records activation 'explicit'.
"""
from __future__ import annotations

import pytest

import labtrace as lt
from pdtrace.connector.lab import metrics
from pdtrace.connector.lab.launcher import Lab
from pdtrace.connector.lab.model import model_info

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]

N_REPLAY = lt.N_REPLAY
STAGES_ONCE = ("prefill.queue", "decode.queue", "handoff.prep", "handoff.descriptors",
               "kv.transfer", "kv.ready", "decode.first_step", "decode.block_reserve", "prefill.block_hold")


def _traced_cfg(model, run_dir, trace: bool, env: dict | None = None):
    return lt.traced_cfg(model, run_dir, trace, mode="pull", env=env)


def _plugin_cfg(model, run_dir, trace: bool):
    return lt.plugin_cfg(model, run_dir, trace, mode="pull")


@pytest.fixture(scope="module")
def model_dir():
    return lt.lab_model("default")  # the shared model cache (built once per machine)


@pytest.fixture(scope="module")
def wl(model_dir):
    return lt.azure_workload(model_dir, N_REPLAY)


@pytest.fixture(scope="module")
def greedy_prompts(wl):
    return [r.prompt for r in wl.requests[:4]]


@pytest.fixture(scope="module")
def traced_run(model_dir, wl, greedy_prompts, tmp_path_factory, traced_greedy_record, traced_lab_stores):
    """The traced lab's run: trace dir, client records, D's nixl counters, greedy outputs (also recorded in
    ``traced_greedy_record["pull"]``; the trace dir in ``traced_lab_stores["pull"]``)."""
    run_dir = tmp_path_factory.mktemp("traced")
    with Lab(_plugin_cfg(model_dir, run_dir, trace=True)) as lab:
        lt.warm_up(lab, wl.requests[0].prompt, tries=1)
        recs = lt.replay_ok(lab, wl)
        greedy = lt.greedy(lab, greedy_prompts)
        d_metrics = lt.settled_metrics(lab.decodes[0].url, "vllm:nixl_xfer_time_seconds_count", N_REPLAY + 4)
        stats = metrics.router_stats(lab.router_url)
        affinity = lt.helper_affinities(lab)
        in_procs = lt.pdtrace_in_processes(lab)
    traced_greedy_record["pull"] = {"model": model_dir, "prompts": greedy_prompts, "outputs": greedy}
    traced_lab_stores["pull"] = {"dir": run_dir, "router_starts": 1}
    tr = lt.open_trace(run_dir)
    yield {"dir": run_dir, "tr": tr, "recs": recs, "greedy": greedy, "d_metrics": d_metrics, "stats": stats,
           "affinity": affinity, "in_procs": in_procs,
           "kv_bytes_per_token": model_info(model_dir)["kv_bytes_per_token"]}
    tr.close()


def _q(run, sql, params=None):
    return run["tr"].query(sql, params)


def test_every_request_has_one_router_root_and_joined_engine_spans(traced_run):
    # besides the replay: the first (handshake) request and the greedy prompts
    lt.check_joined(traced_run["tr"], {r.router_request_id for r in traced_run["recs"]},
                    N_REPLAY + 1 + len(traced_run["greedy"]))


def test_every_stage_once_per_attempt_and_rank(traced_run):
    lt.check_stages_once(traced_run["tr"], [r.router_request_id for r in traced_run["recs"]], STAGES_ONCE)


def test_causal_order(traced_run):
    lt.check_causal(traced_run["tr"], [r.router_request_id for r in traced_run["recs"]])


def test_transfer_bytes_are_blocks_times_block_bytes(traced_run):
    lt.check_transfer_bytes(traced_run["tr"], [r.router_request_id for r in traced_run["recs"]],
                            traced_run["kv_bytes_per_token"])


def test_transfer_totals_equal_vllm_nixl_counters(traced_run):
    """Pull: D owns the READ handles, so D's ``vllm:nixl_*`` counters are compared."""
    lt.check_nixl_counters(traced_run["tr"], traced_run["d_metrics"], min_count=N_REPLAY + 4)


def test_handshake_only_on_the_first_request_per_pair_and_rank(traced_run):
    lt.check_handshake_once(traced_run["tr"], {r.router_request_id for r in traced_run["recs"]})


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


def test_sinks_are_not_pinned_to_an_engine_core(traced_run):
    """vLLM pins each lab worker to its engine's core; the writer and its sink leave it (instrument/cpus.py)."""
    a = traced_run["affinity"]
    print(a)
    if len(a["allowed"]) < 2:
        pytest.skip("one CPU: nothing to leave")
    assert any(name.startswith("VLLM::Worker") and len(cpus) == 1 for name, cpus in a["pinned_engine_procs"]), a
    # one sink for the host, whatever the number of traced processes (router, 2 API servers, 2 engine
    # cores, 2 workers)
    assert len(a["sinks"]) == 1 and all(cpus == a["allowed"] for _, cpus in a["sinks"]), a


def test_no_tracing_errors_logged(traced_run):
    lt.check_no_tracing_errors(traced_run["dir"])


def test_engines_traced_through_the_plugin(traced_run):
    """Stock command + PDTRACE_DIR: engines' stats rows say 'plugin' (router: 'explicit'); the connector
    vLLM built is pdtrace's; a pdtrace-writer thread runs in every API server and EngineCore."""
    by = lt.check_activation(traced_run["dir"], "plugin")
    print(by, traced_run["in_procs"])
    log = (traced_run["dir"] / "logs" / "decode-0.log").read_text(errors="replace")
    assert "Creating v1 connector with name: TracedNixlPullConnector" in log
    assert len(traced_run["in_procs"]["writers"]) >= 4 and len(traced_run["in_procs"]["sinks"]) == 1


def test_sampling_half_keeps_the_same_ids_everywhere(model_dir, wl, traced_run, tmp_path_factory, monkeypatch):
    from pdtrace.instrument import ids as _ids

    run_dir = tmp_path_factory.mktemp("sampled")
    monkeypatch.setenv("PDTRACE_SAMPLE", "0.5")  # inherited by the router and the engines
    with Lab(_traced_cfg(model_dir, run_dir, trace=True)) as lab:
        recs = lt.replay_ok(lab, wl)
    sent = {r.router_request_id for r in recs}
    with lt.open_trace(run_dir) as tr:
        rows = tr.query("""SELECT role, list(DISTINCT request_id) AS ids FROM spans
                           WHERE request_id IS NOT NULL GROUP BY role""")
    by = {r["role"]: set(r["ids"]) for r in rows}
    kept = by["router"] & sent
    print(f"PDTRACE_SAMPLE=0.5: {len(kept)} of {len(sent)} requests kept")
    assert 0 < len(kept) < len(sent)
    assert by["router"] == by["prefill"] == by["decode"]
    assert kept == {x for x in sent if _ids.is_sampled(x, 0.5)}
    lt.check_activation(run_dir, "explicit")  # pdtrace's class names on the command line


def test_engine_clock_window_without_the_routers_files(traced_run):
    """Issue 16 item 2: the run's files minus the router's give every replayed request a complete engine-clock
    TTFT (ttft_source = engine) whose breakdown tiles the window to the ns, within the router's TTFT."""
    from engine_window import check_engine_window
    check_engine_window(traced_run["dir"], [r.router_request_id for r in traced_run["recs"]])


def test_spark_engine_gives_duckdbs_answers(traced_run, spark):
    """Issue 20: the same answers from Spark's tasks as from DuckDB on this lab run."""
    lt.check_spark_engine(traced_run["dir"], traced_run["tr"], spark)
