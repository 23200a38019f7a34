"""Root causes, orphan waits, time to failure and request_events, each rebuilt from a public report.

Issue 17 kinds 5, 6 and (part of) 10. Each case is a small store in pdtrace's
vocabulary (ms from T0; router / P / D files as the recorders write them), with
the right answer the report implies. Rules: module analysis/sql/incomplete.sql
(incomplete_requests) and analysis/sql/request_events.sql.
"""
from pdtrace_case_builder import Case, ns

from pdtrace_case_builder import one


def _flushes(c, role, engine=None, at=()):
    """The recorder's periodic stats rows: a process's last one is its trace end (module in_flight)."""
    for t in at:
        c.rows[(role, engine)].append({"record": "stats", "name": "recorder.stats", "start_ns": c._t(engine or role, t),
                                       "attrs": {"recorder.written": 1}})


def _inc(tr, rid):
    return one(tr, "SELECT * FROM incomplete_requests WHERE request_id = ?", [rid])


# ---------------------------------------------------------------- kind 5: root causes and orphan waits

def _case_post_failure():
    c = Case()
    root = c.router_request("pf", 0, 31012, "push", attrs={})
    c.span("router", "router.dispatch", 0, 1, rid="pf", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", 0, 1, rid="pf", parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.compute", 2, 1000, rid="pf", engine="p0")
    c.span("decode", "decode.queue", 2, 4, rid="pf", engine="d0")
    c.span("decode", "dest.register", 4, 20, rid="pf", engine="d0")
    c.span("prefill", "kv.transfer", 1001, 1004, rid="pf", engine="p0", rank=0, attrs={"kv.op": "WRITE", "kv.bytes": 4096})
    c.event("prefill", "kv.post_failed", 1005, rid="pf", engine="p0", rank=1,
            attrs={"lifecycle.cause": "post_failure", "lifecycle.phase": "post", "error.type": "nixlBackendError"})
    c.event("decode", "notification.received", 1006, rid="pf", engine="d0",
            attrs={"kv.notif_kind": "write_done", "peer.tp_rank": 0, "kv.ranks_expected": 2})
    c.event("decode", "kv.ttl_expired", 31000, rid="pf", engine="d0",
            attrs={"lifecycle.expected": 2, "lifecycle.received": 1, "lifecycle.cause": "ttl_expired"})
    c.event("router", "router.leg_failed", 31010, rid="pf", attrs={"http.response.status_code": 504, "router.leg": "decode"})
    return c


def test_vllm_50754_push_post_failure_orphans_decode(analyse):
    """vllm-project/vllm#50754: in push, P could not post one WRITE (rank 1 of 2), just logged it, and D
    counted notifications toward a number it never reached, holding its blocks until the lease/TTL
    expired. Right answer: the root is the request's own post failure (root_request_id = itself); D
    waited from the failure (1005) to its TTL expiry (31000): orphan_wait 29995 ms on the decode side;
    the client saw the failure when the router's 504 went out (31010)."""
    r = _inc(analyse(_case_post_failure()), "pf")
    assert (r["cause"], r["root_request_id"], r["root_engine_id"]) == ("post_failure", "pf", None)
    assert (r["orphan_wait_ms"], r["orphan_side"]) == (29995, "decode")
    assert r["time_to_failure_ms"] == 31010
    assert (r["ranks_expected"], r["ranks_received"], r["ranks_missing"]) == (2, 1, "1")


