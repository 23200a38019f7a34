"""Proof by intervention on real engines: a delay injected inside a stage shows up where it belongs.

One short lab per mode (pdtrace's traced connectors and router; 16 requests: pull replays the
public trace, push isolated alike requests, see ``CASES``; each listed stage injected into about
half of them by a hash of the request id, see
``pdtrace.connector.lab.inject``), analysed by ``benchmarks/inject_attribution.py`` (the script
behind BENCHMARKS.md "Injected delays") with main's analysis. Asserted per stage: the ``lab.inject``
records agree with the selection rule; on the critical path at least 80 % of the injected
interval itself is charged to the stage and the paired-neighbour increase of the stage's exposed
time equals the delay within the benchmark's tolerance (max(8 ms, 25 %)) or its 95 % CI covers
it; off the path the exposed time stays within the tolerance of 0 while the hidden time grows. The TTFT increase is
printed, not asserted: on the shared 2-core machine its CI at n≈8 spans hundreds of ms.
Run under ``flock /tmp/pdtrace-heavy.lock``.
"""
from __future__ import annotations

import labkit
import pytest

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1500)]

CASES = {
    # pull, the public trace (lengths x0.25): D's READ preparation and the promotion wait are on the path
    "pull": ("handoff.prep=40ms,kv.ready=25ms", {"handoff.prep": "on", "kv.ready": "on"}, None),
    # push, isolated alike requests of 4096 prompt tokens 0.8 s apart: P computes for ~100 ms, so D's
    # registration (delayed 20 ms) arrives while P computes (hidden) and P's WRITE preparation is on
    # the path. Not the public trace: at lengths x3 it overloads the 2 cores (TTFT p90 2-4 s), the
    # push writer thread is serial, and the paired-neighbour increase of ~8 pairs swung from -342 to
    # +34 ms between runs with 100 % of every injected interval charged to handoff.prep (CI run of
    # 2026-12-04 and a rerun)
    "push": ("handoff.prep=40ms,dest.register=20ms", {"handoff.prep": "on", "dest.register": "off"},
             {"isolated": (4096, 0.8)}),
}


@pytest.mark.parametrize("mode", sorted(CASES))
def test_injected_delay_is_attributed(mode, lab_ready, tmp_path):
    mod = labkit.benchmark("inject_attribution")
    spec, want, shape = CASES[mode]
    if shape:
        prompt_tokens, gap_s = shape["isolated"]
        wl = mod.isolated_workload(tmp_path / "isolated.jsonl", 16, gap_s, prompt_tokens, 16)
        d = mod.run_mode(mode, spec, tmp_path, max_requests=16, length_scale=1.0, rate_scale=1.0, lock=False,
                         workload_file=wl)
    else:
        d = mod.run_mode(mode, spec, tmp_path, max_requests=16, length_scale=None, rate_scale=0.5, lock=False)
    rows, parsed = mod.per_request(d)
    assert len(rows) >= 14, f"only {len(rows)} complete requests"
    res = mod.evaluate(rows, parsed, mode)
    print("\n" + mod.table(res))
    for r in res:
        assert r["record_mismatch"] == 0, f"{r['stage']}: lab.inject events disagree with the selection rule"
        assert r["n_injected"] >= 3, r
        if want[r["stage"]] == "on":
            # the injected interval itself is charged to the stage (no control group: load-proof) ...
            assert r["interval_share"] is not None and r["interval_share"] >= 0.8, r
            # ... and the stage grew by the delay: the benchmark's verdict (its paired median over half
            # the delay, within the tolerance), or (a load spike among ~8 pairs) the 95 % CI of the
            # increase, widened by the tolerance, holds the delay. Not the median alone: in CI runs on a
            # slower machine of the kind (2026-12-07) push's handoff.prep (40 ms, 100 % of every injected
            # interval charged to it) had a paired median of 6.2 ms [-49.7, 108.2] in one run, and in
            # another a CI starting at 40.8 ms (the delay plus knock-on queueing on 2 loaded cores)
            lo, hi = r["attributed_ci"]
            tol = r["tol_ms"]
            assert (r["path"] == "on" and r["attributed_ok"]) or lo - tol <= r["injected_ms"] <= hi + tol, r
        else:
            # off the path: exposed time unchanged, hidden time grew
            assert r["path"] == "off" and r["attributed_ok"], r
