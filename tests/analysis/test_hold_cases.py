"""Issue 17 kinds 9 and 10 (part): facts recorded but not read, and what operators asked for.

Each test rebuilds a public bug report as a small store in pdtrace's vocabulary
(DESIGN.md §2) and checks the answer the report implies:

  kind 9   transfers.first_contact from the handshake stage of the same request;
           block_holds rows for holds never released (either side), D-side
           releases without use (abort, expiry), the prefix hit on its own side
  kind 10  requests.flags; ttft_segments.culprit_request_id (module segment_culprits)
"""
from pdtrace_case_builder import Case, ns

from pdtrace_case_builder import one


def _open(c, role, name, start_ms, flushes_ms, rid, engine=None, span_id=None, attrs=None, state="open"):
    """Open rows of a span still open at each flush (the recorder's `open` records, schema 1.1)."""
    for t in flushes_ms:
        a = {"open.state": "open", **(attrs or {})}
        if t == flushes_ms[-1]:
            a["open.state"] = state
        c.rows[(role, engine)].append({
            "record": "open", "name": name, "span_id": span_id, "start_ns": c._t(engine or role, start_ms),
            "end_ns": c._t(engine or role, t), "request_id": rid, "attempt": 0, "attrs": a})


def _flushes(c, role, engine=None, at=(1000, 2000, 3000)):
    """The process's flushes (`stats` rows): its trace end is the last one (module in_flight)."""
    for t in at:
        c.rows[(role, engine)].append({"record": "stats", "name": "recorder.stats", "start_ns": c._t(engine or role, t),
                                       "attrs": {"recorder.written": 1}})


def _flags(tr):
    return {r["request_id"]: r["flags"] for r in tr.query("SELECT request_id, flags FROM requests")}


def _holds(tr):
    return {(r["request_id"], r["side"]): r for r in tr.query("SELECT * FROM block_holds")}