def test_sglang_36033_nixl_failure_not_pushed_decode_waits_waiting_timeout(analyse):
    """sgl-project/sglang#36033: with the NIXL backend, P's transfer worker records a transfer failure only
    locally; D learns nothing and waits until SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s). Right
    answer: cause transfer_failure, root = itself; orphan_wait = 300 s - (failure - D's start) on D:
    failure at 2000, D's waiting timeout at 300010 -> 298010 ms; the client saw the router's 500 at
    300020 (time_to_failure 300020, not P's failure instant)."""
    c = Case()
    root = c.router_request("sg", 0, 300021, "pull")
    c.span("router", "router.dispatch", 0, 1, rid="sg", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1, 1500, rid="sg", engine="p0")
    c.span("router", "router.dispatch", 1500, 1501, rid="sg", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 1502, 1510, rid="sg", engine="d0")
    c.span("decode", "handoff.prep", 1510, 1520, rid="sg", engine="d0")
    c.event("prefill", "kv.transfer_failed", 2000, rid="sg", engine="p0", rank=0,
            attrs={"lifecycle.cause": "transfer_failed", "lifecycle.phase": "transfer"})
    c.event("decode", "request.timeout", 300010, rid="sg", engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
    c.event("router", "router.leg_failed", 300020, rid="sg", attrs={"http.response.status_code": 500, "router.leg": "decode"})
    r = _inc(analyse(c), "sg")
    assert (r["cause"], r["root_request_id"]) == ("transfer_failure", "sg")
    assert (r["orphan_wait_ms"], r["orphan_side"]) == (298010, "decode")
    assert r["time_to_failure_ms"] == 300020


def _case_worker_died(with_thread_event: bool):
    """sgl-project/sglang#27162: P's Mooncake transfer worker raised on one request (IndexError on an
    empty block list) and re-raised, which killed the worker thread; every later transfer queued on it
    stalled and the decode peers hung until their own ~300 s timeout. w1 is the request that raised
    (its own transfer failure), w2 and w3 come later on the same P/D pair: P computed their KV, D
    allocated and waited, nothing was ever transferred. One complete request (w0) precedes them."""
    c = Case()
    # w0: complete (pull) before the failure
    root = c.router_request("w0", 0, 300, "pull", first_token_ms=250)
    c.span("router", "router.dispatch", 0, 1, rid="w0", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1, 100, rid="w0", engine="p0")
    c.span("router", "router.dispatch", 100, 101, rid="w0", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 101, 105, rid="w0", engine="d0")
    c.span("decode", "kv.transfer", 105, 200, rid="w0", engine="d0", rank=0, attrs={"kv.bytes": 1 << 20})
    c.span("decode", "decode.first_step", 200, 250, rid="w0", engine="d0")
    for i, t0 in enumerate((1000, 1100, 1200), start=1):
        rid = f"w{i}"
        root = c.router_request(rid, t0, t0 + 300020, "pull")
        c.span("router", "router.dispatch", t0, t0 + 1, rid=rid, parent=root, attrs={"router.leg": "prefill"})
        c.span("prefill", "prefill.compute", t0 + 1, t0 + 100, rid=rid, engine="p0")
        c.span("router", "router.dispatch", t0 + 100, t0 + 101, rid=rid, parent=root, attrs={"router.leg": "decode"})
        c.span("decode", "decode.queue", t0 + 101, t0 + 105, rid=rid, engine="d0")
        c.span("decode", "handoff.prep", t0 + 105, t0 + 110, rid=rid, engine="d0")
        c.event("decode", "request.timeout", t0 + 300010, rid=rid, engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
        c.event("router", "router.leg_failed", t0 + 300015, rid=rid,
                attrs={"http.response.status_code": 500, "router.leg": "decode"})
    c.event("prefill", "kv.transfer_failed", 1150, rid="w1", engine="p0", rank=0,
            attrs={"lifecycle.cause": "transfer_exception", "lifecycle.phase": "transfer", "error.type": "IndexError"})
    if with_thread_event:
        c.event("prefill", "engine.thread_exited", 1151, engine="p0", attrs={"lifecycle.cause": "exception",
                                                                             "error.type": "IndexError"})
        c.rows[("prefill", "p0")][-1]["thread"] = "transfer_worker"
    return c


def test_sglang_27162_dead_transfer_worker_is_the_engine_root(analyse):
    """With the engine-level event (engine.thread_exited on p0 at 1151): w1 keeps its own root (the
    exception that killed the worker, transfer_failure); w2 and w3 wait for a thread that no longer
    exists: cause thread_exited, root_request_id NULL, root_engine_id p0. Their time to failure is the
    router's 500 (300015 ms after arrival), not D's timeout."""
    tr = analyse(_case_worker_died(True))
    rows = {r["request_id"]: r for r in tr.query("SELECT * FROM incomplete_requests ORDER BY request_id")}
    assert set(rows) == {"w1", "w2", "w3"}
    assert (rows["w1"]["cause"], rows["w1"]["root_request_id"]) == ("transfer_failure", "w1")
    for rid in ("w2", "w3"):
        r = rows[rid]
        assert (r["cause"], r["root_request_id"], r["root_engine_id"]) == ("thread_exited", None, "p0")
        assert r["symptom"] == "load_not_reported"
        assert "transfer_worker exited" in r["detail"]
        assert r["time_to_failure_ms"] == 300015
    # the requests table carries the root cause
    req = {r["request_id"]: r for r in tr.query("SELECT request_id, cause FROM requests")}
    assert req["w2"]["cause"] == "thread_exited" and req["w0"]["cause"] is None


def test_sglang_27162_without_thread_event_first_of_the_run_is_root(analyse):
    """The same failure traced by a connector that records no thread exit (the load of w2 and w3 is
    never reported and emits no event of its own): the missing completions form a run of requests on
    p0->d0 with no complete request between them; its first request, w1, is the root of the others
    (blocked_by_earlier_request), and itself. w0 completed before the run and is not in it."""
    tr = analyse(_case_worker_died(False))
    rows = {r["request_id"]: r for r in tr.query("SELECT * FROM incomplete_requests ORDER BY request_id")}
    assert (rows["w1"]["cause"], rows["w1"]["root_request_id"]) == ("transfer_failure", "w1")
    for rid in ("w2", "w3"):
        assert (rows[rid]["cause"], rows[rid]["root_request_id"]) == ("blocked_by_earlier_request", "w1")
        assert rows[rid]["symptom"] == "load_not_reported"
        assert "run of 3 requests on p0->d0, first: w1" in rows[rid]["detail"]


def test_sglang_omni_1773_cancel_kills_the_stage_loop_in_flight_requests_wait(analyse):
    """sgl-project/sglang-omni#1773 (review): cancelling one request during its KV transfer made the
    prefill Stage's background callback treat the cleanup exception as fatal, stop its loop and close
    the control plane: "a single request cancellation can therefore fail unrelated in-flight requests
    and leave the pipeline unable to serve subsequent requests". x1 is cancelled by its client (499 at
    500); P's loop exits at 501 (engine.thread_exited on p0); x2 was already in flight (P computed, D
    waiting for its writes) and x3 arrives after the exit. Right answer: x1's root is itself (the
    client's cancel, leg_failed: a router failure that is no deadline and precedes every engine's
    failure is the cause; the thread exited after it), and D kept waiting from the cancel to its own
    timeout (29500 ms); x2 and x3: thread_exited, root engine p0."""
    c = Case()
    def push(rid, t0, d_timeout):
        root = c.router_request(rid, t0, t0 + d_timeout + 10, "push")
        c.span("router", "router.dispatch", t0, t0 + 1, rid=rid, parent=root, attrs={"router.leg": "decode"})
        c.span("prefill", "prefill.compute", t0 + 1, t0 + 200, rid=rid, engine="p0")
        c.span("decode", "decode.queue", t0 + 1, t0 + 3, rid=rid, engine="d0")
        c.span("decode", "dest.register", t0 + 3, t0 + 10, rid=rid, engine="d0")
        return root
    push("x1", 0, 30000)
    c.event("router", "router.leg_failed", 500, rid="x1", attrs={"http.response.status_code": 499, "router.leg": "decode"})
    c.event("decode", "request.timeout", 30000, rid="x1", engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
    c.event("prefill", "engine.thread_exited", 501, engine="p0", attrs={"lifecycle.cause": "fatal_callback_error"})
    c.rows[("prefill", "p0")][-1]["thread"] = "stage-loop"
    push("x2", 300, 30000)
    c.event("decode", "request.timeout", 30300, rid="x2", engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
    push("x3", 2000, 30000)
    c.event("decode", "request.timeout", 32000, rid="x3", engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
    tr = analyse(c)
    rows = {r["request_id"]: r for r in tr.query("SELECT * FROM incomplete_requests")}
    assert (rows["x1"]["cause"], rows["x1"]["root_request_id"]) == ("leg_failed", "x1")
    assert (rows["x1"]["orphan_wait_ms"], rows["x1"]["orphan_side"]) == (29500, "decode")
    for rid in ("x2", "x3"):
        assert (rows[rid]["cause"], rows[rid]["root_request_id"], rows[rid]["root_engine_id"]) == ("thread_exited", None, "p0")
        assert "stage-loop exited" in rows[rid]["detail"]


def test_llm_d_187_run_broken_by_a_complete_request(analyse):
    """llm-d/llm-d#187: the prefill worker crashed (KeyError in NixlConnector) under load and every
    decode request on it afterwards failed. Two failures on the same pair separated by a request that
    completed are two runs, not one: k1 (TTL expiry with 0 of 1 notifications) is its own root; k3 and
    k4 (after the crash at 5000, no notification) have k3 as root; k2 completed between them."""
    c = Case()
    def leg(rid, t0, complete):
        root = c.router_request(rid, t0, t0 + (400 if complete else 30020), "pull",
                                first_token_ms=(t0 + 300) if complete else None)
        c.span("router", "router.dispatch", t0, t0 + 1, rid=rid, parent=root, attrs={"router.leg": "prefill"})
        c.span("prefill", "prefill.compute", t0 + 1, t0 + 100, rid=rid, engine="p0")
        c.span("router", "router.dispatch", t0 + 100, t0 + 101, rid=rid, parent=root, attrs={"router.leg": "decode"})
        c.span("decode", "decode.queue", t0 + 101, t0 + 105, rid=rid, engine="d0")
        c.span("decode", "handoff.prep", t0 + 105, t0 + 110, rid=rid, engine="d0")
        if complete:
            c.span("decode", "kv.transfer", t0 + 110, t0 + 200, rid=rid, engine="d0", rank=0, attrs={"kv.bytes": 4096})
            c.span("decode", "decode.first_step", t0 + 200, t0 + 300, rid=rid, engine="d0")
        else:
            c.event("decode", "kv.ttl_expired", t0 + 30000, rid=rid, engine="d0",
                    attrs={"lifecycle.expected": 1, "lifecycle.received": 0, "lifecycle.cause": "ttl_expired"})
    leg("k1", 0, False)
    leg("k2", 1000, True)
    leg("k3", 6000, False)
    leg("k4", 6100, False)
    tr = analyse(c)
    rows = {r["request_id"]: r for r in tr.query("SELECT * FROM incomplete_requests ORDER BY request_id")}
    assert set(rows) == {"k1", "k3", "k4"}
    assert (rows["k1"]["cause"], rows["k1"]["root_request_id"]) == ("load_not_reported", "k1")
    assert (rows["k3"]["cause"], rows["k3"]["root_request_id"]) == ("load_not_reported", "k3")
    assert (rows["k4"]["cause"], rows["k4"]["root_request_id"]) == ("blocked_by_earlier_request", "k3")


def _case_46283(api_tokenless: bool = False) -> Case:
    """The store of :func:`test_vllm_46283_aborted_load_holds_decode_blocks_later_request_waits`; with
    ``api_tokenless``, D's API server also answered o1 with a 200 stream without a token (response.tokenless
    at 2002, after EngineCore's abort)."""
    c = Case()
    root = c.router_request("o1", 0, 1992, "push")
    c.span("router", "router.dispatch", 0, 1, rid="o1", parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.compute", 2, 900, rid="o1", engine="p0")
    c.span("decode", "decode.queue", 2, 5, rid="o1", engine="d0")
    c.span("decode", "dest.register", 5, 30, rid="o1", engine="d0")
    c.event("router", "router.leg_failed", 1990, rid="o1", attrs={"http.response.status_code": 499, "router.leg": "decode"})
    c.event("decode", "request.abort", 2000, rid="o1", engine="d0",
            attrs={"lifecycle.cause": "aborted_waiting_for_kv", "lifecycle.expected": 1, "lifecycle.received": 0})
    c.event("prefill", "kv.lease_expired", 31000, rid="o1", engine="p0", rank=0, attrs={"lifecycle.cause": "lease_expired"})
    root = c.router_request("q2", 3000, 8010, "push")
    c.span("router", "router.dispatch", 3000, 3001, rid="q2", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 3002, 8006, rid="q2", engine="d0")  # ended by D's abort after the 504
    c.event("router", "router.leg_failed", 8005, rid="q2",
            attrs={"http.response.status_code": 504, "error.type": "timeout", "router.leg": "decode"})
    _flushes(c, "decode", "d0", at=(5000, 9000))
    _flushes(c, "prefill", "p0", at=(5000, 40000))
    _flushes(c, "router", None, at=(5000, 9000))
    if api_tokenless:
        fe = c.span("decode", "decode.frontend", 3, 2002, rid="o1", engine="d0",
                    attrs={"frontend.part": "whole", "http.response.status_code": 200, "request.stream": 1})
        c.event("decode", "response.tokenless", 2002, rid="o1", engine="d0", span=fe, attrs={"lifecycle.cause": "no_token"})
    return c


def test_vllm_46283_aborted_load_holds_decode_blocks_later_request_waits(analyse):
    """vllm-project/vllm#46283: in push, a D request aborted while WAITING_FOR_REMOTE_KVS keeps its blocks
    until the worker reports finished_recving, which only P's completion produces; P never sent it, so
    the blocks are never reclaimed and later requests cannot be admitted. o1 is aborted on D at 2000
    (aborted_waiting_for_kv) after the router gave up (leg failed at 1990) and holds d0's blocks to D's
    trace end; q2 arrives at 3000 and stays in decode.queue (never allocated) until the router's timeout.
    Right answer: q2's root is o1 (slot_held_by_orphan on d0); o1 is its own root: its client went away
    (leg_failed, 499, before any engine failure; D's abort follows it and is its consequence); o1's P was
    still holding its KV at the failure and released it when its lease expired (31000): orphan_wait
    29010 ms on the prefill side (the longer of P's hold and D's hold to its trace end at 9000)."""
    c = _case_46283()
    tr = analyse(c)
    q2 = _inc(tr, "q2")
    assert (q2["cause"], q2["root_request_id"], q2["root_engine_id"]) == ("slot_held_by_orphan", "o1", "d0")
    assert q2["symptom"] == "timeout"           # the router's own deadline (error.type timeout)
    assert q2["time_to_failure_ms"] == 5005
    o1 = _inc(tr, "o1")
    assert (o1["cause"], o1["root_request_id"]) == ("leg_failed", "o1")
    assert (o1["orphan_wait_ms"], o1["orphan_side"]) == (29010, "prefill")
    assert o1["time_to_failure_ms"] == 1990


def test_vllm_46283_an_api_servers_tokenless_answer_releases_no_blocks(analyse):
    """The #46283 store where D's API server also answered o1 with HTTP 200 and no token (vllm-project/vllm#57082:
    what vLLM writes for a request its engine aborted) at 2002: that event records what the client saw, not a
    release of D's blocks (vLLM keeps them while the KV is pending, #32255). The answers are those without it:
    q2 still waits for o1's slot, o1's orphan wait and failure time unchanged."""
    tr = analyse(_case_46283(api_tokenless=True))
    q2 = _inc(tr, "q2")
    assert (q2["cause"], q2["root_request_id"], q2["root_engine_id"]) == ("slot_held_by_orphan", "o1", "d0")
    o1 = _inc(tr, "o1")
    assert (o1["cause"], o1["orphan_wait_ms"], o1["orphan_side"], o1["time_to_failure_ms"]) == \
        ("leg_failed", 29010, "prefill", 1990)


def case_sglang_31800() -> Case:
    """The store of :func:`test_sglang_31800_receiver_stuck_transferring_holds_slot` (also read by
    test_window.py: s2's root cause s1 arrived earlier)."""
    c = Case()
    root = c.router_request("s1", 0, 60002, "pull")
    c.span("router", "router.dispatch", 0, 1, rid="s1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1, 200, rid="s1", engine="p0")
    c.span("prefill", "prefill.block_hold", 200, 30200, rid="s1", engine="p0", attrs={"kv.release_cause": "expiry"})
    c.span("router", "router.dispatch", 200, 201, rid="s1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 201, 205, rid="s1", engine="d0")
    c.span("decode", "handoff.prep", 205, 210, rid="s1", engine="d0")
    c.event("router", "router.leg_failed", 60000, rid="s1",
            attrs={"http.response.status_code": 504, "error.type": "timeout", "router.leg": "decode"})
    root = c.router_request("s2", 1000, 61002, "pull")
    c.span("router", "router.dispatch", 1000, 1001, rid="s2", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1001, 1200, rid="s2", engine="p0")
    c.span("router", "router.dispatch", 1200, 1201, rid="s2", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 1202, 61001, rid="s2", engine="d0")  # never allocated; cut at the timeout
    c.event("router", "router.leg_failed", 61000, rid="s2",
            attrs={"http.response.status_code": 504, "error.type": "timeout", "router.leg": "decode"})
    _flushes(c, "decode", "d0", at=(30000, 90000))
    _flushes(c, "prefill", "p0", at=(30000, 90000))
    _flushes(c, "router", None, at=(30000, 90000))
    return c


def test_sglang_31800_receiver_stuck_transferring_holds_slot(analyse):
    """sgl-project/sglang#31800: a Mooncake receiver whose transfer started but never got its done
    signal stays Transferring forever: no timeout, no abort, its req_to_token_pool slot never freed;
    once the pool is exhausted new requests are not admitted. s1 (pull): D allocated and posted its
    READ (handoff.prep) and then nothing, the router timed the client out at 60000; s2 queues on d0 at
    1000 and never gets a slot. Right answer: s1 load_not_reported (root itself: no event anywhere,
    inferred from the missing completion), D kept waiting from the router's timeout to its trace end
    (90000): orphan_wait 30000 ms; s2 slot_held_by_orphan with root s1."""
    tr = analyse(case_sglang_31800())
    s1 = _inc(tr, "s1")
    assert (s1["cause"], s1["root_request_id"]) == ("load_not_reported", "s1")
    assert (s1["orphan_wait_ms"], s1["orphan_side"]) == (30000, "decode")
    assert s1["time_to_failure_ms"] == 60000
    s2 = _inc(tr, "s2")
    assert (s2["cause"], s2["root_request_id"], s2["root_engine_id"]) == ("slot_held_by_orphan", "s1", "d0")


def test_sglang_34510_completion_queued_before_deadline_is_false_timeout(analyse):
    """sgl-project/sglang#34510 (NIXL row "Waiting timeout"): the receiver must drain notifications before
    checking its waiting timeout "so arriving completion does not lose a race to timeout"; checked the
    other way round, a request whose completion was already queued times out and is then aborted. Here
    P sent both ranks' write_done at 29990/29992, D checked its deadline at 30000, saw the notifications
    at 30003 and aborted the request at 30004. Right answer: false_timeout (not abort), root itself."""
    c = Case()
    root = c.router_request("ft", 0, 30010, "push")
    c.span("router", "router.dispatch", 0, 1, rid="ft", parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.compute", 1, 29000, rid="ft", engine="p0")
    c.span("decode", "decode.queue", 1, 3, rid="ft", engine="d0")
    c.span("decode", "dest.register", 3, 10, rid="ft", engine="d0")
    for rank in (0, 1):
        c.event("prefill", "notification.sent", 29990 + 2 * rank, rid="ft", engine="p0", rank=rank,
                attrs={"kv.notif_kind": "write_done"})
    c.event("decode", "request.timeout", 30000, rid="ft", engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
    for rank in (0, 1):
        c.event("decode", "notification.received", 30003, rid="ft", engine="d0",
                attrs={"kv.notif_kind": "write_done", "peer.tp_rank": rank, "kv.ranks_expected": 2})
    c.event("decode", "request.abort", 30004, rid="ft", engine="d0", attrs={"lifecycle.cause": "FINISHED_ABORTED"})
    r = _inc(analyse(c), "ft")
    assert (r["cause"], r["root_request_id"]) == ("false_timeout", "ft")
    assert "2 rank completions existed before the deadline check" in r["detail"]


def test_abort_naming_a_deadline_with_completions_is_false_timeout_not_abort(analyse):
    """sgl-project/sglang#33507: a request aborted while its KV transfer was in flight (a running timeout
    landing mid-transfer) is reported by the engine as an abort; the abort's reason (lifecycle.cause
    'kv_transfer_timeout') says it was a deadline. The READ had already ended with bytes at 4000, before
    the deadline abort at 4005: a false timeout. The same store with the READ ending after the abort is a
    timeout (read from the reason, not the name 'abort')."""
    def case(read_end):
        c = Case()
        root = c.router_request("ab", 0, 4020, "pull")
        c.span("router", "router.dispatch", 0, 1, rid="ab", parent=root, attrs={"router.leg": "prefill"})
        c.span("prefill", "prefill.compute", 1, 100, rid="ab", engine="p0")
        c.span("router", "router.dispatch", 100, 101, rid="ab", parent=root, attrs={"router.leg": "decode"})
        c.span("decode", "decode.queue", 101, 105, rid="ab", engine="d0")
        c.span("decode", "kv.transfer", 105, read_end, rid="ab", engine="d0", rank=0, attrs={"kv.bytes": 8192})
        c.event("decode", "request.abort", 4005, rid="ab", engine="d0", attrs={"lifecycle.cause": "kv_transfer_timeout"})
        return c
    assert _inc(analyse(case(4000)), "ab")["cause"] == "false_timeout"
    assert _inc(analyse(case(4010)), "ab")["cause"] == "timeout"


# ---------------------------------------------------------------- kind 6: time to failure

def test_sglang_28651_gateway_timeout_abort_not_propagated_to_decode(analyse):
    """sgl-project/sglang#28651: a gateway timeout aborted requests on P, but MooncakeKVSender.abort()
    never told D, so the paired decode requests waited the full 300 s waiting timeout, holding their
    slots. Root cause: the router's timeout (P's abort at 30001 follows it: a consequence). The client
    saw the failure at the router's timeout (30000): time_to_failure 30000, not D's
    timeout at 300010 (the old rule took the latest failure event on any engine); D kept waiting from
    the router's timeout until its own: orphan_wait 270010 ms on the decode side."""
    c = Case()
    root = c.router_request("gt", 0, 30002, "pull")
    c.span("router", "router.dispatch", 0, 1, rid="gt", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.queue", 1, 29000, rid="gt", engine="p0")
    c.span("router", "router.dispatch", 5, 6, rid="gt", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 6, 10, rid="gt", engine="d0")
    c.event("router", "router.leg_failed", 30000, rid="gt",
            attrs={"http.response.status_code": 504, "error.type": "timeout", "router.leg": "prefill"})
    c.event("prefill", "request.abort", 30001, rid="gt", engine="p0", attrs={"lifecycle.cause": "FINISHED_ABORTED"})
    c.event("decode", "request.timeout", 300010, rid="gt", engine="d0", attrs={"lifecycle.cause": "waiting_timeout"})
    r = _inc(analyse(c), "gt")
    assert r["time_to_failure_ms"] == 30000
    assert (r["orphan_wait_ms"], r["orphan_side"]) == (270010, "decode")
    # P's abort came after the router's timeout: its consequence, not the cause
    assert (r["cause"], r["root_request_id"]) == ("timeout", "gt")


def test_lmcache_5047_api_timeout_is_the_failure_time_decode_holds_to_trace_end(analyse):
    """LMCache/LMCache#5047: a KV load whose result never arrived left the request parked in
    WAITING_FOR_REMOTE_KVS with no timeout, while the engine served other traffic; at 600 s the API-side
    timeout cancelled it (504). Right answer: time_to_failure 600000 (the 504), cause load_not_reported
    (no event of its own, inferred from the missing completion); D's abort of a request waiting for KV
    keeps its blocks, so D held them until its trace end (700000): orphan_wait 100000 ms."""
    c = Case()
    root = c.router_request("lm", 0, 600002, "pull")
    c.span("router", "router.dispatch", 0, 1, rid="lm", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1, 300, rid="lm", engine="p0")
    c.span("prefill", "prefill.block_hold", 300, 30300, rid="lm", engine="p0", attrs={"kv.release_cause": "expiry"})
    c.span("router", "router.dispatch", 300, 301, rid="lm", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 301, 310, rid="lm", engine="d0")
    c.event("router", "router.leg_failed", 600000, rid="lm",
            attrs={"http.response.status_code": 504, "error.type": "timeout", "router.leg": "decode"})
    c.event("decode", "request.abort", 600001, rid="lm", engine="d0", attrs={"lifecycle.cause": "aborted_waiting_for_kv"})
    _flushes(c, "decode", "d0", at=(100000, 700000))
    _flushes(c, "router", None, at=(100000, 700000))
    r = _inc(analyse(c), "lm")
    assert r["time_to_failure_ms"] == 600000
    assert (r["cause"], r["root_request_id"]) == ("load_not_reported", "lm")
    assert (r["orphan_wait_ms"], r["orphan_side"]) == (100000, "decode")


def test_vllm_ascend_13648_open_request_runs_to_the_routers_trace_end(analyse):
    """vllm-project/vllm-ascend#13648: decode requests hung indefinitely (no first chunk for > 31 min)
    while /health stayed 200; the request was still open when the logs were captured. pdtrace sees the
    router's root span never written (arrival is then the request's first engine record, ~1):
    time_to_failure runs to the router process's trace end (its last flush, 1_900_000), not to its last
    record of the request (D's kv.ready ending at 910)."""
    c = Case()
    c.span("router", "router.dispatch", 0, 1, rid="hang", attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", 6, 7, rid="hang", attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.compute", 1, 6, rid="hang", engine="p0")
    c.span("decode", "decode.queue", 7, 9, rid="hang", engine="d0")
    c.span("decode", "kv.transfer", 9, 900, rid="hang", engine="d0", rank=0, attrs={"kv.bytes": 1 << 20})
    c.span("decode", "kv.ready", 900, 910, rid="hang", engine="d0")
    _flushes(c, "router", None, at=(1_000_000, 1_900_000))
    _flushes(c, "decode", "d0", at=(1_000_000, 1_800_000))
    r = _inc(analyse(c), "hang")
    assert r["cause"] == "no_router_record"
    assert r["failure_ns"] == ns(1_900_000)
    assert r["time_to_failure_ms"] == (r["failure_ns"] - r["arrival_ns"]) / 1e6 > 1_899_990


def test_vllm_56640_engine_only_full_prefix_hit_never_reported(analyse):
    """vllm-project/vllm#56640: on a full prefix-cache hit D's _read_blocks returned early without
    recording anything, so the request was never named finished and stayed in WAITING_FOR_REMOTE_KVS
    (no timeout) holding its blocks for the life of the process. Traced with a foreign router (engine
    clock only): P answered, D allocated, no READ, no notification, no failure, D's frontend never
    ended. Right answer: load_not_reported, root itself, time_to_failure to the engines' trace end
    (D's last flush at 50000) from P's API server receiving the request (0)."""
    c = Case()
    c.span("prefill", "prefill.frontend", 0, 2, rid="ph", engine="p0", attrs={"frontend.part": "in"})
    c.span("prefill", "prefill.compute", 2, 50, rid="ph", engine="p0")
    c.span("prefill", "prefill.frontend", 50, 52, rid="ph", engine="p0", attrs={"frontend.part": "out"})
    c.span("decode", "decode.frontend", 60, 61, rid="ph", engine="d0", attrs={"frontend.part": "in"})
    c.span("decode", "decode.queue", 61, 62, rid="ph", engine="d0", attrs={"kv.prefix_hit_blocks": 12})
    _flushes(c, "decode", "d0", at=(10000, 50000))
    _flushes(c, "prefill", "p0", at=(10000, 40000))
    r = _inc(analyse(c), "ph")
    assert (r["cause"], r["root_request_id"], r["ttft_source"]) == ("load_not_reported", "ph", "engine")
    assert r["time_to_failure_ms"] == 50000


# ---------------------------------------------------------------- the engine gave the request up, HTTP 200

def test_vllm_57082_shutdown_abort_before_the_first_token_has_no_ttft(analyse):
    """vllm-project/vllm#57082: an engine-initiated abort (engine shutdown, a sleep or scale-down pause)
    ends an open stream with HTTP 200, a tokenless finish_reason "abort" chunk and data: [DONE], so a
    client or router that checks the status and [DONE] counts it complete (sgl-project/sglang#8936: P/D
    aborts answered 200 the same way). vLLM 0.32 writes no abort chunk for a request with no token yet:
    the stream is the role chunk (chat) and data: [DONE]. Behind a foreign router (engine clock), D's API
    server's middleware records no token and a response.tokenless (no_token) when the response ends at 400;
    EngineCore's own request.abort may be lost with the engine. Right answer: no TTFT; incomplete with cause
    and symptom abort, root itself; time to failure 400 ms, from P's API server receiving the request (0) to
    D's API server ending the response (what the client saw). A request served beside it keeps its TTFT."""
    c = Case()
    for rid, t in (("sd", 0), ("ok", 1000)):
        c.span("prefill", "prefill.frontend", t, t + 2, rid=rid, engine="p0", attrs={"frontend.part": "in"})
        c.span("prefill", "prefill.compute", t + 2, t + 50, rid=rid, engine="p0")
        c.span("prefill", "prefill.frontend", t + 50, t + 52, rid=rid, engine="p0",
               attrs={"frontend.part": "out"})
        c.span("decode", "decode.frontend", t + 60, t + 61, rid=rid, engine="d0", attrs={"frontend.part": "in"})
        c.span("decode", "decode.queue", t + 61, t + 62, rid=rid, engine="d0")
        c.span("decode", "kv.transfer", t + 62, t + 90, rid=rid, engine="d0", rank=0, attrs={"kv.bytes": 4096})
    fe = c.span("decode", "decode.frontend", 95, 400, rid="sd", engine="d0",
                attrs={"frontend.part": "out", "http.response.status_code": 200, "request.stream": 1})
    c.event("decode", "response.tokenless", 400, rid="sd", engine="d0", span=fe,
            attrs={"lifecycle.cause": "no_token"})
    fe = c.span("decode", "decode.frontend", 1095, 1130, rid="ok", engine="d0",
                attrs={"frontend.part": "out", "http.response.status_code": 200})
    c.event("decode", "token", 1096, rid="ok", engine="d0", span=fe)
    _flushes(c, "decode", "d0", at=(2000,))
    _flushes(c, "prefill", "p0", at=(2000,))
    tr = analyse(c)
    r = _inc(tr, "sd")
    assert (r["cause"], r["symptom"], r["root_request_id"], r["ttft_source"]) == ("abort", "abort", "sd", "engine")
    assert r["time_to_failure_ms"] == 400
    q = {x["request_id"]: x for x in tr.query("SELECT request_id, ttft_ms, flags FROM requests ORDER BY 1")}
    assert q["sd"]["ttft_ms"] is None and q["ok"]["ttft_ms"] == 1096 - 1000
    assert tr.query("SELECT request_id FROM incomplete_requests") == [{"request_id": "sd"}]


def test_vllm_45520_sleep_aborts_streams_mid_decode_flagged_ttft_kept(analyse):
    """vllm-project/vllm#45520: POST /sleep while streams were mid-decode returned finish_reason=abort to
    every in-flight request. A request aborted after its first token keeps its TTFT (the client had the
    token) and is flagged aborted_after_first_token, by each source of the abort: 'sl' behind pdtrace's
    router (first token 100; EngineCore's request.abort at 500, then the router's leg failure
    decode_aborted at 505), 'se' behind a foreign router (D's API server's token at 1150, EngineCore's
    request.abort FINISHED_ABORTED at 1290, D's API server ending the response at 1300). An abort before the first token of a retried attempt is not the flag's:
    'rt' (D's attempt 0 aborted at 20, attempt 1's token at 90) is not flagged, nor is 'pa', whose P leg was
    aborted after D's first token (a router cancelling P's leg: D served the request)."""
    c = Case()
    root = c.router_request("sl", 0, 520, "pull", first_token_ms=100, last_token_ms=480)
    c.span("prefill", "prefill.compute", 2, 50, rid="sl", engine="p0")
    c.span("decode", "kv.transfer", 55, 80, rid="sl", engine="d0", rank=0, attrs={"kv.bytes": 4096})
    c.span("decode", "decode.first_step", 80, 95, rid="sl", engine="d0")
    c.event("decode", "request.abort", 500, rid="sl", engine="d0", attrs={"lifecycle.cause": "FINISHED_ABORTED"})
    c.event("router", "router.leg_failed", 505, rid="sl", span=root,
            attrs={"error.type": "decode_aborted", "router.leg": "decode"})
    c.span("prefill", "prefill.frontend", 1000, 1002, rid="se", engine="p0", attrs={"frontend.part": "in"})
    c.span("prefill", "prefill.compute", 1002, 1050, rid="se", engine="p0")
    c.span("decode", "decode.frontend", 1060, 1061, rid="se", engine="d0", attrs={"frontend.part": "in"})
    c.span("decode", "kv.transfer", 1062, 1090, rid="se", engine="d0", rank=0, attrs={"kv.bytes": 4096})
    fe = c.span("decode", "decode.frontend", 1095, 1300, rid="se", engine="d0",
                attrs={"frontend.part": "out", "http.response.status_code": 200, "request.stream": 1})
    c.event("decode", "token", 1150, rid="se", engine="d0", span=fe)
    c.event("decode", "request.abort", 1290, rid="se", engine="d0", attrs={"lifecycle.cause": "FINISHED_ABORTED"})
    c.router_request("rt", 2000, 2200, "pull", first_token_ms=2090, last_token_ms=2150)
    c.span("prefill", "prefill.compute", 2002, 2010, rid="rt", engine="p0")
    c.event("decode", "request.abort", 2020, rid="rt", engine="d0", attrs={"lifecycle.cause": "FINISHED_ABORTED"})
    c.router_request("pa", 3000, 3200, "pull", first_token_ms=3100, last_token_ms=3150)
    c.span("prefill", "prefill.compute", 3002, 3050, rid="pa", engine="p0")
    c.span("decode", "kv.transfer", 3052, 3080, rid="pa", engine="d0", rank=0, attrs={"kv.bytes": 4096})
    c.event("prefill", "request.abort", 3120, rid="pa", engine="p0", attrs={"lifecycle.cause": "FINISHED_ABORTED"})
    c.span("prefill", "prefill.compute", 2030, 2060, rid="rt", engine="p0", attempt=1)
    c.span("decode", "kv.transfer", 2062, 2080, rid="rt", engine="d0", rank=0, attempt=1, attrs={"kv.bytes": 4096})
    tr = analyse(c)
    q = {x["request_id"]: x for x in tr.query("SELECT request_id, ttft_ms, flags FROM requests ORDER BY 1")}
    assert (q["sl"]["ttft_ms"], q["se"]["ttft_ms"], q["rt"]["ttft_ms"]) == (100, 150, 90)
    assert "aborted_after_first_token" in q["sl"]["flags"] and "aborted_after_first_token" in q["se"]["flags"]
    assert "aborted_after_first_token" not in q["rt"]["flags"] + q["pa"]["flags"], (q["rt"], q["pa"])
    assert tr.query("SELECT request_id FROM incomplete_requests") == []


# ---------------------------------------------------------------- kind 10 (part): request_events

def test_aws_do_eks_84_lease_expiry_per_rank_collapsed(analyse):
    """aws-samples/aws-do-eks#84: "Releasing expired KV blocks ... retrieved by 0 remote worker(s)" is
    logged once per prefill TP rank (8/8). One incident, ranks_reported 8 of 8 expected, first/last time
    the earliest and latest rank's report."""
    c = Case()
    root = c.router_request("ls", 0, 31000, "pull")
    c.span("router", "router.dispatch", 0, 1, rid="ls", parent=root, attrs={"router.leg": "prefill"})
    for rank in range(8):
        c.span("prefill", "prefill.compute", 1, 200, rid="ls", engine="p0", rank=rank)
        c.event("prefill", "kv.lease_expired", 30200 + rank, rid="ls", engine="p0", rank=rank,
                attrs={"lifecycle.cause": "lease_expired"})
    tr = analyse(c)
    ev = one(tr, "SELECT * FROM request_events WHERE request_id = 'ls'")
    assert (ev["incident"], ev["reason"], ev["engine_id"], ev["attempt"]) == ("kv.lease_expired", "lease_expired", "p0", 0)
    assert (ev["ranks_reported"], ev["ranks_expected"], ev["records"]) == (8, 8, 8)
    assert (ev["first_ns"], ev["spread_ms"]) == (tr.query("SELECT min(time_ns) AS t FROM events WHERE event = 'kv.lease_expired'")[0]["t"], 7)


def test_vllm_ascend_7846_transfer_failed_on_three_of_four_ranks(analyse):
    """vllm-project/vllm-ascend#7846: "Mooncake transfer failed for request ..." logged by each worker
    (TP0, TP1, TP2, ...) of D for one request. Here three of D's four ranks report it (rank 3's READ
    ended): one incident with ranks_reported 3 of 4 (the ranks D's own records name); the router's leg
    failure of the same request is a second incident (no rank); a retry (attempt 1) that fails again is
    a third. Per-rank duplicates never make more rows."""
    c = Case()
    root = c.router_request("mf", 0, 5000, "pull")
    c.span("router", "router.dispatch", 0, 1, rid="mf", parent=root, attrs={"router.leg": "prefill"})
    for rank in range(4):
        c.span("decode", "handoff.prep", 100, 110, rid="mf", engine="d0", rank=rank)
    c.span("decode", "kv.transfer", 110, 300, rid="mf", engine="d0", rank=3, attrs={"kv.bytes": 4096})
    for rank in range(3):
        c.event("decode", "kv.transfer_failed", 2000 + rank, rid="mf", engine="d0", rank=rank,
                attrs={"lifecycle.cause": "transfer_failed", "lifecycle.phase": "transfer"})
    c.event("decode", "kv.transfer_failed", 4000, rid="mf", engine="d0", rank=0, attempt=1,
            attrs={"lifecycle.cause": "transfer_failed"})
    c.event("router", "router.leg_failed", 4990, rid="mf", attrs={"http.response.status_code": 500, "router.leg": "decode"})
    tr = analyse(c)
    rows = tr.query("SELECT * FROM request_events WHERE request_id = 'mf' ORDER BY first_ns")
    assert [(r["incident"], r["attempt"], r["role"], r["ranks_reported"], r["ranks_expected"]) for r in rows] == [
        ("kv.transfer_failed", 0, "decode", 3, 4),
        ("kv.transfer_failed", 1, "decode", 1, 4),
        ("router.leg_failed", 0, "router", 0, 1),
    ]
    assert rows[0]["ranks"] == [0, 1, 2] and rows[0]["phase"] == "transfer" and rows[0]["spread_ms"] == 2
