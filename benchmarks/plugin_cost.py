"""Cost of pdtrace's vLLM plugin with ``PDTRACE_DIR`` unset: per process start and per engine step.

    .venv/bin/python benchmarks/plugin_cost.py [--runs 30]

Per process start: vLLM's ``load_general_plugins`` loads every entry point of
``vllm.general_plugins`` and calls it, once per process (API server,
EngineCore, each worker). This runs that step for pdtrace's entry point alone
in ``--runs`` fresh interpreters (no ``PDTRACE_*`` variable set) and prints
the median and p90 of

- ``load``: ``EntryPoint.load()`` (imports ``pdtrace.connector.plugin`` and
  its package; the entry-point lookup itself is vLLM's, done with or without
  pdtrace, and not counted),
- ``call``: the ``register()`` call (imports ``pdtrace.instrument.config``
  the first time, then one environment lookup),
- ``call again``: a second call (the cost of the check alone),

all in µs (``time.perf_counter_ns``). The interpreters first import the
stdlib modules pdtrace's config module uses (``dataclasses``, ``logging``,
``math``), which every vLLM process has loaded before it loads plugins.

Per engine step: the plugin installs nothing when the variable is unset, so
no pdtrace code is on the step path; the figure printed is what proves it, read
in the same interpreters after the call: vLLM's connector registry unchanged
(every entry the same loader object), the pdtrace modules loaded (the plugin
and the config check only: no recorder, no fork hook), the process's threads
(no ``pdtrace-writer``) and child processes (no sink). Needs vLLM installed
(the registry check imports its connector factory, outside the timed part).

What one round hides: the first interpreter on a cold page cache pays the
disk reads of the modules (excluded by the median); ``load`` includes
``importlib`` finding ``pdtrace`` on ``sys.path``, which grows with the
number of path entries (an editable install adds one finder).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from pdtrace.connector.lab import replay  # its percentile rule, shared by the benchmarks (this parent is not measured)

CHILD = r"""
import json, os, sys, threading, time
import dataclasses, logging, math  # stdlib modules vLLM has imported long before it loads plugins
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "pdtrace"]
t0 = time.perf_counter_ns(); fn = ep.load(); t1 = time.perf_counter_ns()
fn(); t2 = time.perf_counter_ns()
fn(); t3 = time.perf_counter_ns()
mods = sorted(m for m in sys.modules if m.startswith("pdtrace"))
threads = sorted(t.name for t in threading.enumerate())
children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
reg_same = None
if os.environ.get("CHECK_REGISTRY") == "1":
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
    before = dict(F._registry)
    fn()
    reg_same = all(F._registry[k] is v for k, v in before.items()) and F._registry.keys() == before.keys()
    nixl = F.get_connector_class_by_name("NixlConnector").__module__
else:
    nixl = None
print(json.dumps({"load": t1 - t0, "call": t2 - t1, "again": t3 - t2, "mods": mods, "threads": threads,
                  "children": children, "registry_unchanged": reg_same, "nixl_module": nixl}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30, help="fresh interpreters to time (default 30)")
    a = ap.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDTRACE_")}
    rows = []
    for i in range(a.runs):
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120,
                           check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    env["CHECK_REGISTRY"] = "1"
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    chk = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    print(f"pdtrace vLLM plugin, PDTRACE_DIR unset, {a.runs} fresh interpreters ({sys.executable})")
    print("per process start (us)      median      p90")
    for k, label in (("load", "EntryPoint.load()"), ("call", "register() first call"),
                     ("again", "register() again")):
        xs = [x[k] / 1e3 for x in rows]
        print(f"  {label:24s} {statistics.median(xs):9.1f} {replay._pct(xs, 0.9):9.1f}")
    tot = [(x["load"] + x["call"]) / 1e3 for x in rows]
    print(f"  {'total (load + call)':24s} {statistics.median(tot):9.1f} {replay._pct(tot, 0.9):9.1f}")
    last = rows[-1]
    print("per engine step: 0 (nothing of pdtrace is installed on the step path):")
    print(f"  pdtrace modules loaded: {last['mods']}")
    print(f"  threads: {last['threads']}; child processes: {last['children'] or 'none'}")
    if chk is not None:
        print(f"  vLLM connector registry unchanged: {chk['registry_unchanged']} "
              f"(NixlConnector from {chk['nixl_module']})")
    else:
        print("  vLLM connector registry: not checked (vLLM not importable here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
