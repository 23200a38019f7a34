"""Attribution problems found by the lab's injected delays (issue 17 part A; /work/notes/inject-bench.md).

Each states the right answer from DESIGN.md; the rules that make them pass: clock.sql
``_clock_peer_stamped`` (a stage starting at a peer's instant is no receipt) and ttft_segments.sql
rule 12 (a queue stage starts no earlier than its frontend's 'in' part hands the request over).
"""
from __future__ import annotations

from pdtrace_case_builder import Case


def _push_same_host() -> Case:
    """Push, one host, no skew. The router dispatches D's leg at once and P's leg 30 ms late (the lab's
    injected router.dispatch, or any slow P dispatch); D allocates at 5 ms and its registration
    reaches P at 40 ms. P records ``dest.register`` from D's allocation (D's timestamp) to arrival."""
    c = Case()
    root = c.router_request("r1", 0, 200, "push", first_token_ms=150)
    c.span("router", "router.dispatch", 0, 30, rid="r1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", 0, 0.3, rid="r1", parent=root,
           attrs={"router.leg": "decode", "router.concurrent_legs": 1})
    c.span("router", "router.wait", 30, 120, rid="r1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 0.3, 149, rid="r1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 1, 5, rid="r1", engine="d0")
    c.span("prefill", "dest.register", 5, 40, rid="r1", engine="p0", rank=0,
           attrs={"request.mode": "push", "peer.engine_id": "d0"})
    c.span("prefill", "prefill.queue", 31, 35, rid="r1", engine="p0")
    c.span("prefill", "prefill.compute", 35, 100, rid="r1", engine="p0")
    c.span("prefill", "handoff.prep", 100, 102, rid="r1", engine="p0", rank=0)
    c.span("prefill", "kv.transfer", 102, 110, rid="r1", engine="p0", rank=0)
    c.span("decode", "kv.ready", 110, 112, rid="r1", engine="d0", rank=0)
    c.span("decode", "decode.first_step", 112, 148, rid="r1", engine="d0")
    return c


def test_span_with_a_peer_timestamp_is_not_receipt_evidence(analyse):
    """Seen in the lab (push, one host): clock_offsets router<->prefill -57 ms, consistent=false,
    after P's leg was dispatched late. Right answer: no offset — every message here is causal and
    admits 0 (DESIGN.md §3 "Clock skew": evidence is a message between the two clocks; a span P
    records with D's timestamp is not P receiving the router's leg)."""
    tr = analyse(_push_same_host())
    off = {r["domain"]: r for r in tr.query("SELECT * FROM _domain_offsets WHERE window_idx IS NULL")}
    assert off["p0"]["offset_ns"] == 0


