"""pdtrace's own CPU time on the traced process's threads (the overhead self-measurement).

Off by default. With ``PDTRACE_SELF_CPU=1`` (see :mod:`.config`) the traced
connectors time every pdtrace hook with the calling thread's CPU clock
(``time.thread_time_ns``, CLOCK_THREAD_CPUTIME_ID: CPU the thread used, not
wall time, so other processes on the machine do not inflate it) and add it to
a per-thread counter. The step spans carry the process total since the
previous step span as ``step.pdtrace_cpu_ns``; the overhead benchmark divides
it by the step's duration (issue 4's goal: ≤ 1 % of a decode step).

Cost when on: two thread-CPU clock reads per hook (≈ 0.2–0.5 µs each here,
a system call); when off: one module-attribute check per hook.

Counters are per thread (no lock on the hot path); :func:`total_ns` sums
them. A thread's cell outlives the thread, so the total never goes down.
"""
from __future__ import annotations

import threading
import time

from . import config as _config

#: True when ``PDTRACE_SELF_CPU=1`` was set at import (re-read by :func:`configure`).
enabled: bool = False

_tls = threading.local()
_cells: list[list[int]] = []
_cells_lock = threading.Lock()
thread_time_ns = time.thread_time_ns


def configure(cfg: _config.Config | None = None) -> None:
    """(Re)read the switch from ``cfg`` (default: the environment)."""
    global enabled
    enabled = bool((cfg or _config.from_env()).self_cpu)


def _cell() -> list[int]:
    try:
        return _tls.cell
    except AttributeError:
        c = _tls.cell = [0]
        with _cells_lock:
            _cells.append(c)
        return c


def add(t0_ns: int) -> None:
    """Charge this thread with the CPU used since ``t0_ns`` (a :func:`thread_time_ns` reading)."""
    _cell()[0] += thread_time_ns() - t0_ns


def total_ns() -> int:
    """pdtrace CPU (ns) charged so far in this process, all threads."""
    with _cells_lock:
        return sum(c[0] for c in _cells)


def reset() -> None:
    """Zero every counter (tests)."""
    with _cells_lock:
        for c in _cells:
            c[0] = 0


configure()
