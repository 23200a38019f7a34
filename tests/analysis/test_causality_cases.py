"""Issue 17, kinds 1 and 2: exposure follows causality; a transfer's category follows its outcome.

Kind 1 (DESIGN.md §3 "Causality"): a consumer stage that started before its
input existed (D's load or READ posted while P still queued or computed, a D
leg dispatched together with P's) is exposed only from the instant its last
input existed; its earlier part is hidden behind the producer's chain.
Kind 2 (DESIGN.md §2): a kv.transfer that failed or moved no bytes was
waiting, not moving data: its time is coordination.

Each public report is rebuilt as a small store in pdtrace's vocabulary; times
are ms from the request's arrival at the router.
"""
import pytest

from pdtrace_case_builder import Case, tiles

MB = 1 << 20


def _bd(tr, rid):
    rows = tr.query("SELECT * FROM ttft_breakdown WHERE request_id = ?", [rid])
    assert len(rows) == 1, rows
    return rows[0]


def _segs(tr, rid):
    return tr.query("SELECT stage, category, dur_ns, start_ns, end_ns FROM ttft_segments "
                    "WHERE request_id = ? ORDER BY seq", [rid])


def _hidden(tr, rid):
    return {r["stage"]: r["hidden_ms"] for r in tr.query("SELECT stage, hidden_ms FROM ttft_hidden WHERE request_id = ?", [rid])}




def _owned_ms(tr, rid):
    out = {}
    for s in _segs(tr, rid):
        out[s["stage"]] = out.get(s["stage"], 0) + s["dur_ns"] / 1e6
    return out


# ---------------------------------------------------------------------------
# Kind 1. Exposure follows causality.

