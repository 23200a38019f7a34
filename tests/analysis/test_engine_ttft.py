"""Engine-clock TTFT windows (DESIGN.md §3 "TTFT source", issue 16 item 2) on hand-built stores.

No router record: the window is P's API server receiving the request
(prefill.frontend 'in' start) -> D's API server writing the first token chunk
(its `token` event on decode.frontend), P and D corrected against each other,
and the router's hop between the legs is the pseudo-stage router.unseen.
Times are ms on the true clock; a shifted engine records true + shift.
"""
import pytest

from pdtrace_case_builder import Case, ns

PULL = "TracedNixlPullConnector"


def _segs(tr, rid):
    return [(s["stage"], s["category"], s["dur_ns"] / 1e6)
            for s in tr.query("SELECT stage, category, dur_ns FROM ttft_segments WHERE request_id = ? ORDER BY seq",
                              [rid])]


def _tiles(tr, rid):
    """The segments tile [arrival, first token] to the ns and the categories add up to the TTFT."""
    b = tr.query("SELECT * FROM ttft_breakdown WHERE request_id = ?", [rid])[0]
    segs = tr.query("SELECT start_ns, end_ns, dur_ns FROM ttft_segments WHERE request_id = ? ORDER BY seq", [rid])
    assert segs[0]["start_ns"] == b["arrival_ns"] and segs[-1]["end_ns"] == b["first_token_ns"]
    assert all(a["end_ns"] == c["start_ns"] for a, c in zip(segs, segs[1:]))
    assert b["queue_ns"] + b["compute_ns"] + b["transfer_ns"] + b["coordination_ns"] == b["ttft_ns"]
    assert sum(s["dur_ns"] for s in segs) == b["ttft_ns"]
    return b


def _frontend(c, role, engine, rid, t_in, t_handed, t_out0, t_out1, t_token):
    """The middleware's two frontend spans and its token event (on the out span) for one request."""
    name = f"{role}.frontend"
    c.span(role, name, t_in, t_handed, rid=rid, engine=engine, attrs={"frontend.part": "in"})
    out = c.span(role, name, t_out0, t_out1, rid=rid, engine=engine, attrs={"frontend.part": "out"})
    c.event(role, "token", t_token, rid=rid, engine=engine, span=out, attrs={"request.stream": int(role == "decode")})


# ---------------------------------------------------------------------------
# EP. Engine-clock pull, no router record; D's clock reads `shift` ms late and
# its handshake sample (peer minus own = -shift, rtt 1 ms) says so.
#
#   P  |fe 2|q 3|------ compute 100 ------|fe.out 105-110 (token 106)
#   (router, unseen)                         106 ... 109
#   D                                             |fe 2|q 2|prep 5|xfer 8|rdy 1|first_step 30|fe.out (token 158)
#   P's notification.received at 128 (D's read done)
#   => TTFT 158: [0 P received, 158 D's first chunk]
def _case_ep(shift):
    c = Case(clock_shift_ms={"d0": shift}, connector=PULL)
    _frontend(c, "prefill", "p0", "ep", 0, 2, 105, 110, 106)
    c.span("prefill", "prefill.queue", 2, 5, rid="ep", engine="p0")
    c.span("prefill", "prefill.compute", 5, 105, rid="ep", engine="p0")
    c.event("prefill", "notification.received", 128, rid="ep", engine="p0", attrs={"kv.notif_kind": "read_done"})
    _frontend(c, "decode", "d0", "ep", 109, 111, 157, 190, 158)
    c.span("decode", "decode.queue", 111, 113, rid="ep", engine="d0")
    c.span("decode", "handoff.prep", 113, 118, rid="ep", engine="d0", rank=0)
    c.span("decode", "kv.transfer", 118, 126, rid="ep", engine="d0", rank=0, attrs={"kv.descriptors": 4})
    c.span("decode", "kv.ready", 126, 127, rid="ep", engine="d0")
    c.span("decode", "decode.first_step", 127, 157, rid="ep", engine="d0")
    c.event("decode", "token", 157, rid="ep", engine="d0", attrs={"gen_ai.usage.output_tokens": 1})  # EngineCore's
    c.event("decode", "request.finished", 189, rid="ep", engine="d0", attrs={"gen_ai.usage.output_tokens": 17})
    c.event("decode", "clock.sample", 50, engine="d0",
            attrs={"clock.peer_engine_id": "p0", "clock.offset_ns": round(-shift * 1e6), "clock.rtt_ns": 1_000_000})
    return c


