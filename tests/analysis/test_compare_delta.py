"""The delta decomposition of `pdtrace report A --compare B` (issue 17 part B) on two hand-built stores.

Mean TTFT of a bucket = sum over its critical-path (stage, category) of the mean exposed ms per request
(segments tile TTFT, DESIGN.md §3), so B's mean minus A's is exactly the sum of the per-stage differences.
Times are ms from each request's arrival at the router.
"""
import json

import pytest
from click.testing import CliRunner
from pdtrace_case_builder import Case

from pdtrace.analysis import report
from pdtrace.cli.main import main


# A (pull): router |disp 2|queue q|--- compute c ---|prep 1|xfer 8|ready 1|first_step 30|*
def _pull(c, rid, base, prompt, q, comp):
    ttft = 2 + q + comp + 1 + 8 + 1 + 30
    root = c.router_request(rid, base, base + ttft + 2, "pull", first_token_ms=base + ttft, prompt_tokens=prompt)
    c.span("router", "router.dispatch", base, base + 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    t = base + 2
    c.span("prefill", "prefill.queue", t, t + q, rid=rid, engine="p0")
    c.span("prefill", "prefill.compute", t + q, t + q + comp, rid=rid, engine="p0")
    t += q + comp
    c.span("decode", "handoff.prep", t, t + 1, rid=rid, engine="d0", rank=0)
    c.span("decode", "kv.transfer", t + 1, t + 9, rid=rid, engine="d0", rank=0,
           attrs={"kv.op": "READ", "kv.bytes": 1 << 20, "peer.engine_id": "p0"})
    c.span("decode", "kv.ready", t + 9, t + 10, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", t + 10, t + 40, rid=rid, engine="d0")
    return ttft


# B (push, concurrent legs): D registers early (hidden behind P); P's writer waits `sw` for P's next engine
# step before posting the WRITE (handoff.step_wait under handoff.prep); then D's readiness and first step.
#   router |disp 2|queue q|--- compute c ---|prep: step_wait sw, 1|xfer 8|ready 1|first_step 30|*
#   D           |dest.register 2-10| (hidden)
def _push(c, rid, base, prompt, q, comp, sw):
    ttft = 2 + q + comp + sw + 1 + 8 + 1 + 30
    root = c.router_request(rid, base, base + ttft + 2, "push", first_token_ms=base + ttft, prompt_tokens=prompt)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", base, base + 2, rid=rid, parent=root, attrs={"router.leg": leg})
    t = base + 2
    c.span("decode", "dest.register", t, t + 8, rid=rid, engine="d0")
    c.span("prefill", "prefill.queue", t, t + q, rid=rid, engine="p0")
    c.span("prefill", "prefill.compute", t + q, t + q + comp, rid=rid, engine="p0")
    t += q + comp
    hp = c.span("prefill", "handoff.prep", t, t + sw + 1, rid=rid, engine="p0", rank=0)
    c.span("prefill", "handoff.step_wait", t, t + sw, rid=rid, engine="p0", rank=0, parent=hp)
    t += sw + 1
    c.span("prefill", "kv.transfer", t, t + 8, rid=rid, engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "kv.bytes": 1 << 20, "peer.engine_id": "d0"})
    c.span("decode", "kv.ready", t + 8, t + 9, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", t + 9, t + 39, rid=rid, engine="d0")
    return ttft


def _stores():
    """A: three long prompts (bucket 1024) and two short ones (bucket 64); B: two long prompts whose P queue is
    400 ms longer on average and whose WRITE waited 150 ms for P's next step, with prefill 50 ms shorter, and
    one prompt of bucket 4096 (only in B). Different n per bucket on purpose: the means are per run."""
    a, b = Case(), Case()
    _pull(a, "a1", 0, 1500, q=100, comp=300)
    _pull(a, "a2", 5000, 1100, q=200, comp=300)
    _pull(a, "a3", 10000, 2000, q=0, comp=300)
    _pull(a, "a4", 15000, 100, q=5, comp=20)
    _pull(a, "a5", 20000, 70, q=15, comp=20)
    _push(b, "b1", 0, 1500, q=600, comp=250, sw=100)
    _push(b, "b2", 5000, 1800, q=400, comp=250, sw=200)
    _push(b, "b3", 10000, 5000, q=50, comp=900, sw=10)
    return a, b


@pytest.fixture
def runs(analyse, tmp_path):
    a, b = _stores()
    ta, tb = analyse(a, tmp_path / "A"), analyse(b, tmp_path / "B")
    return ta, tb, report.collect(ta.readonly()), report.collect(tb.readonly())


def _bucket(delta, lo):
    scope = "all" if lo is None else "bucket"
    return [r for r in delta["by_stage"] if r["scope"] == scope and r["prompt_bucket_lo"] == lo]


def test_stage_means_add_up_to_the_bucket_mean(runs):
    ta, tb, da, db_ = runs
    for tr in (ta, tb):
        per = tr.query("SELECT mode, prompt_bucket_lo, sum(mean_exposed_ms) AS s, any_value(ttft_mean_ms) AS m "
                       "FROM ttft_stage_means WHERE scope = 'bucket' GROUP BY ALL")
        summ = {(r["mode"], r["prompt_bucket_lo"]): r["ttft_mean_ms"]
                for r in tr.query("SELECT mode, prompt_bucket_lo, ttft_mean_ms FROM summary_by_prompt_bucket")}
        assert per
        for r in per:
            assert r["s"] == pytest.approx(r["m"], abs=1e-9)
            assert r["m"] == pytest.approx(summ[(r["mode"], r["prompt_bucket_lo"])], abs=1e-9)


def test_parts_sum_to_the_difference_and_name_the_stage(runs):
    ta, tb, da, db_ = runs
    delta = report.compare_delta(da, db_)
    rows = _bucket(delta, 1024)
    # mean TTFT: A (442 + 542 + 342) / 3 = 442; B (2+600+250+100+40 = 992, 2+400+250+200+40 = 892) -> 942
    assert rows[0]["ttft_mean_a_ms"] == pytest.approx(442, abs=1e-9)
    assert rows[0]["ttft_mean_b_ms"] == pytest.approx(942, abs=1e-9)
    assert sum(r["delta_ms"] for r in rows) == pytest.approx(rows[0]["ttft_delta_ms"], abs=1e-9)
    assert rows[0]["ttft_delta_ms"] == pytest.approx(500, abs=1e-9)
    by = {r["stage"]: r for r in rows}
    # the blamed stages, largest first: P's queue (500 - 100), the writer's wait for P's next step (150),
    # then the shorter prefill (250 - 300); handoff.prep's own 1 ms is the same in both (delta 0)
    assert [r["stage"] for r in rows[:3]] == ["prefill.queue", "handoff.step_wait", "prefill.compute"]
    assert by["prefill.queue"]["delta_ms"] == pytest.approx(400, abs=1e-9)
    assert by["prefill.queue"]["category"] == "queue"
    assert by["handoff.step_wait"]["delta_ms"] == pytest.approx(150, abs=1e-9)
    assert by["handoff.step_wait"]["category"] == "coordination"
    assert by["handoff.step_wait"]["mean_a_ms"] == 0
    assert by["prefill.compute"]["delta_ms"] == pytest.approx(-50, abs=1e-9)
    assert by["handoff.prep"]["delta_ms"] == pytest.approx(0, abs=1e-9)
    assert "dest.register" not in by          # hidden behind P in B: not on the path, not a term
    assert by["prefill.queue"]["share_of_delta"] == pytest.approx(400 / 500)
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    cats = {r["category"]: r["delta_ms"] for r in delta["by_category"]
            if r["scope"] == "bucket" and r["prompt_bucket_lo"] == 1024}
    assert cats["queue"] == pytest.approx(400, abs=1e-9) and cats["compute"] == pytest.approx(-50, abs=1e-9)
    assert sum(cats.values()) == pytest.approx(500, abs=1e-9)
    # buckets in one run only have no difference to split; scope 'all' still does and adds up
    assert delta["only_a"] == [64] and delta["only_b"] == [4096]
    allrows = _bucket(delta, None)
    mean_a = ta.query("SELECT avg(ttft_ms) AS m FROM ttft_breakdown")[0]["m"]
    mean_b = tb.query("SELECT avg(ttft_ms) AS m FROM ttft_breakdown")[0]["m"]
    assert allrows[0]["ttft_delta_ms"] == pytest.approx(mean_b - mean_a, abs=1e-9)
    assert sum(r["delta_ms"] for r in allrows) == pytest.approx(mean_b - mean_a, abs=1e-9)


def test_parts_sum_on_irregular_times(analyse, tmp_path):
    """Times that are not round ms, several modes in one run and unattributed gaps: still exact to 1e-9."""
    a, b = Case(), Case()
    for i in range(7):
        _pull(a, f"a{i}", i * 3000, 600 + 97 * i, q=13.337 * i, comp=101.01 + i * 7.7)
        _push(b, f"b{i}", i * 3000, 600 + 89 * i, q=3.1 * i * i, comp=97.3, sw=0.123 * i)
    # a request with a gap no stage covers (unattributed) in B's pull part
    root = b.router_request("bx", 40000, 40500, "pull", first_token_ms=40400.5, prompt_tokens=700)
    b.span("router", "router.dispatch", 40000, 40002, rid="bx", parent=root, attrs={"router.leg": "prefill"})
    b.span("prefill", "prefill.compute", 40002, 40200, rid="bx", engine="p0")
    b.span("decode", "decode.first_step", 40300, 40400.5, rid="bx", engine="d0")
    ta, tb = analyse(a, tmp_path / "A"), analyse(b, tmp_path / "B")
    delta = report.compare_delta(report.collect(ta.readonly()), report.collect(tb.readonly()))
    assert delta["by_stage"]
    keys = {(r["scope"], r["prompt_bucket_lo"]) for r in delta["by_stage"]}
    for scope, lo in keys:
        rows = [r for r in delta["by_stage"] if (r["scope"], r["prompt_bucket_lo"]) == (scope, lo)]
        assert sum(r["delta_ms"] for r in rows) == pytest.approx(rows[0]["ttft_delta_ms"], abs=1e-9)
        assert sum(r["mean_a_ms"] for r in rows) == pytest.approx(rows[0]["ttft_mean_a_ms"], abs=1e-9)
        assert sum(r["mean_b_ms"] for r in rows) == pytest.approx(rows[0]["ttft_mean_b_ms"], abs=1e-9)
    assert "unattributed" in {r["stage"] for r in _bucket(delta, None)}


def test_compare_report_text_and_json(runs, tmp_path):
    env = {"PDTRACE_CACHE_DIR": str(tmp_path / "cache")}
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    r = CliRunner().invoke(main, ["report", a, "--compare", b, "--no-cache"], env=env)
    assert r.exit_code == 0, r.output
    text = r.output.split("Why mean TTFT differs")[1]
    block = text.split("prompt tokens [1024, 2048)")[1]
    lines = [ln for ln in block.splitlines()[1:] if ln.strip()][:4]
    assert "delta +500.000 ms" in block.splitlines()[0]
    assert lines[2].startswith("prefill.queue") and lines[3].startswith("handoff.step_wait")
    assert "only in " + a in text and "only in " + b in text
    r = CliRunner().invoke(main, ["report", a, "--compare", b, "--no-cache", "--format", "json"], env=env)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["ttft_delta"]["a"] == a and d["ttft_delta"]["b"] == b
    top = [x for x in d["ttft_delta"]["by_stage"] if x["scope"] == "bucket" and x["prompt_bucket_lo"] == 1024][0]
    assert top["stage"] == "prefill.queue" and top["rank"] == 1
    assert d[a]["ttft_stage_means"] and d[b]["ttft_stage_means"]


# ---------------------------------------------------------------------------
# Public reports: a P/D TTFT gap that the components "don't add up to", explained by the decomposition.
#
# sgl-project/sglang#22853: PD mode had ~200 ms higher TTFT than non-PD (rps 2, 12000-token prompts) although the
# KV transfer took ~6 ms and D's first forward ~10 ms. Cause: the router dispatches P and D concurrently and waits
# for BOTH HTTP responses before streaming D's; P's response can only go out between P's run_batch calls, so it
# waits for P's next (busy) engine step. In pdtrace's words: the difference is router.wait (the router's join on
# P's late response, bug case D), not kv.transfer or decode.first_step.
# sgl-project/sglang#13926: P sent the KV only in the next event-loop iteration after the batch that computed it,
# so TTFT carried one extra P iteration: push's wait for P's next engine step, handoff.step_wait.
#
# Run A: the fixed system (router streams D's first token; KV posted when ready). Run B: the report's system.
#   router |disp 2|.......................... router.wait ..........................|* first token
#   P       |---- prefill.compute 700 ----|prep [step_wait it]+1|xfer 6|   P's response written at +late
#   D       |dest.register 2-20| (hidden)                       |ready 1|first_step 10|
def _sglang_push(c, rid, base, it=0.0, late=None):
    """`it`: P iteration the WRITE waits for (#13926); `late`: P's response this long after D's first token, and
    the router streams only after it (#22853); None: the router streams D's first token at once."""
    t_ready = base + 702
    t_tok = t_ready + it + 1 + 6 + 1 + 10
    first = t_tok + 1 if late is None else t_tok + late + 1
    root = c.router_request(rid, base, first + 50, "push", first_token_ms=first, prompt_tokens=12000)
    for leg in ("prefill", "decode"):
        c.span("router", "router.dispatch", base, base + 2, rid=rid, parent=root, attrs={"router.leg": leg})
    p_resp = t_tok if late is None else t_tok + late
    c.span("router", "router.wait", base + 2, p_resp, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", p_resp, first, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "dest.register", base + 2, base + 20, rid=rid, engine="d0")
    c.span("prefill", "prefill.compute", base + 2, t_ready, rid=rid, engine="p0")
    hp = c.span("prefill", "handoff.prep", t_ready, t_ready + it + 1, rid=rid, engine="p0", rank=0)
    if it:
        c.span("prefill", "handoff.step_wait", t_ready, t_ready + it, rid=rid, engine="p0", rank=0, parent=hp)
    t = t_ready + it + 1
    c.span("prefill", "kv.transfer", t, t + 6, rid=rid, engine="p0", rank=0,
           attrs={"kv.op": "WRITE", "kv.bytes": 1 << 24, "peer.engine_id": "d0"})
    c.span("decode", "kv.ready", t + 6, t + 7, rid=rid, engine="d0")
    c.span("decode", "decode.first_step", t + 7, t + 17, rid=rid, engine="d0")


@pytest.mark.parametrize("report_id, kw, stage, expected", [
    ("sglang#22853", [{"late": 190}, {"late": 150}, {"late": 260}], "router.wait", 200.0),
    ("sglang#13926", [{"it": 120}, {"it": 80}, {"it": 100}], "handoff.step_wait", 100.0),
])
def test_public_pd_gap_is_named(analyse, tmp_path, report_id, kw, stage, expected):
    """The TTFT gap between the fixed and the reported system is one stage's term: router.wait (the router's
    join on P's late response, sglang#22853: 'the raw component latencies don't add up') or handoff.step_wait
    (the KV sent one P iteration late, sglang#13926). kv.transfer (6 ms) and decode.first_step (10 ms) are the
    same in both runs: their terms are 0, which is the report's point."""
    a, b = Case(), Case()
    for i, k in enumerate(kw):
        _sglang_push(a, f"a{i}", i * 5000)
        _sglang_push(b, f"b{i}", i * 5000, **k)
    ta, tb = analyse(a, tmp_path / "A"), analyse(b, tmp_path / "B")
    delta = report.compare_delta(report.collect(ta.readonly()), report.collect(tb.readonly()))
    rows = _bucket(delta, 8192)
    assert rows[0]["ttft_delta_ms"] == pytest.approx(expected, abs=1e-9)
    assert sum(r["delta_ms"] for r in rows) == pytest.approx(expected, abs=1e-9)
    assert rows[0]["stage"] == stage and rows[0]["delta_ms"] == pytest.approx(expected, abs=1e-9)
    by = {r["stage"]: r for r in rows}
    for s in ("kv.transfer", "decode.first_step", "prefill.compute"):
        assert by[s]["delta_ms"] == pytest.approx(0, abs=1e-9)
    assert by["kv.transfer"]["mean_b_ms"] == pytest.approx(6) and by["decode.first_step"]["mean_b_ms"] == pytest.approx(10)