def _dual_dispatch_push(rid="s1", writer_from=12):
    """SGLang-style dual dispatch (push: P writes into D's pre-allocated blocks).

    router  |disp P 0-2|   router.wait (both legs) ................................|* 842
            |disp D 0-2|
    P            |-- prefill.queue 2-300 --|--- prefill.compute 300-800 ---|
    P writer               |------ handoff.prep (from the registration) 12-805 ------|xfer 805-815|
    D            |fe 2-4|queue 4-10|dest.register 10-12|                  |ready 815-818|first_step 818-840|
    """
    c = Case()
    root = c.router_request(rid, 0, 900, "push", first_token_ms=842)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 2, rid=rid, parent=root, attrs={"router.leg": leg})
    c.span("router", "router.wait", 2, 842, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.queue", 2, 300, rid=rid, engine="p0")
    c.span("prefill", "prefill.compute", 300, 800, rid=rid, engine="p0")
    c.span("decode", "decode.frontend", 2, 4, rid=rid, engine="d0")
    c.span("decode", "decode.queue", 4, 10, rid=rid, engine="d0")
    c.span("decode", "dest.register", 10, 12, rid=rid, engine="d0")
    c.event("prefill", "registration.received", 12, rid=rid, engine="p0")
    c.span("prefill", "handoff.prep", writer_from, 805, rid=rid, engine="p0", rank=0, thread="nixl-push-writer")
    c.span("prefill", "kv.transfer", 805, 815, rid=rid, engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "kv.bytes": 64 * MB, "peer.engine_id": "d0"})
    c.span("decode", "kv.ready", 815, 818, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", 818, 840, rid=rid, engine="d0")
    return c


def test_sglang_dual_dispatch_handoff_waits_for_prefill(analyse):
    """sgl-project/sglang#9726 and llm-d/llm-d-router#2974: SGLang's PD router sends the
    prefill and decode requests at the same time; D pre-allocates, connects to P's
    bootstrap server and waits (PreAlloc -> TransferQueue) while P queues and computes;
    the KV can only be sent once P's prefill is done. The request waited for P's queue
    (298 ms) and prefill (500 ms), not for a 793 ms "handoff": P's writer task opened
    at the registration is exposed only from P's KV ready (800), 5 ms; the 788 ms
    before it are hidden behind P's chain, as is D's whole branch (dispatch, frontend,
    queue, registration: it arrived long before P's KV)."""
    tr = analyse(_dual_dispatch_push())
    b = tiles(tr, "s1")
    assert b["ttft_ms"] == 842
    assert (b["queue_ms"], b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (298, 522, 10, 12)
    assert b["dominant_stage"] == "prefill.compute" and b["dominant_ms"] == 500
    own = _owned_ms(tr, "s1")
    assert own["handoff.prep"] == 5 and own["prefill.queue"] == 298
    assert not {"dest.register", "decode.queue", "decode.frontend"} & set(own)
    hid = _hidden(tr, "s1")
    assert hid["handoff.prep"] == 788
    assert hid["dest.register"] == 2 and hid["decode.queue"] == 6


def _concurrent_legs(rid="y1", prep_from=None, d_dispatch_end=1):
    """Both legs dispatched at once (push router: P writes into D's blocks). D reserves
    its blocks and registers at once; a D-side connector records its wait for the KV
    (blocks allocated -> transfer posted) as handoff.prep, which runs until P's KV is
    ready (SGLang's decode PreAlloc -> TransferQueue; Dynamo's decode worker).

    router  |disp P 0-1|  router.wait P 1-601 ...........................|            * 652
            |disp D 0-d|
    P          |-- prefill.queue 1-200 --|--- prefill.compute 200-600 ---|xfer 604-620|
    D          |fe|q|reg|------- handoff.prep prep_from-604 ---------------|      |ready|first_step 622-650|
    """
    d = d_dispatch_end
    prep_from = d + 4 if prep_from is None else prep_from
    c = Case()
    root = c.router_request(rid, 0, 700, "push", first_token_ms=652)
    c.span("router", "router.dispatch", 0, 1, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", 0, d, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("router", "router.wait", 1, 601, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 601, 652, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.queue", 1, 200, rid=rid, engine="p0")
    c.span("prefill", "prefill.compute", 200, 600, rid=rid, engine="p0")
    c.span("decode", "decode.frontend", d, d + 2, rid=rid, engine="d0")
    c.span("decode", "decode.queue", d + 2, d + 3, rid=rid, engine="d0")
    c.span("decode", "dest.register", d + 3, d + 4, rid=rid, engine="d0")
    c.span("decode", "handoff.prep", prep_from, 604, rid=rid, engine="d0", rank=0)
    c.span("prefill", "kv.transfer", 604, 620, rid=rid, engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "kv.bytes": 32 * MB, "peer.engine_id": "d0"})
    c.span("decode", "kv.ready", 620, 622, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", 622, 650, rid=rid, engine="d0")
    return c


def test_decode_reserves_blocks_while_prefill_runs(analyse):
    """ray-project/ray#63741 (SGLang PD in Ray Serve: "dispatches both sides
    simultaneously -- it does not wait for a prefill response before starting decode"),
    ai-dynamo/dynamo#563 ("Dynamo currently allocates the KV blocks immediately when the
    decode engine gets the requests") and sgl-project/sglang#40703 ("decode can reserve a
    request's destination KV slots while its prefill is still running"). D's wait for
    the KV (blocks allocated -> transfer posted) spans P's queue and prefill; no KV could
    be sent before P's KV existed. Right answer: P's queue 199 ms and prefill 400 ms are on
    the path, the handoff only from P's KV ready (600 -> 604), the WRITE 16 ms; the 595 ms
    of early handoff.prep are hidden. Before the causality rule the handoff was charged
    599 ms of coordination and P's queue and prefill were hidden."""
    tr = analyse(_concurrent_legs())
    b = tiles(tr, "y1")
    assert b["ttft_ms"] == 652
    assert (b["queue_ms"], b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (199, 428, 16, 9)
    own = _owned_ms(tr, "y1")
    assert own["handoff.prep"] == 4 and own["prefill.compute"] == 400 and own["prefill.queue"] == 199
    assert _hidden(tr, "y1")["handoff.prep"] == 595


@pytest.mark.parametrize("prep_from", [5, 150, 450, 600])
def test_hidden_grows_by_the_producer_overlap(analyse, prep_from):
    """General rule: moving the consumer's start earlier (more overlap with P's chain)
    changes nothing on the path; ttft_hidden grows by exactly the overlap."""
    tr = analyse(_concurrent_legs(prep_from=prep_from))
    b = tiles(tr, "y1")
    assert (b["queue_ms"], b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (199, 428, 16, 9)
    assert _owned_ms(tr, "y1")["handoff.prep"] == 4
    assert _hidden(tr, "y1").get("handoff.prep", 0) == 600 - prep_from


def test_slow_decode_leg_dispatch_in_the_shadow_of_prefill_queue(analyse):
    """A D leg dispatched together with P's (ttft_segments rule 8) is D's input to the
    join: a slow D dispatch (0-250, past the end of P's queue at 200) that ends long
    before P's KV is hidden, and P's queue owns its time (latest end wins alone gave the
    D leg's dispatch all of P's queue, 199 ms, as coordination)."""
    tr = analyse(_concurrent_legs(d_dispatch_end=250))
    b = tiles(tr, "y1")
    assert (b["queue_ms"], b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (199, 428, 16, 9)
    assert _hidden(tr, "y1")["router.dispatch"] == 250


def _layerwise(rid, xfer_from):
    """Push with layer-wise upload: P's WRITE of the KV starts at xfer_from (layer 1
    done) and its last layer is written 20 ms after prefill ends (800)."""
    c = Case()
    root = c.router_request(rid, 0, 900, "push", first_token_ms=850)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 2, rid=rid, parent=root, attrs={"router.leg": leg})
    c.span("prefill", "prefill.compute", 2, 800, rid=rid, engine="p0")
    c.span("decode", "dest.register", 2, 6, rid=rid, engine="d0")
    end = 820 if xfer_from < 800 else xfer_from + 20
    c.span("prefill", "kv.transfer", xfer_from, end, rid=rid, engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "kv.bytes": 512 * MB, "peer.engine_id": "d0"})
    c.span("decode", "decode.first_step", end, end + 30, rid=rid, engine="d0")
    c.span("router", "router.wait", 2, end + 30, rid=rid, parent=root, attrs={"router.leg": "decode"})
    return c, end + 30


def test_layerwise_upload_overlapping_prefill(analyse):
    """vllm-project/vllm-ascend#16984: "prefill-side KV upload appears serialized with
    forward compute (MooncakeConnectorV1) ... ~2x TTFT headroom on long prompts": the
    operator needs to tell an upload overlapped with prefill from a serialized one. With
    layer-wise upload (l1: WRITE from 10, the last layer 20 ms after prefill) only the
    tail after P's KV is ready is exposed transfer, 20 ms; the 790 ms overlapped with
    prefill are hidden. The serialized upload (l2: after prefill, 20 ms) gives the same
    exposed transfer and no hidden transfer."""
    c1, ft1 = _layerwise("l1", 10)
    tr = analyse(c1)
    b = tiles(tr, "l1")
    assert b["transfer_ms"] == 20 and b["compute_ms"] == 798 + 30
    assert _hidden(tr, "l1")["kv.transfer"] == 790
    c2, ft2 = _layerwise("l2", 800)
    tr2 = analyse(c2)
    b2 = tiles(tr2, "l2")
    assert b2["transfer_ms"] == 20 and "kv.transfer" not in _hidden(tr2, "l2")
    assert ft1 == ft2


def test_push_late_registration_keeps_registration_as_last_input(analyse):
    """Push: the handoff's last input is the later of KV ready and registration matched
    (DESIGN.md §3). With the registration matched at 4000 and P's KV at 800, P's writer
    (opened at KV ready, 800) is exposed only from 4000; P's prefill is hidden (bug case H,
    now with the writer recorded from KV ready)."""
    c = Case()
    root = c.router_request("h2", 0, 4100, "push", first_token_ms=4075)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 10, rid="h2", parent=root, attrs={"router.leg": leg})
    c.span("prefill", "prefill.compute", 10, 800, rid="h2", engine="p0")
    c.span("decode", "dest.register", 10, 4000, rid="h2", engine="d0")
    c.span("prefill", "handoff.prep", 800, 4005, rid="h2", engine="p0", rank=0)
    c.span("prefill", "kv.transfer", 4005, 4035, rid="h2", engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "kv.bytes": MB})
    c.span("decode", "decode.first_step", 4035, 4075, rid="h2", engine="d0")
    tr = analyse(c)
    b = tiles(tr, "h2")
    assert (b["coordination_ms"], b["transfer_ms"], b["compute_ms"]) == (4005, 30, 40)
    own = _owned_ms(tr, "h2")
    assert own["dest.register"] == 3990 and own["handoff.prep"] == 5
    hid = _hidden(tr, "h2")
    assert hid["prefill.compute"] == 790 and hid["handoff.prep"] == 3200


# ---------------------------------------------------------------------------
# Kind 2. Category by outcome.

def _pull_with_transfer(c, rid, base, xfer_ms, attrs=None, status=0, ranks=(0,), events=None, first_step_ms=30):
    """pull: disp 2 | prefill 2-500 | disp D 500-502 | prep 502-505 | xfer | ready 1 | first_step."""
    root = c.router_request(rid, base, base + 100_000, "pull",
                            first_token_ms=base + 505 + xfer_ms + 1 + first_step_ms)
    c.span("router", "router.dispatch", base, base + 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", base + 2, base + 500, rid=rid, engine="p0")
    c.span("router", "router.dispatch", base + 500, base + 502, rid=rid, parent=root, attrs={"router.leg": "decode"})
    sids = []
    for rank in ranks:
        c.span("decode", "handoff.prep", base + 502, base + 505, rid=rid, engine="d0", rank=rank)
        a = {"kv.op": "READ", "peer.engine_id": "p0"}
        a.update(attrs or {})
        sids.append(c.span("decode", "kv.transfer", base + 505, base + 505 + xfer_ms, rid=rid, engine="d0",
                           rank=rank, attrs=a, status=status))
    t = base + 505 + xfer_ms
    for name, on_span, rank in events or ():
        c.event("decode", name, t, rid=rid, engine="d0", rank=rank, span=sids[rank] if on_span else None,
                attrs={"lifecycle.cause": "transfer_failed"})
    c.span("decode", "kv.ready", t, t + 1, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", t + 1, t + 1 + first_step_ms, rid=rid, engine="d0")
    return root


def test_mooncake_transfer_timeout_is_waiting(analyse):
    """vllm-project/vllm-ascend#7846: "Sync batch data transfer timeout after
    33061142969ns" then "Mooncake transfer failed for request ..." on every TP rank; D
    then recomputes the prompt (kv.load_failed). The 33 s READ moved nothing the request
    used: it is coordination (waiting for a timeout), not transfer. Rank 0's failure is
    an event on its span, rank 1's an event on the request at its rank (both ranks'
    READs are coordination in spans too)."""
    c = Case()
    _pull_with_transfer(c, "m1", 0, 33061, attrs={"kv.bytes": 64 * MB}, ranks=(0, 1),
                        events=[("kv.transfer_failed", True, 0), ("kv.transfer_failed", False, 1)],
                        first_step_ms=480)
    c.event("decode", "kv.load_failed", 33566, rid="m1", engine="d0")
    # a healthy request on the same pair: its READ stays transfer
    _pull_with_transfer(c, "m2", 100_000, 8, attrs={"kv.bytes": 64 * MB}, ranks=(0, 1))
    tr = analyse(c)
    b = tiles(tr, "m1")
    assert b["transfer_ms"] == 0
    assert b["coordination_ms"] == 2 + 2 + 3 + 33061 + 1
    assert b["compute_ms"] == 498 + 480
    cats = {s["stage"]: s["category"] for s in _segs(tr, "m1")}
    assert cats["kv.transfer"] == "coordination"
    assert {r["category"] for r in tr.query(
        "SELECT category FROM spans WHERE request_id = 'm1' AND stage = 'kv.transfer'")} == {"coordination"}
    b2 = tiles(tr, "m2")
    assert b2["transfer_ms"] == 8
    assert {r["category"] for r in tr.query(
        "SELECT category FROM spans WHERE request_id = 'm2' AND stage = 'kv.transfer'")} == {"transfer"}


def test_push_write_failed_to_post_is_waiting(analyse):
    """vllm-project/vllm#50754: in push, "if the prefill node cannot start one of those
    transfers it just logs and moves on"; D waits for notifications that never come
    (the fix: a failure message, after which D applies its load-failure policy and
    recomputes). P's WRITE span ends in error (OTLP status 2, error.type set) with a
    kv.post_failed event on it: its 250 ms are coordination, and the recompute on D is
    compute."""
    c = Case()
    root = c.router_request("w1", 0, 2000, "push", first_token_ms=1400)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 2, rid="w1", parent=root, attrs={"router.leg": leg})
    c.span("prefill", "prefill.compute", 2, 600, rid="w1", engine="p0")
    c.span("decode", "dest.register", 2, 10, rid="w1", engine="d0")
    c.span("prefill", "handoff.prep", 600, 603, rid="w1", engine="p0", rank=0)
    x = c.span("prefill", "kv.transfer", 603, 853, rid="w1", engine="p0", rank=0, status=2,
               attrs={"kv.op": "WRITE", "error.type": "nixlBackendError", "error.code": "NIXL_ERR_BACKEND"})
    c.event("prefill", "kv.post_failed", 853, rid="w1", engine="p0", rank=0, span=x,
            attrs={"lifecycle.cause": "post_failure"})
    c.span("decode", "kv.ready", 853, 860, rid="w1", engine="d0")
    c.event("decode", "kv.load_failed", 860, rid="w1", engine="d0")
    c.span("decode", "decode.first_step", 860, 1400, rid="w1", engine="d0")
    tr = analyse(c)
    b = tiles(tr, "w1")
    assert b["transfer_ms"] == 0
    assert (b["coordination_ms"], b["compute_ms"]) == (2 + 3 + 250 + 7, 598 + 540)


@pytest.mark.parametrize("attrs,status", [({"error.type": "TimeoutError"}, 0), ({}, 2)])
def test_failure_attribute_or_status_alone_is_waiting(analyse, attrs, status):
    """A failure recorded on the span itself (error.type, or OTLP status error) is enough."""
    c = Case()
    _pull_with_transfer(c, "e1", 0, 120, attrs=dict(attrs, **{"kv.bytes": MB}), status=status)
    tr = analyse(c)
    b = tiles(tr, "e1")
    assert b["transfer_ms"] == 0 and b["coordination_ms"] == 2 + 2 + 3 + 120 + 1


def test_zero_byte_transfer_on_full_prefix_hit_is_waiting(analyse):
    """vllm-project/vllm#18632 ("Fix full prefix cache hit bug": with a full D-side
    prefix hit the NIXL connector still runs the read with no local blocks and sends the
    notification, so P can release) and vllm-project/vllm-ascend#13897 ("zero-byte
    Mooncake completion ... no KV payload needs to be copied. The decode side must still
    notify the prefill side"). The 0-byte kv.transfer (4 ms: post + notification) moved
    no data: coordination. The same request shape with a 32 MB READ keeps its 4 ms as
    transfer."""
    c = Case()
    _pull_with_transfer(c, "z1", 0, 4, attrs={"kv.bytes": 0, "kv.descriptors": 0, "kv.blocks": 0})
    _pull_with_transfer(c, "z2", 10_000, 4, attrs={"kv.bytes": 32 * MB, "kv.descriptors": 64})
    tr = analyse(c)
    b1, b2 = tiles(tr, "z1"), tiles(tr, "z2")
    assert (b1["transfer_ms"], b1["coordination_ms"]) == (0, 2 + 2 + 3 + 4 + 1)
    assert (b2["transfer_ms"], b2["coordination_ms"]) == (4, 2 + 2 + 3 + 1)
    assert b1["ttft_ms"] == b2["ttft_ms"]
    # summaries read the breakdown: the zero-byte request adds no transfer share
    s = tr.query("SELECT transfer_share, coordination_share FROM summary_by_mode WHERE mode = 'pull'")[0]
    assert s["transfer_share"] == pytest.approx(4 / (2 * b1["ttft_ms"]))


def test_failure_event_outside_the_transfer_does_not_mark_it(analyse):
    """A kv.transfer_failed of another rank, or after the span ended, is not this transfer's outcome."""
    c = Case()
    _pull_with_transfer(c, "o1", 0, 10, attrs={"kv.bytes": MB}, ranks=(0,))
    c.event("decode", "kv.transfer_failed", 700, rid="o1", engine="d0", rank=0)   # after the span (505-515)
    c.event("decode", "kv.transfer_failed", 510, rid="o1", engine="d0", rank=1)   # another rank
    tr = analyse(c)
    assert tiles(tr, "o1")["transfer_ms"] == 10
