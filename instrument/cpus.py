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

The environment pins too: vLLM's CPU executor gives each worker process
OpenMP binding variables for its cores (``GOMP_CPU_AFFINITY``, or
``KMP_AFFINITY``, ``OMP_PLACES``/``OMP_PROC_BIND``; ``vllm/utils/
ompmultiprocessing.py``) and preloads the OpenMP runtime (``LD_PRELOAD`` of
torch's ``libgomp``). A child inheriting both has its main thread bound by
the runtime as it loads, before any Python runs (seen in the lab: each
worker's sink on that worker's core). The sink needs no OpenMP, so it is
started without those variables (:func:`helper_env`).

So the writer sets its own affinity when it starts, before it starts the
sink (which inherits it): the CPUs of ``PDTRACE_HELPER_CPUS`` if set (Linux
cpulist syntax, e.g. ``2-3,6``: housekeeping cores an operator keeps free of
engine threads), else every CPU the kernel allows the process (the kernel
drops CPUs outside the cgroup's cpuset from the mask it is given). The
process's own affinity cannot stand for the operator's intent: an engine
worker is already bound when pdtrace loads (libgomp binds the main thread as
the process starts). So a deployment that confines engines with ``taskset``
rather than a cgroup cpuset should set ``PDTRACE_HELPER_CPUS`` to the CPUs
the helpers may use. On systems without ``os.sched_setaffinity`` nothing
changes.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("pdtrace")


#: OpenMP variables that bind threads to CPUs (GNU libgomp, Intel libiomp, OpenMP 4 standard); dropped
#: from the sink's environment.
OMP_BINDING_VARS = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")


def helper_env(env) -> dict[str, str]:
    """A copy of ``env`` for pdtrace's sink: without :data:`OMP_BINDING_VARS` (and without ``PDTRACE_DIR``,
    so the sink is not traced itself)."""
    return {k: v for k, v in env.items() if k not in OMP_BINDING_VARS and k != "PDTRACE_DIR"}


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
