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
