"""The paired-neighbour estimator (pdtrace.connector.lab.paired) on inputs whose answer is known."""
from __future__ import annotations

import labkit
import pytest

from pdtrace.connector.lab import paired
from pdtrace.instrument import ids


def test_drift_cancels_and_the_effect_is_recovered_exactly():
    # every odd request treated (+7 ms); a linear drift of 1 ms per request that neighbours cancel
    treated = [i % 2 == 1 for i in range(41)]
    values = [100.0 + i + (7.0 if t else 0.0) for i, t in enumerate(treated)]
    diffs, unmatched = paired.neighbour_differences(treated, values, k=2)
    assert unmatched == 0 and len(diffs) == 20
    # interior requests: controls i±1, i±3 have median i + 100, so the difference is exactly 7
    assert diffs[1:-1] == [7.0] * 18
    e = paired.paired_estimate(treated, values, k=2, block=4)
    assert e.median == 7.0 and e.lo == 7.0 and e.hi == 7.0 and e.n == 20
    assert e.control_median == 120.0 and e.pct(e.median) == pytest.approx(7.0 / 120.0 * 100)


def test_prompt_length_matching_removes_the_length_bias():
    # lengths alternate in pairs (100, 100, 1000, 1000, ...); value = length / 10, treated (odd) +5
    n = 80
    lengths = [100 if (i // 2) % 2 == 0 else 1000 for i in range(n)]
    treated = [i % 2 == 1 for i in range(n)]
    values = [L / 10 + (5.0 if t else 0.0) for L, t in zip(lengths, treated)]
    e = paired.paired_estimate(treated, values, k=2, match=paired.length_match(lengths, 0.5), max_dist=12)
    assert e.median == 5.0 and (e.lo, e.hi) == (5.0, 5.0) and e.unmatched == 0
    # not matched: half the neighbours have the other length, every control is 55, the differences are
    # +50 or -40 and the interval spans the whole length effect
    raw = paired.paired_estimate(treated, values, k=2)
    assert sorted(set(paired.neighbour_differences(treated, values, k=2)[0][4:-4])) == [-40.0, 50.0]
    assert raw.lo == -40.0 and raw.hi == 50.0
    # no neighbour of the same length within reach -> unmatched, counted
    d, un = paired.neighbour_differences(treated, values, k=2, match=paired.length_match(lengths, 0.5),
                                         max_dist=0)
    assert d == [] and un == n // 2


def test_none_values_take_no_part():
    treated = [False, True, False, True, False]
    values = [10.0, 13.0, None, None, 10.0]
    d, un = paired.neighbour_differences(treated, values, k=1)
    assert d == [3.0] and un == 0  # the None treated request is not counted, the None control is skipped
    e = paired.paired_estimate([True, True], [1.0, 2.0])
    assert e.n == 0 and e.median is None and e.unmatched == 2 and e.control_median is None
    with pytest.raises(ValueError):
        paired.neighbour_differences([True], [1.0, 2.0])


def test_bootstrap_interval_of_a_median():
    # uniform 1..100: median 50.5, sd of the sample median 1 / (2 f sqrt(n)) = 100 / (2 * 10) = 5
    # (density f = 1/100), so the 95 % interval is about 50.5 +- 9.8
    xs = [float(i) for i in range(1, 101)]
    lo, hi = paired.bootstrap_median_ci(xs, n_boot=2000, seed=1)
    assert 38.0 < lo < 44.0 and 57.0 < hi < 63.0
    # one block as long as the data: every resample is the data itself
    assert paired.bootstrap_median_ci(xs, block=100) == (50.5, 50.5)
    # blocks of 10 keep runs together: an interval as wide as with single values or wider on sorted data
    blo, bhi = paired.bootstrap_median_ci(xs, block=10, seed=1)
    assert blo < 50.5 < bhi and bhi - blo >= (hi - lo) * 0.9
    with pytest.raises(ValueError):
        paired.bootstrap_median_ci([])


def test_placebo_split_is_independent_of_the_sampling_rule():
    xs = [f"lab-{i:016x}" for i in range(2000)]
    sampled = [ids.is_sampled(x, 0.5) for x in xs]
    pl = paired.placebo_flags(xs)
    assert pl == paired.placebo_flags(xs)  # deterministic
    share_in_sampled = sum(p for p, s in zip(pl, sampled) if s) / sum(sampled)
    share_in_unsampled = sum(p for p, s in zip(pl, sampled) if not s) / (len(xs) - sum(sampled))
    assert 0.44 < share_in_sampled < 0.56 and 0.44 < share_in_unsampled < 0.56  # 0.5 +- 3.5 sigma (n ~ 1000)


def test_paired_overhead_estimate_on_client_rows():
    mod = labkit.benchmark("paired_overhead")
    rows = []
    for i in range(400):
        x = f"lab-{i:016x}"
        t = ids.is_sampled(x, 0.5)
        rows.append({"x": x, "traced": t, "ok": True, "prompt_tokens": 256,
                     "ttft_ms": 40.0 + (1.5 if t else 0.0), "tpot_ms": 3.0})
    e = mod.estimate(rows, "ttft_ms")
    assert e.median == 1.5 and (e.lo, e.hi) == (1.5, 1.5) and e.pct(e.hi) == pytest.approx(1.5 / 40 * 100)
    assert mod.estimate(rows, "tpot_ms").median == 0.0
    pl = mod.estimate(rows, "ttft_ms", placebo=True)  # untraced halves: no effect
    assert pl.median == 0.0 and 0 < pl.n < sum(1 for r in rows if not r["traced"])
    rows.append({"x": None, "traced": None, "ok": True, "prompt_tokens": 256, "ttft_ms": 1e6, "tpot_ms": 1e6})
    assert mod.estimate(rows, "ttft_ms").median == 1.5  # a request without id is left out


def test_sampling_curve_paired_cost_is_undefined_at_0_and_1():
    mod = labkit.benchmark("connector_overhead")
    per = {}
    for i in range(200):
        x = f"lab-{i:016x}"
        t = ids.is_sampled(x, 0.5)
        per[(i // 20, i % 20)] = {"x": x, "prompt": 100 + (i % 3), "send_ns": i * 10**8,
                                  "ttft": 30.0 + (3.0 if t else 0.0), "tpot": 2.0 + (0.2 if t else 0.0)}
    assert mod.paired_in_lab(per, 0.0) is None and mod.paired_in_lab(per, 1.0) is None
    got = mod.paired_in_lab(per, 0.5)
    assert got["traced"] + got["untraced"] == 200
    assert got["ttft"]["median"] == 3.0 and got["ttft"]["pct_hi"] == pytest.approx(10.0)
    assert got["tpot"]["median"] == pytest.approx(0.2) and got["tpot"]["pct"] == pytest.approx(10.0)


def test_placebo_null_and_inverted_interval():
    assert paired.quantile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert paired.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0 and paired.quantile([], 0.5) is None
    # values alternating 10 / 20 by position: a placebo split's median difference is within [-10, 10]
    vals = [10.0 if i % 2 else 20.0 for i in range(200)]
    xs = [f"lab-{i:016x}" for i in range(200)]
    meds = paired.null_medians(vals, [paired.placebo_flags(xs, f"s{j}") for j in range(50)])
    assert len(meds) == 50 and all(-10.0 <= m <= 10.0 for m in meds)
    mod = labkit.benchmark("paired_overhead")
    rows = [{"x": x, "traced": ids.is_sampled(x, 0.5), "ok": True, "prompt_tokens": 64,
             "ttft_ms": 50.0, "tpot_ms": 4.0} for x in xs]
    for r in rows:
        r["ttft_ms"] += 2.0 if r["traced"] else 0.0
    nul = mod.null_spread(rows, "ttft_ms", n_splits=40)
    # every placebo half holds about half the traced requests: each split's median difference is 0 or +-2
    assert nul["n"] == 40 and set(nul["medians"]) <= {-2.0, -1.0, 0.0, 1.0, 2.0}
    assert mod.null_spread(rows, "ttft_ms", n_splits=40, untraced_only=True)["medians"] == [0.0] * 40
