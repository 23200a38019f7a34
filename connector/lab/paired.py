"""Paired-neighbour estimates for lab experiments: the effect of a per-request treatment.

The lab's experiments treat about half of the requests of one run (an injected delay,
``benchmarks/inject_attribution.py``; tracing by ``PDTRACE_SAMPLE``,
``benchmarks/paired_overhead.py``), chosen by a hash of the request id, so treated and untreated
requests interleave under the same load. On the noisy 2-core lab machine the load moves a request's
latency by far more than the effects measured, but it moves neighbours in arrival order alike. So
each treated request is compared with its nearest untreated neighbours:

- ``treated[i]``, ``values[i]``: the requests in arrival order (``None`` values are left out).
- control of treated request i = the median of its ``k`` nearest untreated neighbours on each side in
  arrival order (at most ``max_dist`` positions away) that also pass ``match(i, j)`` (e.g. a similar
  prompt length: :func:`length_match`); paired difference d_i = values[i] − control.
  A treated request with no such neighbour is unmatched and left out (counted).
- the effect = the median of the d_i (robust: on this machine a few requests meet load spikes of
  hundreds of ms, which would swamp a mean); also their mean.
- 95 % interval: percentile bootstrap (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993,
  ch. 13) of the median of the d_i. Neighbouring d_i share controls and load, so with ``block`` > 1
  the d_i are resampled in moving blocks of ``block`` consecutive pairs (Künsch, "The jackknife and the
  bootstrap for general stationary observations", Ann. Statist. 17, 1989), which keeps that
  dependence; ``block`` = 1 resamples single pairs.

A placebo (:func:`placebo_flags`) splits the *untreated* requests by a second, independent hash and
runs the same estimator on them: its interval is what the method reports when there is no effect
(its noise floor). Many placebo splits (:func:`null_medians`, one salt each) give the estimator's
whole distribution under no effect; on a machine whose load comes in bursts it is wider than the
bootstrap interval says (neighbours share bursts), and its 2.5 / 97.5 % points, subtracted from the
estimate, give an interval by test inversion under a constant shift (Imbens & Rubin 2015, ch. 5).
"""
from __future__ import annotations

import hashlib
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PairedEstimate:
    """Result of :func:`paired_estimate`; values in the unit of the input (ms in the lab).

    ``median``: median paired difference (the effect), ``lo``/``hi``: its 95 % bootstrap interval,
    ``mean``: mean paired difference, ``n``: pairs used, ``unmatched``: treated requests without a
    control, ``control_median``: median of the untreated values (the base for a relative cost).
    All None (n = 0) when no pair exists.
    """

    median: float | None
    lo: float | None
    hi: float | None
    mean: float | None
    n: int
    unmatched: int
    control_median: float | None

    def pct(self, v: float | None) -> float | None:
        """``v`` as % of the untreated median (None when either is missing or the median is 0)."""
        if v is None or not self.control_median:
            return None
        return 100.0 * v / self.control_median


