"""Engine-clock TTFT vs router-clock TTFT on one run directory (issue 16 item 2).

Usage (from the repo root)::

    .venv/bin/python benchmarks/engine_vs_router_ttft.py RUN_DIR [--json]

What it does:

1. Analyses RUN_DIR as it is: every request's window is the router's
   (``requests.ttft_source = 'router'``).
2. Copies RUN_DIR's store files *without* the router's records (``role =
   'router'``; the host's sink shares files between processes, so each file is
   rewritten without them: what a router that writes no pdtrace spans
   leaves) into a temporary directory and analyses that: every request's
   window is the engines' own (``ttft_source = 'engine'``: P's API server
   received the request -> D's API server wrote the first token chunk,
   DESIGN.md §3).
3. Joins the two by (run id, request id, prompt index) and prints, per mode,
   the difference router TTFT - engine TTFT (ms): median, p99, min, max. The
   router's window contains the engines' (the router receives the request
   before P does and writes the first token after D does), so every
   difference is >= 0 up to the clock-correction bound; the difference is the
   router's own time outside the engines' window (its receive and dispatch to
   P, and D's first chunk on its way to the client), plus, in engine mode,
   nothing of the hop between the legs is lost: it is the pseudo-stage
   ``router.unseen``.

It also checks, for the engine-mode analysis, that every complete request's
``ttft_segments`` tile its window to the ns (``sum(dur_ns) = ttft_ns``), and
reports the mean exposed ``router.unseen`` time.

Reading never writes: RUN_DIR is only read; the copy and the analyses (in
memory) live in a temporary directory removed at the end.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path


from pdtrace import analysis
from pdtrace.connector.lab import replay  # its percentile rule (linear interpolation), shared by the benchmarks


def engine_only_copy(run_dir: Path, dest: Path) -> list[str]:
    """Copy ``run_dir``'s top-level ``*.parquet`` files into ``dest`` without the router's records; returns the
    names of the files that held any.

    The router's records are those with ``role = 'router'``. The host's sink writes every traced process of
    the host into shared files, so a file is rewritten without those rows (same schema and file metadata),
    or left out when nothing else is in it. Files that cannot be read are copied as they are (the analysis
    skips and names them).
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    dest.mkdir(parents=True, exist_ok=True)
    touched = []
    for f in sorted(run_dir.glob("*.parquet")):
        try:
            t = pq.read_table(f)
        except Exception:  # noqa: BLE001 - unreadable: copied for the analysis to skip and name
            shutil.copy2(f, dest / f.name)
            continue
        is_router = pc.fill_null(pc.equal(t["role"], "router"), False)
        n_router = pc.sum(is_router).as_py() or 0
        if not n_router:
            shutil.copy2(f, dest / f.name)
            continue
        touched.append(f.name)
        rest = t.filter(pc.invert(is_router))
        if rest.num_rows:
            pq.write_table(rest, dest / f.name)
    return touched


