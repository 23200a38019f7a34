"""Traced push connector on real engines (the lab's launcher and router): ≥ 20 real-trace requests.

One lab: a traced push lab by the production recipe: vLLM's stock serving command
   (``NixlPushConnector``, no module path, no ``--middleware``) plus
   ``PDTRACE_DIR`` = the run directory (sampling 1), traced by pdtrace's vLLM
   plugin; in this order:
   a first request (first contact: P's handshake with D), 20 Azure-conversation
   requests replayed open-loop through the router (concurrent dispatch), greedy
   prompts, then the dispatch perturbation: ``SEQ`` new 3,000-token prompts one at a time
   with the router dispatching both legs concurrently, the router restarted
   with ``push_dispatch="serial"`` (D only after P answered; same engines), and
   ``SEQ`` other new prompts of that length one at a time, and one 7,000-token
   request whose client goes away 50 ms after sending it. vLLM's
   ``vllm:nixl_*`` counters are read from P — in push the prefill engine owns
   the WRITE handles and records them (D's stay 0) — before the lab stops.
   The greedy prompts' tokens go to the session's ``traced_greedy_record``:
   ``tests/lab/test_push.py`` checks that its untraced lab, the same stock
   command without ``PDTRACE_DIR``, gives the same tokens and runs no pdtrace
   thread or sink.

The trace goes to the session's ``traced_lab_stores`` (the dashboard tests show it).
(pdtrace's explicit push class names run on real engines in
``tests/connector/test_in_flight_lab.py`` and ``tests/lab/test_inject_lab.py``.)
"""
from __future__ import annotations

import pytest

import labtrace as lt
from pdtrace.connector.lab import metrics
from pdtrace.connector.lab.launcher import Lab
from pdtrace.connector.lab.model import model_info

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]

SEQ = 8  # prompts per dispatch policy in the perturbation
SEQ_TOKENS = 3000  # prompt tokens of each (see seq_prompts)
STAGES_ONCE = ("prefill.queue", "decode.queue", "dest.register", "handoff.prep", "handoff.descriptors",
               "kv.transfer", "kv.ready", "decode.first_step", "decode.block_reserve", "prefill.block_hold")


@pytest.fixture(scope="module")
def model_dir():
    return lt.lab_model("default")


@pytest.fixture(scope="module")
def wl(model_dir):
    return lt.azure_workload(model_dir)


@pytest.fixture(scope="module")
def greedy_prompts(wl):
    return [r.prompt for r in wl.requests[:4]]


@pytest.fixture(scope="module")
def seq_prompts(model_dir):
    """(concurrent, serial) prompt lists of ``SEQ_TOKENS`` random tokens each (no prefix-cache hit).

    Long on purpose: the known answer ("the concurrent router hides D's registration")
    needs P's prefill to outlast D's allocate-and-register path (a few ms idle, up to
    ~150 ms on this shared machine under load); 3,000 tokens take P ≈ 50-300 ms.
    """
    import random
    vocab = model_info(model_dir)["vocab_size"]
    rng = random.Random(11)
    mk = lambda: [16 + rng.randrange(vocab - 16) for _ in range(SEQ_TOKENS)]  # noqa: E731
    return [mk() for _ in range(SEQ)], [mk() for _ in range(SEQ)]


@pytest.fixture(scope="module")
def gone_prompt(model_dir):
    """7,000 random tokens: P's prefill outlasts the 50 ms after which the client goes away."""
    import random
    vocab = model_info(model_dir)["vocab_size"]
    rng = random.Random(12)
    return [16 + rng.randrange(vocab - 16) for _ in range(7000)]


def _transfers_expected(greedy) -> int:
    """KV transfers of the traced run: warm-up, replay, greedy, concurrent and serial (none for the gone client)."""
    return 1 + lt.N_REPLAY + len(greedy) + 2 * SEQ


@pytest.fixture(scope="module")
def traced_run(model_dir, wl, greedy_prompts, seq_prompts, gone_prompt, tmp_path_factory, traced_greedy_record,
               traced_lab_stores):
    run_dir = tmp_path_factory.mktemp("push-traced")
    cfg = lt.plugin_cfg(model_dir, run_dir, trace=True, mode="push", push_join_timeout_s=60.0,
                        router_timeout_s=300.0)
    with Lab(cfg) as lab:
        in_procs = lt.pdtrace_in_processes(lab)
        lt.warm_up(lab, wl.requests[0].prompt)
        recs = lt.replay_ok(lab, wl)
        greedy = lt.greedy(lab, greedy_prompts)
        conc = [lt.one(lab, p, max_tokens=2) for p in seq_prompts[0]]
        lab.restart_router(push_dispatch="serial")
        assert lt.get_json(lab.router_url + "/health")["push_dispatch"] == "serial"
        serial = [lt.one(lab, p, max_tokens=2) for p in seq_prompts[1]]
        lt.send_and_go_away(lab, gone_prompt)  # a client gone while the router waits for P (serial)
        p_metrics = lt.settled_metrics(lab.prefills[0].url, "vllm:nixl_xfer_time_seconds_count",
                                       _transfers_expected(greedy))
        d_metrics = metrics.scrape(lab.decodes[0].url)
    traced_greedy_record["push"] = {"model": model_dir, "prompts": greedy_prompts, "outputs": greedy}
    traced_lab_stores["push"] = {"dir": run_dir, "router_starts": 2}  # (the serial part restarts the router)
    tr = lt.open_trace(run_dir)
    yield {"dir": run_dir, "tr": tr, "recs": recs, "greedy": greedy, "conc": conc, "serial": serial,
           "p_metrics": p_metrics, "d_metrics": d_metrics, "in_procs": in_procs,
           "kv_bytes_per_token": model_info(model_dir)["kv_bytes_per_token"]}
    tr.close()


