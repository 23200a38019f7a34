"""pdtrace's own CPU time on the traced process's threads (the overhead self-measurement).

Off by default. With ``PDTRACE_SELF_CPU=1`` (see :mod:`.config`) every pdtrace
hook that runs on an engine thread (the traced connectors' hooks on the
EngineCore thread, which also runs the forward pass at TP=1, the worker's
hooks on the forward thread of a TP rank, the API-server middleware and its two
engine hooks on the event-loop thread) goes through
:func:`pdtrace.connector.traced.safety.safe`, which reads the calling thread's
CPU clock (``time.thread_time_ns``, CLOCK_THREAD_CPUTIME_ID: CPU the thread
used, not wall time, so other processes do not inflate it) before and after
the hook and adds the difference to that thread's counter. The recorder calls
a hook makes (``record``/``start``/``end``/``event``) are inside the hook, so
they are charged too. This is the *hot path*: CPU pdtrace takes from a thread
that vLLM needs.

Where the figures land (all cumulative since the thread's first hook, so a
lost record loses nothing):

- at every flush of the process's writer (:meth:`Tracer.open_records`), one
  ``stats`` record named ``pdtrace.thread_cpu`` per thread that ran a hook
  (:func:`records`): ``cpu.pdtrace_ns`` (pdtrace's CPU on that thread),
  ``cpu.thread_ns`` (the thread's whole CPU, as the thread read its own clock
  at the end of its last hook), ``cpu.hooks`` (hook calls); the
  record's ``thread`` column names the thread. Analysis view ``thread_cpu``
  turns them into per-thread shares;
- on each recorded step span, the EngineCore thread's figures since the
  previous recorded step span (``step.pdtrace_cpu_ns``, ``step.thread_cpu_ns``;
  :func:`thread_pair_at`, from the clock sample the hook's own window started
  with), and on each ``connector.load`` span the forward thread's (:func:`stamp`).

The *hot-path share* of a thread over an interval is pdtrace's CPU on it
divided by the thread's whole CPU in the same interval (both thread CPU
clocks, independent of how busy the machine is; after the correction below a
window of only trivial hooks can come out slightly below 0).

The self-measurement is taken out of both figures (timer-overhead
compensation, as Python's ``profile`` module calibrates and subtracts its own
per-event cost, "Calibration" in its documentation): each hook's window runs
from the clock sample of its first read to that of its second, so it holds
one whole read besides the hook; one read's cost is calibrated per process
(:func:`read_cost_ns`: the median gap between back-to-back reads, taken once
when :func:`configure` switches the measurement on) and
subtracted from every hook's charge, and the thread's whole CPU loses the two
reads per hook it would not spend without the measurement. Without this, an
idle engine step's two hooks (≈ 2.3 µs of pdtrace) were charged ≈ 4.1 µs on a
machine whose thread clock read costs ≈ 0.9 µs (``benchmarks/step_hook_cost.py``).
The thread CPU rows carry the read cost used (``cpu.read_cost_ns``).

Cost when on: two thread-CPU clock reads per hook (≈ 0.2–0.9 µs each here
warm, ~10 µs with cold caches), one more per recorded ``connector.load`` span
(none per step span), and one record per active thread
per flush on the writer thread; when off: one module-attribute
check per hook and nothing at a flush.

Counters are per thread (no lock on the hot path); :func:`total_ns` sums
them. A thread's cell outlives the thread, so the total never goes down.
"""
from __future__ import annotations

import threading
import time

from . import attributes as _attributes
from . import config as _config

#: True when ``PDTRACE_SELF_CPU=1`` was set at import (re-read by :func:`configure`).
enabled: bool = False

#: Name of the per-thread stats records (record type ``stats``).
RECORD_NAME = "pdtrace.thread_cpu"

_attributes.register("cpu.pdtrace_ns", int, "pdtrace's own CPU on this thread since its first pdtrace hook "
                     "(thread CPU clock around every hook, less one calibrated clock read per hook; PDTRACE_SELF_CPU=1), "
                     "cumulative, ns")
_attributes.register("cpu.thread_ns", int, "the thread's whole CPU time since it started (its own thread CPU clock, read by "
                     "the thread at the end of its last hook before the flush that wrote the row) less the self-measurement's "
                     "two clock reads per hook, cumulative, ns")
_attributes.register("cpu.hooks", int, "pdtrace hook calls on this thread so far (count, cumulative)")
_attributes.register("cpu.read_cost_ns", int, "one thread-CPU clock read as calibrated in this process (median gap "
                     "between back-to-back reads), subtracted once per hook from cpu.pdtrace_ns and twice per hook "
                     "from cpu.thread_ns (the self-measurement taken out), ns")

