"""Per-step CPU of the traced scheduler's hooks, warm and with cold caches, and what the self-measurement charges.

The EngineCore thread runs two pdtrace hooks per engine step (``build_connector_meta`` and
``update_connector_output`` of :class:`pdtrace.connector.traced.scheduler.TracedSchedulerMixin`).
This calls them as vLLM does (the hooks' ``super()`` is a stand-in for vLLM's NIXL scheduler that
returns a fresh metadata object and does nothing else), in one process, for an idle step (nothing
scheduled: P stepping while D reads its held blocks), a decode step of one request, and a decode
step of ``--batch`` requests, each:

- ``true``: hooks with ``PDTRACE_SELF_CPU`` off, minus the same loop calling only the stand-in
  (thread CPU clock over ``--steps`` steps), per step;
- ``charged``: with ``PDTRACE_SELF_CPU=1``, what :mod:`pdtrace.instrument.selfcpu` charges pdtrace
  per step (its counter, one calibrated clock read per hook taken out), and ``raw``, the same
  without that correction (the windows as read);
- ``cold``: with ``--cold MIB`` > 0, caches are evicted before each hook (a copy of a MIB-sized
  buffer and some unrelated Python allocation: in the engine the forward pass, other threads and
  other processes run between two hooks), and each hook call is timed on the monotonic clock
  (``time.perf_counter_ns``, vDSO: no system call); ``cold`` is the median per step of the two
  calls minus the median of the stand-in's calls timed the same way (self-measurement off), and
  ``cold charged`` what the self-measurement charges per step under the same eviction;
- ``read``: the calibrated cost of one thread-CPU clock read on this machine.

``--before REF`` runs the same figures for the code at git revision REF (a temporary git worktree
on ``PYTHONPATH``) in child processes, alternating with the working tree round by round (the
machine is noisy: compare within one run), and prints both with the ratio after/before.

The scheduler is the traced pull scheduler built without vLLM's ``__init__`` (only the attributes
the hooks read), its outputs plain objects with the fields of vLLM's ``KVConnectorOutput``; the
recorder is real (a temporary ``PDTRACE_DIR``) and its writer runs. Medians over ``--rounds``.

Run:  .venv/bin/python benchmarks/step_hook_cost.py [--steps 20000] [--rounds 7] [--batch 8] [--cold 4]
      .venv/bin/python benchmarks/step_hook_cost.py --steps 10000 --rounds 5 --cold 4 --before HEAD~3
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

_PKGS = ("analysis", "cli", "connector", "dashboard", "instrument")


class _VllmStandIn:
    """What the hooks' ``super()`` calls return: a fresh metadata object with the field the
    scheduler hook reads (``reqs_to_recv``, empty), and nothing for the output update."""

    def build_connector_meta(self, scheduler_output):
        return types.SimpleNamespace(reqs_to_recv={})

    def update_connector_output(self, connector_output):
        return None


def _scheduler(batch: int):
    """(scheduler, num_scheduled_tokens): ``batch`` requests decoding one token each (0: idle)."""
    from pdtrace.connector.traced.pull import TracedNixlPullConnectorScheduler as P
    from pdtrace.connector.traced.scheduler import SReq, TracedSchedulerMixin

    cls = type("BenchScheduler", (TracedSchedulerMixin, _VllmStandIn), {"_pdt_mode": "pull"})
    s = object.__new__(cls)
    assert issubclass(P, TracedSchedulerMixin)
    s._pdt_role, s._pdt_step_name, s._pdt_mode, s._pdt_tp = "decode", "decode.step", "pull", 1
    s._pdt_reqs, s._pdt_pending, s._pdt_step_id = {}, collections.deque(), 0
    s._pdt_holds, s._pdt_expired, s._pdt_idle, s._pdt_cpu_mark = {}, set(), 0, None
    sched = {}
    for i in range(batch):
        rid = f"cmpl-B{i}-0-0123abcd"
        req = types.SimpleNamespace(request_id=rid, num_prompt_tokens=64, num_computed_tokens=64 + i,
                                    num_output_tokens=i, arrival_time=None)
        st = s._pdt_reqs[rid] = SReq(req, "decode")
        st.promoted = st.prefill_done = True
        st.first_step_sid = 0
        sched[rid] = 1
    return s, sched


def _output(step: int):
    from pdtrace.connector.traced.messages import StepReport

    return types.SimpleNamespace(kv_connector_worker_meta=StepReport(step), finished_recving=None,
                                 finished_sending=None, failed_recving=None)


def _loop(s, sched, n: int, hooks: bool) -> int:
    """Thread CPU (ns) of ``n`` steps, with the two hooks or only the stand-in's methods."""
    so = types.SimpleNamespace(num_scheduled_tokens=sched, preempted_req_ids=set())
    base = _VllmStandIn
    t0 = time.thread_time_ns()
    if hooks:
        for i in range(n):
            meta = s.build_connector_meta(so)
            out = _output(meta._pdtrace.step)
            s.update_connector_output(out)
    else:
        for i in range(n):
            base.build_connector_meta(s, so)
            out = _output(i)
            base.update_connector_output(s, out)
    return time.thread_time_ns() - t0