# ----------------------------------------------------------------------------- kind 9: first contact
def _pull_request(c, rid, base, p, cold, n_xfers=1, prep_attr=None):
    """Pull: P computes 0-150, D's handoff.prep (a handshake + agent load on first contact), READ(s), first step."""
    root = c.router_request(rid, base, base + 3000, "pull", first_token_ms=base + 2000)
    c.span("router", "router.dispatch", base, base + 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", base + 2, base + 152, rid=rid, engine=p)
    t = base + 152
    prep = 1400 if cold else 1
    a = {"peer.engine_id": p}
    if prep_attr is not None:
        a["kv.first_contact"] = prep_attr
    hp = c.span("decode", "handoff.prep", t, t + prep, rid=rid, engine="d0", rank=0, attrs=a)
    if cold:
        hs = c.span("decode", "handoff.handshake", t, t + 1300, rid=rid, engine="d0", rank=0, parent=hp,
                    attrs={"peer.engine_id": p})
        c.span("decode", "handoff.agent_load", t + 1300, t + 1390, rid=rid, engine="d0", rank=0, parent=hs,
               attrs={"peer.engine_id": p})
    t += prep
    for k in range(n_xfers):
        c.span("decode", "kv.transfer", t + k, t + k + 8, rid=rid, engine="d0", rank=0,
               attrs={"kv.bytes": 1 << 20, "kv.descriptors": 64, "kv.op": "READ", "peer.engine_id": p,
                      "kv.backend": "UCX"})
    c.span("decode", "kv.ready", t + 8 + n_xfers, t + 10 + n_xfers, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", t + 10 + n_xfers, t + 40 + n_xfers, rid=rid, engine="d0")


def test_first_contact_from_the_handshake_stage_sglang_28737(analyse):
    """sgl-project/sglang#28737 (NIXL section): "the first request after launch pays a ~38 s one-time UCX
    connection"; later requests on the same pair are fast. The traced connectors record that cost as the
    request's handoff.handshake (+ handoff.agent_load) and never set kv.first_contact on kv.transfer, so the
    old rule (the transfer's own attribute) said false for every transfer of a live store.
    c1: first request p0->d0 (cold, two READ handles: the first one paid), c2: p0->d0 warm, c3: p1->d0 cold
    (a new engine pair pays again). Right answer: transfers.first_contact true for c1's first READ and
    c3's READ only; requests.first_contact and the flag agree."""
    c = Case()
    _pull_request(c, "c1", 0, "p0", True, n_xfers=2)
    _pull_request(c, "c2", 5000, "p0", False)
    _pull_request(c, "c3", 10000, "p1", True)
    tr = analyse(c)
    got = [(r["request_id"], r["first_contact"]) for r in
           tr.query("SELECT request_id, first_contact FROM transfers ORDER BY start_ns")]
    assert got == [("c1", True), ("c1", False), ("c2", False), ("c3", True)]
    req = {r["request_id"]: r["first_contact"] for r in tr.query("SELECT request_id, first_contact FROM requests")}
    assert req == {"c1": True, "c2": False, "c3": True}
    fl = _flags(tr)
    assert ["first_contact" in fl[r] for r in ("c1", "c2", "c3")] == [True, False, True]


def test_first_contact_push_per_rank_neuralmagic_vllm_63(analyse):
    """neuralmagic/vllm#63 (NIXL runtime handshake): "the nixl handshake takes ~2s. This happens on the
    hotpath" -- once per engine pair and rank. Push, TP=2: P's writer owns the NIXL handle, so P records
    the handshake (handoff.prep with kv.first_contact = 1 and a handoff.handshake child per rank) and the
    WRITEs. Right answer: w1's WRITE on each rank is first_contact (each rank handshook), w2's are not
    (the pair is warm); a handshake on rank 0 does not mark rank 1's WRITE of another request."""
    c = Case()
    for rid, base, cold in (("w1", 0, True), ("w2", 5000, False)):
        c.router_request(rid, base, base + 4000, "push", first_token_ms=base + 3000)
        c.span("prefill", "prefill.compute", base, base + 100, rid=rid, engine="p0")
        for rank in (0, 1):
            hp = c.span("prefill", "handoff.prep", base + 100, base + (2100 if cold else 101), rid=rid, engine="p0",
                        rank=rank, attrs={"peer.engine_id": "d0", "kv.first_contact": int(cold)})
            if cold:
                c.span("prefill", "handoff.handshake", base + 100, base + 2090, rid=rid, engine="p0", rank=rank,
                       parent=hp, attrs={"peer.engine_id": "d0"})
            t = base + (2100 if cold else 101)
            c.span("prefill", "kv.transfer", t, t + 10, rid=rid, engine="p0", rank=rank,
                   attrs={"kv.op": "WRITE", "peer.engine_id": "d0", "kv.bytes": 1 << 20})
    # w3: rank 0 handshakes with d0, rank 1 was already warm (its pair handshook earlier)
    c.router_request("w3", 9000, 12000, "push", first_token_ms=11000)
    hp = c.span("prefill", "handoff.prep", 9100, 9600, rid="w3", engine="p0", rank=0,
                attrs={"peer.engine_id": "d0", "kv.first_contact": 1})
    c.span("prefill", "handoff.handshake", 9100, 9590, rid="w3", engine="p0", rank=0, parent=hp)
    for rank in (0, 1):
        c.span("prefill", "kv.transfer", 9600, 9610, rid="w3", engine="p0", rank=rank,
               attrs={"kv.op": "WRITE", "peer.engine_id": "d0"})
    tr = analyse(c)
    got = {(r["request_id"], r["tp_rank"]): r["first_contact"] for r in tr.query("SELECT * FROM transfers")}
    assert got == {("w1", 0): True, ("w1", 1): True, ("w2", 0): False, ("w2", 1): False,
                   ("w3", 0): True, ("w3", 1): False}
    assert all(r["src_engine"] == "p0" and r["dst_engine"] == "d0" for r in tr.query("SELECT * FROM transfers"))


# ----------------------------------------------------------------------------- kind 9: holds never released
def test_p_blocks_never_released_unmatched_notification_vllm_36958(analyse):
    """vllm-project/vllm#36958: with MLA and P TP > D TP the read-done notification carried D's local id,
    "the notification arrived with an unrecognized ID and the KV blocks were never freed" on P.
    n1: D READ the blocks (400-450), P logged notification.unmatched, P's prefill.block_hold stays open
    (open rows at each flush, last flush 3000). n2: released normally by its notification.
    Right answer: n1 has a P row released 'never', running from KV ready (400) to P's trace end (3000),
    read by one transfer (so not held_without_read); flag blocks_never_released on n1 only."""
    c = Case()
    for rid, base in (("n1", 0), ("n2", 100)):
        c.router_request(rid, base, base + 900, "pull", first_token_ms=base + 800, last_token_ms=base + 850)
        c.span("prefill", "prefill.compute", base + 10, base + 400, rid=rid, engine="p0")
        c.span("decode", "kv.transfer", base + 400, base + 450, rid=rid, engine="d0", rank=0,
               attrs={"kv.op": "READ", "peer.engine_id": "p0", "kv.blocks": 8, "kv.bytes": 8 << 20})
        c.span("decode", "decode.block_reserve", base + 390, base + 460, rid=rid, engine="d0", attrs={"kv.blocks": 8})
    _open(c, "prefill", "prefill.block_hold", 400, [1000, 2000, 3000], "n1", engine="p0", span_id=901,
          attrs={"wait.for": "read_done"})
    c.event("prefill", "notification.unmatched", 452, rid="n1", engine="p0",
            attrs={"kv.notif_kind": "read_done", "lifecycle.cause": "unrecognized_or_expired"})
    c.span("prefill", "prefill.block_hold", 500, 552, rid="n2", engine="p0",
           attrs={"kv.blocks": 8, "kv.release_cause": "notification"})
    _flushes(c, "prefill", "p0")
    _flushes(c, "decode", "d0")
    tr = analyse(c)
    h = _holds(tr)
    p1 = h[("n1", "prefill")]
    assert (p1["release_cause"], p1["source"], p1["start_ns"], p1["end_ns"]) == ("never", "open", ns(400), ns(3000))
    assert p1["hold_ms"] == 2600 and p1["held_without_read"] is False and p1["transfers"] == 1
    assert h[("n2", "prefill")]["release_cause"] == "notification"
    fl = _flags(tr)
    assert "blocks_never_released" in fl["n1"] and "blocks_never_released" not in fl["n2"]


def _push_d_waiting(c, rid, base, abort_ms=None, write_done_ms=None, ttl_ms=None, cause="aborted_waiting_for_kv"):
    """Push, D side: decode.queue until blocks allocated (base+5), a registration sent; P never finishes."""
    c.router_request(rid, base, base + 2000, "push")
    c.span("decode", "decode.queue", base, base + 5, rid=rid, engine="d0")
    c.span("decode", "dest.register", base + 5, base + 40, rid=rid, engine="d0", attrs={"kv.blocks": 16})
    if write_done_ms is not None:
        c.event("decode", "notification.received", write_done_ms, rid=rid, engine="d0",
                attrs={"kv.notif_kind": "write_done"})
    if abort_ms is not None:
        c.event("decode", "request.abort", abort_ms, rid=rid, engine="d0", attrs={"lifecycle.cause": cause})
    if ttl_ms is not None:
        c.event("decode", "kv.ttl_expired", ttl_ms, rid=rid, engine="d0")


def test_d_blocks_of_aborted_load_never_reclaimed_vllm_46283(analyse):
    """vllm-project/vllm#46283: a decode request aborted in WAITING_FOR_REMOTE_KVS keeps its blocks (the
    #32255 fix) until the worker reports the receive finished; in push that needs P's completion
    notification, and if P never sends it "the blocks are never freed". a1: D allocated at 5, aborted at
    1500 while waiting, P never wrote. a2: same, but P's write_done arrived at 1800, after the abort.
    Right answer: a1 has a D row 'never' from 5 to D's trace end (3000), derived from D's stages;
    a2's D row is released by 'abort' at 1800 (held until the pending receive finished), not at the
    abort itself; blocks_never_released flags a1 only."""
    c = Case()
    _push_d_waiting(c, "a1", 0, abort_ms=1500)
    _push_d_waiting(c, "a2", 0, abort_ms=1500, write_done_ms=1800)
    _flushes(c, "decode", "d0")
    tr = analyse(c)
    h = _holds(tr)
    a1, a2 = h[("a1", "decode")], h[("a2", "decode")]
    assert (a1["release_cause"], a1["source"], a1["start_ns"], a1["end_ns"]) == ("never", "derived", ns(5), ns(3000))
    assert (a2["release_cause"], a2["end_ns"], a2["hold_ms"]) == ("abort", ns(1800), 1795)
    fl = _flags(tr)
    assert "blocks_never_released" in fl["a1"] and "blocks_never_released" not in fl["a2"]


def test_d_release_without_use_expiry_and_abort_vllm_50754_sglang_35360(analyse):
    """vllm-project/vllm#50754: in push, when P cannot post one WRITE "the decode node counts toward a
    number it never reaches. The request hangs until its lease expires while holding blocks" -> e1: D's
    blocks from 5 to kv.ttl_expired at 900, release 'expiry'.
    sgl-project/sglang#35360 (deferred decode-side KV release): on abort, an in-flight request's KV pages
    are held until the prefill side's transfer drained -> e2 (pull): D posted its READ at 100, was aborted
    at 300 while the READ ran, the READ ended at 450: 'abort' at 450. e3: the READ ended at 200, the abort
    at 300 came after the KV arrived: freed at the abort, 300. None of them used the blocks (no
    decode.block_reserve / decode.first_step)."""
    c = Case()
    _push_d_waiting(c, "e1", 0, ttl_ms=900)
    c.event("prefill", "kv.post_failed", 400, rid="e1", engine="p0", attrs={"lifecycle.cause": "post_failed"})
    for rid, xfer_end in (("e2", 450), ("e3", 200)):
        c.router_request(rid, 0, 2000, "pull")
        c.span("decode", "decode.queue", 0, 10, rid=rid, engine="d0")
        c.span("decode", "handoff.prep", 10, 100, rid=rid, engine="d0", rank=0, attrs={"peer.engine_id": "p0"})
        c.span("decode", "kv.transfer", 100, xfer_end, rid=rid, engine="d0", rank=0,
               attrs={"kv.op": "READ", "peer.engine_id": "p0", "kv.bytes": 1 << 20})
        c.event("decode", "request.abort", 300, rid=rid, engine="d0", attrs={"lifecycle.cause": "ABORTED"})
    _flushes(c, "decode", "d0")
    tr = analyse(c)
    h = _holds(tr)
    assert (h[("e1", "decode")]["release_cause"], h[("e1", "decode")]["end_ns"]) == ("expiry", ns(900))
    assert h[("e1", "decode")]["hold_ms"] == 895
    assert (h[("e2", "decode")]["release_cause"], h[("e2", "decode")]["start_ns"], h[("e2", "decode")]["end_ns"]) \
        == ("abort", ns(10), ns(450))
    assert (h[("e3", "decode")]["release_cause"], h[("e3", "decode")]["end_ns"]) == ("abort", ns(300))
    assert not any("blocks_never_released" in f for f in _flags(tr).values())


def test_completed_request_gets_no_derived_d_row(analyse):
    """Control for the derived D rows: a request that used its blocks (decode.block_reserve, first step)
    has its one span row ('used'), no second row."""
    c = Case()
    _pull_request(c, "u1", 0, "p0", False)
    c.span("decode", "decode.block_reserve", 152, 163, rid="u1", engine="d0", attrs={"kv.blocks": 4})
    tr = analyse(c)
    rows = tr.query("SELECT side, release_cause, source FROM block_holds")
    assert rows == [{"side": "decode", "release_cause": "used", "source": "span"}]


# ----------------------------------------------------------------------------- kind 9: prefix hit on its side
def test_prefix_hit_on_its_own_side_sglang_7990_vllm_18632(analyse):
    """sgl-project/sglang#7990: with radix cache on D, "prefix cache hits may occur on decode nodes ...
    the current implementation unnecessarily transfers KVCache for all tokens" -> x1: D held 24 blocks of
    the prompt, the READ moved all 32 again: missed prefix hit, on D's row. P has its own prefix cache
    (vllm-project/vllm#46383: P looks up its local prefix cache first): P hit 8 blocks of x1's prompt.
    vllm-project/vllm#18632: a FULL prefix hit on D read nothing and sent no notification, so P's blocks
    leaked (until the lease) -> x2: D hit 32, no transfer; P held its blocks without a read until expiry.
    Right answer: each row carries its own side's hit (x1: D 24, P 8; x2: D 32, P NULL) -- before, P's rows
    showed D's hit; missed_prefix_hit only on x1's D row; x2's P row held_without_read, released 'expiry'."""
    c = Case()
    c.span("prefill", "prefill.compute", 0, 100, rid="x1", engine="p0", attrs={"kv.prefix_hit_blocks": 8})
    c.span("prefill", "prefill.block_hold", 100, 200, rid="x1", engine="p0",
           attrs={"kv.blocks": 32, "kv.release_cause": "notification"})
    c.span("decode", "decode.block_reserve", 110, 210, rid="x1", engine="d0",
           attrs={"kv.blocks": 32, "kv.prefix_hit_blocks": 24})
    c.span("decode", "kv.transfer", 120, 190, rid="x1", engine="d0", rank=0,
           attrs={"kv.blocks": 32, "kv.bytes": 32 << 20, "peer.engine_id": "p0"})
    c.span("prefill", "prefill.compute", 1000, 1100, rid="x2", engine="p0")
    c.span("prefill", "prefill.block_hold", 1100, 5100, rid="x2", engine="p0", attrs={"kv.blocks": 32})
    c.event("prefill", "kv.lease_expired", 5100, rid="x2", engine="p0")
    c.span("decode", "decode.block_reserve", 1110, 1120, rid="x2", engine="d0",
           attrs={"kv.blocks": 32, "kv.prefix_hit_blocks": 32})
    tr = analyse(c)
    h = _holds(tr)
    assert (h[("x1", "decode")]["prefix_hit_blocks"], h[("x1", "prefill")]["prefix_hit_blocks"]) == (24, 8)
    assert (h[("x2", "decode")]["prefix_hit_blocks"], h[("x2", "prefill")]["prefix_hit_blocks"]) == (32, None)
    assert [h[k]["missed_prefix_hit"] for k in (("x1", "decode"), ("x1", "prefill"), ("x2", "decode"))] \
        == [True, False, False]
    assert h[("x2", "prefill")]["held_without_read"] is True and h[("x2", "prefill")]["release_cause"] == "expiry"
    fl = _flags(tr)
    assert "missed_prefix_hit" in fl["x1"] and "missed_prefix_hit" not in fl["x2"]


# ----------------------------------------------------------------------------- kind 10: flags
def test_read_after_release_vllm_21570_vllm_52234(analyse):
    """vllm-project/vllm#21570: "The P node releases the kv blocks due to the timeout mechanism, and the D
    node retrieves the already released kv blocks, leading to abnormal precision." -> r1: P's lease
    expired at 500 while D's READ (480-700) was still reading. vllm-project/vllm#52234 ("stale reference
    after producer reused the blocks": HTTP 200, another prompt's answer) -> r2: D's READ posted after the
    expiry (600-650). Its lease-expiry row ("D recomputed") -> r3: expired, D's load failed and it
    recomputed: no READ after the release, flag recomputed. r4: read 300-400, then released by its
    notification. Right answer: read_after_release on r1 and r2 only (block_holds.transfer_after_release
    on their P rows); recomputed on r3, and wasted_compute (P's prefill fed nothing: D recomputed)."""
    c = Case()
    for rid, xfer in (("r1", (480, 700)), ("r2", (600, 650)), ("r3", None), ("r4", (300, 400))):
        c.router_request(rid, 0, 1000, "pull", first_token_ms=900, last_token_ms=950)
        c.span("prefill", "prefill.compute", 10, 100, rid=rid, engine="p0")
        rel = 450 if rid == "r4" else 500
        c.span("prefill", "prefill.block_hold", 100, rel, rid=rid, engine="p0",
               attrs={"kv.blocks": 8, "kv.release_cause": "notification" if rid == "r4" else "expiry"})
        if xfer:
            c.span("decode", "kv.transfer", xfer[0], xfer[1], rid=rid, engine="d0", rank=0,
                   attrs={"kv.op": "READ", "peer.engine_id": "p0", "kv.bytes": 8 << 20})
        if rid == "r3":
            c.event("decode", "kv.load_failed", 520, rid=rid, engine="d0", attrs={"lifecycle.cause": "load_failed"})
    tr = analyse(c)
    h = _holds(tr)
    assert [h[(r, "prefill")]["transfer_after_release"] for r in ("r1", "r2", "r3", "r4")] == [True, True, False, False]
    fl = _flags(tr)
    assert [("read_after_release" in fl[r]) for r in ("r1", "r2", "r3", "r4")] == [True, True, False, False]
    assert fl["r3"] == ["recomputed", "wasted_compute"]
    assert fl["r4"] == []


def test_write_after_release_vllm_55470(analyse):
    """vllm-project/vllm#55470: a deferred push WRITE was still submitted after the request had been
    retired (lease expiry): the blocks "can already belong to another request". D side: D's TTL expired
    at 900 and freed its blocks; P's WRITE ended at 950. Right answer: D's row released 'expiry' with
    transfer_after_release; flag write_after_release (not read_after_release)."""
    c = Case()
    _push_d_waiting(c, "wr", 0, ttl_ms=900)
    c.span("prefill", "kv.transfer", 920, 950, rid="wr", engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "peer.engine_id": "d0", "kv.bytes": 1 << 20})
    tr = analyse(c)
    d = _holds(tr)[("wr", "decode")]
    assert d["release_cause"] == "expiry" and d["transfer_after_release"] is True
    assert "write_after_release" in _flags(tr)["wr"] and "read_after_release" not in _flags(tr)["wr"]


def test_transport_fallback_dynamo_1314_nixl_909_vllm_26382(analyse):
    """ai-dynamo/dynamo#1314: UCX without RDMA devices -> "TCP being selected", init xfer 1800 ms instead
    of 0.16 ms (t1: kv.transport tcp). ai-dynamo/nixl#909: vLLM's NIXL/UCX on EFA "only uses UCX software
    emulation", not RDMA (t2: the connector flags kv.transport_fallback = 1). vllm-project/vllm#26382: NIXL
    slow on CUDA_IPC, UCX staging through cuda_copy (t3). t4 (rc_mlx5) and t5 (cuda_ipc) are the fast
    transports; t6 records none. Right answer: transfers.transport_fallback and the flag on t1-t3 only."""
    c = Case()
    spec = {"t1": {"kv.transport": "tcp"}, "t2": {"kv.transport": "srd", "kv.transport_fallback": 1},
            "t3": {"kv.transport": "cuda_copy"}, "t4": {"kv.transport": "rc_mlx5"},
            "t5": {"kv.transport": "cuda_ipc"}, "t6": {}}
    for k, (rid, attrs) in enumerate(spec.items()):
        c.router_request(rid, k * 100, k * 100 + 90, "pull", first_token_ms=k * 100 + 80)
        c.span("decode", "kv.transfer", k * 100 + 10, k * 100 + 60, rid=rid, engine="d0", rank=0,
               attrs={"kv.op": "READ", "peer.engine_id": "p0", "kv.backend": "UCX", "kv.bytes": 1 << 20, **attrs})
    tr = analyse(c)
    got = {r["request_id"]: r["transport_fallback"] for r in tr.query("SELECT * FROM transfers")}
    assert got == {"t1": True, "t2": True, "t3": True, "t4": False, "t5": False, "t6": False}
    fl = _flags(tr)
    assert sorted(r for r, f in fl.items() if "transport_fallback" in f) == ["t1", "t2", "t3"]
    assert one(tr, "SELECT transport FROM transfers WHERE request_id = 't4'")["transport"] == "rc_mlx5"


def test_hung_after_first_token_flag_is_requests_hung(analyse):
    """The flag reuses requests.hung (first token written, no last token; kind 7 owns the hang itself):
    on every request the flag and requests.hung agree."""
    c = Case()
    c.router_request("h1", 0, 5000, "pull", first_token_ms=300)
    c.router_request("h2", 0, 5000, "pull", first_token_ms=300, last_token_ms=900)
    c.router_request("h3", 0, 5000, "pull")
    tr = analyse(c)
    rows = tr.query("SELECT request_id, hung, flags FROM requests ORDER BY request_id")
    assert [(r["request_id"], r["hung"]) for r in rows] == [("h1", True), ("h2", False), ("h3", False)]
    assert all(r["hung"] == ("hung_after_first_token" in r["flags"]) for r in rows)
    assert rows[1]["flags"] == [] and rows[2]["flags"] == []


# ----------------------------------------------------------------------------- kind 10: culprits
def _culprits(tr, stage):
    return {r["request_id"]: (r["culprit_request_id"], r["culprit_kind"]) for r in
            tr.query("SELECT request_id, culprit_request_id, culprit_kind FROM ttft_segments WHERE stage = ?",
                     [stage])}


def test_culprit_decode_queue_head_of_line_vllm_31731(analyse):
    """vllm-project/vllm#31731 (PR #33499: "a KV-heavy request at the head of the WAITING queue can
    repeatedly fail KV allocation and block all lighter requests behind it"; inference-sim#1061 the same
    in a simulator). D engine d0: R runs and holds the blocks until it finishes at 1000; heavy H queued at
    100 waiting for blocks; light L queued at 200 behind H (it would fit) and is admitted in the same step
    as H, at 1000. Right answer: H's decode.queue waited for R's blocks (kv_blocks), L's for H
    (head_of_line), not R. Other segments have no culprit."""
    c = Case()
    c.router_request("R", 0, 1200, "pull", first_token_ms=50, last_token_ms=1000)
    c.event("decode", "request.finished", 1000, rid="R", engine="d0", attrs={"gen_ai.usage.output_tokens": 9})
    for rid, q0 in (("H", 100), ("L", 200)):
        c.router_request(rid, q0 - 20, 2000, "pull", first_token_ms=1100)
        c.span("prefill", "prefill.compute", q0 - 20, q0, rid=rid, engine="p0")
        c.span("decode", "decode.queue", q0, 1000, rid=rid, engine="d0")
        c.span("decode", "kv.transfer", 1000, 1060, rid=rid, engine="d0", rank=0,
               attrs={"kv.op": "READ", "peer.engine_id": "p0"})
        c.span("decode", "decode.first_step", 1060, 1100, rid=rid, engine="d0")
    tr = analyse(c)
    assert _culprits(tr, "decode.queue") == {"H": ("R", "kv_blocks"), "L": ("H", "head_of_line")}
    assert {r["culprit_request_id"] for r in tr.query("SELECT * FROM ttft_segments WHERE stage <> 'decode.queue'")} \
        == {None}


def test_culprit_prefill_queue_batch_slot_vllm_21495_pegainfer_744(analyse):
    """vllm-project/vllm#21495 (= sgl-project/sglang#8211): after a long-context request "any subsequent
    short-context requests are blocked until the long-context prefill finishes" -> S waits in P's queue
    100-2000 while Lg's prefill runs 0-2000: S's culprit is Lg (batch_slot).
    pegainfer-project/pegainfer#744: concurrent prompts "serialize on the per-step prefill budget": A, B, C
    arrive together (0, 0.5, 1); A computes 0-170, B 170-340, C 340-510. Right answer: B waited for A,
    C for B (the prefill whose end let it in, the latest event in its wait), each batch_slot."""
    c = Case()
    c.router_request("Lg", 0, 3000, "pull", first_token_ms=2500)
    c.span("prefill", "prefill.compute", 0, 2000, rid="Lg", engine="p0")
    c.router_request("S", 100, 3000, "pull", first_token_ms=2100)
    c.span("prefill", "prefill.queue", 100, 2000, rid="S", engine="p0")
    c.span("prefill", "prefill.compute", 2000, 2010, rid="S", engine="p0")
    for rid, t0, q in (("A", 5000, 0), ("B", 5000.5, 170), ("C", 5001, 340)):
        c.router_request(rid, t0, 6000, "pull", first_token_ms=5000 + q + 180)
        if q:
            c.span("prefill", "prefill.queue", t0, 5000 + q, rid=rid, engine="p1")
        c.span("prefill", "prefill.compute", 5000 + q, 5000 + q + 170, rid=rid, engine="p1")
    tr = analyse(c)
    assert _culprits(tr, "prefill.queue") == {"S": ("Lg", "batch_slot"), "B": ("A", "batch_slot"),
                                              "C": ("B", "batch_slot")}


def test_culprit_writer_queue_vllm_48633_vllm_55589(analyse):
    """vllm-project/vllm#48633 row S2 (P0, "head-of-line handshake"): in push one nixl-push-writer thread
    serves every request, so a first-contact handshake on it holds up the WRITEs of the others;
    vllm-project/vllm#55589 (review): the writer "performs blocking NIXL calls in the same loop body",
    a stalled writer delays everything queued on it. P p0 rank 0: W1's handshake runs on the writer
    100-600; W2 waits in the writer queue 150-600, then builds descriptors 600-650; W3 waits 200-650.
    Right answer: W2's writer_queue culprit W1, W3's W2 (the work that ended its wait), kind writer."""
    c = Case()
    plan = {"W1": (100, None, 600), "W2": (150, 600, 650), "W3": (200, 650, 700)}
    for rid, (t0, wq_end, desc_end) in plan.items():
        c.router_request(rid, 0, 2000, "push", first_token_ms=1000)
        c.span("prefill", "prefill.compute", 0, t0, rid=rid, engine="p0")
        hp = c.span("prefill", "handoff.prep", t0, desc_end, rid=rid, engine="p0", rank=0,
                    attrs={"peer.engine_id": "d0"})
        if wq_end is None:
            c.span("prefill", "handoff.handshake", t0, desc_end, rid=rid, engine="p0", rank=0, parent=hp)
        else:
            c.span("prefill", "handoff.writer_queue", t0, wq_end, rid=rid, engine="p0", rank=0, parent=hp)
            c.span("prefill", "handoff.descriptors", wq_end, desc_end, rid=rid, engine="p0", rank=0, parent=hp)
        c.span("prefill", "kv.transfer", desc_end, desc_end + 20, rid=rid, engine="p0", rank=0,
               attrs={"kv.op": "WRITE", "peer.engine_id": "d0"})
        c.span("decode", "kv.ready", desc_end + 20, desc_end + 30, rid=rid, engine="d0")
        c.span("decode", "decode.first_step", desc_end + 30, 1000, rid=rid, engine="d0")
    tr = analyse(c)
    assert _culprits(tr, "handoff.writer_queue") == {"W2": ("W1", "writer"), "W3": ("W2", "writer")}
