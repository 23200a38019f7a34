"""Dashboard render times on a large store: overview first render (cold and warm cache), page switches.

``python benchmarks/dashboard_bench.py STORE [--cache-dir DIR] [--skip-cold]``

STORE is a span store, e.g. the 1,000,000-request one written by
``python benchmarks/analysis_gen.py STORE --requests 1000000``. Each
measurement renders real pages through Streamlit's AppTest (the same script
runs a browser would trigger, minus the network), in a fresh Python process
so no Streamlit cache is warm:

1. cold: the analysis cache file is deleted first, so the first render
   includes building it (``pdtrace.analysis`` absorbs every file);
2. warm: a new process opens the existing cache file; the first render of the
   Overview (open + refresh check + every overview query + plotly figures);
3. page switches: in that warm process, the first visit of each other page
   (its queries are not cached yet) and a return to the Overview.

Goals (issue 6): warm overview first render <= 3 s, page switches <= 1 s.
What one round hides: a single run per number; the OS page cache is warm after
the cold run; the browser's own rendering of the plotly figures (~0.1-0.5 s
on this machine) is not included.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
PAGES = ["app_pages/request.py", "app_pages/compare.py", "app_pages/stalls.py", "app_pages/changed.py",
         "app_pages/sql.py", "app_pages/overview.py"]


def _child(store: str, switches: bool) -> dict:
    """Run in a fresh process: first overview render, then (optionally) each page switch; times in s."""
    from streamlit.testing.v1 import AppTest

    os.environ["PDTRACE_DASHBOARD_DIR"] = store
    out: dict = {}
    t0 = time.perf_counter()
    at = AppTest.from_file(str(APP), default_timeout=3600)
    at.run()
    out["overview_first_render_s"] = time.perf_counter() - t0
    out["exceptions"] = [e.value for e in at.exception]
    out["metrics"] = {m.label: m.value for m in at.metric}
    if switches:
        out["switches_s"] = {}
        for page in PAGES:
            at.switch_page(page)
            t0 = time.perf_counter()
            at.run()
            out["switches_s"][page.split("/")[-1][:-3]] = time.perf_counter() - t0
            out["exceptions"] += [e.value for e in at.exception]
    return out


def _run_child(store: Path, cache_dir: Path, switches: bool) -> dict:
    env = dict(os.environ, PDTRACE_CACHE_DIR=str(cache_dir))
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import dashboard_bench as b; "
            f"print('RESULT', json.dumps(b._child({str(store)!r}, {switches!r})))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"benchmark child failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def _store_size(store: Path) -> str:
    import duckdb

    from pdtrace.instrument.store import store_files

    files = store_files(store)
    size = sum(f.stat().st_size for f in files)
    con = duckdb.connect()
    rows, reqs = con.execute(
        "SELECT count(*), count(DISTINCT request_id) FROM read_parquet(?, union_by_name = true)",
        [[str(f) for f in files]]).fetchone()
    return f"{reqs:,} requests, {rows:,} rows, {len(files)} files, {size / 2**20:,.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="analysis cache directory (default: <store>-dashboard-cache)")
    ap.add_argument("--skip-cold", action="store_true", help="keep an existing cache file (no cold run)")
    args = ap.parse_args()
    store = args.store.resolve()
    cache_dir = (args.cache_dir or store.with_name(store.name + "-dashboard-cache")).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"store: {store}: {_store_size(store)}")
    if not args.skip_cold:
        for f in cache_dir.glob("pdtrace-*.duckdb*"):
            f.unlink()
        cold = _run_child(store, cache_dir, switches=False)
        print(f"overview first render, cold (builds the analysis cache): {cold['overview_first_render_s']:.2f} s")
    warm = _run_child(store, cache_dir, switches=True)
    ok = warm["overview_first_render_s"] <= 3.0
    print(f"overview first render, warm cache (new process): {warm['overview_first_render_s']:.2f} s "
          f"(goal <= 3 s: {'met' if ok else 'NOT met'})")
    worst = max(warm["switches_s"].values())
    for page, s in warm["switches_s"].items():
        print(f"  switch to {page:<9} {s:.2f} s")
    print(f"page switches: worst {worst:.2f} s (goal <= 1 s: {'met' if worst <= 1.0 else 'NOT met'})")
    print("overview shows:", ", ".join(f"{k} {v}" for k, v in warm["metrics"].items()))
    if warm["exceptions"]:
        print("EXCEPTIONS:", warm["exceptions"])
        sys.exit(1)


if __name__ == "__main__":
    main()
