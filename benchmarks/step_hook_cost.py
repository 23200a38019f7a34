"""Per-step CPU of the traced scheduler's hooks, and what the self-measurement charges for it.

The EngineCore thread runs two pdtrace hooks per engine step (``build_connector_meta`` and
``update_connector_output`` of :class:`pdtrace.connector.traced.scheduler.TracedSchedulerMixin`).
This times them in one process, on the thread CPU clock, for an idle step (nothing scheduled: P
stepping while D reads its held blocks) and for a decode step of ``--batch`` requests, each:

- ``true``: hooks with ``PDTRACE_SELF_CPU`` off, minus the same loop without the hooks (the
  harness: building the step's metadata and output objects), per step;
- ``charged``: with ``PDTRACE_SELF_CPU=1``, what :mod:`pdtrace.instrument.selfcpu` charges pdtrace
  per step (its counter, one calibrated clock read per hook taken out), and ``raw``, the same
  without that correction (the windows as read);
- ``read``: the calibrated cost of one thread-CPU clock read on this machine.

The scheduler is the traced pull scheduler built without vLLM's ``__init__`` (only the attributes
the hooks read), its outputs plain objects with the fields of vLLM's ``KVConnectorOutput``; the
recorder is real (a temporary ``PDTRACE_DIR``) and its writer runs. Medians over ``--rounds``.

Run:  .venv/bin/python benchmarks/step_hook_cost.py [--steps 20000] [--rounds 7] [--batch 8]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
import types


def _scheduler(batch: int):
    from pdtrace.connector.traced.pull import TracedNixlPullConnectorScheduler as S
    from pdtrace.connector.traced.scheduler import SReq

    s = object.__new__(S)
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


def _loop(s, sched, n: int, hooks: bool) -> int:
    """Thread CPU (ns) of ``n`` steps, with or without the two hooks."""
    from pdtrace.connector.traced.safety import safe
    from pdtrace.connector.traced.messages import StepReport
    from pdtrace.instrument import tracer

    so = types.SimpleNamespace(num_scheduled_tokens=sched, preempted_req_ids=set())
    t0 = time.thread_time_ns()
    for i in range(n):
        meta = types.SimpleNamespace(reqs_to_recv={})
        rep = StepReport(i)
        out = types.SimpleNamespace(kv_connector_worker_meta=rep, finished_recving=None, finished_sending=None,
                                    failed_recving=None)
        if hooks:
            safe(s._pdt_step_start, so, meta, tracer.now())
            rep.step = meta._pdtrace.step
            safe(s._pdt_step_end, out, tracer.now())
    return time.thread_time_ns() - t0


def measure(batch: int, steps: int, rounds: int) -> dict:
    """{'true_ns', 'charged_ns', 'raw_ns', 'read_ns'} per step (medians over rounds)."""
    from pdtrace.instrument import config, selfcpu

    s, sched = _scheduler(batch)
    true, charged, raw = [], [], []
    for _ in range(rounds):
        selfcpu.configure(config.from_env({}))
        on = _loop(s, sched, steps, True)
        base = _loop(s, sched, steps, False)
        true.append((on - base) / steps)
        selfcpu.configure(config.from_env({"PDTRACE_SELF_CPU": "1"}))
        selfcpu.reset()
        _loop(s, sched, steps, True)
        pd = selfcpu.thread_pair()[0]
        charged.append(pd / steps)
        raw.append((pd + 2 * steps * selfcpu.read_cost_ns()) / steps)  # two hooks per step
    selfcpu.configure(config.from_env({}))
    return {"true_ns": statistics.median(true), "charged_ns": statistics.median(charged),
            "raw_ns": statistics.median(raw), "read_ns": selfcpu.read_cost_ns()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8, help="decoding requests in the busy step")
    a = ap.parse_args(argv)
    os.environ.setdefault("PDTRACE_DIR", tempfile.mkdtemp(prefix="pdtrace-stephook-"))
    from pdtrace.instrument import activate, tracer

    if not activate("explicit", role="decode"):
        raise SystemExit("tracing did not start (PDTRACE_DIR)")
    print(f"{'step':<22} {'true µs':>8} {'charged µs':>11} {'raw µs':>7}   (per step; 2 hooks)")
    for name, b in (("idle (nothing sched.)", 0), (f"decode, batch {a.batch}", a.batch)):
        m = measure(b, a.steps, a.rounds)
        print(f"{name:<22} {m['true_ns'] / 1e3:>8.2f} {m['charged_ns'] / 1e3:>11.2f} {m['raw_ns'] / 1e3:>7.2f}")
    print(f"one thread-CPU clock read: {m['read_ns'] / 1e3:.2f} µs (calibrated)")
    tracer.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
