"""Bug cases E (missing rank notification) and K (id mismatch): incomplete requests with a cause."""
from pdtrace_case_builder import Case


# E. Push, P at TP=4 (4 producer ranks). e1: rank 2's write fails to post at
#   401; D gets write-done notifications from ranks 0, 1, 3 at 410-412 and
#   holds the blocks until its TTL expires at 30400. e2 (sibling, at 50000):
#   all 4 ranks write; rank 3 is the slowest and ends the transfer stage.
def _case_e():
    c = Case()
    root = c.router_request("e1", 0, 30500, "push", first_token_ms=None)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 1, rid="e1", parent=root, attrs={"router.leg": leg})
    c.span("prefill", "prefill.compute", 1, 390, rid="e1", engine="p0")
    c.span("decode", "dest.register", 1, 50, rid="e1", engine="d0")
    for rank in range(4):
        if rank == 2:
            c.event("prefill", "kv.post_failed", 401, rid="e1", engine="p0", rank=2,
                    attrs={"lifecycle.cause": "post_failure", "error.type": "nixlBackendError"})
        else:
            c.span("prefill", "kv.transfer", 400, 405 + rank, rid="e1", engine="p0", rank=rank, attrs={"kv.op": "WRITE"})
    for i, rank in enumerate((0, 1, 3)):
        c.event("decode", "notification.received", 410 + i, rid="e1", engine="d0",
                attrs={"kv.notif_kind": "write_done", "peer.tp_rank": rank, "peer.engine_id": "p0",
                       "kv.ranks_expected": 4})
    c.event("decode", "kv.ttl_expired", 30400, rid="e1", engine="d0",
            attrs={"lifecycle.expected": 4, "lifecycle.received": 3, "kv.ranks_missing": "2",
                   "lifecycle.cause": "ttl_expired"})
    # sibling: complete, 4/4
    b = 50000
    root = c.router_request("e2", b, b + 600, "push", first_token_ms=b + 470)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", b, b + 1, rid="e2", parent=root, attrs={"router.leg": leg})
    c.span("prefill", "prefill.compute", b + 1, b + 390, rid="e2", engine="p0")
    c.span("decode", "dest.register", b + 1, b + 50, rid="e2", engine="d0")
    for rank in range(4):
        c.span("prefill", "handoff.prep", b + 390, b + 392, rid="e2", engine="p0", rank=rank)
        c.span("prefill", "kv.transfer", b + 392, b + 400 + 3 * rank, rid="e2", engine="p0", rank=rank)
        c.event("decode", "notification.received", b + 400 + 3 * rank, rid="e2", engine="d0",
                attrs={"kv.notif_kind": "write_done", "peer.tp_rank": rank, "kv.ranks_expected": 4})
    c.span("decode", "kv.ready", b + 409, b + 420, rid="e2", engine="d0")
    c.span("decode", "decode.first_step", b + 420, b + 470, rid="e2", engine="d0")
    return c


def test_e_missing_rank_notification(analyse):
    tr = analyse(_case_e())
    rows = tr.query("SELECT * FROM incomplete_requests")
    assert len(rows) == 1
    e = rows[0]
    assert e["request_id"] == "e1" and e["cause"] == "post_failure"
    assert (e["ranks_expected"], e["ranks_received"], e["ranks_missing"]) == (4, 3, "2")
    assert e["waited_after_last_notification_ms"] == 29988
    assert "3/4 rank notifications, missing rank 2" in e["detail"]
    # the client saw the failure when the router's root ended (30500, no token written), not at
    # D's TTL expiry (30400): time_to_failure runs to the failure the client saw (DESIGN.md §4)
    assert e["time_to_failure_ms"] == 30500
    # P's post failure (401) reached P only: D kept waiting until its TTL expired (30400)
    assert e["root_request_id"] == "e1" and e["root_engine_id"] is None
    assert (e["orphan_wait_ms"], e["orphan_side"]) == (29999, "decode")
    req = {r["request_id"]: r for r in tr.query("SELECT * FROM requests")}
    assert req["e1"]["status"] == "incomplete" and req["e1"]["ttft_ms"] is None
    assert req["e2"]["status"] == "complete" and req["e2"]["ttft_ms"] == 470
    # no TTFT sample from e1
    assert [r["request_id"] for r in tr.query("SELECT request_id FROM ttft_breakdown")] == ["e2"]


def test_e_sibling_tp4_slowest_rank_on_path(analyse):
    tr = analyse(_case_e())
    segs = tr.query("SELECT stage, tp_rank, dur_ns FROM ttft_segments WHERE request_id = 'e2' ORDER BY seq")
    xfer = [s for s in segs if s["stage"] == "kv.transfer"]
    assert xfer == [{"stage": "kv.transfer", "tp_rank": 3, "dur_ns": 17_000_000}]
    b = tr.query("SELECT * FROM ttft_breakdown WHERE request_id = 'e2'")[0]
    assert b["transfer_ms"] == 17 and b["queue_ns"] + b["compute_ns"] + b["transfer_ns"] + b["coordination_ns"] == b["ttft_ns"]
    assert b["compute_ms"] == 389 + 50 and b["coordination_ms"] == 1 + 2 + 11


