"""Time every statement of one cold build of a store, per materialization and per batch.

    python benchmarks/cold_profile.py /tmp/pdtrace-bench/store --memory-limit 6GB [--json OUT]

Runs the cold build ``cold_ab.py`` measures (fresh cache file, ``Trace.refresh``,
then ``ttft_breakdown`` and the four summaries) with the pdtrace that this
interpreter imports (run it with another checkout's interpreter to profile
that checkout), through a proxy on the analysis connection that times each
statement: wall seconds (``time.perf_counter``) and process CPU seconds (user +
sys of every thread, ``resource.getrusage``). A statement is named by the
table it fills (``INSERT INTO _mat_X ...`` -> ``_mat_X``) or by its first 60
characters. A cold build of more than ``Trace.batch_requests`` requests runs
in batches (``Trace._materialize_in_batches``); the statements of each batch
are counted apart, so a step whose time per batch grows with the batch number
(it reads more than its batch) shows as a rising row.

Prints the steps by total wall time: total wall and CPU seconds, then the
wall seconds of each batch (``-`` outside batches); ``--json`` writes every
step's figures as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from pdtrace.analysis import db

_TARGET = re.compile(r"^\s*INSERT\s+(?:OR\s+REPLACE\s+)?INTO\s+(\w+)", re.IGNORECASE)
_BATCH = "INSERT INTO _scope_keys SELECT rkey FROM _scope_batch WHERE b = ?"


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class TimingConnection:
    """A stand-in for a DuckDB connection that times each ``execute``/``executemany``.

    ``steps[name][batch]`` = [wall s, CPU s, calls]; ``batch`` is -1 outside a
    batch of :meth:`Trace._materialize_in_batches`, else the batch number.
    """

    def __init__(self, con):
        self._con = con
        self.batch = -1
        self.steps: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0]))

    def _timed(self, fn, sql, *args):
        if sql.strip() == _BATCH:
            self.batch = args[0][0] if args else self.batch
        m = _TARGET.match(sql)
        name = m.group(1) if m else " ".join(sql.split())[:60]
        w, c = time.perf_counter(), _cpu()
        try:
            return fn(sql, *args)
        finally:
            s = self.steps[name][self.batch]
            s[0] += time.perf_counter() - w
            s[1] += _cpu() - c
            s[2] += 1

    def execute(self, sql, *args):
        return self._timed(self._con.execute, sql, *args)

    def executemany(self, sql, *args):
        return self._timed(self._con.executemany, sql, *args)

    def __getattr__(self, name):
        return getattr(self._con, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--memory-limit", default=None, help="DuckDB memory_limit, e.g. 6GB")
    ap.add_argument("--json", type=Path, default=None, help="write the per-step figures here")
    ap.add_argument("--top", type=int, default=40, help="steps to print")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="pdtrace-coldprof-"))
    # its own cache root: the cold build loads the SQL library (no library template from an earlier run)
    os.environ["PDTRACE_CACHE_DIR"] = str(d)
    try:
        w0, c0 = time.perf_counter(), _cpu()
        tr = db.Trace(a.store, cache=d / "cache.duckdb")
        if a.memory_limit:
            tr.con.execute(f"SET memory_limit = '{a.memory_limit}'")
        proxy = TimingConnection(tr.con)
        tr.con = proxy
        tr.refresh()
        proxy.batch = -1
        n = proxy.execute("SELECT count(*) FROM ttft_breakdown").fetchone()[0]
        for v in ("summary_by_mode", "summary_by_prompt_bucket", "summary_by_uncached_bucket", "summary_by_window"):
            proxy.execute(f"SELECT * FROM {v}").fetchall()
        wall, cpu = time.perf_counter() - w0, _cpu() - c0
        tr.con = proxy._con
        tr.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    steps = proxy.steps
    batches = sorted({b for s in steps.values() for b in s if b >= 0})
    rows = sorted(steps.items(), key=lambda kv: -sum(v[0] for v in kv[1].values()))
    print(f"pdtrace: {Path(db.__file__).resolve().parent.parent}; cold build {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU; ttft_breakdown {n:,} rows; {len(batches)} batches")
    print(f"{'step':<44} {'wall':>7} {'cpu':>7}  " + " ".join(f"b{b:<5}" for b in batches))
    for name, per in rows[:a.top]:
        tw, tc = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
        cells = " ".join(f"{per[b][0]:6.2f}" if b in per else f"{'-':>6}" for b in batches)
        print(f"{name[:44]:<44} {tw:7.2f} {tc:7.2f}  {cells}")
    if a.json:
        a.json.write_text(json.dumps({"wall": wall, "cpu": cpu, "rows": n, "steps": {
            k: {str(b): v for b, v in per.items()} for k, per in steps.items()}}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
