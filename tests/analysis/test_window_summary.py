"""The window summaries (analysis/sql/window_summary.sql): the whole-trace summaries' numbers, for any arrival window."""
import statistics

import pytest

from pdtrace import analysis
from test_ttft_cases import _case_a, _case_h

CATS = ("queue", "compute", "transfer", "coordination")


@pytest.fixture
def session(tmp_path):
    d = tmp_path / "s"
    _case_a().write(d, prefix="a-")
    _case_h().write(d, prefix="h-")
    with analysis.open(d, cache=None) as s:
        yield s


def _approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def test_an_open_window_gives_the_whole_trace_summary(session):
    for m in session.query("SELECT * FROM summary_by_mode ORDER BY mode"):
        w = session.query("SELECT * FROM window_summary(NULL, NULL, ?)", [m["mode"]])[0]
        assert (w["requests"], w["complete"], w["incomplete"]) == (m["requests"], m["complete"], m["incomplete"])
        for q in ("p50", "p90", "p99"):
            assert w[f"ttft_{q}_ms"] == _approx(m[f"ttft_{q}_ms"])
        for c in CATS + ("unattributed",):
            assert w[f"{c}_share"] == _approx(m[f"{c}_share"])
    every = session.query("SELECT * FROM window_summary(NULL, NULL, NULL)")[0]
    assert every["requests"] == session.query("SELECT count(*) AS n FROM requests")[0]["n"] == 4
    assert sum(every[f"{c}_share"] for c in CATS) == _approx(1.0)


def test_a_window_holds_the_requests_that_arrived_in_it(session):
    reqs = session.query("SELECT request_id, arrival_ns, ttft_ms FROM requests ORDER BY arrival_ns")
    times = sorted({r["arrival_ns"] for r in reqs})
    assert len(times) >= 3
    lo, hi = times[1], times[2]
    inside = [r for r in reqs if lo <= r["arrival_ns"] < hi]                        # [start, end): end excluded
    w = session.query("SELECT * FROM window_summary(?, ?, NULL)", [lo, hi])[0]
    assert w["requests"] == len(inside) >= 1
    assert w["ttft_p50_ms"] == _approx(statistics.median(r["ttft_ms"] for r in inside))  # quantile_cont 0.5
    assert session.query("SELECT requests FROM window_summary(?, NULL, NULL)", [hi])[0]["requests"] == sum(
        r["arrival_ns"] >= hi for r in reqs)
    empty = session.query("SELECT * FROM window_summary(0, 1, NULL)")[0]
    assert empty["requests"] == 0 and empty["queue_share"] is None and empty["router_unseen_ms"] == 0.0


def test_category_shares_are_the_breakdown_in_long_form(session):
    b = {r["request_id"]: r for r in session.query("SELECT * FROM ttft_breakdown")}
    rows = session.query("SELECT * FROM category_shares_over_time(NULL, NULL, 1000000000000000000)")
    assert [r["category"] for r in rows] == [c for m in sorted({r["mode"] for r in rows}) for c in CATS]
    for r in rows:
        mine = [x for x in b.values() if x["mode"] == r["mode"]]
        assert r["requests"] == len(mine)
        assert r["ms"] == _approx(sum(x[f"{r['category']}_ms"] for x in mine))
        assert r["share"] == _approx(r["ms"] / sum(x["ttft_ms"] for x in mine))
    by = session.query("SELECT * FROM category_shares_by_prompt_bucket(NULL, NULL)")
    assert {(r["mode"], r["prompt_bucket"]) for r in by} == {
        (x["mode"], session.query("SELECT prompt_bucket(?) AS b", [x["prompt_tokens"]])[0]["b"]) for x in b.values()}
    for r in by:
        assert r["mean_ms"] == _approx(r["ms"] / r["requests"])


def test_percentiles_by_prompt_bucket_match_the_summary_view(session):
    got = session.query("SELECT * FROM percentiles_by_prompt_bucket(NULL, NULL)")
    want = session.query("SELECT mode, prompt_bucket(prompt_bucket_lo) AS b, complete, ttft_p50_ms, ttft_p99_ms "
                         "FROM summary_by_prompt_bucket WHERE complete > 0")
    assert sorted((r["mode"], r["prompt_bucket"], r["requests"], round(r["ttft_p50_ms"], 9), round(r["ttft_p99_ms"], 9))
                  for r in got) == sorted((r["mode"], r["b"], r["complete"], round(r["ttft_p50_ms"], 9),
                                           round(r["ttft_p99_ms"], 9)) for r in want)


def test_stage_share_change_ranks_growth(session):
    reqs = session.query("SELECT arrival_ns FROM requests ORDER BY arrival_ns")
    split = reqs[2]["arrival_ns"]
    rows = session.query("SELECT * FROM stage_share_change(?, NULL, NULL, ?)", [split, split])
    assert rows and [r["growth_pp"] for r in rows] == sorted((r["growth_pp"] for r in rows), reverse=True)
    for r in rows:
        assert r["growth_pp"] == _approx(((r["share_incident"] or 0) - (r["share_baseline"] or 0)) * 100)
    # the shares of each window add up to 1: the segments tile each request's TTFT
    assert sum(r["share_incident"] for r in rows) == _approx(1.0)
    assert sum(r["share_baseline"] for r in rows) == _approx(1.0)