def compare(run_dir: str | Path) -> dict:
    """Router- vs engine-clock TTFT of ``run_dir`` (see the module docstring).

    Returns a dict: ``rows`` (per request: request_id, mode, router_ttft_ms,
    engine_ttft_ms, diff_ms, engine_status, engine_cause, tiles), ``by_mode``
    (mode -> n, median/p99/min/max diff ms, median router/engine TTFT ms,
    mean router.unseen ms), ``engine_sources`` (ttft_source -> count in the
    engine-only analysis), ``skipped_router_files``, ``engine_clock_bound_ms`` (the largest clock-offset
    bound of the engine-only analysis, whole trace or one time window, ms), ``untiled`` (requests
    whose engine-mode segments do not sum to the TTFT).
    Raises FileNotFoundError when ``run_dir`` does not exist.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    key = "concat_ws('/', coalesce(run_id, ''), request_id, prompt_index)"
    with analysis.open(run_dir, cache=None) as tr:
        router = {r["k"]: r for r in tr.query(
            f"SELECT {key} AS k, request_id, mode, ttft_ms, ttft_source FROM requests")}
    with tempfile.TemporaryDirectory(prefix="pdtrace-engine-only-") as tmp:
        skipped = engine_only_copy(run_dir, Path(tmp) / "store")
        with analysis.open(Path(tmp) / "store", cache=None) as tr:
            engine = {r["k"]: r for r in tr.query(
                f"SELECT {key} AS k, request_id, mode, ttft_ms, ttft_source, status, cause FROM requests")}
            # the bound of any correction a request may have had: a time window's can exceed the whole trace's
            bound = tr.query("SELECT max(bound_ms) AS b FROM clock_offsets")[0]["b"]
            tiles = {r["k"]: r for r in tr.query(
                f"SELECT {key} AS k, b.ttft_ns, b.router_unseen_ms, "
                "(SELECT sum(s.dur_ns) FROM ttft_segments s WHERE s.rkey = b.rkey) AS seg_ns FROM ttft_breakdown b")}
    rows = []
    for k, r in sorted(router.items()):
        e = engine.get(k)
        t = tiles.get(k)
        diff = (r["ttft_ms"] - e["ttft_ms"]) if e and r["ttft_ms"] is not None and e["ttft_ms"] is not None else None
        rows.append({"request_id": r["request_id"], "mode": r["mode"], "router_ttft_ms": r["ttft_ms"],
                     "engine_ttft_ms": e["ttft_ms"] if e else None, "diff_ms": diff,
                     "engine_status": e["status"] if e else "missing", "engine_cause": e["cause"] if e else None,
                     "engine_source": e["ttft_source"] if e else None,
                     "tiles": bool(t) and t["seg_ns"] == t["ttft_ns"],
                     "router_unseen_ms": t["router_unseen_ms"] if t else None})
    by_mode = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode and r["diff_ms"] is not None]
        d = [r["diff_ms"] for r in rs]
        by_mode[mode] = {
            "n": len(rs), "requests": sum(1 for r in rows if r["mode"] == mode),
            "diff_median_ms": statistics.median(d) if d else None, "diff_p99_ms": replay._pct(d, 0.99),
            "diff_min_ms": min(d) if d else None, "diff_max_ms": max(d) if d else None,
            "router_ttft_median_ms": statistics.median(r["router_ttft_ms"] for r in rs) if rs else None,
            "engine_ttft_median_ms": statistics.median(r["engine_ttft_ms"] for r in rs) if rs else None,
            "router_unseen_mean_ms": statistics.mean(r["router_unseen_ms"] for r in rs) if rs else None,
        }
    sources: dict[str, int] = {}
    for e in engine.values():
        sources[e["ttft_source"]] = sources.get(e["ttft_source"], 0) + 1
    return {"run_dir": str(run_dir), "rows": rows, "by_mode": by_mode, "engine_sources": sources,
            "skipped_router_files": skipped, "engine_clock_bound_ms": bound,
            "untiled": [r["request_id"] for r in rows if r["engine_status"] == "complete" and not r["tiles"]]}


def render(s: dict) -> str:
    """Text summary of :func:`compare`'s dict."""
    out = [f"# {s['run_dir']}: router-clock TTFT - engine-clock TTFT (files with router records: "
           f"{len(s['skipped_router_files'])})",
           f"engine-only analysis ttft_source counts: {s['engine_sources']}; largest P<->D clock bound "
           f"{s['engine_clock_bound_ms']} ms"]
    for mode, m in s["by_mode"].items():
        f = lambda v: "-" if v is None else f"{v:.3f}"
        out.append(f"{mode}: {m['n']}/{m['requests']} joined; diff ms median {f(m['diff_median_ms'])} "
                   f"p99 {f(m['diff_p99_ms'])} min {f(m['diff_min_ms'])} max {f(m['diff_max_ms'])}; "
                   f"TTFT median router {f(m['router_ttft_median_ms'])} engine {f(m['engine_ttft_median_ms'])}; "
                   f"router.unseen mean {f(m['router_unseen_mean_ms'])} ms")
    out.append(f"engine-mode segments tile every complete request's window to the ns: {not s['untiled']}"
               + (f" (not: {s['untiled']})" if s["untiled"] else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    a = ap.parse_args(argv)
    s = compare(a.run_dir)
    print(json.dumps(s, indent=1, default=str) if a.json else render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
