"""Lower bound for the cold analysis goal: the skeleton of a TTFT critical path, timed step by step.

    python benchmarks/analysis_gen.py /tmp/pdtrace-bench/store          # 1M requests, ~20M rows
    python benchmarks/analysis_lower_bound.py /tmp/pdtrace-bench/store

Builds the analysis cache once (for the clock offsets the corrected times
need; not timed), then times, each step once over the whole store: the bare
scan-and-group-by the goal's ratio is measured against, the arrival and first
token per request, the leaf-stage candidates with corrected times, one
"latest end wins" window (DESIGN.md §3's flatten), numbering the segments and
summing them per category. None of DESIGN.md's other rules (TP ranks,
branches, children, waits, gaps, hidden time, duplicates, incomplete
requests, stalls) is applied, so the printed total is a lower bound for the
full cold build (BENCHMARKS.md "Analysis lower bound"). Prints seconds per
step, the total and its ratio to the bare scan.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from pdtrace.analysis import db
from pdtrace.instrument import store
from pdtrace.instrument.stages import CATEGORIES

STEPS = [
    ("a. arrival and first token per request (router rows)", """
        CREATE OR REPLACE TEMP TABLE lb_req AS SELECT rkey,
            min(c_start_ns) FILTER (WHERE name = 'router.request') AS arrival_ns,
            min(c_start_ns) FILTER (WHERE name = 'router.first_token') AS first_token_ns
        FROM _timed WHERE role = 'router' GROUP BY rkey"""),
    ("b. leaf-stage candidates with corrected times", """
        CREATE OR REPLACE TEMP TABLE lb_cand AS
        SELECT t.rkey, t.span_id, t.name::_stage_name AS stage, s.category, t.c_start_ns AS s0, t.c_end_ns AS e0
        FROM _timed t JOIN stages s ON s.stage = t.name WHERE t.record = 'span' AND s.owns_ttft"""),
    ("c. latest end wins: one window over the candidates", """
        CREATE OR REPLACE TEMP TABLE lb_top AS SELECT * FROM (
            SELECT *, least(e0, coalesce(min(s0) OVER w, e0)) AS oe FROM lb_cand
            WINDOW w AS (PARTITION BY rkey ORDER BY e0 DESC, s0 DESC, span_id
                         ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)) WHERE oe > s0"""),
    ("d. segments numbered in time order", """
        CREATE OR REPLACE TEMP TABLE lb_seg AS
        SELECT *, row_number() OVER (PARTITION BY rkey ORDER BY s0, oe) AS seq FROM lb_top"""),
    ("e. breakdown per request and category", """
        CREATE OR REPLACE TEMP TABLE lb_bd AS
        SELECT rkey, """ + "".join(f"sum(oe - s0) FILTER (WHERE category = '{c}') AS {c}_ns, " for c in CATEGORIES)
     + """arg_max(stage, oe - s0) AS dominant_stage
        FROM lb_seg GROUP BY rkey"""),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path, help="a store written by analysis_gen.py")
    a = ap.parse_args()
    files = [str(p) for p in store.store_files(a.store)]
    with tempfile.TemporaryDirectory(prefix="pdtrace-lb-") as tmp:
        tr = db.Trace(a.store, cache=Path(tmp) / "cache.duckdb")
        tr.refresh()  # clock offsets for the corrected times (not timed); _records is then every file
        con = tr.con
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {len(files)} files")
        t = time.perf_counter()
        con.execute("CREATE OR REPLACE TEMP TABLE lb_bare AS SELECT request_id, count(*) AS n "
                    "FROM read_parquet(?) GROUP BY request_id", [files])
        bare = time.perf_counter() - t
        print(f"bare scan + group by request id: {bare:.2f} s")
        total = 0.0
        for label, sql in STEPS:
            t = time.perf_counter()
            con.execute(sql)
            dt = time.perf_counter() - t
            total += dt
            print(f"{label}: {dt:.2f} s")
        n = con.execute("SELECT (SELECT count(*) FROM lb_cand), (SELECT count(*) FROM lb_seg), "
                        "(SELECT count(*) FROM lb_bd)").fetchone()
        print(f"rows: {n[0]:,} candidates, {n[1]:,} segments, {n[2]:,} requests")
        print(f"skeleton total: {total:.2f} s = {total / bare:.0f}x the bare scan (goal: full build <= 5x, <= 20 s)")
        tr.close()


if __name__ == "__main__":
    main()
