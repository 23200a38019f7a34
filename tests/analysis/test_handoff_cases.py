"""Bug cases B (descriptor-bound transfer), F (prefix hit on D / unreleased blocks), J (recompute stalls)."""
from pdtrace_case_builder import Case


# B. Same bytes, 2k vs 112k descriptors: post 4 of a 120 ms transfer vs 600 of 1055.
def test_b_descriptor_bound_transfer(analyse):
    c = Case()
    for rid, base, desc, post, dur in (("b1", 0, 2_000, 4, 120), ("b2", 1000, 112_000, 600, 1055)):
        c.span("decode", "kv.transfer", base, base + dur, rid=rid, engine="d0", rank=0,
               attrs={"kv.bytes": 2 << 30, "kv.descriptors": desc, "kv.post_ns": post * 1_000_000,
                      "kv.xfer_ns": dur * 1_000_000, "kv.op": "READ", "peer.engine_id": "p0", "kv.backend": "UCX"})
    tr = analyse(c)
    t = {r["request_id"]: r for r in tr.query("SELECT * FROM transfers")}
    assert t["b1"]["descriptor_bound"] is False and t["b1"]["post_share_pct"] == 3.3
    assert t["b2"]["descriptor_bound"] is True and t["b2"]["post_share_pct"] == 56.9
    assert t["b2"]["src_engine"] == "p0" and t["b2"]["dst_engine"] == "d0"
    assert t["b2"]["idle_before_ms"] == 1000 - 120
    assert round(t["b1"]["bandwidth_gbps"], 3) == round((2 << 30) / 120e6, 3)


def test_transfers_starting_together_have_one_previous(analyse):
    """Two requests' READs posted at the same instant on one engine pair and rank (one engine step posts
    both): idle_before_ms orders them by start, end, request key and span id, a total order, so the answer
    does not depend on the plan. (A CI run: the windowed Spark and DuckDB answers differed on such a
    tie, the one taking the other as its previous transfer, -9 ms, or the one 10 minutes before, 599,991.)"""
    c = Case()
    for rid, base, dur in (("early", 0, 10), ("long", 5000, 9), ("short", 5000, 4)):
        c.span("decode", "kv.transfer", base, base + dur, rid=rid, engine="d0", rank=0,
               attrs={"kv.bytes": 4096, "kv.op": "READ", "peer.engine_id": "p0"})
    tr = analyse(c)
    t = {r["request_id"]: r["idle_before_ms"] for r in tr.query("SELECT * FROM transfers")}
    assert t == {"early": None, "short": 5000 - 10, "long": -4}  # short ends first: it comes first


# F. The same prompt three times (pull, 32 blocks). f1 reads 32 blocks.
#   f2 reads 32/32 again although D holds them (prefix hit missed). f3 reads
#   nothing, but P never gets a release and holds its blocks 120 s (lease expiry).
def test_f_prefix_hit_on_d(analyse):
    c = Case()
    for rid, base, read, hit in (("f1", 0, True, 0), ("f2", 1000, True, 32), ("f3", 2000, False, 32)):
        hold_end = base + (120_000 if not read else 60)
        cause = "expiry" if not read else "notification"
        c.span("prefill", "prefill.block_hold", base + 10, hold_end, rid=rid, engine="p0",
               attrs={"kv.blocks": 32, "kv.release_cause": cause})
        c.span("decode", "decode.block_reserve", base + 12, base + 20, rid=rid, engine="d0",
               attrs={"kv.blocks": 32, "kv.prefix_hit_blocks": hit})
        if read:
            c.span("decode", "kv.transfer", base + 20, base + 50, rid=rid, engine="d0", rank=0,
                   attrs={"kv.blocks": 32, "kv.bytes": 32 << 20, "peer.engine_id": "p0"})
            c.event("prefill", "notification.received", base + 60, rid=rid, engine="p0",
                    attrs={"kv.notif_kind": "read_done"})
        else:
            c.event("prefill", "kv.lease_expired", hold_end, rid=rid, engine="p0")
    tr = analyse(c)
    h = {(r["request_id"], r["side"]): r for r in tr.query("SELECT * FROM block_holds")}
    assert [h[(r, "decode")]["missed_prefix_hit"] for r in ("f1", "f2", "f3")] == [False, True, False]
    assert h[("f3", "prefill")]["held_without_read"] is True and h[("f3", "prefill")]["long_hold"] is True
    assert h[("f3", "prefill")]["hold_ms"] == 120_000 - 10 and h[("f3", "prefill")]["release_cause"] == "expiry"
    assert h[("f1", "prefill")]["held_without_read"] is False and h[("f1", "prefill")]["release_cause"] == "notification"
    assert h[("f2", "prefill")]["long_hold"] is False


