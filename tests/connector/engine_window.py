"""Engine-clock TTFT on a real traced lab run (DESIGN.md §3 "TTFT source", issue 16 item 2).

Shared by the traced pull and push lab tests: their run directory (with the
router's files) is analysed as is and again as a copy without the router's
files (what a router that writes no pdtrace spans leaves), by
``benchmarks/engine_vs_router_ttft.py``. No new lab is started.
"""
from __future__ import annotations

from pathlib import Path

import labkit



def check_engine_window(run_dir: Path, ids: list[str]) -> dict:
    """Every request in ``ids``: complete from the engines' clocks alone, ``ttft_source = 'engine'``, its segments
    tiling the window to the ns, and its engine TTFT <= its router TTFT (the router's window contains the engines':
    it receives the request before P and writes the first token after D), up to D's clock-correction bound."""
    mod = labkit.benchmark("engine_vs_router_ttft")
    s = mod.compare(run_dir)
    print(mod.render(s))
    assert s["skipped_router_files"], "the run has no router file to remove"
    rows = {r["request_id"]: r for r in s["rows"]}
    missing = [i for i in ids if i not in rows]
    assert not missing, missing
    bad = [(i, rows[i]["engine_status"], rows[i]["engine_cause"]) for i in ids
           if rows[i]["engine_status"] != "complete" or rows[i]["engine_source"] != "engine"]
    assert not bad, bad
    untiled = [i for i in ids if not rows[i]["tiles"]]
    assert not untiled, untiled
    # slack: the largest P<->D clock-correction bound of the engine-only analysis, of the whole trace or of a
    # time window (a request is corrected by its window's offset; same host: ~1-8 ms; one window of a run on
    # 2026-12-07 was corrected by +5.3 ms within a 7.3 ms bound while the whole trace's bound was 3.3)
    slack_ms = s["engine_clock_bound_ms"] or 0.0
    neg = [(i, rows[i]["router_ttft_ms"], rows[i]["engine_ttft_ms"]) for i in ids
           if rows[i]["diff_ms"] < -slack_ms]
    assert not neg, (slack_ms, neg)
    return s