EP_SEGMENTS = [
    ("prefill.frontend", "coordination", 2), ("prefill.queue", "queue", 3), ("prefill.compute", "compute", 100),
    ("prefill.frontend", "coordination", 1),      # P's out part, clipped at P's response (its token event)
    ("router.unseen", "coordination", 3),         # the router's hop between the legs: named, not dropped
    ("decode.frontend", "coordination", 2), ("decode.queue", "queue", 2), ("handoff.prep", "coordination", 5),
    ("kv.transfer", "transfer", 8), ("kv.ready", "coordination", 1), ("decode.first_step", "compute", 30),
    ("decode.frontend", "coordination", 1),
]


@pytest.mark.parametrize("shift", [0, 40, -40])
def test_ep_engine_pull_window_and_breakdown(analyse, shift):
    tr = analyse(_case_ep(shift))
    r = tr.query("SELECT * FROM requests")[0]
    assert (r["status"], r["ttft_source"], r["mode"]) == ("complete", "engine", "pull")
    assert r["arrival_ns"] == ns(0) and r["first_token_ns"] == ns(158) and r["ttft_ms"] == 158
    # TPOT from D's API server: last chunk 190, 17 tokens
    assert r["last_token_ns"] == ns(190) and r["tpot_ms"] == pytest.approx(32 / 16)
    assert _segs(tr, "ep") == EP_SEGMENTS
    b = _tiles(tr, "ep")
    assert (b["queue_ms"], b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (5, 130, 8, 15)
    assert b["router_unseen_ms"] == 3 and b["unattributed_ms"] == 0 and b["ttft_source"] == "engine"
    # D corrected to P's clock (the reference without a router): raw - shift
    off = tr.query("SELECT DISTINCT clock_domain, clock_offset_ns FROM spans ORDER BY 1")
    assert off == [{"clock_domain": "d0", "clock_offset_ns": round(shift * 1e6)},
                   {"clock_domain": "p0", "clock_offset_ns": 0}]
    assert tr.query("SELECT status FROM clock_domains WHERE domain = 'p0'") == [{"status": "reference"}]


def test_ep_skew_without_sample_is_bounded_by_the_handoff_messages(analyse):
    """No sample: the two engine-only messages (P's response -> D's request, D's READ -> P's notification) bound
    D's offset to [+30, +43] ms; the least correction (+30) leaves D 10 ms late, never earlier than P's answer."""
    c = _case_ep(40)
    for rows in c.rows.values():
        rows[:] = [x for x in rows if x["name"] != "clock.sample"]
    tr = analyse(c)
    co = tr.query("SELECT lower_ns, upper_ns, offset_ns, sources FROM clock_offsets WHERE window_start_ns IS NULL")
    assert co == [{"lower_ns": -43_000_000, "upper_ns": -30_000_000, "offset_ns": -30_000_000,
                   "sources": "frontend_hop,read_done"}]
    r = tr.query("SELECT ttft_ms, ttft_source FROM requests")[0]
    assert r == {"ttft_ms": 168, "ttft_source": "engine"}
    _tiles(tr, "ep")
    assert dict((s, d) for s, _, d in _segs(tr, "ep"))["router.unseen"] == 13


# ---------------------------------------------------------------------------
# EQ. Engine-clock push, no router record; D's clock reads 25 ms early.
#
#   P  |fe 3|q 3|------ compute 74 ------|prep 2|xfer 8|        (fe.out 80-85: hidden behind D's chain)
#   D    |fe 2|q 2|dest.register 6-9 (matched on P)|     |ready 3|first_step 27|fe.out (token 121)
#   => TTFT 121; D's early branch is hidden (P's compute arrived last); router.unseen [0, 2] is
#      covered by P's frontend, so it owns nothing.
def _case_eq(shift):
    c = Case(clock_shift_ms={"d0": shift})
    _frontend(c, "prefill", "p0", "eq", 0, 3, 80, 85, 81)
    c.span("prefill", "prefill.queue", 3, 6, rid="eq", engine="p0")
    c.span("prefill", "prefill.compute", 6, 80, rid="eq", engine="p0")
    _frontend(c, "decode", "d0", "eq", 2, 4, 120, 140, 121)
    c.span("decode", "decode.queue", 4, 6, rid="eq", engine="d0")
    c.event("decode", "registration.sent", 6, rid="eq", engine="d0")
    c.span("prefill", "dest.register", 6, 9, rid="eq", engine="p0")
    c.event("prefill", "registration.received", 9, rid="eq", engine="p0",
            attrs={"clock.send_ns": ns(6 + shift), "peer.engine_id": "d0"})
    c.span("prefill", "handoff.prep", 80, 82, rid="eq", engine="p0", rank=0)
    c.span("prefill", "kv.transfer", 82, 90, rid="eq", engine="p0", rank=0, attrs={"kv.descriptors": 4})
    c.span("decode", "kv.ready", 91, 93, rid="eq", engine="d0")
    c.span("decode", "decode.first_step", 93, 120, rid="eq", engine="d0")
    c.event("decode", "clock.sample", 50, engine="d0",
            attrs={"clock.peer_engine_id": "p0", "clock.offset_ns": round(-shift * 1e6), "clock.rtt_ns": 1_000_000})
    return c


@pytest.mark.parametrize("shift", [0, -25])
def test_eq_engine_push_window_and_breakdown(analyse, shift):
    tr = analyse(_case_eq(shift))
    r = tr.query("SELECT * FROM requests")[0]
    assert (r["status"], r["ttft_source"], r["mode"]) == ("complete", "engine", "push")
    assert r["arrival_ns"] == ns(0) and r["first_token_ns"] == ns(121) and r["ttft_ms"] == 121
    assert _segs(tr, "eq") == [
        ("prefill.frontend", "coordination", 3), ("prefill.queue", "queue", 3), ("prefill.compute", "compute", 74),
        ("handoff.prep", "coordination", 2), ("kv.transfer", "transfer", 8),
        ("kv.ready", "coordination", 3),          # rule 6: from the transfer's end (90), not D's 91
        ("decode.first_step", "compute", 27), ("decode.frontend", "coordination", 1)]
    b = _tiles(tr, "eq")
    assert (b["queue_ms"], b["compute_ms"], b["transfer_ms"], b["coordination_ms"]) == (3, 101, 8, 9)
    assert b["router_unseen_ms"] == 0
    hid = {h["stage"]: h["hidden_ms"] for h in tr.query("SELECT stage, hidden_ms FROM ttft_hidden")}
    assert hid["dest.register"] == 3 and hid["decode.queue"] == 2


# ---------------------------------------------------------------------------
# One side only: incomplete with a cause that says which side is missing.
def test_one_sided_engine_requests_are_incomplete_with_a_cause(analyse):
    c = Case(connector=PULL)
    _frontend(c, "prefill", "p0", "p-only", 0, 2, 50, 52, 51)
    c.span("prefill", "prefill.compute", 2, 50, rid="p-only", engine="p0")
    _frontend(c, "decode", "d0", "d-only", 0, 2, 40, 60, 41)
    c.span("decode", "decode.first_step", 2, 40, rid="d-only", engine="d0")
    # both sides, but P's API server recorded nothing: no window start
    c.span("prefill", "prefill.compute", 0, 50, rid="no-fe", engine="p0")
    _frontend(c, "decode", "d0", "no-fe", 55, 57, 90, 99, 91)
    tr = analyse(c)
    inc = {r["request_id"]: (r["cause"], r["detail"], r["ttft_source"])
           for r in tr.query("SELECT * FROM incomplete_requests")}
    assert inc == {
        "p-only": ("no_decode_record", "no router record; P saw the request, D never did", "engine"),
        "d-only": ("no_prefill_record", "no router record; D saw the request, P never did", "engine"),
        "no-fe": ("no_prefill_frontend",
                  "no router record and no prefill.frontend span: the engine-clock window has no start", "engine"),
    }
    assert tr.query("SELECT count(*) AS n FROM ttft_segments") == [{"n": 0}]
    assert {r["status"] for r in tr.query("SELECT status FROM requests")} == {"incomplete"}


def test_router_record_wins_over_engine_marks(analyse):
    """A request the router recorded keeps the router's window, whatever the engines' frontends say."""
    c = Case(connector=PULL)
    root = c.router_request("rt", 0, 200, "pull", first_token_ms=170)
    c.span("router", "router.dispatch", 0, 1, rid="rt", parent=root, attrs={"router.leg": "prefill"})
    _frontend(c, "prefill", "p0", "rt", 1, 2, 100, 104, 101)
    c.span("prefill", "prefill.compute", 2, 100, rid="rt", engine="p0")
    _frontend(c, "decode", "d0", "rt", 105, 106, 160, 190, 165)
    c.span("decode", "decode.first_step", 106, 160, rid="rt", engine="d0")
    tr = analyse(c)
    r = tr.query("SELECT ttft_source, ttft_ms, arrival_ns FROM requests")[0]
    assert r == {"ttft_source": "router", "ttft_ms": 170, "arrival_ns": ns(0)}
    assert "router.unseen" not in {s for s, _, _ in _segs(tr, "rt")}
    _tiles(tr, "rt")