def test_f_release_cause_derived_from_events(analyse):
    c = Case()
    c.span("prefill", "prefill.block_hold", 0, 50, rid="n1", engine="p0", attrs={"kv.blocks": 4})
    c.event("prefill", "notification.received", 50, rid="n1", engine="p0", attrs={"kv.notif_kind": "read_done"})
    c.span("prefill", "prefill.block_hold", 0, 90, rid="n2", engine="p0", attrs={"kv.blocks": 4})
    c.event("prefill", "request.abort", 90, rid="n2", engine="p0")
    c.span("prefill", "prefill.block_hold", 0, 70, rid="n3", engine="p0", attrs={"kv.blocks": 4})
    tr = analyse(c)
    got = {r["request_id"]: r["release_cause"] for r in tr.query("SELECT * FROM block_holds")}
    assert got == {"n1": "notification", "n2": "abort", "n3": "never"}


# J. Three requests decode 101 tokens (100 intervals) at 20 ms/step; step 50
#   takes 620 because request R's KV load failed and its 500-token prompt was
#   recomputed in that step.
def _case_j(connector_ms=0):
    c = Case()
    for rid in "ABC":
        c.router_request(rid, 0, 4000, "pull", first_token_ms=1000, last_token_ms=3600, output_tokens=101)
    c.router_request("R", 900, 4000, "pull", first_token_ms=2620, last_token_ms=3600, output_tokens=50)
    c.event("decode", "kv.load_failed", 1990, rid="R", engine="d0", attrs={"lifecycle.cause": "load_failed"})
    t = 1000
    for k in range(100):
        dur = 620 if k == 50 else 20
        batch = "A:d1;B:d1;C:d1" + (";R:r500" if k == 50 else "")
        sid = c.span("decode", "decode.step", t, t + dur, engine="d0", rank=0,
                     attrs={"step.id": k, "step.batch": batch, "step.decode_tokens": 3,
                            "step.recompute_tokens": 500 if k == 50 else 0})
        if k == 50 and connector_ms:
            c.span("decode", "connector.load", t, t + connector_ms, engine="d0", rank=0, parent=sid,
                   attrs={"vllm.method": "start_load_kv", "connector.request_ids": "Z"})
        t += dur
    return c


def test_j_recompute_stalls_neighbours(analyse):
    tr = analyse(_case_j())
    st = tr.query("SELECT * FROM decode_stalls WHERE excess_ns > 0")
    assert len(st) == 1
    assert st[0]["step_id"] == 50 and st[0]["baseline_ms"] == 20 and st[0]["excess_ms"] == 600
    assert st[0]["culprit_request_id"] == "R" and st[0]["culprit_kind"] == "recompute"
    rs = {r["request_id"]: r for r in tr.query("SELECT * FROM request_stalls")}
    for rid in "ABC":
        assert round(rs[rid]["tpot_ms"], 6) == 26.0
        assert rs[rid]["stall_ms"] == 600 and round(rs[rid]["stall_tpot_ms"], 6) == 6.0
        assert round(rs[rid]["tpot_without_stalls_ms"], 6) == 20.0
        assert rs[rid]["top_culprit_request_id"] == "R" and rs[rid]["top_culprit_kind"] == "recompute"
    assert tr.query("SELECT * FROM requests WHERE request_id = 'R'")[0]["recomputed"] is True