# K. Id mismatch (push): the router sent X1 to P and X2 to D. P holds
#   cmpl-X1-0-1a2b3c4d, D waits under cmpl-X2-0-5e6f7a8b, no registration ever
#   matches; the router's decode-leg span links both ids. Y (sibling) has the
#   same base id on both legs with different internal suffixes: it must join.
def _case_k():
    c = Case()
    root = c.router_request("X1", 0, 30010, "push", first_token_ms=None, attrs={})
    c.span("router", "router.dispatch", 0, 1, rid="X1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", 0, 1, rid="X1", parent=root,
           attrs={"router.leg": "decode", "router.linked_request_id": "X2"})
    c.span("prefill", "prefill.compute", 1, 300, rid="cmpl-X1-0-1a2b3c4d", engine="p0",
           attrs={"request.internal_id": "cmpl-X1-0-1a2b3c4d"})
    c.event("decode", "registration.sent", 2, rid="cmpl-X2-0-5e6f7a8b", engine="d0")
    c.event("prefill", "notification.unmatched", 3, rid="cmpl-X2-0-5e6f7a8b", engine="p0",
            attrs={"kv.notif_kind": "push_reg"})
    c.event("decode", "registration.timeout", 30000, rid="cmpl-X2-0-5e6f7a8b", engine="d0",
            attrs={"lifecycle.cause": "registration_timeout"})
    c.event("router", "router.leg_failed", 30005, rid="X1", attrs={"http.response.status_code": 504})
    # sibling Y: same base id, different internal suffixes on P and D
    b = 40000
    root = c.router_request("Y", b, b + 200, "push", first_token_ms=b + 150)
    c.span("router", "router.dispatch", b, b + 1, rid="Y", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", b + 1, b + 100, rid="cmpl-Y-0-1a2b3c4d", engine="p0")
    c.span("decode", "dest.register", b + 1, b + 5, rid="cmpl-Y-0-5e6f7a8b", engine="d0")
    c.span("prefill", "kv.transfer", b + 100, b + 110, rid="cmpl-Y-0-1a2b3c4d", engine="p0", rank=0)
    c.span("decode", "decode.first_step", b + 110, b + 150, rid="cmpl-Y-0-5e6f7a8b", engine="d0")
    return c


def test_k_id_mismatch(analyse):
    tr = analyse(_case_k())
    inc = tr.query("SELECT * FROM incomplete_requests")
    assert len(inc) == 1
    assert inc[0]["request_id"] == "X1" and inc[0]["cause"] == "id_mismatch"
    assert inc[0]["linked_request_id"] == "X2"
    req = {r["request_id"]: r for r in tr.query("SELECT * FROM requests")}
    assert set(req) == {"X1", "Y"}         # X2 is not a second request
    assert req["Y"]["status"] == "complete" and req["Y"]["ttft_ms"] == 150
    assert req["Y"]["prefill_engine"] == "p0" and req["Y"]["decode_engine"] == "d0"
    b = tr.query("SELECT * FROM ttft_breakdown WHERE request_id = 'Y'")[0]
    assert (b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (139, 10, 1)


def test_unlinked_engine_only_request_is_incomplete_not_dropped(analyse):
    c = Case()
    c.span("decode", "decode.queue", 0, 5, rid="lonely", engine="d0")
    tr = analyse(c)
    inc = tr.query("SELECT request_id, cause, detail, ttft_source FROM incomplete_requests")
    # no router record: an engine-clock request (DESIGN.md §3), and D alone cannot give its window
    assert inc == [{"request_id": "lonely", "cause": "no_prefill_record",
                    "detail": "no router record; D saw the request, P never did", "ttft_source": "engine"}]


def test_missing_stages_named(analyse):
    c = Case()
    root = c.router_request("m1", 0, 100, "pull", first_token_ms=None)
    c.span("router", "router.dispatch", 0, 1, rid="m1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1, 50, rid="m1", engine="p0")
    tr = analyse(c)
    inc = tr.query("SELECT cause, detail FROM incomplete_requests")
    assert inc[0]["cause"] == "no_first_token"
    assert inc[0]["detail"] == "stages seen: prefill.compute,router.dispatch,router.request"


def test_hung_request_keeps_ttft(analyse):
    c = Case()
    root = c.router_request("hg", 0, 9000, "pull", first_token_ms=100, output_tokens=50)
    c.span("router", "router.dispatch", 0, 100, rid="hg", parent=root, attrs={"router.leg": "prefill"})
    tr = analyse(c)
    r = tr.query("SELECT * FROM requests")[0]
    assert r["status"] == "complete" and r["ttft_ms"] == 100 and r["hung"] is True
    assert r["tpot_ms"] is None and r["hang_ms"] == 8900