def _replay_ids(run) -> list[str]:
    return [r.router_request_id for r in run["recs"]]


def test_every_request_has_one_router_root_and_joined_engine_spans(traced_run):
    n_total = 1 + lt.N_REPLAY + len(traced_run["greedy"]) + 2 * SEQ + 1  # + the client that went away
    lt.check_joined(traced_run["tr"], set(_replay_ids(traced_run)), n_total)


def test_every_stage_once_per_attempt_and_rank(traced_run):
    ids = _replay_ids(traced_run) + traced_run["conc"] + traced_run["serial"]
    lt.check_stages_once(traced_run["tr"], ids, STAGES_ONCE)
    # both legs' router.wait (P's answer and D's first chunk) and one dispatch per leg
    rows = traced_run["tr"].query("""
        SELECT request_id, list(attr_str['router.leg'] ORDER BY attr_str['router.leg']) AS legs
        FROM spans WHERE stage IN ('router.wait', 'router.dispatch') GROUP BY request_id, stage""")
    legs = {}
    for r in rows:
        legs.setdefault(r["request_id"], []).append(r["legs"])
    for x in ids:
        assert legs[x] == [["decode", "prefill"], ["decode", "prefill"]], (x, legs.get(x))


def test_p_leg_cut_short_leaves_its_wait_as_an_error(traced_run):
    """The client went away while the (serial) router waited for P: the root ends 499 and P's leg's
    router.wait is still there, ended at the cancellation with status error (CancelledError)."""
    tr = traced_run["tr"]
    gone = tr.query("SELECT request_id FROM spans WHERE stage = 'router.request' "
                    "AND attr_int['http.response.status_code'] = 499")
    assert len(gone) == 1, gone
    waits = tr.query("SELECT attr_str['router.leg'] AS leg, status_code, status_message, dur_ns FROM spans "
                     "WHERE request_id = ? AND stage = 'router.wait'", [gone[0]["request_id"]])
    assert [(w["leg"], w["status_code"], w["status_message"]) for w in waits] == \
        [("prefill", 2, "CancelledError")], waits
    assert waits[0]["dur_ns"] > 0


def test_causal_order(traced_run):
    """P compute ends before the WRITE ends; D's first step starts after readiness; D's registration
    starts when D's blocks are allocated (end of decode.queue) and is matched before the WRITE is posted."""
    ids = _replay_ids(traced_run) + traced_run["conc"] + traced_run["serial"]
    by = lt.check_causal(traced_run["tr"], ids, transfer_owner_is_decode=False)
    for x in ids:
        r = by[x]
        assert abs(r["reg_start"] - r["d_queue_end"]) <= 1_000_000, r  # D's alloc, D's wall clock → P's record
        assert r["reg_start"] <= r["reg_end"] <= r["prep_end"], r
        assert r["prep_start"] <= r["prep_end"] <= r["xfer_start"] + 1_000_000, r


def test_transfer_bytes_are_blocks_times_block_bytes(traced_run):
    ids = _replay_ids(traced_run) + traced_run["conc"] + traced_run["serial"]
    lt.check_transfer_bytes(traced_run["tr"], ids, traced_run["kv_bytes_per_token"])
    ops = traced_run["tr"].query("SELECT DISTINCT attr_str['kv.op'] AS op, role FROM spans WHERE stage = 'kv.transfer'")
    assert ops == [{"op": "WRITE", "role": "prefill"}], ops


def test_transfer_totals_equal_vllm_nixl_counters_on_the_writer(traced_run):
    """In push P owns the WRITE handles: P's counters equal the spans; D records no transfer."""
    lt.check_nixl_counters(traced_run["tr"], traced_run["p_metrics"],
                           min_count=_transfers_expected(traced_run["greedy"]))
    assert metrics.total(traced_run["d_metrics"], "vllm:nixl_xfer_time_seconds_count") == 0


def test_handshake_only_on_the_first_request_per_pair_and_rank(traced_run):
    first = lt.check_handshake_once(traced_run["tr"], set(_replay_ids(traced_run)))
    row = traced_run["tr"].query("SELECT role FROM spans WHERE stage = 'handoff.handshake'")[0]
    assert row["role"] == "prefill"  # push: the writer (P) connects to D on first contact
    assert first


