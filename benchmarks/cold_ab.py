"""Cold analysis time of two pdtrace checkouts on one store, interleaved in one run.

    python benchmarks/cold_ab.py /tmp/pdtrace-bench/store \\
        --python-a /work/wt/base/.venv/bin/python --rounds 3

Each round runs a cold build (fresh cache file: absorb every file, materialize
every view, then ttft_breakdown and the four summaries, exactly what
``analysis_bench.py`` calls "full ttft_breakdown + summary, cold") once with
interpreter A and once with interpreter B (default: this interpreter), in
alternating order (A B, B A, A B, ...) so drift in the machine's load falls
on both. Each build runs in its own child process; its time is measured
inside the child (process start and imports excluded) and its peak RSS is the
child's, and so is its CPU time (user + sys of all its threads, from
``resource.getrusage``: less sensitive to the machine's load than wall time).
The end prints every round's pair, the median ratios B/A (wall and CPU) with
the min-max of the per-round ratios, and whose pdtrace each interpreter imports
(the git revision of the tree holding its ``pdtrace.analysis``).

A ratio, not a time, is the figure: on a shared 2-core machine a cold build
of the same store moves by tens of percent between minutes, while the two
builds of one round see nearly the same load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, os, resource, sys, tempfile, time, shutil
from pathlib import Path
from pdtrace.analysis import db
store = Path(sys.argv[1]); mem = sys.argv[2] or None
d = Path(tempfile.mkdtemp(prefix="pdtrace-coldab-"))
os.environ["PDTRACE_CACHE_DIR"] = str(d)  # the build loads the SQL library: no template from an earlier round
try:
    t = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_SELF); cpu0 = ru0.ru_utime + ru0.ru_stime
    tr = db.Trace(store, cache=d / "cache.duckdb")
    if mem:
        tr.con.execute(f"SET memory_limit = '{mem}'")
    r = tr.refresh()
    n = tr.con.execute("SELECT count(*) FROM ttft_breakdown").fetchone()[0]
    for v in ("summary_by_mode", "summary_by_prompt_bucket", "summary_by_uncached_bucket", "summary_by_window"):
        tr.con.execute(f"SELECT * FROM {v}").fetchall()
    s = time.perf_counter() - t
    tr.close()
finally:
    shutil.rmtree(d, ignore_errors=True)
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": s, "cpu_s": ru.ru_utime + ru.ru_stime - cpu0, "rows": n, "requests": r.dirty_requests,
                  "rss_mib": ru.ru_maxrss / 1024}))
"""

_WHERE = "import pdtrace.analysis as a, pathlib; print(pathlib.Path(a.__file__).resolve().parent.parent)"


def _tree(python: str) -> str:
    """'<tree> @ <git rev>' of the pdtrace that ``python`` imports."""
    tree = subprocess.run([python, "-c", _WHERE], capture_output=True, text=True, check=True).stdout.strip()
    rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"{tree} @ {rev.stdout.strip() or '?'}{' (modified)' if dirty else ''}"


def _build(python: str, store: Path, memory_limit: str | None) -> dict:
    out = subprocess.run([python, "-c", _CHILD, str(store), memory_limit or ""],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cold build with {python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--python-a", required=True, help="interpreter of the baseline checkout")
    ap.add_argument("--python-b", default=sys.executable, help="interpreter of the checkout measured (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-limit", default=None, help="DuckDB memory_limit of each build, e.g. 6GB")
    a = ap.parse_args()
    print(f"A: {_tree(a.python_a)}")
    print(f"B: {_tree(a.python_b)}")
    ratios, cpu_ratios = [], []
    for i in range(a.rounds):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        res = {k: _build(a.python_a if k == "A" else a.python_b, a.store, a.memory_limit) for k in order}
        if res["A"]["rows"] != res["B"]["rows"]:
            print(f"  note: ttft_breakdown rows differ: A {res['A']['rows']:,}, B {res['B']['rows']:,}")
        ratios.append(res["B"]["s"] / res["A"]["s"])
        cpu_ratios.append(res["B"]["cpu_s"] / res["A"]["cpu_s"])
        print(f"round {i + 1}/{a.rounds} ({' then '.join(order)}): A {res['A']['s']:.1f} s "
              f"({res['A']['cpu_s']:.1f} s CPU, {res['A']['rss_mib']:.0f} MiB), B {res['B']['s']:.1f} s "
              f"({res['B']['cpu_s']:.1f} s CPU, {res['B']['rss_mib']:.0f} MiB), "
              f"B/A {ratios[-1]:.3f} wall, {cpu_ratios[-1]:.3f} CPU", flush=True)
    print(f"cold build B/A: median {statistics.median(ratios):.3f} over {len(ratios)} rounds "
          f"(per-round {min(ratios):.3f}-{max(ratios):.3f}); a regression above 10 % is a median above 1.100")
    print(f"cold build B/A process CPU time (user + sys, every thread): median {statistics.median(cpu_ratios):.3f} "
          f"(per-round {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")


if __name__ == "__main__":
    main()
