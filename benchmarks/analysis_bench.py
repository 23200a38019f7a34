"""Analysis benchmark: full TTFT breakdown + summaries on a generated store, against a bare scan.

    python benchmarks/analysis_gen.py /tmp/pdtrace-bench/store          # 1M requests, ~19M rows
    python benchmarks/analysis_bench.py /tmp/pdtrace-bench/store

Prints, in one run: the bare scan-and-group-by time over the same files
(DuckDB reading the Parquet files, grouping by request_id), the cold time
(absorb every file into a fresh cache + materialize spans' clock offsets,
requests, ttft_segments, ttft_breakdown) plus the summary views, their ratio,
the time to absorb one new file set (``<store>-tail``, written by the
generator) into the warm cache, and the process's peak RSS.

One round only: numbers move with the page cache and the other load on the
machine; run twice and keep the second when comparing changes.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import duckdb

from pdtrace.analysis import db
from pdtrace.instrument import store

SUMMARIES = ["summary_by_mode", "summary_by_prompt_bucket", "summary_by_uncached_bucket", "summary_by_window"]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--tail", type=Path, default=None, help="files to absorb as 'one new file' (default: <store>-tail)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-cache", action="store_true", help="analyse in memory instead of a cache file")
    a = ap.parse_args()
    files = [str(p) for p in store.store_files(a.store)]
    tail = a.tail or a.store.parent / (a.store.name + "-tail")

    con = duckdb.connect()
    t = time.perf_counter()
    n_req, n_rows = con.execute(
        "SELECT count(*), sum(n) FROM (SELECT request_id, count(*) AS n, min(start_ns), max(end_ns) "
        "FROM read_parquet(?) GROUP BY request_id)", [files]).fetchone()
    bare = time.perf_counter() - t
    con.close()
    import os
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"store: {len(files)} files, {n_rows:,} rows, {n_req - 1:,} request ids (+ step rows)")
    print(f"bare scan + group by request_id: {bare:.2f} s  (peak RSS so far {_peak_mib():.0f} MiB)")

    cache_dir = Path(tempfile.mkdtemp(prefix="pdtrace-bench-"))
    cache = cache_dir / "cache.duckdb"
    try:
        t = time.perf_counter()
        tr = db.Trace(a.store, cache=None if a.no_cache else cache, threads=a.threads)
        r = tr.refresh()
        t_refresh = time.perf_counter() - t
        t2 = time.perf_counter()
        n_bd, ttft_sum = tr.con.execute("SELECT count(*), sum(ttft_ns) FROM ttft_breakdown").fetchone()
        for v in SUMMARIES:
            tr.con.execute(f"SELECT * FROM {v}").fetchall()
        t_sum = time.perf_counter() - t2
        full = t_refresh + t_sum
        print(f"cold: absorb {len(r.new)} files + materialize {r.dirty_requests:,} requests: {t_refresh:.2f} s; "
              f"ttft_breakdown ({n_bd:,} rows) + {len(SUMMARIES)} summaries: {t_sum:.2f} s")
        print(f"full ttft_breakdown + summary (cold): {full:.2f} s   goal <= 20 s")
        print(f"ratio full / bare scan: {full / bare:.1f}x   goal <= 5x")
        t = time.perf_counter()
        for v in SUMMARIES:
            tr.con.execute(f"SELECT * FROM {v}").fetchall()
        print(f"warm summaries (from the cache): {time.perf_counter() - t:.2f} s")

        if tail.is_dir():
            added = []
            for p in store.store_files(tail):
                dst = a.store / p.name
                shutil.copy(p, dst)
                added.append(dst)
            try:
                t = time.perf_counter()
                r = tr.refresh()
                t_abs = time.perf_counter() - t
                print(f"absorb one new file set ({len(r.new)} files, {r.dirty_requests:,} requests): {t_abs:.2f} s")
            finally:
                for p in added:
                    p.unlink()
        tr.close()
        if cache.exists():
            print(f"cache file: {cache.stat().st_size / 2**20:.0f} MiB")
        print(f"peak RSS: {_peak_mib():.0f} MiB")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
