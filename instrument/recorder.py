"""The span recorder: the call-site API, run on the caller's thread.

(Over 400 lines on purpose: most of it is one class, :class:`Tracer`, the call-site API, whose every
method follows the same rules -- never raise into the engine, never block, bounded memory -- and reads
best in one place.)

Contract (the *processor* role of OpenTelemetry's SDK): every method is
thread-safe, never blocks on I/O and never raises into the caller. A record is
a tuple appended to a bounded deque; a background thread
(:mod:`pdtrace.instrument.writer`) hands the records to the host's helper
process (:mod:`pdtrace.instrument.sink`, one per host and trace directory)
that converts and writes. When the deque is
full the record is dropped and counted.

Nothing starts on import: a process that traces calls :meth:`Tracer.activate`
once (idempotent; the traced connectors, the middleware and the lab's router
do), which starts the writer iff ``PDTRACE_DIR`` is set. Use from a call site::

    from pdtrace.instrument import tracer
    if tracer.on:                                  # the one check when tracing is off
        t0 = tracer.now()
        ...
        tracer.record("kv.transfer", rid, t0, tracer.now(), {"kv.bytes": n})

Times are monotonic ns (``time.monotonic_ns()``, :func:`now`); a float
``time.monotonic()`` seconds value from vLLM converts with ``int(t * 1e9)``.

Memory bound: at most ``PDTRACE_BUFFER_SPANS`` records wait in the deque
(one record: a tuple of 15 slots plus two per attribute, ~390 bytes with 3
attributes as measured by ``benchmarks/recorder_bench.py``, so the default
65,536 bounds the buffer at ~25 MiB), and at most ``PDTRACE_BUFFER_SPANS``
spans may be open (started, not ended).

Open spans are visible while they stay open: at every flush the writer
thread asks :meth:`Tracer.open_records` for a record of each span open at
least ``PDTRACE_OPEN_AFTER_S`` (record type ``open``, see
:mod:`pdtrace.instrument.schema`), so a stage that hangs is in the store
while it hangs. A call site that records a stage after the fact with
explicit times makes it visible as it waits with :meth:`Tracer.start`, then
writes the final span itself with ``record(..., span_id=sid)`` and
:meth:`Tracer.close` (or :meth:`Tracer.abandon` when no span follows).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import random
import signal
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Iterator, Mapping

from . import ACTIVATIONS as _ACTIVATIONS
from . import clock as _clock
from . import config as _config
from . import ids as _ids
from . import selfcpu as _selfcpu
from .schema import KIND_INTERNAL, STATUS_ERROR, STATUS_UNSET

log = logging.getLogger("pdtrace")

# Record tuple layout (shared with writer.py):
# (rtype, record_id, span_id, parent, name, kind, start, end, status, status_msg,
#  request_id, prompt_index, attempt, tp_rank, thread, *attr_keys, *attr_values)
# ``thread`` is the recording thread's name, read when the record is made (an
# ident could be reused by a later thread before the writer runs). The
# attributes follow as flat slots, keys then values (convert.N_FIXED = 15 slots
# come first): no dict and no nested tuple. CPython's cyclic GC untracks a tuple
# of atoms at its first collection, but keeps any tuple holding a dict tracked
# (and one holding a tuple for one more collection). Records waiting in the
# buffer then survive into the oldest generation and trigger full
# collections; in a process whose heap was frozen (vLLM's engine calls
# gc.freeze()), those took 3.5-4.4 ms each, GIL held, every ~120,000 records
# (BENCHMARKS.md "Recorder overhead").
R_SPAN, R_EVENT, R_CLOCK, R_STATS, R_OPEN = 0, 1, 2, 3, 4

_tls = threading.local()
_NO_ATTRS: dict = {}  # shared, never written to


def _thread_name() -> str:
    """The calling thread's name, cached per thread (a str keeps the record tuple
    out of the cyclic GC's tracked set; a Thread object would keep it in)."""
    try:
        return _tls.name
    except AttributeError:
        _tls.name = threading.current_thread().name
        return _tls.name