def _join_input(run, ids) -> list[tuple[str, int, int]]:
    """Per request: (the stage owning the critical path just before the handoff starts — the join's
    last input —, dest.register ns on the path, TTFT ns)."""
    rows = run["tr"].query("""
        WITH s AS (SELECT rkey, request_id, stage, start_ns, dur_ns FROM ttft_segments),
             h AS (SELECT rkey, min(start_ns) AS h0 FROM s
                   WHERE stage LIKE 'handoff.%' OR stage = 'kv.transfer' GROUP BY rkey)
        SELECT s.request_id,
               arg_max(s.stage, s.start_ns) FILTER (WHERE s.start_ns < h.h0 AND s.stage NOT IN
                   ('router.wait', 'router.dispatch', 'unattributed')) AS before_join,
               coalesce(sum(s.dur_ns) FILTER (WHERE s.stage = 'dest.register'), 0) AS reg_ns,
               any_value(b.ttft_ns) AS ttft_ns
        FROM s JOIN h USING (rkey) JOIN ttft_breakdown b USING (rkey) GROUP BY s.request_id""")
    by = {r["request_id"]: (r["before_join"], r["reg_ns"], r["ttft_ns"]) for r in rows}
    return [by[x] for x in ids]


def test_serial_dispatch_exposes_dest_register_on_the_critical_path(traced_run):
    """Known answer: with D dispatched only after P answered, D's registration is the last input of
    the join, so ``dest.register`` owns the critical path up to the handoff (and time on it) in
    (nearly) every request; with concurrent dispatch D registers while P computes, P's KV is the
    last input and ``dest.register`` is hidden (at most a sliver before P's first stage starts)."""
    conc = _join_input(traced_run, traced_run["conc"])
    ser = _join_input(traced_run, traced_run["serial"])
    fmt = lambda v: [f"{j}:{r / 1e6:.2f}/{t / 1e6:.0f}" for j, r, t in v]  # noqa: E731
    print(f"join input: dest.register ms on path / TTFT ms: concurrent {fmt(conc)}; serial {fmt(ser)}")
    print(f"dest.register on the path, total: concurrent {sum(r for _, r, _ in conc) / 1e6:.1f} ms, "
          f"serial {sum(r for _, r, _ in ser) / 1e6:.1f} ms")
    assert sum(1 for j, r, _ in ser if j == "dest.register" and r > 0) >= SEQ - 1, ser
    assert sum(1 for j, _, _ in conc if j == "dest.register") <= SEQ // 4, conc
    assert sum(r for _, r, _ in ser) > sum(r for _, r, _ in conc), (conc, ser)


def test_no_tracing_errors_logged(traced_run):
    lt.check_no_tracing_errors(traced_run["dir"])


def test_engines_traced_through_the_plugin(traced_run):
    """Stock command + PDTRACE_DIR: engines' stats rows say 'plugin' (router: 'explicit'); the connector
    vLLM built is pdtrace's; a pdtrace-writer thread runs in every API server and EngineCore."""
    by = lt.check_activation(traced_run["dir"], "plugin")
    print(by, traced_run["in_procs"])
    log = (traced_run["dir"] / "logs" / "prefill-0.log").read_text(errors="replace")
    assert "Creating v1 connector with name: TracedNixlPushConnector" in log
    assert len(traced_run["in_procs"]["writers"]) >= 4 and len(traced_run["in_procs"]["sinks"]) == 1


def test_engine_clock_window_without_the_routers_files(traced_run):
    """Issue 16 item 2: the run's files minus the router's give every replayed request a complete engine-clock
    TTFT (ttft_source = engine) whose breakdown tiles the window to the ns, within the router's TTFT."""
    from engine_window import check_engine_window
    check_engine_window(traced_run["dir"], [r.router_request_id for r in traced_run["recs"]])


def test_non_streamed_requests_are_finished_not_hung(traced_run):
    """A non-streamed response hands every token over in one write: the router records the first and the
    last token at that write, so the request is complete with TPOT 0 -- before, it had no last token and
    was flagged ``hung_after_first_token`` (the lab's warm-up request was, in every run)."""
    ids = traced_run["conc"] + traced_run["serial"]
    rows = traced_run["tr"].query(
        "SELECT request_id, status, hung, first_token_ns = last_token_ns AS one_write, tpot_ms, flags "
        "FROM requests WHERE list_contains(?, request_id) ORDER BY request_id", [ids])
    assert len(rows) == len(ids) == 2 * SEQ, rows
    for r in rows:
        assert (r["status"], r["hung"], r["one_write"], r["tpot_ms"]) == ("complete", False, True, 0.0), r
        assert "hung_after_first_token" not in r["flags"], r


def test_spark_engine_gives_duckdbs_answers(traced_run, spark):
    """Issue 20: the same answers from Spark's tasks as from DuckDB on this lab run."""
    lt.check_spark_engine(traced_run["dir"], traced_run["tr"], spark)