class _Evictor:
    """Evicts caches (a copy of ``mib`` MiB and some unrelated Python allocation) before a timed call."""

    def __init__(self, mib: int):
        self.buf = bytearray(mib << 20)

    def __call__(self) -> None:
        bytes(self.buf)
        d = {}
        for i in range(300):
            d[str(i)] = [i] * 3


def _cold(s, sched, n: int, mib: int, hooks: bool) -> list[int]:
    """Per step, the wall ns (perf_counter) of the two calls, caches evicted before each."""
    so = types.SimpleNamespace(num_scheduled_tokens=sched, preempted_req_ids=set())
    evict = _Evictor(mib)
    pc = time.perf_counter_ns
    base = _VllmStandIn
    out = []
    for i in range(n):
        evict()
        w0 = pc()
        meta = s.build_connector_meta(so) if hooks else base.build_connector_meta(s, so)
        w1 = pc()
        o = _output(meta._pdtrace.step if hooks else i)
        evict()
        w2 = pc()
        if hooks:
            s.update_connector_output(o)
        else:
            base.update_connector_output(s, o)
        w3 = pc()
        out.append(w1 - w0 + w3 - w2)
    return out


def measure(batch: int, steps: int, rounds: int, cold_mib: int = 0) -> dict:
    """{'true_ns', 'charged_ns', 'raw_ns', 'read_ns'[, 'cold_ns', 'cold_charged_ns']} per step (medians)."""
    from pdtrace.instrument import config, selfcpu

    s, sched = _scheduler(batch)
    true, charged, raw, cold, cold_ch = [], [], [], [], []
    off, on = config.from_env({}), config.from_env({"PDTRACE_SELF_CPU": "1"})
    cold_n = max(50, steps // 20)
    for _ in range(rounds):
        selfcpu.configure(off)
        a = _loop(s, sched, steps, True)
        b = _loop(s, sched, steps, False)
        true.append((a - b) / steps)
        selfcpu.configure(on)
        selfcpu.reset()
        _loop(s, sched, steps, True)
        pd = selfcpu.thread_pair()[0]
        charged.append(pd / steps)
        raw.append((pd + 2 * steps * selfcpu.read_cost_ns()) / steps)  # two hooks per step
        if cold_mib:
            selfcpu.configure(off)
            cold.append(statistics.median(_cold(s, sched, cold_n, cold_mib, True))
                        - statistics.median(_cold(s, sched, cold_n, cold_mib, False)))
            selfcpu.configure(on)
            selfcpu.reset()
            _cold(s, sched, cold_n, cold_mib, True)
            cold_ch.append(selfcpu.thread_pair()[0] / cold_n)
    selfcpu.configure(off)
    r = {"true_ns": statistics.median(true), "charged_ns": statistics.median(charged),
         "raw_ns": statistics.median(raw), "read_ns": selfcpu.read_cost_ns()}
    if cold_mib:
        r["cold_ns"] = statistics.median(cold)
        r["cold_charged_ns"] = statistics.median(cold_ch)
    return r


def _shapes(batch: int) -> list[tuple[str, int]]:
    return [("idle (nothing sched.)", 0), ("decode, batch 1", 1), (f"decode, batch {batch}", batch)]


def _child(a) -> dict:
    """All shapes' figures in this process (the code on sys.path)."""
    own = None
    if not os.environ.get("PDTRACE_DIR"):  # a store of our own, removed at the end
        own = os.environ["PDTRACE_DIR"] = tempfile.mkdtemp(prefix="pdtrace-stephook-")
    from pdtrace.instrument import activate, tracer

    try:
        if not activate("explicit", role="decode"):
            raise SystemExit("tracing did not start (PDTRACE_DIR)")
        try:
            return {name: measure(b, a.steps, a.rounds, a.cold) for name, b in _shapes(a.batch)}
        finally:
            tracer.shutdown()
    finally:
        if own:
            shutil.rmtree(own, ignore_errors=True)


def _print(figs: dict, cold: bool, title: str = "") -> None:
    if title:
        print(title)
    head = f"{'step':<22} {'true µs':>8} {'charged µs':>11} {'raw µs':>7}"
    if cold:
        head += f" {'cold µs':>8} {'cold charged µs':>16}"
    print(head + "   (per step; 2 hooks)")
    for name, m in figs.items():
        line = f"{name:<22} {m['true_ns'] / 1e3:>8.2f} {m['charged_ns'] / 1e3:>11.2f} {m['raw_ns'] / 1e3:>7.2f}"
        if cold:
            line += f" {m['cold_ns'] / 1e3:>8.2f} {m['cold_charged_ns'] / 1e3:>16.2f}"
        print(line)
    m = next(iter(figs.values()))
    print(f"one thread-CPU clock read: {m['read_ns'] / 1e3:.2f} µs (calibrated)")


def _worktree(ref: str) -> tuple[str, str]:
    """(worktree dir, PYTHONPATH dir whose ``pdtrace`` package is that worktree) for git revision ``ref``."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="pdtrace-before-")
    wt = os.path.join(tmp, "tree")
    try:
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", wt, ref], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shim = os.path.join(tmp, "path", "pdtrace")
        os.makedirs(shim)
        for p in _PKGS:
            os.symlink(os.path.join(wt, p), os.path.join(shim, p))
    except BaseException:  # leave neither a registered worktree nor the directory behind
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", wt], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return wt, os.path.dirname(shim)


def _run_child(a, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(a.steps), "--rounds", "1",
           "--batch", str(a.batch), "--cold", str(a.cold)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8, help="decoding requests in the busy step")
    ap.add_argument("--cold", type=int, default=0, metavar="MIB",
                    help="also time the hooks with caches evicted by a MIB-sized copy before each (0: not)")
    ap.add_argument("--before", metavar="REF", help="also run git revision REF's code, alternating rounds")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a)))
        return 0
    if not a.before:
        _print(_child(a), bool(a.cold))
        return 0
    runs = {"before": [], "after": []}
    wt = None
    try:
        wt, path = _worktree(a.before)
        for _ in range(a.rounds):  # one round each, alternating, each in a fresh process
            runs["before"].append(_run_child(a, path))
            runs["after"].append(_run_child(a, None))
    finally:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if wt is not None:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", wt], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            shutil.rmtree(os.path.dirname(wt), ignore_errors=True)  # the mkdtemp dir holding tree/ and path/
    med = {}
    for k, rs in runs.items():
        med[k] = {name: {f: statistics.median(r[name][f] for r in rs) for f in rs[0][name]} for name in rs[0]}
    _print(med["before"], bool(a.cold), f"before: {a.before} (medians of {a.rounds} alternating rounds)")
    _print(med["after"], bool(a.cold), "after: the working tree")
    print("after / before:")
    for name in med["after"]:
        fs = [f for f in ("true_ns", "charged_ns", "cold_ns", "cold_charged_ns") if f in med["after"][name]]
        print(f"  {name:<22} " + "  ".join(f"{f[:-3]} {med['after'][name][f] / med['before'][name][f]:.2f}"
                                          for f in fs if med["before"][name][f] > 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
