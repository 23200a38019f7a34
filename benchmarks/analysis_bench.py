"""Analysis benchmark: full TTFT breakdown + summaries on a generated store, against a bare scan.

    python benchmarks/analysis_gen.py /tmp/pdtrace-bench/store          # 1M requests, ~20M rows
    python benchmarks/analysis_bench.py /tmp/pdtrace-bench/store --rounds 3

Each round prints, measured in the same round: the bare scan-and-group-by
time over the same files (DuckDB reading the Parquet files, grouping by
request_id), the cold time (absorb every file into a fresh cache + materialize
clock offsets, requests, ttft_segments, ttft_breakdown and the decode-stall
tables) plus the summary views, their ratio, the time to absorb one new file
set (``<store>-tail``, written by the generator) into the warm cache. The end
prints the best round and the spread (min-max) of each figure and the
process's peak RSS.

``--memory-limit`` sets DuckDB's memory_limit on the analysis connection (it
spills beyond it): on a machine shared with other jobs the kernel's OOM killer
otherwise stops a 1M-request build. The load average at each round's start
is printed: the machine may be shared, and figures move with it.
"""
from __future__ import annotations

import argparse
import os
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


def _bare(files: list[str]) -> tuple[float, int, int]:
    """(seconds, request ids, rows) of a bare scan + GROUP BY request_id over ``files``."""
    con = duckdb.connect()
    t = time.perf_counter()
    n_req, n_rows = con.execute(
        "SELECT count(*), sum(n) FROM (SELECT request_id, count(*) AS n, min(start_ns), max(end_ns) "
        "FROM read_parquet(?) GROUP BY request_id)", [files]).fetchone()
    s = time.perf_counter() - t
    con.close()
    return s, n_req, n_rows


def _round(a, files: list[str], tail: Path) -> dict:
    out: dict = {"load": os.getloadavg()[0]}
    out["bare"], n_req, n_rows = _bare(files)
    print(f"  load average at start: {out['load']:.1f} on {os.cpu_count()} cores")
    print(f"  store: {len(files)} files, {n_rows:,} rows, {n_req - 1:,} request ids (+ step rows)")
    print(f"  bare scan + group by request_id: {out['bare']:.2f} s")
    cache_dir = Path(tempfile.mkdtemp(prefix="pdtrace-bench-"))
    cache = cache_dir / "cache.duckdb"
    # its own cache root: the cold build loads the SQL library (no library template from an earlier run)
    os.environ["PDTRACE_CACHE_DIR"] = str(cache_dir)
    try:
        t = time.perf_counter()
        tr = db.Trace(a.store, cache=None if a.no_cache else cache, threads=a.threads)
        if a.memory_limit:
            tr.con.execute(f"SET memory_limit = '{a.memory_limit}'")
        r = tr.refresh()
        out["refresh"] = time.perf_counter() - t
        t2 = time.perf_counter()
        n_bd = tr.con.execute("SELECT count(*), sum(ttft_ns) FROM ttft_breakdown").fetchone()[0]
        for v in SUMMARIES:
            tr.con.execute(f"SELECT * FROM {v}").fetchall()
        out["summaries"] = time.perf_counter() - t2
        out["full"] = out["refresh"] + out["summaries"]
        out["ratio"] = out["full"] / out["bare"]
        print(f"  cold: absorb {len(r.new)} files + materialize {r.dirty_requests:,} requests: {out['refresh']:.2f} s; "
              f"ttft_breakdown ({n_bd:,} rows) + {len(SUMMARIES)} summaries: {out['summaries']:.2f} s")
        print(f"  full ttft_breakdown + summary (cold): {out['full']:.2f} s   goal <= 20 s")
        print(f"  ratio full / bare scan: {out['ratio']:.1f}x   goal <= 5x")
        t = time.perf_counter()
        for v in SUMMARIES:
            tr.con.execute(f"SELECT * FROM {v}").fetchall()
        out["warm_summaries"] = time.perf_counter() - t
        print(f"  warm summaries (from the cache): {out['warm_summaries']:.2f} s")
        if tail.is_dir():
            added = []
            for p in store.store_files(tail):
                dst = a.store / p.name
                shutil.copy(p, dst)
                added.append(dst)
            try:
                t = time.perf_counter()
                r = tr.refresh()
                out["absorb"] = time.perf_counter() - t
                print(f"  absorb one new file set ({len(r.new)} files, {r.dirty_requests:,} requests): "
                      f"{out['absorb']:.2f} s")
            finally:
                for p in added:
                    p.unlink()
        tr.close()
        if cache.exists():
            out["cache_mib"] = cache.stat().st_size / 2**20
            print(f"  cache file: {out['cache_mib']:.0f} MiB")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--tail", type=Path, default=None, help="files to absorb as 'one new file' (default: <store>-tail)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="measure this many times; print best and spread")
    ap.add_argument("--memory-limit", default=None, help="DuckDB memory_limit for the analysis, e.g. 6GB")
    ap.add_argument("--no-cache", action="store_true", help="analyse in memory instead of a cache file")
    a = ap.parse_args()
    files = [str(p) for p in store.store_files(a.store)]
    tail = a.tail or a.store.parent / (a.store.name + "-tail")
    rounds = []
    for i in range(a.rounds):
        print(f"round {i + 1}/{a.rounds}:", flush=True)
        rounds.append(_round(a, files, tail))
    if len(rounds) > 1:
        print(f"over {len(rounds)} rounds (best, spread min-max):")
        for k, label in (("bare", "bare scan"), ("full", "full breakdown + summary, cold"), ("ratio", "ratio"),
                         ("absorb", "absorb one new file set"), ("warm_summaries", "warm summaries")):
            v = [r[k] for r in rounds if k in r]
            if v:
                unit = "x" if k == "ratio" else " s"
                print(f"  {label}: best {min(v):.2f}{unit}, spread {min(v):.2f}-{max(v):.2f}{unit}")
        loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
        print(f"  load average at round starts: {loads}")
    print(f"peak RSS: {_peak_mib():.0f} MiB")


if __name__ == "__main__":
    main()