def _pull_queue_before_handover() -> Case:
    """Pull, one host. P's API server received the leg at 2 ms and handed it to EngineCore at 20 ms
    (frontend "in" part); the scheduler's ``prefill.queue`` starts at vLLM's ``arrival_time``, 8 ms,
    stamped while the API server was still processing the request."""
    c = Case()
    root = c.router_request("q1", 0, 200, "pull", first_token_ms=150)
    c.span("router", "router.dispatch", 0, 1, rid="q1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 1, 100, rid="q1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.frontend", 2, 20, rid="q1", engine="p0", attrs={"frontend.part": "in"})
    c.span("prefill", "prefill.queue", 8, 30, rid="q1", engine="p0")
    c.span("prefill", "prefill.compute", 30, 90, rid="q1", engine="p0")
    c.span("prefill", "prefill.frontend", 90, 99, rid="q1", engine="p0", attrs={"frontend.part": "out"})
    c.span("router", "router.dispatch", 100, 101, rid="q1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "handoff.prep", 102, 110, rid="q1", engine="d0", rank=0)
    c.span("decode", "kv.transfer", 110, 115, rid="q1", engine="d0", rank=0)
    c.span("decode", "kv.ready", 115, 117, rid="q1", engine="d0", rank=0)
    c.span("decode", "decode.first_step", 117, 145, rid="q1", engine="d0")
    c.span("decode", "decode.frontend", 145, 150, rid="q1", engine="d0", attrs={"frontend.part": "out"})
    return c


def test_request_processing_before_handover_is_frontend_not_queue(analyse):
    """Seen in the lab (pull): a 30 ms delay injected just before ``AsyncLLM._add_request`` (after vLLM
    stamped ``arrival_time``) was charged to ``prefill.queue`` and the frontend part became hidden;
    an uninjected request shows the same 5-10 ms overlap (its tokenization). Right answer, DESIGN.md
    §2: ``prefill.frontend`` runs from HTTP received to the request queued in EngineCore (parse,
    tokenize), ``prefill.queue`` from queued to scheduled: frontend 2-20 = 18 ms, queue 20-30 = 10 ms."""
    tr = analyse(_pull_queue_before_handover())
    got = {r["stage"]: r["ms"] for r in tr.query(
        "SELECT stage, sum(dur_ns) / 1e6 AS ms FROM ttft_segments WHERE request_id = 'q1' GROUP BY stage")}
    assert got["prefill.queue"] == 10
    assert got["prefill.frontend"] == 18 + 9  # in part + out part


def _pull_decode_queue_before_handover() -> Case:
    """Pull, one host: D's API server received the decode leg at 102 ms and handed it to EngineCore at
    110 ms; ``decode.queue`` starts at D's ``arrival_time``, 105 ms (stamped during input processing)."""
    c = Case()
    root = c.router_request("d1", 0, 200, "pull", first_token_ms=150)
    c.span("router", "router.dispatch", 0, 1, rid="d1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 1, 100, rid="d1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.frontend", 2, 5, rid="d1", engine="p0", attrs={"frontend.part": "in"})
    c.span("prefill", "prefill.queue", 5, 30, rid="d1", engine="p0")
    c.span("prefill", "prefill.compute", 30, 90, rid="d1", engine="p0")
    c.span("prefill", "prefill.frontend", 90, 99, rid="d1", engine="p0", attrs={"frontend.part": "out"})
    c.span("router", "router.dispatch", 100, 101, rid="d1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.frontend", 102, 110, rid="d1", engine="d0", attrs={"frontend.part": "in"})
    c.span("decode", "decode.frontend", 145, 150, rid="d1", engine="d0", attrs={"frontend.part": "out"})
    c.span("decode", "decode.queue", 105, 112, rid="d1", engine="d0")
    c.span("decode", "handoff.prep", 112, 118, rid="d1", engine="d0", rank=0)
    c.span("decode", "kv.transfer", 118, 122, rid="d1", engine="d0", rank=0)
    c.span("decode", "kv.ready", 122, 124, rid="d1", engine="d0", rank=0)
    c.span("decode", "decode.first_step", 124, 145, rid="d1", engine="d0")
    return c


def test_decode_queue_starts_at_the_decode_frontends_handover(analyse):
    """The same rule on D (DESIGN.md §2: ``decode.frontend`` runs HTTP received -> queued in EngineCore,
    ``decode.queue`` queued -> blocks allocated): frontend in 102-110 = 8 ms (+ out 145-150), queue
    110-112 = 2 ms; nothing of either is hidden (the queue's recorded 105-110 was input processing)."""
    tr = analyse(_pull_decode_queue_before_handover())
    got = {r["stage"]: r["ms"] for r in tr.query(
        "SELECT stage, sum(dur_ns) / 1e6 AS ms FROM ttft_segments WHERE request_id = 'd1' GROUP BY stage")}
    assert got["decode.queue"] == 2
    assert got["decode.frontend"] == 8 + 5
    hidden = {r["stage"]: r["hidden_ms"] for r in tr.query(
        "SELECT stage, hidden_ms FROM ttft_hidden WHERE request_id = 'd1'")}
    assert "decode.queue" not in hidden and "decode.frontend" not in hidden, hidden

