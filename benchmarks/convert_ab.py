"""The sink's conversion (``Converter.table`` / ``table_joint``): this tree's code against another git ref's, paired.

Both versions of ``instrument/convert.py`` are loaded in one process (the other one from
``git show REF:instrument/convert.py``, as a module of this package, so it shares the schema and
allowlist) and convert the same record batches, alternating old/new every round. Batches: 8 call
sites of the connectors' shapes (kv.transfer, handoff.*, step spans, events) in turn; sizes 1, 10,
100, 500 and 4,096 records through ``table`` (one process) and 4 x 1,024 records of 4 processes
through ``table_joint``. Cost = this thread's CPU time (``time.thread_time_ns``) per call, median
over rounds; the figure to read is the ratio new / old of the medians of the same run (the
machine's load moves both alike). Prints one line per batch: old ms, new ms, ratio.

Run:  .venv/bin/python benchmarks/convert_ab.py [--before main] [--rounds 200] [--aa]
      (--aa: this tree's code on both sides, the method's noise floor)
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import time

from pdtrace.instrument import convert as new_convert

ROOT = pathlib.Path(__file__).resolve().parent.parent

RES = {"service_name": "pdtrace-decode", "role": "decode", "engine_id": "d0", "host": "h", "pid": 1, "tp_rank": 0}

#: (name, attributes) of 8 call sites, in the shapes the traced connectors record.
SITES = [
    ("kv.transfer", {"kv.op": "READ", "kv.bytes": 1 << 20, "kv.descriptors": 64, "kv.post_ns": 12000,
                     "kv.xfer_ns": 900000, "kv.backend": "UCX", "request.internal_id": "cmpl-X-0-0123abcd",
                     "request.mode": "pull"}),
    ("handoff.step_wait", {}),
    ("handoff.descriptors", {"kv.descriptors": 64}),
    ("handoff.prep", {"request.internal_id": "cmpl-X-0-0123abcd", "request.mode": "pull", "kv.op": "READ",
                      "kv.first_contact": 0}),
    ("decode.step", {"step.id": 7, "step.num_reqs": 4, "step.prefill_tokens": 0, "step.decode_tokens": 4,
                     "step.recompute_tokens": 0, "step.batch": "a:d1;b:d1;c:d1;d:d1"}),
    ("prefill.compute", {"step.id": 7, "step.chunk_index": 0, "step.tokens": 256,
                         "request.internal_id": "cmpl-X-0-0123abcd"}),
    ("notification.received", {"kv.notif_kind": "read_done", "request.internal_id": "cmpl-X-0-0123abcd"}),
    ("token", {"request.internal_id": "cmpl-X-0-0123abcd"}),
]


def records(n: int, base: int = 0) -> list[tuple]:
    """``n`` records in recorder.py's layout, the call sites in turn, 1,000 request ids."""
    out = []
    for i in range(base, base + n):
        name, a = SITES[i % len(SITES)]
        rid = None if name == "decode.step" else f"r{i % 1000}"
        out.append((1 if name in ("notification.received", "token") else 0, i, i, None, name, 1,
                    1000 + i, 2000 + i, 0, None, rid, 0, 0, None, "MainThread", *a, *a.values()))
    return out


def load_before(ref: str | None):
    """The ``instrument/convert.py`` of git ref ``ref`` (None: this tree's file, a second copy) as a module."""
    if ref is None:
        src = (ROOT / "instrument" / "convert.py").read_text()
    else:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:instrument/convert.py"], check=True,
                             capture_output=True, text=True).stdout
    name = "pdtrace.instrument._convert_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "pdtrace.instrument"
    sys.modules[name] = mod
    exec(compile(src, f"{ref}:instrument/convert.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git ref of the old convert.py (default main)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--aa", action="store_true", help="noise floor: this tree's code on both sides")
    args = ap.parse_args()
    old_convert = load_before(None if args.aa else args.before)
    cases = [(f"table {n}", "table", records(n)) for n in (1, 10, 100, 500, 4096)]
    segs = [(records(1024, k * 1024), dict(RES, pid=k + 1), 10 * k, None) for k in range(4)]
    cases.append(("table_joint 4x1024", "joint", segs))
    print(f"convert_ab: before={'this tree (A/A)' if args.aa else args.before} rounds={args.rounds} (thread CPU per call, median)")
    print(f"{'batch':<20} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for label, how, data in cases:
        convs = {"old": old_convert.Converter(), "new": new_convert.Converter()}

        def call(c):
            return c.table(data, RES, 5) if how == "table" else c.table_joint(data)

        # the same result, and one warm-up call each (resource and trace-id caches)
        a, b = call(convs["old"]), call(convs["new"])
        ta, tb = (a if how == "table" else a[0]), (b if how == "table" else b[0])
        assert ta.equals(tb), label
        times = {"old": [], "new": []}
        gc.disable()
        try:
            for r in range(args.rounds):
                for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    t0 = time.thread_time_ns()
                    call(convs[k])
                    times[k].append(time.thread_time_ns() - t0)
        finally:
            gc.enable()
        mo, mn = statistics.median(times["old"]) / 1e6, statistics.median(times["new"]) / 1e6
        print(f"{label:<20} {mo:9.3f} {mn:9.3f} {mn / mo:8.3f}")


if __name__ == "__main__":
    main()
