"""End-to-end time of ``pdtrace report`` on a small store: first run on a machine, cold, warm, in memory.

    python benchmarks/small_cold.py [--requests 20 --requests 1000] [--rounds 5]

Generates each store with ``analysis_gen.py`` (the synthetic store of the
analysis benchmarks; ``--store DIR`` to use a real one instead), then runs
``pdtrace report DIR`` as a new process (interpreter start, imports, opening,
refresh, the report's queries and printing: what a user waits for), in rounds
that interleave four situations so drift in the machine's load falls on all:

- *first*: an empty ``PDTRACE_CACHE_DIR``: the SQL library is loaded into a new
  file (the library template, ``pdtrace.analysis.cache.library_template``) before
  the trace's cache is made from it;
- *cold*: the template exists, the trace has no cache yet (every new trace
  directory, every incident on a machine that ran pdtrace once);
- *warm*: the trace's cache exists and nothing changed;
- *memory*: ``pdtrace report --no-cache`` with the template present (an in-memory
  database, filled from the template as a cache file is; what tests and one-off
  looks run).

Prints the median and min-max wall seconds per store and situation, and the
issue-21 goal: cold report of a store of <= 1,000 requests in <= 1 s.

``--phases`` adds, per store, where a cold report's time goes (medians over the
rounds, each a new process with the template present and no cache): interpreter
start (the process's wall time minus the rest), imports, open (the cache file
copied from the template), refresh, read-only reopen, queries (``report.collect``
and the text) -- the same steps as ``pdtrace report``, timed one by one.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 1.0
_HERE = Path(__file__).resolve().parent


def _pdtrace() -> list[str]:
    return [sys.executable, "-m", "pdtrace.cli.main"]


def _timed_report(store: Path, cache_dir: Path, *options: str) -> float:
    env = dict(os.environ, PDTRACE_CACHE_DIR=str(cache_dir))
    t = time.perf_counter()
    out = subprocess.run(_pdtrace() + ["report", *options, str(store)], env=env, capture_output=True, text=True)
    s = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"pdtrace report {store} failed:\n{out.stderr[-2000:]}")
    return s


#: A cold ``pdtrace report`` split into its steps (pdtrace.analysis.session.open and cli.report, step by
#: step); prints "phase seconds" lines.
_PHASES = r"""
import sys, time
t = [time.perf_counter()]
import pdtrace.analysis.cli
from pdtrace.analysis import report, session
t.append(time.perf_counter())
s = session.Session(sys.argv[1])
s._connect()
t.append(time.perf_counter())
s._trace.refresh(warn=False)
t.append(time.perf_counter())
s._sandbox()
t.append(time.perf_counter())
report.render(report.collect(s.cursor()), sys.argv[1])
t.append(time.perf_counter())
s.close()
for name, a, b in zip(["imports", "open", "refresh", "reopen", "queries"], t, t[1:]):
    print(name, b - a)
"""


def _phases(store: Path, cache_dir: Path) -> dict[str, float]:
    """{phase: seconds} of one cold report of ``store`` (the library template in ``cache_dir`` exists)."""
    for p in _caches(cache_dir):
        p.unlink()
    env = dict(os.environ, PDTRACE_CACHE_DIR=str(cache_dir))
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PHASES, str(store)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"phase split of {store} failed:\n{out.stderr[-2000:]}")
    res = {name: float(v) for name, v in (line.split() for line in out.stdout.splitlines())}
    return {"start": wall - sum(res.values()), **res, "total": wall}


def _caches(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.glob("pdtrace-*.duckdb*") if not p.name.startswith("pdtrace-library-")]


def measure(store: Path, rounds: int, work: Path, phases: bool = False) -> dict[str, list[float]]:
    """{situation: [seconds per round]} for ``store``; with ``phases``, also {"phase <name>": [seconds]}
    of a cold report split into steps (:func:`_phases`), one per round."""
    res: dict[str, list[float]] = {"first": [], "cold": [], "warm": [], "memory": []}
    for _ in range(rounds):
        fresh = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
        res["first"].append(_timed_report(store, fresh))      # builds the template, then the trace's cache
        for p in _caches(fresh):
            p.unlink()
        res["cold"].append(_timed_report(store, fresh))       # template present, no cache for the trace
        res["warm"].append(_timed_report(store, fresh))       # the trace's cache exists
        res["memory"].append(_timed_report(store, fresh, "--no-cache"))  # in memory, template present
        if phases:
            for k, v in _phases(store, fresh).items():
                res.setdefault(f"phase {k}", []).append(v)
        shutil.rmtree(fresh, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, action="append", help="store sizes to generate (default 20 and 1000)")
    ap.add_argument("--store", type=Path, action="append", help="a store directory to measure instead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phases", action="store_true", help="also split a cold report into its steps")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdtrace-small-cold-"))
    try:
        stores: list[tuple[str, Path]] = [(str(p), p) for p in (args.store or [])]
        for n in args.requests or ([] if args.store else [20, 1000]):
            d = work / f"store-{n}"
            subprocess.run([sys.executable, str(_HERE / "analysis_gen.py"), str(d), "--requests", str(n),
                            "--chunks", "2", "--tail", "1"], check=True, capture_output=True)
            stores.append((f"{n} requests (analysis_gen.py)", d))
        print(f"pdtrace report, end to end (process start included), {args.rounds} rounds; load "
              f"{os.getloadavg()[0]:.1f}")
        for label, d in stores:
            res = measure(d, args.rounds, work, args.phases)
            cells = [f"{k} {statistics.median(v):.2f} s ({min(v):.2f}-{max(v):.2f})" for k, v in res.items()
                     if not k.startswith("phase ")]
            cold = statistics.median(res["cold"])
            print(f"{label}: " + ", ".join(cells)
                  + f"; goal cold <= {GOAL_S:.0f} s: {'met' if cold <= GOAL_S else 'missed'}")
            if args.phases:
                print("  cold, step by step (median, min-max): " + ", ".join(
                    f"{k[6:]} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                    for k, v in res.items() if k.startswith("phase ")))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
