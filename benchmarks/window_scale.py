"""Cold analysis of a time window of a large store against the whole store, in the same run.

``python benchmarks/window_scale.py STORE [--minutes 6] [--lookahead 1m] [--memory-limit 6GB] [--tmp DIR]``

Builds the analysis of STORE cold into a new cache file twice with DuckDB (as ``pdtrace report``
does): once whole, once for a window of ``--minutes`` in the middle of the store's time range
(``--since``/``--until`` of ``pdtrace report``, :mod:`pdtrace.analysis.window`, with ``--lookahead``).
Prints for each: wall seconds, requests, files read and left out; and checks that the window's
requests get the whole store's answers: the digest of ``benchmarks/spark_scale.py`` (``DIGEST_SQL``:
an order-free hash of every request's id, TTFT, TPOT and breakdown) over the requests arriving in
the window, and their incomplete causes, from both builds, must be equal, and the window build must
show no other request (exit status 1 otherwise). The store's time range comes from its files' footer
statistics of ``end_ns``.

The store comes from ``benchmarks/analysis_gen.py`` (flat: pruning by footer statistics). Figures:
BENCHMARKS.md "Analysis of a time window".
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spark_scale import DIGEST_SQL  # noqa: E402  (one digest for every benchmark that compares answers)


def _digest(con, lo: int, hi: int) -> tuple[int, str]:
    """(requests, digest) of the requests arriving in [lo, hi) (ns)."""
    sql = DIGEST_SQL.replace("FROM requests r",
                             "FROM (SELECT * FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?) r")
    n, d = con.execute(sql, [lo, hi]).fetchone()
    return n, str(d)


def _build(store: str, work: str, memory_limit: str, window) -> dict:
    """Build ``store``'s analysis cold (``window`` or None) into a new cache file in ``work``; returns
    wall and process CPU seconds, requests, files read and left out, and the open trace."""
    from pdtrace.analysis import db

    t0, c0 = time.perf_counter(), time.process_time()
    name = "whole.duckdb" if window is None else "window.duckdb"
    tr = db.Trace(store, cache=os.path.join(work, name), memory_limit=memory_limit, window=window)
    res = tr.refresh(warn=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = tr.con.execute("SELECT count(*) FROM requests").fetchone()[0]
    return {"wall_s": wall, "cpu_s": cpu, "requests": n, "read": len(res.new), "pruned": len(res.pruned),
            "trace": tr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--minutes", type=float, default=6.0, help="length of the window (minutes)")
    ap.add_argument("--lookahead", default="1m", help="the window's lookahead (pdtrace report --lookahead)")
    ap.add_argument("--memory-limit", default="6GB", help="DuckDB memory_limit of both builds")
    ap.add_argument("--tmp", default=None, help="directory for the cache files (default the temp dir)")
    a = ap.parse_args()

    import duckdb

    from pdtrace.analysis.window import NS, Window, iso, parse_duration
    from pdtrace.instrument import store as _store

    files = [str(p) for p in _store.store_files(a.store)]
    lo, hi = duckdb.connect().execute(
        "SELECT min(TRY_CAST(stats_min AS BIGINT)), max(TRY_CAST(stats_max AS BIGINT)) FROM parquet_metadata(?) "
        "WHERE path_in_schema = 'end_ns'", [files]).fetchone()
    mid = (lo + hi) // 2
    half = int(a.minutes * 60 * NS) // 2
    w = Window(mid - half, mid + half, lookahead_ns=parse_duration(a.lookahead))
    print(f"store {a.store}: {len(files)} files, rows ending {iso(lo)} .. {iso(hi)}; window "
          f"[{iso(w.since_ns)}, {iso(w.until_ns)}) ({a.minutes:g} min, lookahead {a.lookahead})", flush=True)
    work = tempfile.mkdtemp(prefix="pdtrace-window-", dir=a.tmp)
    try:
        part = _build(a.store, work, a.memory_limit, w)
        print(f"window: cold {part['wall_s']:.1f} s (CPU {part['cpu_s']:.1f} s), {part['requests']:,} requests, "
              f"{part['read']} files read, {part['pruned']} left out", flush=True)
        whole = _build(a.store, work, a.memory_limit, None)
        print(f"whole:  cold {whole['wall_s']:.1f} s (CPU {whole['cpu_s']:.1f} s), {whole['requests']:,} requests, "
              f"{whole['read']} files read", flush=True)
        dw = _digest(part["trace"].con, w.since_ns, w.until_ns)
        dh = _digest(whole["trace"].con, w.since_ns, w.until_ns)
        causes = ("SELECT cause, count(*) FROM incomplete_requests WHERE arrival_ns >= ? AND arrival_ns < ? "
                  "GROUP BY ALL ORDER BY ALL")
        cw = part["trace"].con.execute(causes, [w.since_ns, w.until_ns]).fetchall()
        ch = whole["trace"].con.execute(causes, [w.since_ns, w.until_ns]).fetchall()
        same = dw == dh and cw == ch and part["requests"] == dw[0]
        print(f"window's requests: {dw[0]:,} in the window build (of {part['requests']:,} it shows), {dh[0]:,} in "
              f"the whole build; digests {'equal' if dw == dh else 'DIFFER'}; incomplete causes "
              f"{'equal' if cw == ch else 'DIFFER'} ({sum(n for _, n in cw):,} incomplete)")
        print(f"speed-up of the window over the whole store: {whole['wall_s'] / part['wall_s']:.2f}x "
              f"for {part['requests'] / max(1, whole['requests']):.1%} of its requests")
        part["trace"].close()
        whole["trace"].close()
        if not same:
            sys.exit(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
