"""The ``pdtrace-writer`` thread: drains the recorder's buffer and hands the records to the host's sink.

(A little over 400 lines: one thread class, :class:`Writer`, and the pickling it needs; its drain,
send, reconnect and drop-and-count paths share one state and are kept together.)

Contract (the *exporter* role of OpenTelemetry's SDK): no caller's thread
ever waits for it. It pickles records in chunks sized to hold the GIL about
:data:`HOLD_NS` and sends them over a local socket to the sink of its trace
directory (:mod:`pdtrace.instrument.sink`, one process per host and directory,
shared by every traced process there; :mod:`pdtrace.instrument.hostsink` finds
or starts it at the first use); the sink converts them to Arrow and writes
Parquet. Conversion is ~10× the CPU of pickling, and pyarrow's work in a traced process
held its GIL for up to 5 ms at a time (page faults in fresh Arrow buffers);
here the writer holds the GIL only to pickle one chunk (~0.25 ms), releases
it while the socket write blocks, and pauses :data:`YIELD_S` after a chunk
whose write returned at once, so that a thread waiting for the GIL gets it.
BENCHMARKS.md "Recorder overhead" and "Host sink" have the figures.

Every flush interval (PDTRACE_FLUSH_INTERVAL_S, default 1 s) the writer sends
the ``open`` records of the spans open at least PDTRACE_OPEN_AFTER_S
(:meth:`Tracer.open_records`), then a *periodic tick* with its counters; the
sink writes the records of all its clients every flush interval of its own and
answers each client with its counters, which :meth:`Writer.stats` reports. On
a flush request and at stop the tick asks the sink to write now, and the
writer waits for that answer. A SIGKILL of the traced process loses only the
records not yet sent (at most one interval): the sink sees end of file and
writes what it has. A SIGKILL of the sink loses what it had not written (at
most one of its intervals): the writer counts what it sent since the sink's
last answer as dropped.

The writer thread first moves itself off the CPU its creator may be pinned
to (an engine's forward thread), and a sink it starts inherits that
(:mod:`pdtrace.instrument.cpus`, ``PDTRACE_HELPER_CPUS``).

Values the sink could not rebuild (objects of non-builtin types among a
record's attribute values) are pickled as None and so dropped and counted as wrong-typed
attributes. The allowlist is the traced process's: keys that plug-ins
register there are sent to the sink before the next records. If the sink
cannot be reached or started, or dies, records are dropped and counted
(``dropped``) with one warning; the next send connects again (or starts a new
sink; after a failed start, one flush interval later, or at once for a flush
request: its caller waits for the records). Warnings of the sink
about this process's records (a directory it cannot write) come back with its
answers and are logged here, once each.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import select
import signal
import socket
import threading
import time

from . import attributes, cpus, hookerrors, hostsink

log = logging.getLogger("pdtrace")

#: Target CPU time (ns) of one chunk's GIL-holding work (pop + pickle + free): the chunk
#: size follows the cost per record measured on the last chunks, between :data:`CHUNK_MIN`
#: and :data:`CHUNK_MAX` records. The recorder's goal bounds a GIL hold at 1 ms
#: (0.3 µs per record pickled alone, BENCHMARKS.md "Host sink").
HOLD_NS = 250_000
CHUNK_MIN, CHUNK_MAX = 32, 512

#: Pause (s) after a chunk whose socket write returned sooner than this (not the
#: last chunk of a drain), without the GIL. CPython hands the GIL over only when
#: a waiter has waited its switch interval (5 ms); a pipe write that returns at
#: once lets the writer re-take the GIL before the waiting thread has woken, so
#: without the pause an engine thread could wait 5 ms per chunk (the "convoy
#: effect", bpo-7946; BENCHMARKS.md "Recorder overhead"). A write that blocked on a full
#: pipe has already given waiters that time.
YIELD_S = 0.0002

#: Seconds the writer waits for the sink's answer to a flush or final tick before going on, and
#: the longest a socket write may block (a sink that stops reading is then given up: dropped and counted).
ACK_TIMEOUT_S = 30.0


class _RecordPickler(pickle.Pickler):
    """Pickles record tuples; any object of a non-builtin type becomes None.

    ``reducer_override`` is only consulted for objects pickle has no built-in
    path for (so not for int, float, str, bool, None, tuple, list, dict), so
    the common case costs nothing extra; classes are replaced too (they would
    need an import in the sink).
    """

    def reducer_override(self, obj):
        if obj is type(None) or obj is type:  # the replacement's own parts
            return NotImplemented
        return (type(None), ())


def _dumps(msg) -> bytes:
    """Pickle a message; inside records (``recs``) non-builtin objects become None."""
    if msg[0] != "recs":
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    f = io.BytesIO()
    _RecordPickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return f.getvalue()


def stats(traced: dict, sink: dict) -> dict[str, int]:
    """All recorder counters from the writer's (``traced``) and the sink's (``sink``) halves.

    recorded (records offered to the recorder) = dropped + written + pending;
    dropped = dropped in the traced process (buffer full, sink unreachable) +
    rows of failed writes; sink_cpu_ns is the CPU time of the current sink process
    (the host's, shared with the other traced processes writing into the same directory);
    hook_errors counts the errors swallowed in the traced process's hooks
    (:mod:`pdtrace.instrument.hookerrors`). With tail retention in the sink
    (:mod:`pdtrace.instrument.retention`) tail_dropped counts the records it dropped by its
    decision (not lost: not kept), and recorded = dropped + written + tail_dropped + pending.
    ``traced["base"]`` holds the counters of earlier sinks of the same
    process (a sink that died is replaced), added in.
    """
    base = traced.get("base") or {}

    def both(k: str) -> int:
        return sink.get(k, 0) + base.get(k, 0)

    out = {"recorded": traced.get("recorded", 0), "dropped": traced.get("dropped", 0) + both("dropped"),
           "written": both("written"), "write_errors": both("write_errors"),
           "export_errors": both("export_errors"), "dropped_attributes": both("dropped_attributes"),
           "writer_cpu_ns": traced.get("writer_cpu_ns", 0), "sink_cpu_ns": sink.get("sink_cpu_ns", 0),
           "hook_errors": traced.get("hook_errors", 0)}
    if "tail_dropped" in sink or "tail_dropped" in base:
        out["tail_dropped"] = both("tail_dropped")
    return out


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the kernel too (``/proc/<pid>/task/<tid>/comm``, ``top -H``,
    ``ps -T``; Linux keeps 15 bytes), so an operator or a test can see pdtrace's thread from outside."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except (OSError, AttributeError):
        pass


class Writer(threading.Thread):
    """The ``pdtrace-writer`` thread of one recorder (one per process), and its connection to the host's sink."""

    def __init__(self, tracer, cfg) -> None:
        super().__init__(name="pdtrace-writer", daemon=True)
        self.tracer = tracer
        self.cfg = cfg
        self._stop_evt = threading.Event()
        self._flush_done = threading.Condition()
        self._flush_gen = 0  # generation of the last flush or final tick sent (the sink's answers name it)
        # flush requests: each caller's number, and the latest number a finished drain served (a drain
        # serves the requests made before it began, never one made while it ran)
        self._flush_asked = 0
        self._flush_served = 0
        self._start_tag = time.strftime("%Y%m%dT%H%M%S")
        self._sock: socket.socket | None = None
        self._inbuf = bytearray()  # the sink's answers, read and not yet a whole frame
        self.sink_pid: int | None = None  # pid of the sink this writer is connected to (SO_PEERCRED)
        self._flush_ok = True  # the last flush or final tick was answered
        self._res_sent = None
        self._attrs_sent = -1  # attributes.registrations when the allowlist was last sent
        self._sink_retry_at = 0.0
        self._sinks_started = 0
        self._sink: dict[str, int] = {}  # the current sink's counters, as of its last answer
        self._base: dict[str, int] = {}  # the counters of sinks that have gone away
        self._sent = 0  # records sent to the current sink
        self.drained = 0
        self.dropped_in_writer = 0
        self._warned: set[str] = set()
        self.max_stretch_cpu_ns = 0
        self._send_wall_ns = 0  # wall time of the last socket write, ns
        self._rec_ns = 1000  # CPU per record sent, ns (first guess; then measured by _drain)
        self.cpus: frozenset[int] | None = None  # CPUs this thread and its sink may use (set by run)

    # ------------------------------------------------------------- control
    def cpu_ns(self) -> int:
        """CPU time (ns, thread CPU clock) this writer thread has used so far; 0 if unavailable."""
        try:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(self.ident))
        except (AttributeError, OSError, TypeError, OverflowError):
            return 0

    def _traced(self) -> dict:
        """The traced process's half of the counters (see :func:`stats`), and ``hook_error_first`` (str or
        None: :func:`pdtrace.instrument.hookerrors.first`)."""
        caller_dropped = self.tracer.dropped_count()
        return {"recorded": caller_dropped + len(self.tracer._buf) + self.drained,
                "dropped": caller_dropped + self.dropped_in_writer, "writer_cpu_ns": self.cpu_ns(),
                "hook_errors": hookerrors.total(), "hook_error_first": hookerrors.first(), "base": self._base}

    def stats(self) -> dict[str, int]:
        """All recorder counters (see Tracer.stats), the sink's as of its last answer."""
        return stats(self._traced(), self._sink)

    def flush(self, timeout: float) -> bool:
        """Ask for a flush now and wait up to ``timeout`` s for the sink to write it.

        False on timeout, or when the sink did not answer (unreachable, or gone before writing:
        the records sent to it are then counted as dropped)."""
        deadline = time.monotonic() + timeout
        with self._flush_done:
            self._flush_asked += 1
            mine = self._flush_asked
            self.tracer._wake.set()
            while self._flush_served < mine:
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    return False
                self._flush_done.wait(min(left, 0.05))
            return self._flush_ok

    def stop(self, timeout: float) -> bool:
        """Final flush (the sink merges parts into a segment and exits), then end the thread; False on timeout."""
        self._stop_evt.set()
        self.tracer._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        return not self.is_alive()

    def detach_after_fork(self) -> None:
        """In a forked child: close the child's copy of the parent's socket without a word to the sink
        (no shutdown: the parent's connection stays as it was)."""
        if self._sock is not None:
            try:
                os.close(self._sock.detach())
            except OSError:
                pass
        self._sock = None

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ---------------------------------------------------------------- loop
    def start(self) -> None:
        """Start the thread with SIGTERM and SIGINT blocked in it (a thread inherits the signal mask
        of the thread that starts it, and so does a sink process it starts: the sink ignores SIGINT and
        unblocks SIGTERM itself). The kernel
        then delivers a process-directed signal to a thread that runs Python handlers, the main
        thread: one delivered to this thread only sets Python's flag, and the handler waited,
        unrun, until the main thread woke (a traced process in ``time.sleep(60)`` outlived SIGTERM
        in about 1 of 12 runs of tests/instrument/test_faults.py::test_sigterm_flushes)."""
        try:
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        except (AttributeError, OSError, ValueError):  # no pthread_sigmask on this platform
            return super().start()
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def run(self) -> None:
        _name_os_thread(self.name)
        # off the engine thread's pinned core, before a sink is started (it inherits this)
        self.cpus = cpus.unpin_current_thread(self.cfg.helper_cpus)
        self._start_sink()  # now, so its start-up (~0.5 s: imports) overlaps the first interval
        interval = self.cfg.flush_interval_s
        next_flush = time.monotonic() + interval
        wake = self.tracer._wake
        while True:
            wake.wait(max(0.0, next_flush - time.monotonic()))
            wake.clear()
            stopping = self._stop_evt.is_set()
            # A flush request counts as served only by a drain that began after it (an int read: atomic).
            seq = self._flush_asked
            asked = seq > self._flush_served
            ok = False
            if asked and self._sock is None:
                # a caller waits for these records (up to its timeout): try a failed start again now. Not
                # at stop: a process's exit never waits for a sink that could not be started just before
                self._sink_retry_at = 0.0
            try:
                self._drain()
                now = time.monotonic()
                if stopping or asked or now >= next_flush:
                    self._send_open()
                    ok = self._tick(final=stopping, asked=asked)
                    next_flush = now + interval
                elif self._sock is not None:
                    self._pump()  # the sink's answers to earlier ticks
            except (EOFError, OSError) as exc:
                self._sink_lost(exc)
            except Exception as exc:  # never let the thread die: count and go on
                self._warn_once(f"loop-{type(exc).__name__}", "pdtrace: writer error %s: %s", type(exc).__name__, exc)
            if asked or stopping:
                with self._flush_done:
                    self._flush_ok = ok
                    self._flush_gen += 1
                    self._flush_served = max(self._flush_served, seq)
                    self._flush_done.notify_all()
            if stopping:
                self._close()
                return

    def _drain(self) -> None:
        """Send every buffered record to the sink, one chunk (about :data:`HOLD_NS` of work) per message."""
        buf = self.tracer._buf
        n = len(buf)
        pop = buf.popleft
        while n > 0:
            k = min(n, max(CHUNK_MIN, min(CHUNK_MAX, HOLD_NS // self._rec_ns)))
            cpu0 = time.thread_time_ns()
            chunk = [pop() for _ in range(k)]
            n -= k
            self.drained += k
            ok = self._send(("recs", chunk), cpu0)
            cpu1 = time.thread_time_ns()
            if ok:
                self._sent += k
            else:
                self.dropped_in_writer += k
            del chunk  # freed here: a second stretch with the GIL, after the socket write
            cpu2 = time.thread_time_ns()
            self.max_stretch_cpu_ns = max(self.max_stretch_cpu_ns, cpu2 - cpu1)
            # cost per record of this chunk (pop, pickle, free; the socket write's copy is a few µs), smoothed
            self._rec_ns = max(1, (3 * self._rec_ns + (cpu2 - cpu0) // k) // 4)
            if n > 0 and self._send_wall_ns < YIELD_S * 1e9:  # a blocked write already let waiters in
                time.sleep(YIELD_S)

    def _send_open(self) -> None:
        """Send the ``open`` records of the spans open long enough (Tracer.open_records), before a tick:
        the part file the tick writes then holds each such span's latest state."""
        recs = self.tracer.open_records()
        if not recs:
            return
        self.drained += len(recs)  # counted as recorded: recorded = dropped + written (+ pending)
        if self._send(("recs", recs)):
            self._sent += len(recs)
        else:
            self.dropped_in_writer += len(recs)

    def _send(self, msg, cpu0: int | None = None) -> bool:
        """Send one message to the sink (connecting, or starting one, if needed); False if it is unreachable."""
        if self._sock is None and not self._start_sink():
            return False
        res = self.tracer.resource
        try:
            if res is not self._res_sent:
                self._write(_dumps(("res", res)))
                self._res_sent = res
            if attributes.registrations != self._attrs_sent:  # keys registered by plug-ins in this process
                n = attributes.registrations
                self._write(_dumps(("attrs", dict(attributes.ALLOWED))))
                self._attrs_sent = n
            data = _dumps(msg)
            if cpu0 is not None:  # the stretch of GIL-holding work since the last release
                self.max_stretch_cpu_ns = max(self.max_stretch_cpu_ns, time.thread_time_ns() - cpu0)
            t0 = time.perf_counter_ns()
            self._write(data)  # blocks while the socket buffer is full, without the GIL
            self._send_wall_ns = time.perf_counter_ns() - t0
            return True
        except (OSError, ValueError) as exc:
            self._sink_lost(exc)
            return False

    def _write(self, data: bytes) -> None:
        """One frame to the sink (:func:`pdtrace.instrument.hostsink.frame`), waiting (without the GIL)
        while the socket buffer is full. Raises OSError: TimeoutError after :data:`ACK_TIMEOUT_S`
        without room (a sink that stopped reading), BrokenPipeError when the sink is gone (no SIGPIPE)."""
        s = self._sock
        deadline = None
        for part in (len(data).to_bytes(4, "big"), data):
            view = memoryview(part)
            while view:
                try:
                    n = s.send(view, socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    if deadline is None:
                        deadline = time.monotonic() + ACK_TIMEOUT_S
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("the sink has not read for %.0f s" % ACK_TIMEOUT_S)
                    select.select([], [s], [], min(left, 1.0))
                    continue
                view = view[n:]

    def _pump(self, want: int = 0, timeout: float = 0.0) -> bool:
        """Read the sink's answers that have arrived (counters, warnings to log).

        With ``want`` > 0, wait up to ``timeout`` s for an answer to tick generation ``want`` or
        later; returns whether one came. Raises EOFError when the sink closed the connection.
        """
        s = self._sock
        deadline = time.monotonic() + timeout
        got = False
        while True:
            try:
                data = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            if data == b"":
                raise EOFError("the sink closed the connection")
            if data:
                self._inbuf += data
                for m in hostsink.unframe(self._inbuf):
                    kind, g, counters, warnings = pickle.loads(m)
                    self._sink = counters
                    for w in warnings:
                        self._warn_once("sink:" + w, "%s", w)
                    if want and g >= want:
                        got = True
                if got:  # answered: what follows (end of file after a final answer) is not read here
                    return True
                continue
            if not want or got:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([s], [], [], min(left, 1.0))

    def _tick(self, final: bool, asked: bool = False) -> bool:
        """Send the counters; on a flush request or at stop (``final``), ask the sink to write now and wait for
        its answer. True when the sink answered such a tick."""
        gen = self._flush_gen + 1
        mode = "final" if final else "flush" if asked else "periodic"
        if not self._send(("tick", gen, self._traced(), mode)):
            return False
        try:
            if mode == "periodic":
                self._pump()
                return True
            if self._pump(gen, ACK_TIMEOUT_S):
                return True
            self._warn_once("ack-timeout", "pdtrace: the sink did not answer within %.0f s", ACK_TIMEOUT_S)
        except (EOFError, OSError) as exc:
            self._sink_lost(exc)
        return False

    def _start_sink(self) -> bool:
        """Connect to the host's sink of this trace directory, starting one if none runs; False (records
        dropped, one warning) if it cannot be reached now. After a failure the next try waits one flush
        interval, or a flush request (:meth:`flush`: its caller waits for the records)."""
        now = time.monotonic()
        if now < self._sink_retry_at:
            return False
        self._sink_retry_at = now + self.cfg.flush_interval_s
        s = None
        try:
            env = cpus.helper_env(os.environ)  # not traced, and not bound to the engine's cores by OpenMP
            s, _started = hostsink.connect(self.cfg.trace_dir, env)
            self.sink_pid = hostsink.peer_cred(s)[0]
            s.setblocking(False)  # reads never wait; writes wait in _write, bounded
            self._sock, self._inbuf = s, bytearray()
            self._sinks_started += 1
            tag = self._start_tag + (f"r{self._sinks_started}" if self._sinks_started > 1 else "")
            self._write(_dumps(("init", self.cfg, self.tracer.resource, os.getpid(), tag, self.tracer.activation)))
            self._res_sent = self.tracer.resource
            self._attrs_sent = -1
            return True
        except (OSError, ValueError) as exc:
            if s is not None:
                s.close()
            self._sock = None
            self._warn_once("sink-start", "pdtrace: cannot start the sink process (%s: %s); "
                            "spans are dropped and counted", type(exc).__name__, exc)
            return False

    def _sink_lost(self, exc: BaseException) -> None:
        """The sink went away: read its last answers, count what it had not answered for as dropped, warn
        once; the next send connects again (or starts a new sink)."""
        if self._sock is None:
            return
        try:
            self._pump()
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            pass
        # what the lost sink had not answered for is lost with it; its counters carry over
        last = self._sink
        self.dropped_in_writer += max(0, self._sent - last.get("written", 0) - last.get("dropped", 0)
                                      - last.get("tail_dropped", 0))
        for k, v in last.items():
            if k != "sink_cpu_ns":
                self._base[k] = self._base.get(k, 0) + v
        self._sink, self._sent = {}, 0
        self._sink_retry_at = 0.0  # the next send may reconnect at once; a failed start waits
        self._warn_once("sink-lost", "pdtrace: the sink process is gone (pid %s, %s: %s); "
                        "spans are dropped and counted until a new one starts", self.sink_pid,
                        type(exc).__name__, exc)
        self._close()

    def _close(self) -> None:
        """Close the socket (the sink sees end of file)."""
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