_now = _clock.now_ns  # the monotonic clock of every span time


class Tracer:
    """Process-wide recorder. Use the module singleton :data:`pdtrace.instrument.tracer`.

    ``on`` is a plain bool attribute: True once :meth:`activate` found
    ``PDTRACE_DIR`` set (or :meth:`configure` was given a trace dir). All
    recording methods return 0 and do nothing while it is False.
    ``activation`` says how tracing was switched on in this process
    (``pdtrace.instrument.ACTIVATIONS``), written on every ``recorder.stats`` row.
    """

    def __init__(self) -> None:
        self.on = False
        self.config = _config.Config()
        self._buf: deque = deque()
        self._cap = 0
        self._wake_at = 0
        self._wake = threading.Event()
        self._open: dict[int, tuple] = {}
        self._ids = itertools.count(1)
        self._dropped = itertools.count()
        self._dropped_seen = 0
        self._sample_threshold = 1 << 256
        self._step_every = 1
        self._sampled_cache: dict[str, bool] = {}
        self.resource: dict[str, object] = {}
        self._writer = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._atexit_registered = False
        self._prev_sigterm = None
        self._last_stats: dict[str, int] | None = None
        self.activation = "explicit"
        self._activated_pid = 0
        self._activate_lock = threading.Lock()
        self._open_after_ns = 1_000_000_000

    # ------------------------------------------------------------------ setup
    def activate(self, activation: str = "explicit", **resource: object) -> bool:
        """Start the recorder from the environment if ``PDTRACE_DIR`` is set; return :attr:`on`.

        The one start function of a process that traces (never called on import).
        Idempotent and thread-safe: the first call in a process reads the
        environment and, when a trace directory is set, starts the writer
        (:meth:`configure`) with ``activation`` recorded; later calls in the same
        process return the state and change nothing (also after :meth:`shutdown`:
        a process that stopped tracing, e.g. on SIGTERM, is not restarted). A
        forked child keeps tracing through the fork hook; a spawned one calls
        this again. ``activation``: 'plugin' or 'explicit'; ValueError otherwise.
        ``resource``: resource columns (:meth:`set_resource`; KeyError for an unknown key) set
        before the writer starts, so that none of the process's rows (its first
        ``recorder.stats`` row and clock anchor included) is written without them; on a later
        call, set when tracing is on.
        """
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be 'plugin' or 'explicit', not {activation!r}")
        _check_resource_keys(resource)
        pid = os.getpid()
        started = False
        if self._activated_pid != pid:
            with self._activate_lock:
                if self._activated_pid != pid:
                    cfg = _config.from_env()
                    if cfg.enabled and not self.on:
                        self.activation = activation
                        self.configure(cfg, **resource)
                        started = True
                    self._activated_pid = pid
        if resource and self.on and not started:
            self.set_resource(**resource)
        return self.on

    def configure(self, cfg: _config.Config | None = None, **resource: object) -> "Tracer":
        """(Re)configure from ``cfg`` (default: the environment) and start the writer.

        Stops a running writer first (flushing it). ``resource`` sets resource
        columns (see :meth:`set_resource`). Returns self. Never raises for bad
        settings: a trace directory that cannot be created logs a warning and
        records are dropped and counted at write time.
        """
        with self._lock:
            self._shutdown_locked(timeout=5.0)
            cfg = _config.from_env() if cfg is None else cfg
            self.config = cfg
            self._cap = cfg.buffer_spans
            self._wake_at = max(1, cfg.buffer_spans // 2)
            self._buf = deque()
            self._open = {}
            self._open_after_ns = int(cfg.open_after_s * 1e9)
            self._reset_ids()
            self._sample_threshold = _ids.sample_threshold(cfg.sample)
            self._step_every = 0 if cfg.step_sample <= 0 else max(1, round(1 / cfg.step_sample))
            self._sampled_cache = {}
            self.resource = _default_resource(cfg)
            self.resource.update(resource)
            if not cfg.enabled:
                self.on = False
                return self
            from .writer import Writer  # deferred: only a traced process needs it

            self._writer = Writer(self, cfg)
            self._writer.start()
            if not self._atexit_registered:
                atexit.register(_atexit_shutdown, weakref.ref(self))
                self._atexit_registered = True
            self._install_sigterm()
            self.on = True
            return self

    def set_resource(self, **resource: object) -> None:
        """Set resource columns for rows written from now on.

        Keys: run_id, service_name, role, engine_id, host, pid,
        pdtrace_version, vllm_version, connector, config_hash, and ``tp_rank``
        (the default rank for rows that give none). Raises KeyError for
        another key.
        """
        _check_resource_keys(resource)
        self.resource = {**self.resource, **resource}

    def _reset_ids(self) -> None:
        # Ids are unique across processes: a random 31-bit process prefix, a counter below it.
        base = (random.SystemRandom().getrandbits(31) << 32) | 1
        self._ids = itertools.count(base)
        self._dropped = itertools.count()
        self._dropped_seen = 0

    # -------------------------------------------------------------- hot path
    now = staticmethod(_now)

    def sampled(self, request_id: str) -> bool:
        """True iff ``request_id`` (the base id X) is kept by the PDTRACE_SAMPLE rule (DESIGN.md §3)."""
        if not self.on:
            return False
        v = self._sampled_cache.get(request_id)
        if v is None:
            v = int.from_bytes(_ids.digest(request_id), "big") < self._sample_threshold
            if len(self._sampled_cache) > 65536:
                self._sampled_cache.clear()
            self._sampled_cache[request_id] = v
        return v

    def step_sampled(self, step_id: int) -> bool:
        """True iff the per-step spans of engine step ``step_id`` are kept (every k-th step)."""
        return self.on and self._step_every > 0 and step_id % self._step_every == 0

    def step_span_id(self, step_id: int) -> int:
        """A fresh span id for engine step ``step_id``'s span if its per-step spans are kept
        (:meth:`step_sampled`), else 0: the two calls in one (once per engine step)."""
        every = self._step_every
        if self.on and every > 0 and step_id % every == 0:
            return next(self._ids)
        return 0

    @staticmethod
    def trace_id(request_id: str) -> str:
        """W3C trace id (32 hex) of a request, the same in every process."""
        return _ids.trace_id(request_id)

    def new_id(self) -> int:
        """A fresh span id (uint64, unique across processes) to pass as ``span_id`` or ``parent`` later."""
        return next(self._ids)

    def record(self, name: str, request_id: str | None = None, start_ns: int = 0, end_ns: int = 0,
               attrs: Mapping[str, object] | None = None, parent: int | None = None,
               kind: int = KIND_INTERNAL, status: int = STATUS_UNSET, span_id: int | None = None,
               attempt: int = 0, tp_rank: int | None = None, prompt_index: int = 0) -> int:
        """Record a finished span with explicit monotonic-ns times; return its span id (0 if not recorded).

        ``name`` is a DESIGN.md stage name; ``attrs`` a dict of allowlisted
        keys (pdtrace.instrument.attributes); ``parent`` a span id. Never raises.
        """
        if not self.on:
            return 0
        buf = self._buf
        if len(buf) >= self._cap:
            next(self._dropped)
            return 0
        sid = next(self._ids) if span_id is None else span_id
        try:
            th = _tls.name
        except AttributeError:
            th = _thread_name()
        buf.append((R_SPAN, sid, sid, parent, name, kind, start_ns, end_ns, status, None,
                    request_id, prompt_index, attempt, tp_rank, th, *attrs, *attrs.values())
                   if attrs else (R_SPAN, sid, sid, parent, name, kind, start_ns, end_ns, status, None,
                                  request_id, prompt_index, attempt, tp_rank, th))
        if len(buf) == self._wake_at:
            self._wake.set()
        return sid

    def end_extra(self, span_id: int, end_ns: int, keys: tuple, values: tuple) -> bool:
        """Close a span opened by :meth:`start` at ``end_ns`` with its attributes as started followed by
        ``keys`` / ``values`` (two tuples of equal length, keys not among them): :meth:`end` with more
        attributes and no dict merge (the engine step spans, once per step). Returns False, writing
        nothing, when the span is not open (not started, dropped, already closed) or tracing is off, so
        the caller can record it itself; never raises."""
        o = self._open.pop(span_id, None)
        if o is None or not self.on:
            return False
        name, rid, start, parent, a0, kind, attempt, rank, pidx = o
        buf = self._buf
        if len(buf) >= self._cap:
            next(self._dropped)
            return True
        try:
            th = _tls.name
        except AttributeError:
            th = _thread_name()
        a0 = a0 or _NO_ATTRS
        buf.append((R_SPAN, span_id, span_id, parent, name, kind, start, end_ns, STATUS_UNSET, None, rid, pidx,
                    attempt, rank, th, *a0, *keys, *a0.values(), *values))
        if len(buf) == self._wake_at:
            self._wake.set()
        return True

    def start(self, name: str, request_id: str | None = None, start_ns: int | None = None,
              parent: int | None = None, attrs: Mapping[str, object] | None = None,
              kind: int = KIND_INTERNAL, attempt: int = 0, tp_rank: int | None = None,
              span_id: int | None = None, prompt_index: int = 0) -> int:
        """Open a span (ended later by :meth:`end`, from any thread); return its id (0 if not recorded)."""
        if not self.on:
            return 0
        if len(self._open) >= self._cap:
            next(self._dropped)
            return 0
        sid = next(self._ids) if span_id is None else span_id
        self._open[sid] = (name, request_id, _now() if start_ns is None else start_ns, parent,
                           attrs, kind, attempt, tp_rank, prompt_index)
        return sid

    def end(self, span_id: int, end_ns: int | None = None, attrs: Mapping[str, object] | None = None,
            status: int = STATUS_UNSET, error: BaseException | None = None) -> None:
        """Close a span opened by :meth:`start`; ``attrs`` are merged over the start's.

        ``error`` sets status ERROR with the exception's class (and code) only.
        Unknown or already-closed ids are ignored.
        """
        if not self.on:
            return
        o = self._open.pop(span_id, None)
        if o is None:
            return
        name, rid, start, parent, a0, kind, attempt, rank, pidx = o
        if attrs:
            a0 = {**a0, **attrs} if a0 else attrs
        msg = None
        if error is not None:
            status = STATUS_ERROR
            code = getattr(error, "errno", None) or getattr(error, "status", None)
            msg = type(error).__name__ + (f":{code}" if isinstance(code, (int, str)) else "")
        buf = self._buf
        if len(buf) >= self._cap:
            next(self._dropped)
            return
        try:
            th = _tls.name
        except AttributeError:
            th = _thread_name()
        end = _now() if end_ns is None else end_ns
        buf.append((R_SPAN, span_id, span_id, parent, name, kind, start, end, status, msg, rid, pidx, attempt, rank,
                    th, *a0, *a0.values())
                   if a0 else (R_SPAN, span_id, span_id, parent, name, kind, start, end, status, msg, rid, pidx,
                               attempt, rank, th))
        if len(buf) == self._wake_at:
            self._wake.set()

    def update(self, span_id: int, attrs: Mapping[str, object]) -> None:
        """Merge ``attrs`` into an open span's attributes (what it waits for, counts received so far).

        Seen by the next flush's ``open`` record and by :meth:`end`. Unknown or
        closed ids are ignored; never raises.
        """
        o = self._open.get(span_id)
        if o is not None and attrs:
            a0 = o[4]
            self._open[span_id] = o[:4] + ({**a0, **attrs} if a0 else dict(attrs),) + o[5:]

    def close(self, span_id: int) -> None:
        """Forget an open span whose final row the caller records itself (``record(..., span_id=span_id)``).

        Writes nothing. Unknown ids are ignored.
        """
        self._open.pop(span_id, None)

    def abandon(self, span_id: int, time_ns: int | None = None) -> None:
        """Forget an open span that gets no ``span`` row (the stage did not happen after all:
        the request was freed, the wait was not needed). If it may have been written as open
        (open at least ``PDTRACE_OPEN_AFTER_S``), one last ``open`` record with ``open.state``
        = ``'abandoned'`` tells readers it is over. Unknown ids are ignored; never raises.
        """
        o = self._open.pop(span_id, None)
        if o is None or not self.on:
            return
        t = _now() if time_ns is None else time_ns
        if t - o[2] < self._open_after_ns:
            return
        buf = self._buf
        if len(buf) >= self._cap:
            next(self._dropped)
            return
        buf.append(self._open_record(span_id, o, t, "abandoned"))

    def _open_record(self, sid: int, o: tuple, t: int, state: str) -> tuple:
        name, rid, start, parent, a0, kind, attempt, rank, pidx = o
        keys = (*a0, "open.state") if a0 else ("open.state",)
        vals = (*a0.values(), state) if a0 else (state,)
        return (R_OPEN, next(self._ids), sid, parent, name, kind, start, t, STATUS_UNSET, None,
                rid, pidx, attempt, rank, None, *keys, *vals)

    def open_records(self, now_ns: int | None = None) -> list[tuple]:
        """One ``open`` record (recorder.py layout, fresh record id, ``end`` = ``now_ns``) per span
        open at least ``PDTRACE_OPEN_AFTER_S`` at ``now_ns`` (monotonic ns, default now).

        Called by the writer thread at each flush; a snapshot of the open set
        (``dict.copy`` runs without releasing the GIL, so callers on other
        threads may start and end spans meanwhile). With ``PDTRACE_SELF_CPU=1``
        the list also holds one ``pdtrace.thread_cpu`` stats record per thread
        that ran a pdtrace hook (:func:`pdtrace.instrument.selfcpu.records`),
        so that those figures reach the store at every flush. Never raises.
        """
        t = _now() if now_ns is None else now_ns
        cpu = _selfcpu.records(t, self.new_id) if _selfcpu.enabled else []
        if not self._open:
            return cpu
        cut = t - self._open_after_ns
        try:
            snap = self._open.copy()
        except RuntimeError:  # pragma: no cover - a copy does not iterate in Python
            return cpu
        return [self._open_record(sid, o, t, "open") for sid, o in snap.items() if o[2] <= cut] + cpu

    @contextmanager
    def span(self, name: str, request_id: str | None = None, **kw) -> Iterator[int]:
        """Context manager around :meth:`start`/:meth:`end`; records the exception class on error.

        For code off the hot path (one generator frame more than ``start``/``end``).
        """
        sid = self.start(name, request_id, **kw)
        try:
            yield sid
        except BaseException as exc:
            self.end(sid, error=exc)
            raise
        else:
            self.end(sid)

    def event(self, name: str, request_id: str | None = None, span_id: int | None = None,
              time_ns: int | None = None, attrs: Mapping[str, object] | None = None,
              attempt: int = 0, tp_rank: int | None = None, prompt_index: int = 0) -> int:
        """Record an instant ``name`` (see stages.EVENTS) on a span or request; return its record id."""
        if not self.on:
            return 0
        buf = self._buf
        if len(buf) >= self._cap:
            next(self._dropped)
            return 0
        rid_ = next(self._ids)
        t = _now() if time_ns is None else time_ns
        th = _thread_name()
        buf.append((R_EVENT, rid_, span_id, None, name, KIND_INTERNAL, t, t, STATUS_UNSET, None,
                    request_id, prompt_index, attempt, tp_rank, th, *attrs, *attrs.values())
                   if attrs else (R_EVENT, rid_, span_id, None, name, KIND_INTERNAL, t, t, STATUS_UNSET, None,
                                  request_id, prompt_index, attempt, tp_rank, th))
        if len(buf) == self._wake_at:
            self._wake.set()
        return rid_

    # ------------------------------------------------------------ lifecycle
    def force_flush(self, timeout: float = 5.0) -> bool:
        """Write everything recorded so far; False if ``timeout`` (s) passed first."""
        w = self._writer
        if not self.on or w is None:
            return True
        return w.flush(timeout)

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Flush and stop the writer; tracing is off afterwards. Safe to call twice.

        Returns False if the final flush did not finish within ``timeout`` (s).
        """
        with self._lock:
            return self._shutdown_locked(timeout)

    def _shutdown_locked(self, timeout: float) -> bool:
        self.on = False
        w, self._writer = self._writer, None
        if w is None:
            return True
        ok = w.stop(timeout)
        self._last_stats = w.stats()
        return ok

    def stats(self) -> dict[str, int]:
        """The recorder's counters: recorded, dropped, written, write_errors, export_errors, dropped_attributes,
        and tail_dropped under tail retention (:func:`pdtrace.instrument.writer.stats`); after shutdown,
        the counters of the writer's stop, recorded including what the sink still held (pending)."""
        w = self._writer
        if w is not None:
            return w.stats()
        last = self._last_stats or {"written": 0, "write_errors": 0, "export_errors": 0,
                                     "dropped_attributes": 0, "dropped": 0}
        st = dict(last)
        before = st.get("dropped", 0)
        st["dropped"] = max(before, self.dropped_count())  # records offered after shutdown drop and count
        # recorded as the writer counted it at its stop (records the sink still held undecided under tail
        # retention are in it, pending), plus what dropped since
        st["recorded"] = st.get("recorded", before + st["written"] + st.get("tail_dropped", 0)) + st["dropped"] - before
        return st

    def dropped_count(self) -> int:
        """Records dropped on the caller's side (buffer full or too many open spans)."""
        # itertools.count has no read; its repr carries the next value.
        return int(repr(self._dropped)[6:-1])

    # --------------------------------------------------------------- fork/signals
    def _after_fork_in_child(self) -> None:
        # A forked child is a client of its own: new ids, new buffer, its own writer and
        # connection to the host's sink, its own pid on its rows (the parent's thread does
        # not exist in the child; the child's copy of the parent's socket is closed here,
        # without a shutdown, so the parent's connection is unaffected).
        self._lock = threading.Lock()
        self._activate_lock = threading.Lock()
        if self._writer is not None:
            self._writer.detach_after_fork()
        self._writer = None
        self._pid = os.getpid()
        if not self.on:
            return
        self.on = False
        res = {k: v for k, v in self.resource.items()}
        res["pid"] = self._pid
        # with the parent's resource from the start, so that the child's writer never announces a default one
        self.configure(self.config, **res)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            prev = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):
            return
        if prev is signal.SIG_IGN or getattr(prev, "_pdtrace", False):
            return
        ref = weakref.ref(self)

        def _on_sigterm(signum, frame):
            t = ref()
            if t is not None:
                t.shutdown(timeout=2.0)
            if callable(prev):
                prev(signum, frame)
            else:  # SIG_DFL / None: die by the signal, as without pdtrace
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        _on_sigterm._pdtrace = True  # type: ignore[attr-defined]
        try:
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass


def _check_resource_keys(resource) -> None:
    """KeyError unless every key is a resource column (schema.RESOURCE_COLUMNS) or ``tp_rank``."""
    from .schema import RESOURCE_COLUMNS

    for k in resource:
        if k not in RESOURCE_COLUMNS and k != "tp_rank":
            raise KeyError(f"not a resource column: {k!r}")


def _default_resource(cfg: _config.Config) -> dict[str, object]:
    import socket

    try:
        from importlib.metadata import version

        pdv = version("pdtrace")
    except Exception:
        pdv = None
    return {
        "run_id": cfg.run_id,
        "service_name": f"pdtrace-{cfg.role}" if cfg.role else "pdtrace",
        "role": cfg.role,
        "engine_id": None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pdtrace_version": pdv,
        "vllm_version": None,
        "connector": None,
        "config_hash": None,
        "tp_rank": None,
    }


def _atexit_shutdown(ref) -> None:
    t = ref()
    if t is not None:
        t.shutdown(timeout=5.0)


tracer = Tracer()


def _after_fork() -> None:
    tracer._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