def neighbour_differences(treated: Sequence[bool], values: Sequence[float | None], k: int = 2,
                          match: Callable[[int, int], bool] | None = None,
                          max_dist: int | None = None) -> tuple[list[float], int]:
    """Paired differences of the treated requests, in arrival order, and the number unmatched.

    ``treated``, ``values``: one entry per request in arrival order (same length, else ValueError);
    a None value takes part neither as treated nor as control. Each treated i is paired with the
    median of up to ``k`` untreated j on each side (nearest first, |i − j| ≤ ``max_dist`` if given,
    ``match(i, j)`` true if given). Returns (differences, unmatched count).
    """
    if len(treated) != len(values):
        raise ValueError(f"treated has {len(treated)} entries, values {len(values)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(values)
    diffs, unmatched = [], 0
    for i in range(n):
        if not treated[i] or values[i] is None:
            continue
        nb = []
        for step in (-1, 1):
            j, got = i + step, 0
            while 0 <= j < n and got < k and (max_dist is None or abs(j - i) <= max_dist):
                if not treated[j] and values[j] is not None and (match is None or match(i, j)):
                    nb.append(values[j])
                    got += 1
                j += step
        if nb:
            diffs.append(values[i] - statistics.median(nb))
        else:
            unmatched += 1
    return diffs, unmatched


def bootstrap_median_ci(xs: Sequence[float], n_boot: int = 2000, block: int = 1, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``xs`` (in order), moving blocks of ``block``.

    ``block`` = 1: each resample draws len(xs) values with replacement (``random.Random(seed).choices``).
    ``block`` > 1: each resample concatenates blocks xs[s:s+block] with s uniform in
    [0, len(xs) − block] until it has len(xs) values (moving-block bootstrap, Künsch 1989).
    Raises ValueError for an empty ``xs``.
    """
    if not xs:
        raise ValueError("no values to bootstrap")
    rng = random.Random(seed)
    m = len(xs)
    b = max(1, min(block, m))
    boots = []
    for _ in range(n_boot):
        if b == 1:
            sample = rng.choices(xs, k=m)
        else:
            sample = []
            while len(sample) < m:
                s = rng.randrange(m - b + 1)
                sample.extend(xs[s:s + b])
            del sample[m:]
        boots.append(statistics.median(sample))
    boots.sort()
    a = (1.0 - level) / 2
    return boots[int(a * n_boot)], boots[int((1 - a) * n_boot) - 1]


def paired_estimate(treated: Sequence[bool], values: Sequence[float | None], k: int = 2,
                    match: Callable[[int, int], bool] | None = None, max_dist: int | None = None,
                    block: int = 1, n_boot: int = 2000, seed: int = 0) -> PairedEstimate:
    """The paired-neighbour effect of the treatment on ``values`` (module docstring) with its 95 % CI."""
    diffs, unmatched = neighbour_differences(treated, values, k=k, match=match, max_dist=max_dist)
    ctrl = [v for t, v in zip(treated, values) if not t and v is not None]
    cmed = statistics.median(ctrl) if ctrl else None
    if not diffs:
        return PairedEstimate(None, None, None, None, 0, unmatched, cmed)
    lo, hi = bootstrap_median_ci(diffs, n_boot=n_boot, block=block, seed=seed)
    return PairedEstimate(statistics.median(diffs), lo, hi, statistics.fmean(diffs), len(diffs), unmatched, cmed)


def length_match(lengths: Sequence[int], tol_log2: float | None) -> Callable[[int, int], bool] | None:
    """``match(i, j)``: true iff |log2(lengths[i] / lengths[j])| ≤ ``tol_log2`` (prompt tokens; 0.5 = within
    ×1.41). None for ``tol_log2`` None (no length matching). Lengths below 1 count as 1."""
    if tol_log2 is None:
        return None
    lg = [math.log2(max(1, x)) for x in lengths]
    return lambda i, j: abs(lg[i] - lg[j]) <= tol_log2


def placebo_flags(ids: Sequence[str], salt: str = "placebo") -> list[bool]:
    """A second split of requests, independent of the sampling rule: bit 0 of sha256(``salt:id``)."""
    return [hashlib.sha256(f"{salt}:{x}".encode()).digest()[0] & 1 == 1 for x in ids]


def null_medians(values: Sequence[float | None], splits: Sequence[Sequence[bool]], k: int = 2,
                 match: Callable[[int, int], bool] | None = None, max_dist: int | None = None) -> list[float]:
    """The estimator's median paired difference under each of ``splits`` (placebo assignments, same length
    as ``values``): its spread when no split carries an effect (a randomization null; Imbens & Rubin,
    *Causal Inference*, 2015, ch. 5). Splits without a pair are left out."""
    out = []
    for flags in splits:
        d, _ = neighbour_differences(flags, values, k=k, match=match, max_dist=max_dist)
        if d:
            out.append(statistics.median(d))
    return out


def quantile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated q-quantile of ``xs`` (None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