_tls = threading.local()
# one cell per thread that ran a hook:
# [pdtrace ns, hook calls, the thread's own CPU clock at the end of its last hook, thread name, hooks last reported]
_cells: list[list] = []
_cells_lock = threading.Lock()
thread_time_ns = time.thread_time_ns
_read_cost: int | None = None  # ns; calibrated once per process (read_cost_ns)


def read_cost_ns() -> int:
    """One thread-CPU clock read (ns): the median gap between 201 back-to-back reads on the calling
    thread, taken on the first call in the process and kept (a forked child keeps its parent's)."""
    global _read_cost
    if _read_cost is None:
        r = thread_time_ns
        prev = r()
        gaps = []
        for _ in range(201):
            t = r()
            gaps.append(t - prev)
            prev = t
        gaps.sort()
        _read_cost = gaps[100]
    return _read_cost


def configure(cfg: _config.Config | None = None) -> None:
    """(Re)read the switch from ``cfg`` (default: the environment)."""
    global enabled
    enabled = bool((cfg or _config.from_env()).self_cpu)
    if enabled:
        read_cost_ns()  # calibrated here, outside any hook's window


def _cell() -> list:
    try:
        return _tls.cell
    except AttributeError:
        read_cost_ns()  # calibrated before the first charge
        c = _tls.cell = [0, 0, 0, threading.current_thread().name, 0]
        with _cells_lock:
            _cells.append(c)
        return c


def add(t0_ns: int) -> None:
    """Charge this thread with the CPU used since ``t0_ns`` (a :func:`thread_time_ns` reading) less one
    clock read (:func:`read_cost_ns`); one hook call."""
    try:
        c = _tls.cell
    except AttributeError:
        c = _cell()
    t1 = thread_time_ns()
    c[0] += t1 - t0_ns - _read_cost
    c[1] += 1
    c[2] = t1


def stamp(attrs: dict, mark: tuple[int, int] | None) -> tuple[int, int]:
    """Put the calling thread's pdtrace CPU and whole CPU since ``mark`` (a previous return value; None: none
    yet, nothing put) into ``attrs`` as ``step.pdtrace_cpu_ns`` / ``step.thread_cpu_ns`` (ns); return the new
    mark. The ``connector.load`` spans (forward thread) use it; step spans use :func:`thread_pair_at`."""
    pd, th = thread_pair()
    if mark is not None:
        attrs["step.pdtrace_cpu_ns"] = pd - mark[0]
        attrs["step.thread_cpu_ns"] = th - mark[1]
    return (pd, th)


def thread_pair() -> tuple[int, int]:
    """(pdtrace CPU charged to the calling thread so far, the calling thread's whole CPU now less its
    self-measurement reads), ns."""
    return thread_pair_at(thread_time_ns())


def thread_pair_at(t_ns: int) -> tuple[int, int]:
    """:func:`thread_pair` with the calling thread's CPU clock already read (``t_ns``, a
    :func:`thread_time_ns` reading, e.g. the start of the running hook's window): no clock read."""
    try:
        c = _tls.cell
    except AttributeError:
        c = _cell()
    return c[0], t_ns - 2 * _read_cost * c[1]


def total_ns() -> int:
    """pdtrace CPU (ns) charged so far in this process, all threads."""
    with _cells_lock:
        return sum(c[0] for c in _cells)


def records(now_ns: int, new_id) -> list[tuple]:
    """One ``pdtrace.thread_cpu`` stats record (recorder.py tuple layout) per thread that ran a hook since
    the last call.

    ``now_ns``: monotonic ns of the flush (the records' start and end);
    ``new_id``: a callable returning a fresh record id. Empty when the switch
    is off. Called on the writer thread. ``cpu.thread_ns`` is the thread's own
    CPU clock as read by the thread itself at the end of its last hook (no
    thread reads another's clock: ``pthread_getcpuclockid`` on a thread that has
    just exited is undefined behaviour), so a window between two records runs
    from the last hook of one flush interval to the last hook of the next.
    """
    if not enabled:
        return []
    from .recorder import R_STATS  # deferred: recorder imports this module
    from .schema import KIND_INTERNAL

    out = []
    with _cells_lock:
        for c in _cells:
            pd_ns, hooks, th_ns, name, seen = c
            if hooks == seen:
                continue
            c[4] = hooks
            out.append((R_STATS, new_id(), None, None, RECORD_NAME, KIND_INTERNAL, now_ns, now_ns, 0, None,
                        None, 0, 0, None, name, "cpu.pdtrace_ns", "cpu.thread_ns", "cpu.hooks", "cpu.read_cost_ns",
                        pd_ns, th_ns - 2 * _read_cost * hooks, hooks, _read_cost))
    return out


def reset() -> None:
    """Zero every counter (tests)."""
    with _cells_lock:
        for c in _cells:
            c[0] = c[1] = c[2] = c[4] = 0


configure()
