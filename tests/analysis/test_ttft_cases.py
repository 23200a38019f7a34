"""Bug cases A, C, D, G, H, I of issue 5: TTFT critical path on hand-built stores.

Times are ms from the arrival of each request at the router unless noted.
"""
from pdtrace_case_builder import Case, ns, tiles


def _bd(tr, rid):
    rows = tr.query("SELECT * FROM ttft_breakdown WHERE request_id = ?", [rid])
    assert len(rows) == 1, rows
    return rows[0]


def _segs(tr, rid):
    return tr.query("SELECT stage, category, dur_ns, detail FROM ttft_segments WHERE request_id = ? ORDER BY seq", [rid])




# ---------------------------------------------------------------------------
# A. Cold-peer handshake (pull). Per request, from its arrival b:
#
#   router  |disp 2|                                                    * first token
#   P            |--- prefill.compute 150 ---|
#   D                                         |-- handoff.prep 1400 (cold) --|xfer 8|ready 1|first_step 30|
#                                              |handshake 1300|agent 90|self 10|
# r1: p0->d0 cold, r2: p0->d0 warm (prep 0.5), r3: p1->d0 cold.
def _case_a():
    c = Case()
    for rid, base, p, cold in (("r1", 0, "p0", True), ("r2", 5000, "p0", False), ("r3", 10000, "p1", True)):
        prep = 1400 if cold else 0.5
        ttft = 2 + 150 + prep + 8 + 1 + 30
        root = c.router_request(rid, base, base + ttft + 3, "pull", first_token_ms=base + ttft)
        c.span("router", "router.dispatch", base, base + 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
        c.span("prefill", "prefill.compute", base + 2, base + 152, rid=rid, engine=p)
        t = base + 152
        hp = c.span("decode", "handoff.prep", t, t + prep, rid=rid, engine="d0", rank=0,
                    attrs={"peer.engine_id": p, "kv.first_contact": int(cold)})
        if cold:
            c.span("decode", "handoff.handshake", t, t + 1300, rid=rid, engine="d0", rank=0, parent=hp)
            c.span("decode", "handoff.agent_load", t + 1300, t + 1390, rid=rid, engine="d0", rank=0, parent=hp)
        t += prep
        c.span("decode", "kv.transfer", t, t + 8, rid=rid, engine="d0", rank=0,
               attrs={"kv.bytes": 1 << 20, "kv.descriptors": 64, "kv.op": "READ", "peer.engine_id": p})
        c.span("decode", "kv.ready", t + 8, t + 9, rid=rid, engine="d0")
        c.span("decode", "decode.first_step", t + 9, t + 39, rid=rid, engine="d0")
    return c


def test_a_cold_peer_handshake(analyse):
    tr = analyse(_case_a())
    for rid in ("r1", "r3"):
        b = tiles(tr, rid)
        assert b["ttft_ms"] == 1591
        assert (b["compute_ms"], b["transfer_ms"], b["coordination_ms"], b["queue_ms"]) == (180, 8, 1403, 0)
        assert b["dominant_stage"] == "handoff.prep" and b["dominant_ms"] == 1400
        assert b["first_contact"] is True
        assert b["unattributed_ms"] == 0
    b = tiles(tr, "r2")
    assert b["ttft_ms"] == 191.5 and b["first_contact"] is False
    assert (b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (180, 8, 3.5)
    # the handshake child owns its part of handoff.prep; the parent keeps the rest
    segs = {s["stage"]: s["dur_ns"] for s in _segs(tr, "r1")}
    assert segs["handoff.handshake"] == 1300_000_000 and segs["handoff.agent_load"] == 90_000_000
    assert segs["handoff.prep"] == 10_000_000


# ---------------------------------------------------------------------------
# C. Orchestration-heavy handover (pull, serial router, D at TP=2):
#   disp 3 | prefill 400 | response 2 | D disp 10 | step wait 45 | xfer 29 (rank 1; rank 0: 20)
#   | ready 51 | first step 58 | stream 2          => TTFT 600
def _case_c():
    c = Case()
    root = c.router_request("c1", 0, 650, "pull", first_token_ms=600)
    c.span("router", "router.dispatch", 0, 3, rid="c1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 3, 405, rid="c1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 3, 403, rid="c1", engine="p0")
    c.span("prefill", "prefill.frontend", 403, 405, rid="c1", engine="p0")
    c.span("router", "router.dispatch", 405, 415, rid="c1", parent=root, attrs={"router.leg": "decode"})
    for rank, xfer in ((0, 20), (1, 29)):
        hp = c.span("decode", "handoff.prep", 415, 460, rid="c1", engine="d0", rank=rank)
        c.span("decode", "handoff.step_wait", 415, 460, rid="c1", engine="d0", rank=rank, parent=hp)
        c.span("decode", "kv.transfer", 460, 460 + xfer, rid="c1", engine="d0", rank=rank)
    c.span("decode", "kv.ready", 489, 540, rid="c1", engine="d0")
    c.span("decode", "decode.first_step", 540, 598, rid="c1", engine="d0")
    c.span("decode", "decode.frontend", 598, 600, rid="c1", engine="d0")
    return c


def test_c_orchestration_heavy_handover(analyse):
    tr = analyse(_case_c())
    b = tiles(tr, "c1")
    assert b["ttft_ms"] == 600
    assert (b["compute_ms"], b["transfer_ms"], b["coordination_ms"], b["queue_ms"]) == (458, 29, 113, 0)
    assert b["step_boundary_ms"] == 96
    assert b["unattributed_ms"] == 0 and b["router_wait_ms"] == 0
    # the slowest rank (1) is on the path
    ranks = tr.query("SELECT DISTINCT tp_rank FROM ttft_segments WHERE stage = 'kv.transfer'")
    assert ranks == [{"tp_rank": 1}]


# ---------------------------------------------------------------------------
# D. Router join wait (push, concurrent legs):
#   router |disp 0-2|................ router.wait (P's response at 1172) ............|wait D 3|* 1175
#   P           |------------- prefill.compute 2-900 ------------|xfer 900-906|
#   D           |dest.register 2-40|                                          |first_step 906-916|
def _case_d():
    c = Case()
    root = c.router_request("d1", 0, 1200, "push", first_token_ms=1175)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 2, rid="d1", parent=root, attrs={"router.leg": leg})
    c.span("router", "router.wait", 2, 1172, rid="d1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 1172, 1175, rid="d1", parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.compute", 2, 900, rid="d1", engine="p0")
    c.span("decode", "dest.register", 2, 40, rid="d1", engine="d0")
    c.span("prefill", "kv.transfer", 900, 906, rid="d1", engine="p0", rank=0, attrs={"kv.op": "WRITE"})
    c.span("decode", "decode.first_step", 906, 916, rid="d1", engine="d0")
    return c


def test_d_router_join_wait(analyse):
    tr = analyse(_case_d())
    b = tiles(tr, "d1")
    assert b["ttft_ms"] == 1175
    assert (b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (908, 6, 261)
    assert b["router_wait_ms"] == 259 and b["unattributed_ms"] == 0
    assert b["dominant_stage"] == "prefill.compute"
    # the registration ran in the shadow of prefill: hidden, not on the path
    assert "dest.register" not in {s["stage"] for s in _segs(tr, "d1")}
    hid = {r["stage"]: r["hidden_ms"] for r in tr.query("SELECT stage, hidden_ms FROM ttft_hidden")}
    assert hid["dest.register"] == 38


# ---------------------------------------------------------------------------
# H. Late destination registration (push, concurrent legs):
#   router |disp 0-10|                                                         * 4070
#   P             |--- prefill.compute 10-800 ---|   (hidden)
#   D             |------------- dest.register 10-4000 -------------|xfer 30|first_step 40|
def _case_h():
    c = Case()
    root = c.router_request("h1", 0, 4100, "push", first_token_ms=4070)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 10, rid="h1", parent=root, attrs={"router.leg": leg})
    c.span("prefill", "prefill.compute", 10, 800, rid="h1", engine="p0")
    c.span("decode", "dest.register", 10, 4000, rid="h1", engine="d0")
    c.span("prefill", "kv.transfer", 4000, 4030, rid="h1", engine="p0", rank=0, attrs={"kv.op": "WRITE"})
    c.span("decode", "decode.first_step", 4030, 4070, rid="h1", engine="d0")
    return c


def test_h_late_destination_registration(analyse):
    tr = analyse(_case_h())
    b = tiles(tr, "h1")
    assert b["ttft_ms"] == 4070
    assert (b["coordination_ms"], b["transfer_ms"], b["compute_ms"], b["queue_ms"]) == (4000, 30, 40, 0)
    assert b["dominant_stage"] == "dest.register" and b["dominant_ms"] == 3990
    segs = _segs(tr, "h1")
    assert [s["stage"] for s in segs] == ["router.dispatch", "dest.register", "kv.transfer", "decode.first_step"]
    assert segs[0]["dur_ns"] == 10_000_000
    hid = {r["stage"]: r["hidden_ms"] for r in tr.query("SELECT stage, hidden_ms FROM ttft_hidden")}
    assert hid["prefill.compute"] == 790   # speeding up prefill would not help
    assert b["hidden_ms"] == 800           # + the prefill leg's concurrent dispatch


# ---------------------------------------------------------------------------
# I. Readiness noticed late (pull, D at TP=2): ranks' transfers end 480 / 500,
#   kv.ready 500-1700 (promotion at 1700), first step 25, stream 7 -> 1732.
def _case_i():
    c = Case()
    root = c.router_request("i1", 0, 1800, "pull", first_token_ms=1732)
    c.span("router", "router.dispatch", 0, 2, rid="i1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 2, 400, rid="i1", engine="p0")
    c.span("router", "router.dispatch", 400, 402, rid="i1", parent=root, attrs={"router.leg": "decode"})
    for rank, end in ((0, 480), (1, 500)):
        c.span("decode", "handoff.prep", 402, 410, rid="i1", engine="d0", rank=rank)
        c.span("decode", "kv.transfer", 410, end, rid="i1", engine="d0", rank=rank)
    c.span("decode", "kv.ready", 500, 1700, rid="i1", engine="d0")
    c.span("decode", "decode.first_step", 1700, 1725, rid="i1", engine="d0")
    c.span("decode", "decode.frontend", 1725, 1732, rid="i1", engine="d0")
    return c


def test_i_readiness_noticed_late(analyse):
    tr = analyse(_case_i())
    b = tiles(tr, "i1")
    assert b["ttft_ms"] == 1732 and b["readiness_lag_ms"] == 1200
    assert b["dominant_stage"] == "kv.ready"
    assert b["transfer_ms"] == 90 and b["compute_ms"] == 423


# ---------------------------------------------------------------------------
# G. Clock skew: P's clock runs 250 ms ahead. D's handshake sample: offset
#   250, round trip 10 -> 250 +- 5. Raw P compute end (350 on P's clock) ->
#   D transfer start (112) is -238; corrected +12, coordination.
#   router |disp 0-2|                 |disp D 101-103|                  * 150
#   P (raw +250)  |compute 2-100|
#   D                                          |prep 103-112|xfer 112-120|ready|first_step 121-150|
def _case_g():
    c = Case(clock_shift_ms={"p0": 250})
    root = c.router_request("g1", 0, 160, "pull", first_token_ms=150)
    c.span("router", "router.dispatch", 0, 2, rid="g1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 2, 100, rid="g1", engine="p0")
    c.span("router", "router.dispatch", 101, 103, rid="g1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "handoff.prep", 103, 112, rid="g1", engine="d0", rank=0)
    c.span("decode", "kv.transfer", 112, 120, rid="g1", engine="d0", rank=0)
    c.span("decode", "kv.ready", 120, 121, rid="g1", engine="d0")
    c.span("decode", "decode.first_step", 121, 150, rid="g1", engine="d0")
    c.event("decode", "clock.sample", 103, engine="d0",
            attrs={"clock.offset_ns": 250_000_000, "clock.rtt_ns": 10_000_000, "clock.peer_engine_id": "p0"})
    return c


def test_g_clock_skew(analyse):
    tr = analyse(_case_g())
    pair = tr.query("SELECT * FROM clock_offsets WHERE clock_a = 'd0' AND clock_b = 'p0' AND window_start_ns IS NULL")
    assert len(pair) == 1
    # the sample (250 +- 5) intersected with the bounds through the router: P - D in [249 - 0, 250 - 0]
    assert pair[0]["offset_ms"] == 250 and pair[0]["bound_ms"] == 1 and pair[0]["samples"] == 1
    s = {r["stage"]: r for r in tr.query("SELECT * FROM spans WHERE request_id = 'g1'")}
    raw_gap = s["kv.transfer"]["raw_start_ns"] - s["prefill.compute"]["raw_end_ns"]
    gap = s["kv.transfer"]["start_ns"] - s["prefill.compute"]["end_ns"]
    assert raw_gap == -238_000_000 and gap == 12_000_000
    assert s["prefill.compute"]["clock_offset_ns"] == 250_000_000
    assert s["prefill.compute"]["clock_bound_ns"] <= 5_000_000
    b = tiles(tr, "g1")
    assert b["ttft_ms"] == 150 and b["compute_ms"] == 127 and b["transfer_ms"] == 8
    assert b["coordination_ms"] == 15          # dispatch 2 + 1 gap + D dispatch 2 + prep 9 + ready 1
    segs = _segs(tr, "g1")
    gap_seg = [x for x in segs if x["stage"] == "unattributed"]
    assert len(gap_seg) == 1 and gap_seg[0]["dur_ns"] == 1_000_000
    assert gap_seg[0]["detail"] == "between prefill.compute and router.dispatch"


def test_g_uncorrected_store_keeps_every_request(analyse):
    """Without any skew evidence, an impossible raw order is still analysed (clipped, not dropped)."""
    c = _case_g()
    c.rows[("decode", "d0")] = [r for r in c.rows[("decode", "d0")] if r["name"] != "clock.sample"]
    # drop the router<->P evidence too: no dispatch rows
    c.rows[("router", None)] = [r for r in c.rows[("router", None)] if r["name"] != "router.dispatch"]
    tr = analyse(c)
    b = tiles(tr, "g1")
    assert b["ttft_ms"] == 150


def test_g_monotonic_handshake_sample_converted_through_anchors(analyse):
    """The connectors record the handshake's offset between monotonic clocks; anchors convert it."""
    c = _case_g()
    rows = c.rows[("decode", "d0")]
    for r in rows:
        if r["name"] == "clock.sample":
            r["attrs"] = {"clock.offset_ns": 3_000_000, "clock.rtt_bound_ns": 10_000_000,
                          "clock.peer_engine_id": "p0", "clock.domain": "monotonic"}
    # monotonic clocks: D's reads wall - 1000 s, P's wall (already +250 ms) - 1000 s - 3 ms
    rows.append({"record": "clock", "name": "clock.anchor", "start_ns": ns(0),
                 "attrs": {"clock.mono_ns": ns(0) - 1_000_000_000_000}})
    c.rows[("prefill", "p0")].append({"record": "clock", "name": "clock.anchor", "start_ns": ns(250),
                                      "attrs": {"clock.mono_ns": ns(0) - 1_000_000_000_000 + 3_000_000}})
    tr = analyse(c)
    pair = tr.query("SELECT * FROM clock_offsets WHERE clock_a = 'd0' AND clock_b = 'p0' AND window_start_ns IS NULL")
    assert pair[0]["offset_ms"] == 250 and pair[0]["bound_ms"] == 1     # via the router: [249, 250]


def test_h_registration_recorded_by_prefill_is_still_the_decode_branch(analyse):
    """dest.register ends when P matches the registration; P may record it. It stays D's branch."""
    c = _case_h()
    d_rows = c.rows[("decode", "d0")]
    reg = [r for r in d_rows if r["name"] == "dest.register"]
    c.rows[("decode", "d0")] = [r for r in d_rows if r["name"] != "dest.register"]
    c.rows[("prefill", "p0")] += reg
    tr = analyse(c)
    b = tiles(tr, "h1")
    assert (b["coordination_ms"], b["transfer_ms"], b["compute_ms"]) == (4000, 30, 40)
    assert b["dominant_stage"] == "dest.register"


# ---------------------------------------------------------------------------
# L. P's late response write (pull, under load). The router gets P's response
#   at 101 and dispatches D at once, but P's API server only finishes its
#   prefill.frontend "out" part at 110, after D's kv.transfer (105-108.2) ended.
#   router |disp 0-1|... router.wait 1-101 ...|D disp 101-102|                    * 131
#   P          |fe 1-2|queue 2-5|--- compute 5-100 ---|fe out 100-110 (clipped at 101)|
#   D                                  |fe 102-103|queue 103-104|prep 104-105|xfer 105-108.2|ready|first step 109-130|fe 130-131|
# Without the clip, the frontend tail (ends last) owns [101, 110] and hides the
# transfer: transfer 0. Answer: TTFT 131 = queue 4 + compute 116 + transfer 3.2
# + coordination 7.8; P's frontend owns 2 ms (in part 1 + out part up to 101).
def _case_l():
    c = Case()
    root = c.router_request("l1", 0, 140, "pull", first_token_ms=131)
    c.span("router", "router.dispatch", 0, 1, rid="l1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 1, 101, rid="l1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.frontend", 1, 2, rid="l1", engine="p0")
    c.span("prefill", "prefill.queue", 2, 5, rid="l1", engine="p0")
    c.span("prefill", "prefill.compute", 5, 100, rid="l1", engine="p0")
    c.span("prefill", "prefill.frontend", 100, 110, rid="l1", engine="p0")
    c.span("router", "router.dispatch", 101, 102, rid="l1", parent=root, attrs={"router.leg": "decode"})
    c.span("router", "router.wait", 102, 131, rid="l1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.frontend", 102, 103, rid="l1", engine="d0")
    c.span("decode", "decode.queue", 103, 104, rid="l1", engine="d0")
    c.span("decode", "handoff.prep", 104, 105, rid="l1", engine="d0", rank=0)
    c.span("decode", "kv.transfer", 105, 108.2, rid="l1", engine="d0", rank=0,
           attrs={"kv.op": "READ", "peer.engine_id": "p0"})
    c.span("decode", "kv.ready", 108.2, 109, rid="l1", engine="d0")
    c.span("decode", "decode.first_step", 109, 130, rid="l1", engine="d0")
    c.span("decode", "decode.frontend", 130, 131, rid="l1", engine="d0")
    return c


def test_l_late_prefill_response_write_does_not_hide_the_transfer(analyse):
    tr = analyse(_case_l())
    b = tiles(tr, "l1")
    assert b["ttft_ns"] == 131_000_000
    assert (b["queue_ns"], b["compute_ns"], b["transfer_ns"], b["coordination_ns"]) == (
        4_000_000, 116_000_000, 3_200_000, 7_800_000)
    assert b["unattributed_ns"] == 0 and b["router_wait_ms"] == 0
    assert b["dominant_stage"] == "prefill.compute"
    segs = _segs(tr, "l1")
    assert [s["stage"] for s in segs] == [
        "router.dispatch", "prefill.frontend", "prefill.queue", "prefill.compute", "prefill.frontend",
        "router.dispatch", "decode.frontend", "decode.queue", "handoff.prep", "kv.transfer", "kv.ready",
        "decode.first_step", "decode.frontend"]
    assert segs[4]["dur_ns"] == 1_000_000          # P's out part owns only up to the router's receipt (101)
    assert segs[9]["dur_ns"] == 3_200_000          # the whole kv.transfer is on the path
    # the clipped tail (101-110) is after P's leg ended: neither exposed nor hidden
    assert tr.query("SELECT stage FROM ttft_hidden WHERE request_id = 'l1'") == []


# ---------------------------------------------------------------------------
# N. P's late response write hides D's transfer (push, concurrent legs, as on
#   the push lab stores). P's API server writes its response (prefill.frontend,
#   out part) from 20.5 while D's chain runs: P's writer posts the WRITE
#   (handoff.prep 20-22, kv.transfer 22-25), D sees the write-done notification
#   at 30 (kv.ready 30-33), first step 33-45. kv.ready runs from the transfer's
#   end (DESIGN.md §2: transfer finished -> seen by the poll -> promoted).
#   router |disp 0-1|........ router.wait P .........|                    * 60
#   P       |fe 1-2|q 2-5|-- compute 5-20 --|prep|xfer 22-25|
#   P                                        |fe out 20.5-39 (n1) / 20.5-55 (n2)|
#   D       |fe 1-2|q 2-4|reg 4-10|                       |ready 30-33|first step 33-45|fe|
# Without the rule, P's out part (ends last among them) owns [20.5, 33]: transfer 0.
# n1: P's response is in at 40, D's stream (decode.frontend 45-58) is the later
#   input: TTFT 60 = queue 3 + compute 27 + transfer 3 + coordination 27 (incl.
#   kv.ready 8 and decode.frontend 13); P's whole out part (18.5) is hidden.
# n2: P's response is written until 55 (router gets it at 56), after D's chain:
#   the router's join follows P's response, which owns [45, 55] (bug case D with
#   P's frontend recorded); its 24.5 before D's chain ended is hidden.
def _case_n(rid, p_out_end, router_p_response, d_fe_end):
    c = Case()
    root = c.router_request(rid, 0, 70, "push", first_token_ms=60)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", 0, 1, rid=rid, parent=root, attrs={"router.leg": leg})
    c.span("router", "router.wait", 1, router_p_response, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", router_p_response, 60, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.frontend", 1, 2, rid=rid, engine="p0")
    c.span("prefill", "prefill.queue", 2, 5, rid=rid, engine="p0")
    c.span("prefill", "prefill.compute", 5, 20, rid=rid, engine="p0")
    c.span("prefill", "prefill.frontend", 20.5, p_out_end, rid=rid, engine="p0")
    c.span("prefill", "handoff.prep", 20, 22, rid=rid, engine="p0", rank=0)
    c.span("prefill", "kv.transfer", 22, 25, rid=rid, engine="p0", rank=0, attrs={"kv.op": "WRITE", "peer.engine_id": "d0"})
    c.span("decode", "decode.frontend", 1, 2, rid=rid, engine="d0")
    c.span("decode", "decode.queue", 2, 4, rid=rid, engine="d0")
    c.span("prefill", "dest.register", 4, 10, rid=rid, engine="p0", rank=0)
    c.span("decode", "kv.ready", 30, 33, rid=rid, engine="d0", rank=0)
    c.span("decode", "decode.first_step", 33, 45, rid=rid, engine="d0")
    c.span("decode", "decode.frontend", 45, d_fe_end, rid=rid, engine="d0")
    return c


def test_n_push_prefill_response_write_does_not_hide_d_chain(analyse):
    tr = analyse(_case_n("n1", p_out_end=39, router_p_response=40, d_fe_end=58))
    b = tiles(tr, "n1")
    assert b["ttft_ns"] == 60_000_000
    assert (b["queue_ns"], b["compute_ns"], b["transfer_ns"], b["coordination_ns"]) == (
        3_000_000, 27_000_000, 3_000_000, 27_000_000)
    assert b["unattributed_ns"] == 0 and b["router_wait_ms"] == 2 and b["readiness_lag_ms"] == 8
    segs = _segs(tr, "n1")
    assert [(s["stage"], s["dur_ns"]) for s in segs] == [
        ("router.dispatch", 1_000_000), ("prefill.frontend", 1_000_000), ("prefill.queue", 3_000_000),
        ("prefill.compute", 15_000_000), ("handoff.prep", 2_000_000), ("kv.transfer", 3_000_000),
        ("kv.ready", 8_000_000), ("decode.first_step", 12_000_000), ("decode.frontend", 13_000_000),
        ("router.wait", 2_000_000)]
    hid = {r["stage"]: r["hidden_ns"] for r in tr.query("SELECT stage, hidden_ns FROM ttft_hidden")}
    assert hid["prefill.frontend"] == 18_500_000     # P's out part ran while D's chain was on the path
    assert hid["dest.register"] == 6_000_000 and hid["decode.queue"] == 2_000_000


def test_n_push_late_prefill_response_is_the_router_join_after_d_chain(analyse):
    tr = analyse(_case_n("n2", p_out_end=55, router_p_response=56, d_fe_end=47))
    b = tiles(tr, "n2")
    assert b["ttft_ns"] == 60_000_000
    assert (b["queue_ns"], b["compute_ns"], b["transfer_ns"], b["coordination_ns"]) == (
        3_000_000, 27_000_000, 3_000_000, 27_000_000)
    assert b["unattributed_ns"] == 0 and b["router_wait_ms"] == 5
    segs = _segs(tr, "n2")
    assert [(s["stage"], s["dur_ns"]) for s in segs] == [
        ("router.dispatch", 1_000_000), ("prefill.frontend", 1_000_000), ("prefill.queue", 3_000_000),
        ("prefill.compute", 15_000_000), ("handoff.prep", 2_000_000), ("kv.transfer", 3_000_000),
        ("kv.ready", 8_000_000), ("decode.first_step", 12_000_000), ("prefill.frontend", 10_000_000),
        ("router.wait", 1_000_000), ("router.wait", 4_000_000)]
    hid = {r["stage"]: r["hidden_ns"] for r in tr.query("SELECT stage, hidden_ns FROM ttft_hidden")}
    assert hid["prefill.frontend"] == 24_500_000
    assert hid["decode.frontend"] == 1_000_000 + 2_000_000   # in part behind P's branch, out part behind P's response