def test_j_connector_work_shares_the_excess(analyse):
    tr = analyse(_case_j(connector_ms=150))
    causes = {r["kind"]: r for r in tr.query("SELECT * FROM decode_stall_causes")}
    assert causes["connector.load"]["share_ms"] == 150 and causes["connector.load"]["culprit_request_id"] == "Z"
    assert causes["recompute"]["share_ms"] == 450
    assert sum(r["share_ms"] for r in causes.values()) == 600


# J3. Case J with three requests recomputed in step 50, 100 prompt tokens each: the 600 ms excess
#   splits into three equal shares. A tie has one answer whatever the row order: the largest
#   culprit id. Shares are whole ns, so every sum of them is exact.
def _case_j3():
    c = Case()
    for rid in "ABC":
        c.router_request(rid, 0, 4000, "pull", first_token_ms=1000, last_token_ms=3600, output_tokens=101)
    for rid in "RST":
        c.router_request(rid, 900, 4000, "pull", first_token_ms=2620, last_token_ms=3600, output_tokens=50)
    t = 1000
    for k in range(100):
        dur = 620 if k == 50 else 20
        batch = "A:d1;B:d1;C:d1" + (";S:r100;R:r100;T:r100" if k == 50 else "")
        c.span("decode", "decode.step", t, t + dur, engine="d0", rank=0,
               attrs={"step.id": k, "step.batch": batch, "step.decode_tokens": 3,
                      "step.recompute_tokens": 300 if k == 50 else 0})
        t += dur
    return c


def test_j3_tied_culprits_have_one_answer(analyse):
    tr = analyse(_case_j3())
    causes = tr.query("SELECT culprit_request_id, kind, share_ns, typeof(share_ns) AS t FROM decode_stall_causes "
                      "ORDER BY culprit_request_id")
    assert causes == [{"culprit_request_id": r, "kind": "recompute", "share_ns": 200_000_000, "t": "BIGINT"}
                      for r in "RST"]
    st = tr.query("SELECT step_id, culprit_request_id, culprit_kind FROM decode_stalls WHERE excess_ns > 0")
    assert st == [{"step_id": 50, "culprit_request_id": "T", "culprit_kind": "recompute"}]
    rs = {r["request_id"]: r for r in tr.query("SELECT * FROM request_stalls")}
    for rid in "ABC":
        assert rs[rid]["stall_ns"] == 600_000_000
        assert (rs[rid]["top_culprit_request_id"], rs[rid]["top_culprit_ms"]) == ("T", 200.0)


# M. Routine polling on every step (what real stores look like): vLLM calls
#   start_load_kv, wait_for_save and get_transfer_results on every step, so
#   every decode.step has idle connector children naming no request. A, B, C
#   decode 101 tokens (100 steps of 20 ms, the idle children included). Step
#   30 takes 80: it carries request H's handoff, a 60 ms connector.load serving
#   H. Step 31 takes 20.2: its poll sees H's transfer finish (0.3 ms serving H,
#   more than the 0.2 excess: scaled down to it). H decodes elsewhere.
#   Answer: baseline 20 on every step; excess 60 and 0.2, all H's; each
#   victim's TPOT 20.602 = 20 + 0.602 from H's handoff.
def _case_m():
    c = Case()
    for rid in "ABC":
        c.router_request(rid, 0, 4000, "pull", first_token_ms=1000, last_token_ms=3060.2, output_tokens=101)
    c.router_request("H", 1500, 4000, "pull", first_token_ms=1700, last_token_ms=1900, output_tokens=3)
    t = 1000
    for k in range(100):
        dur = {30: 80, 31: 20.2}.get(k, 20)
        sid = c.span("decode", "decode.step", t, t + dur, engine="d0", rank=0,
                     attrs={"step.id": k, "step.batch": "A:d1;B:d1;C:d1", "step.decode_tokens": 3})
        idle = [("connector.save", "wait_for_save", 0.001), ("connector.poll", "get_transfer_results", 0.04)]
        if k == 30:
            c.span("decode", "connector.load", t, t + 60, engine="d0", rank=0, parent=sid,
                   attrs={"vllm.method": "start_load_kv", "connector.request_ids": "cmpl-H-0-1a2b3c4d"})
        else:
            idle.append(("connector.load", "start_load_kv", 0.01))
        for name, method, ms in idle:
            a = {"vllm.method": method, "step.id": k}
            if k == 31 and name == "connector.poll":
                ms, a["connector.request_ids"] = 0.3, "H"
            c.span("decode", name, t + dur - ms, t + dur, engine="d0", rank=0, parent=sid, attrs=a)
        t += dur
    return c


