"""The CPUs pdtrace's background work runs on: the ``pdtrace-writer`` thread and its sink process.

A new thread, and a process it starts, inherit the CPU affinity of the thread
that creates them. Engines pin their hot threads: vLLM's CPU worker binds its
OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND``, and its NIXL worker moves the
thread that runs every forward pass to one core per NUMA node
(``os.sched_setaffinity`` in ``NixlBaseConnectorWorker.__init__``, vLLM 0.32).
A writer thread started from that thread, and the sink the writer starts,
would then share that one core with the forward pass while other cores wait
(seen in the lab: every thread of P's worker process, and its sink, allowed
only core 0, where P's forward thread runs).

So the writer sets its own affinity when it starts, before it starts the
sink (which inherits it): the CPUs of ``PDTRACE_HELPER_CPUS`` if set (Linux
cpulist syntax, e.g. ``2-3,6``: housekeeping cores an operator keeps free of
engine threads), else every CPU the kernel allows the process (the kernel
drops CPUs outside the cgroup's cpuset from the mask it is given). On systems
without ``os.sched_setaffinity`` nothing changes.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("pdtrace")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """CPU ids of a Linux cpulist (``"0-3,6"`` -> ``(0, 1, 2, 3, 6)``), sorted, each once.

    Raises ValueError on an empty list, a negative id, a malformed item or a range whose end is
    below its start.
    """
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {item!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no CPUs listed")
    return tuple(sorted(cpus))


def unpin_current_thread(helper_cpus: tuple[int, ...] | None) -> frozenset[int] | None:
    """Set the calling thread's CPU affinity to ``helper_cpus``, or to every CPU if None.

    Returns the affinity the kernel applied (a subset of the request: CPUs that are offline or
    outside the cgroup's cpuset are dropped), or None when the platform has no affinity calls or
    the kernel refused the mask (one warning; the thread keeps the affinity it had). Never raises.
    """
    setter = getattr(os, "sched_setaffinity", None)
    if setter is None:
        return None
    want = helper_cpus if helper_cpus is not None else range(os.cpu_count() or 1)
    try:
        setter(0, want)  # pid 0: the calling thread only (Linux affinity is per thread)
        return frozenset(os.sched_getaffinity(0))
    except (OSError, ValueError, OverflowError) as exc:
        log.warning("pdtrace: cannot move the writer to CPUs %s (%s: %s); it keeps the CPUs it inherited",
                    list(want), type(exc).__name__, exc)
        return None