def test_m_routine_polling_is_not_a_stall_cause(analyse):
    tr = analyse(_case_m())
    agg = tr.query("SELECT count(*) AS n, count(baseline_ms) AS with_baseline, count(*) FILTER (WHERE clean) AS clean, "
                   "count(*) FILTER (WHERE connector_ns > 0) AS with_connector FROM decode_stalls")[0]
    assert agg == {"n": 100, "with_baseline": 100, "clean": 98, "with_connector": 100}
    st = tr.query("SELECT * FROM decode_stalls WHERE excess_ns > 0 ORDER BY step_id")
    assert [(r["step_id"], r["baseline_ns"], r["excess_ns"]) for r in st] == [
        (30, 20_000_000, 60_000_000), (31, 20_000_000, 200_000)]
    assert [(r["culprit_request_id"], r["culprit_kind"]) for r in st] == [("H", "connector.load"), ("H", "connector.poll")]
    assert st[0]["handoff_connector_ns"] == 60_000_000 and st[0]["connector_ns"] == 60_041_000
    assert st[1]["handoff_connector_ns"] == 300_000
    causes = tr.query("SELECT step_id, kind, culprit_request_id, share_ns FROM decode_stall_causes ORDER BY step_id")
    assert causes == [
        {"step_id": 30, "kind": "connector.load", "culprit_request_id": "H", "share_ns": 60_000_000},
        {"step_id": 31, "kind": "connector.poll", "culprit_request_id": "H", "share_ns": 200_000},
    ]
    rs = {r["request_id"]: r for r in tr.query("SELECT * FROM request_stalls")}
    for rid in "ABC":
        assert round(rs[rid]["tpot_ms"], 9) == 20.602
        assert rs[rid]["stall_ns"] == 60_200_000 and round(rs[rid]["stall_tpot_ms"], 9) == 0.602
        assert round(rs[rid]["tpot_without_stalls_ms"], 9) == 20.0
        assert rs[rid]["top_culprit_request_id"] == "H" and rs[rid]["top_culprit_kind"] == "connector.load"
        assert rs[rid]["top_culprit_ms"] == 60.2
    assert rs["H"]["stall_ns"] == 0


def test_m_idle_connector_work_takes_no_share_beside_a_recompute(analyse):
    """Case J with an idle poll on every step: the recompute still carries all 600 ms."""
    c = _case_j()
    for r in list(c.rows[("decode", "d0")]):
        if r["name"] == "decode.step":
            c.span("decode", "connector.poll", 0, 0.05, engine="d0", rank=0, parent=r["span_id"],
                   attrs={"vllm.method": "get_transfer_results"})
    for r in c.rows[("decode", "d0")]:
        if r["name"] == "connector.poll":
            step = next(s for s in c.rows[("decode", "d0")] if s["span_id"] == r["parent_span_id"])
            r["start_ns"], r["end_ns"] = step["end_ns"] - 50_000, step["end_ns"]
    tr = analyse(c)
    causes = tr.query("SELECT kind, culprit_request_id, share_ns FROM decode_stall_causes")
    assert causes == [{"kind": "recompute", "culprit_request_id": "R", "share_ns": 600_000_000}]
    rs = {r["request_id"]: r for r in tr.query("SELECT * FROM request_stalls")}
    for rid in "ABC":
        assert rs[rid]["stall_ms"] == 600 and round(rs[rid]["tpot_ms"], 6) == 26.0
