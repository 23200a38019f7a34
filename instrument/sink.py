"""The sink: one helper process per host and trace directory that turns its clients' records into Parquet files.

(Over 400 lines on purpose: the helper process's life -- start by the first client, adoption by the
next, SIGTERM and SIGKILL handling -- and the collector loop that writes its files share the guarantees
README "What the recorder guarantees to the engine" lists: at most one flush interval lost, every file readable at
any moment. They are checked together here.)

Every traced process on the host whose ``PDTRACE_DIR`` names the same directory is a *client*:
its ``pdtrace-writer`` thread (:mod:`pdtrace.instrument.writer`) connects over a local socket
(:mod:`pdtrace.instrument.hostsink`: the address, the lock, the start) and sends pickled
messages; the first one starts the sink as ``python -m pdtrace.instrument.sink --dir DIR --by
PID``, detached (own session, reparented to init), so it outlives the process that started it.
Conversion to Arrow, Parquet encoding, file I/O and OTLP export all happen here, so none of it
holds a traced process's GIL (BENCHMARKS.md "Host sink" says why this matters).

Messages from a client (tuples, each connection keeps its own state):

``("init", cfg, resource, pid, start_tag, activation)``  the client's settings, resource columns,
                                             pid, how its tracing was switched on
``("res", resource)``                        new resource columns for its records from now on
``("attrs", {key: Attr})``                   the client's attribute allowlist (keys plug-ins
                                             registered there), before records using it
``("recs", [record tuple, ...])``            records, recorder.py layout
``("tick", gen, traced, mode)``              ``traced``: the writer's counters (recorded,
                                             dropped, writer_cpu_ns, hook_errors,
                                             hook_error_first, base); ``mode`` 'periodic'
                                             (counters only), 'flush' (write everything
                                             received now, then answer) or 'final' (the same,
                                             then the client ends)
``("sync",)``                                 (a control client, e.g. the lab after stopping its
                                             processes) take in what every client sent, write it,
                                             merge if no client is left; answered ``("synced",)``

Answers to a client: ``("ack", gen, counters, warnings)`` after each file holding its rows and
after each 'flush'/'final' tick (``gen``: the latest such tick served; ``counters``: this
connection's written, dropped, write_errors, export_errors, dropped_attributes and the sink's
CPU time; ``warnings``: messages for the client to log, each once).

Files. Every flush interval (PDTRACE_FLUSH_INTERVAL_S of the process that started the sink), and
at once on a client's flush or final tick or end of connection, the sink writes the records of
*all* its clients as one complete *part* file ``sink-<host>-<sink pid>-<start>-p<seq>.parquet``
through a temporary name and a rename; each client's rows keep their own resource columns
(role, pid, ...), and each client that has rows in it (or ticked, ended, or is due a clock
anchor) gets its own ``recorder.stats`` row and, every PDTRACE_ANCHOR_INTERVAL_S, a clock anchor row.
The anchors are the sink's (PDTRACE_ANCHOR_INTERVAL_S of the process that started it), one set for
all clients; a record is converted through the anchor in effect at its monotonic start
(:class:`pdtrace.instrument.clock.HostAnchors`), a client's test wall offset added. At least every
PDTRACE_ROTATE_S, or when the parts hold PDTRACE_ROTATE_BYTES (Arrow buffer bytes), and when the last client has gone, the parts are merged into one *segment* file
(``-s<seq>.parquet``) and then deleted; a reader that lists the directory between the rename and
the deletes sees those rows twice, which readers remove by ``record_id``.

Layout (PDTRACE_LAYOUT, :mod:`pdtrace.instrument.layout`). ``flat``: the files are in the trace
directory. ``hive``: each part file goes to ``date=YYYY-MM-DD/hour=HH/host=<host>/`` of the UTC
hour in which it is written (``<host>``: this host's name); a segment goes to the directory of
its parts, and the parts never span two partitions: the first part file of a new hour (or of
another host name) first has the parts held so far merged in their own partition (an extra
rotation), so a segment is always whole in one partition and a part is never moved.

Life. The sink exits when no client has been connected for PDTRACE_SINK_IDLE_S, after writing
and merging everything; on SIGTERM it takes in what its clients sent, writes and merges what it
holds, answers its clients and exits (they start a new one at their next send; records a client
sent after the sink's last read are counted as dropped by that client, as after a kill). SIGINT is
ignored; SIGTERM is unblocked at start (a writer thread that starts the sink blocks it). If it is killed, its clients
count what they sent since its last answer as dropped, and the next send of any of them starts a
new sink. It runs niced +10 and its stderr goes to :func:`pdtrace.instrument.hostsink.log_path`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import random
import selectors
import signal
import socket
import sys
import time


class _NoPandas:
    """Import hook of the sink process: ``import pandas`` raises ImportError.

    pyarrow imports pandas, when installed, on its first ``pa.array`` call only
    to ask whether the input is a pandas object; the sink never passes one.
    Without pandas a sink starts in 0.08 s instead of 0.24 s, at 66 MiB peak
    RSS instead of 111 MiB (measured with pyarrow 26, pandas 2 in this venv).
    """

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("pandas is not used by the pdtrace sink")
        return None


_EARLY_USR1: list[int] = []  # SIGUSR1 received before main() installed its handler


def _early_usr1(signum, frame) -> None:
    _EARLY_USR1.append(signum)


def _daemonize(argv: list[str]):
    """In ``python -m pdtrace.instrument.sink --dir DIR --by PID``: bind the name, fork, parent exits.

    Exit codes of the parent (what :func:`pdtrace.instrument.hostsink.connect` reads): 0 bound
    (the child serves), 3 another sink holds the name. Returns ``(directory, socket)`` in the child,
    which listens from now on (before pyarrow is imported: a client's connection is queued while
    the sink starts up).
    """
    from pdtrace.instrument import hostsink

    d = argv[argv.index("--dir") + 1]
    sock = hostsink.bind(d)
    if sock is None:
        os._exit(3)
    if os.fork() > 0:
        os._exit(0)
    # SIGUSR1 (a tail-retention mark) from now on: the name is bound, a marker may find this process
    # before main() installs its handler; the default action would kill the sink
    signal.signal(signal.SIGUSR1, _early_usr1)
    sock.listen(128)
    return d, sock


if __name__ == "__main__":  # only in the sink process, before pyarrow is imported
    sys.meta_path.insert(0, _NoPandas)
    _LISTEN = _daemonize(sys.argv)

import pyarrow as pa  # noqa: E402

from . import attributes, clock, config, hostsink, layout, schema, store  # noqa: E402
from .convert import START, Converter  # noqa: E402
from .recorder import R_CLOCK, R_STATS  # noqa: E402
from .retention import SIGNAL_WINDOW_S, TailRetention  # noqa: E402
from .writer import stats  # noqa: E402

log = logging.getLogger("pdtrace")

attributes.register("clock.mono_ns", int, "monotonic reading of a clock anchor (ns)")
attributes.register("clock.uncertainty_ns", int, "half the read window of a clock anchor (ns)")
attributes.register("clock.read_cost_ns", int, "median cost of one monotonic clock read (ns)")
attributes.register("clock.test_offset_ns", int, "TEST ONLY wall shift applied to this process's anchors (ns)")
attributes.register("clock.source", str, "implementation of the monotonic clock")
attributes.register("pdtrace.activation", str,
                    "how tracing was switched on in the process that wrote this recorder.stats row: 'plugin' "
                    "(vLLM loaded pdtrace's plugin; stock connector names / API server traced through it) or "
                    "'explicit' (pdtrace's class names, --middleware, the lab's router, or code)")
for _k in ("recorded", "dropped", "written", "write_errors", "export_errors", "dropped_attributes"):
    attributes.register(f"recorder.{_k}", int, f"recorder counter '{_k}', cumulative since process start (records)")
attributes.register("recorder.tail_dropped", int,
                    "records of this process the host's sink dropped by tail retention (PDTRACE_RETAIN=tail: the "
                    "request was fast and not head-sampled, or a step no kept request was in), cumulative; "
                    "recorded = dropped + written + tail_dropped + pending; absent without tail retention")
attributes.register("recorder.tail_ttft_ms", float,
                    "tail retention in force in the sink that wrote this stats row (PDTRACE_RETAIN=tail): its TTFT "
                    "threshold (ms; 0: none); absent without tail retention")
attributes.register("recorder.tail_tpot_ms", float, "tail retention: the sink's TPOT threshold (ms; 0: none)")
attributes.register("recorder.tail_head", float,
                    "tail retention: the fraction of the other requests the sink keeps anyway (head-sampled)")
attributes.register("recorder.writer_cpu_ns", int,
                    "CPU time of the traced process's pdtrace-writer thread since it started (thread CPU clock), ns")
attributes.register("recorder.sink_cpu_ns", int,
                    "CPU time of the host's sink process (shared by every traced process of the host that writes "
                    "into the same directory) since it started (process CPU clock), ns")
attributes.register("recorder.hook_errors", int,
                    "errors raised by pdtrace's own code inside the traced program's hooks and swallowed there "
                    "(the program ran on; those hooks' records may be missing), cumulative since process start (count)")
attributes.register("recorder.hook_error_first", str,
                    "the process's first swallowed hook error: '<hook qualname>: <exception class>' (names only, "
                    "never the message); absent while there is none")
attributes.register("recorder.sample", float, "fraction of requests the process traces (PDTRACE_SAMPLE, 0..1)")
attributes.register("recorder.step_sample", float,
                    "fraction of engine steps whose step spans the process keeps (PDTRACE_STEP_SAMPLE, 0..1)")

#: The keys the sink itself writes (its own rows) and those every pdtrace module registers on
#: import: part of every client's allowlist, whatever the client sends.
BASE_ALLOWED = dict(attributes.ALLOWED)

#: Thread name written on the sink's own rows (clock anchors, stats).
THREAD = "pdtrace-sink"

#: Niceness the sink adds to its own: when the CPU is short, the engine's threads come first
#: (at nice +10 the sink still gets ~10 % of a contended core, CFS weights 110 vs 1024,
#: about 30,000 records/s at ~3 µs each).
NICE = 10

#: Records joined into one Parquet row group.
ROW_GROUP = 8192

#: Records received from one client and kept as tuples before they are converted to one Arrow
#: table together: the writer sends chunks of 32-512 records, and a table per chunk would
#: repeat the per-table work (resource columns, dictionaries) for every few hundred rows.
CONVERT_BATCH = 4096

#: Bytes read from a client socket per call.
RECV_BYTES = 1 << 20


class Sink:
    """Converts the records of one client (traced process): its resource, allowlist, anchor and counters.

    The :class:`Collector` writes the tables of every client together; this class holds what is
    per client. ``cfg`` is the client's :class:`pdtrace.instrument.config.Config`.
    """

    def __init__(self, cfg, resource: dict, pid: int, start_tag: str, activation: str = "explicit",
                 anchors: clock.HostAnchors | None = None) -> None:
        self.cfg = cfg
        self.activation = activation  # written as pdtrace.activation on every stats row
        self.resource = resource
        self.pid = pid
        self.start_tag = start_tag
        self.allowed = _intern(BASE_ALLOWED)
        self.conv = Converter(self.allowed)
        self._ids = iter(range((random.SystemRandom().getrandbits(31) << 32) | 1, 1 << 64))
        self._raw: list[tuple] = []  # received, not yet converted (< CONVERT_BATCH)
        self._pending: list[pa.Table] = []
        self._pending_rows = 0  # records received since the last part file (in _raw and _pending)
        # the host's anchors (the collector's, shared by its clients; one of its own when used alone):
        # records convert through the anchor in effect at their start (clock.HostAnchors)
        self._anchors = anchors if anchors is not None else clock.HostAnchors(cfg.anchor_interval_s)
        self._anchor = self._anchors.latest(cfg.test_wall_offset_ns)
        self._anchor_due = 0.0  # the first file gets this anchor as it is (the latest when the client came)
        self._anchor_fresh = True
        self._read_cost = clock.read_cost_ns()
        self._clock_source = clock.clock_source()
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self.tail_dropped: int | None = None  # set to 0 by a collector with tail retention (counted from then)
        self.tail_held = 0  # records of this client held undecided by tail retention
        self.tail_dropped_row = None  # tail_dropped as written on its latest stats row
        self.tail_settings: dict[str, float] = {}  # the collector's retention settings, on every stats row
        self._warned: set[str] = set()
        self.warnings: list[str] = []  # not yet sent to the client
        self.otlp = None
        self._closed = False
        if cfg.otlp:
            try:
                from .otlp import OtlpExporter

                self.otlp = OtlpExporter(cfg)
            except Exception as exc:  # missing package or bad settings: Parquet goes on
                self._warn_once("otlp-init", "pdtrace: OTLP export disabled (%s: %s)", type(exc).__name__, exc)

    def counters(self) -> dict[str, int]:
        """written, dropped (failed writes), write_errors, export_errors, dropped_attributes, sink_cpu_ns;
        and tail_dropped with tail retention (:mod:`pdtrace.instrument.retention`)."""
        out = {"written": self.written, "dropped": self.dropped, "write_errors": self.write_errors,
               "export_errors": self.otlp.errors if self.otlp is not None else 0,
               "dropped_attributes": self.conv.dropped_attributes, "sink_cpu_ns": time.process_time_ns()}
        if self.tail_dropped is not None:
            out["tail_dropped"] = self.tail_dropped
        return out

    def set_allowed(self, allowed: dict) -> None:
        """The client's allowlist (its ``attributes.ALLOWED``) for records received from now on."""
        self.convert_received()
        self.allowed = _intern({**BASE_ALLOWED, **allowed})
        self.conv.allowed = self.allowed

    def add(self, recs: list[tuple]) -> None:
        """Take records into the pending part, converted (monotonic times → epoch ns through the
        current anchor) :data:`CONVERT_BATCH` at a time."""
        if recs:
            self._raw.extend(recs)
            self._pending_rows += len(recs)
            if len(self._raw) >= CONVERT_BATCH:
                self.convert_received()

    def convert_received(self) -> None:
        """Convert the records received so far with the current resource, allowlist and anchor (kept for the
        next part file). A record that cannot be converted is dropped alone and counted (:meth:`_convert`)."""
        if not self._raw:
            return
        raw, self._raw = self._raw, []
        for recs, offset in self._anchors.split(raw, START, self.cfg.test_wall_offset_ns):
            tables, bad = self._convert(recs, self.resource, offset)
            self._pending += tables
            self._pending_rows -= bad

    def _convert(self, raw: list[tuple], res: dict, offset: int) -> tuple[list[pa.Table], int]:
        """``raw`` converted with this client's converter: (tables, records dropped).

        A batch that fails to convert is converted again record by record: a record that still
        fails is dropped and counted (``dropped``, one warning per exception class), never kept
        to fail every later batch; the others are kept. ``dropped_attributes`` counts the kept
        records' dropped attributes once, whatever the retries.
        """
        conv = self.conv
        before = conv.dropped_attributes
        try:
            return [conv.table(raw, res, offset)], 0
        except Exception:  # noqa: BLE001 - the record at fault is found below
            pass
        good, bad = [], 0
        for r in raw:
            try:
                conv.table([r], res, offset)
            except Exception as exc:  # noqa: BLE001
                self._drop_unconvertible(1, exc)
                bad += 1
            else:
                good.append(r)
        conv.dropped_attributes = before
        if good:
            try:
                return [conv.table(good, res, offset)], bad
            except Exception as exc:  # noqa: BLE001 - each converts alone, but not together
                conv.dropped_attributes = before
                self._drop_unconvertible(len(good), exc)
                bad += len(good)
        return [], bad

    def _drop_unconvertible(self, n: int, exc: Exception) -> None:
        """Count ``n`` received records as dropped (not written) and warn once per exception class."""
        self.dropped += n
        # the class only: an encoding error's message quotes the offending text
        self._warn_once(f"convert-{type(exc).__name__}", "pdtrace: a record could not be converted "
                        "(%s); such records are dropped and counted", type(exc).__name__)

    def take(self, traced: dict, final: bool, extra_recorded: int = 0) -> tuple[list, list, int] | None:
        """What this client puts into the next part file: ``(tables, segments, rows)``.

        ``tables``: records already converted (a batch of :data:`CONVERT_BATCH`, or before a
        resource or allowlist change); ``segments``: ``[(records, resource, offset_ns, allowed)]``
        still to convert (:meth:`Converter.table_joint` converts every client's together; then
        :meth:`credit` its dropped attributes, or :meth:`convert_segments` on failure): the
        records received since, then a stats row and, when due, a clock anchor; ``rows``: this
        client's records in them. None when there is nothing to write (no record, not final, no
        anchor due). ``extra_recorded``: records received since the counters ``traced`` were taken
        (they count as recorded too).
        """
        if not self._pending_rows and not final and time.monotonic() < self._anchor_due:
            return None
        rows = self._pending_rows
        segs = []
        if self._raw:  # each through the anchor in effect at its start
            for recs, offset in self._anchors.split(self._raw, START, self.cfg.test_wall_offset_ns):
                segs.append((recs, self.resource, offset, self.allowed))
            self._raw = []
        meta = self._meta_records(traced, final, rows, extra_recorded)
        segs.append((meta, self.resource, self._anchor.offset_ns, self.allowed))
        tables, self._pending, self._pending_rows = self._pending, [], 0
        return tables, segs, rows

    def credit(self, dropped_attributes: int) -> None:
        """Attributes of this client's records dropped in a joint conversion."""
        self.conv.dropped_attributes += dropped_attributes

    def convert_segments(self, segs: list) -> tuple[list[pa.Table], int]:
        """This client's segments converted on their own (no joint conversion): (tables, records dropped)."""
        out, bad = [], 0
        for recs, res, offset, _allowed in segs:
            t, b = self._convert(recs, res, offset)
            out += t
            bad += b
        return out, bad

    def written_ok(self, rows: int) -> None:
        """The part file holding ``rows`` of this client's records was written."""
        self.written += rows

    def write_failed(self, rows: int, exc: OSError, directory: str) -> None:
        """The part file holding ``rows`` of this client's records could not be written: dropped and counted."""
        self.write_errors += 1
        self.dropped += rows
        self._warn_once(f"os-{exc.errno}", "pdtrace: cannot write trace file in %s (%s); "
                        "spans are dropped and counted, tracing goes on", directory, exc.strerror or exc)

    def close(self) -> None:
        """Stop the OTLP exporter (waits up to half the flush interval, at least 0.1 s). Idempotent."""
        if self.otlp is not None and not self._closed:
            self._closed = True
            self.otlp.shutdown(max(0.1, self.cfg.flush_interval_s / 2))

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            text = msg % args if args else msg
            log.warning("%s", text)
            self.warnings.append(text)

    def _meta_records(self, traced: dict, final: bool, rows: int, extra_recorded: int = 0) -> list[tuple]:
        """Clock anchor (when due) and recorder stats rows, in record-tuple layout.

        The stats row counts the ``rows`` of the file it is written in as written, and the
        ``extra_recorded`` records received after ``traced`` was read as recorded.
        """
        out = []
        now = time.monotonic()
        if now >= self._anchor_due or final:
            if self._anchor_fresh:  # the latest when the client connected: written once as it is
                self._anchor_fresh = False
            else:
                self._anchors.refresh()
                self._anchor = self._anchors.latest(self.cfg.test_wall_offset_ns)
            a = self._anchor
            self._anchor_due = now + self.cfg.anchor_interval_s
            out.append((R_CLOCK, next(self._ids), None, None, "clock.anchor", schema.KIND_INTERNAL,
                        a.mono_ns, a.mono_ns, 0, None, None, 0, 0, None, THREAD,
                        "clock.mono_ns", "clock.uncertainty_ns", "clock.read_cost_ns", "clock.test_offset_ns",
                        "clock.source", a.mono_ns, a.uncertainty_ns, self._read_cost, a.test_offset_ns,
                        self._clock_source))
        st = stats(traced, self.counters())
        st["written"] += rows
        st["recorded"] += extra_recorded
        t = clock.now_ns()
        attrs = {f"recorder.{k}": v for k, v in st.items()}
        self.tail_dropped_row = self.tail_dropped
        attrs["pdtrace.activation"] = self.activation
        if traced.get("hook_error_first"):
            attrs["recorder.hook_error_first"] = traced["hook_error_first"]
        # the sampling in force, so that a reader (pdtrace check, view processes) can say what was traced
        attrs["recorder.sample"], attrs["recorder.step_sample"] = float(self.cfg.sample), float(self.cfg.step_sample)
        attrs.update(self.tail_settings)
        out.append((R_STATS, next(self._ids), None, None, "recorder.stats", schema.KIND_INTERNAL,
                    t, t, 0, None, None, 0, 0, None, THREAD, *attrs, *attrs.values()))
        return out


_INTERNED: dict[frozenset, dict] = {}


def _intern(allowed: dict) -> dict:
    """One dict object per distinct allowlist: clients whose allowlists are equal share it, so that
    their records' attributes convert in one call (:meth:`Converter.table_joint` groups by identity)."""
    k = frozenset(allowed.items())
    d = _INTERNED.get(k)
    if d is None:
        if len(_INTERNED) > 256:
            _INTERNED.clear()
        d = _INTERNED[k] = dict(allowed)
    return d


def _row_groups(tables: list[pa.Table]) -> list[pa.Table]:
    """The tables joined into groups of about :data:`ROW_GROUP` rows (zero-copy), one row group each."""
    out, cur, n = [], [], 0
    for t in tables:
        cur.append(t)
        n += t.num_rows
        if n >= ROW_GROUP:
            out.append(pa.concat_tables(cur))
            cur, n = [], 0
    if cur:
        out.append(pa.concat_tables(cur))
    return out


class _Conn:
    """One client connection: its socket, input and output buffers, its :class:`Sink` once initialised."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.sink: Sink | None = None
        self.traced: dict = {}
        self.since_tick = 0  # records received after the last tick's counters
        self.asked = 0  # latest 'flush'/'final' tick generation not yet answered
        self.served = 0  # latest generation answered
        self.final = False  # a final tick came: ends after the next file
        self.eof = False  # the connection ended (the client exited or was killed)
        self.sync = False  # a control client waiting for a sync
        self.in_part = False  # had rows in the file just written


class Collector:
    """The sink process's state: the listening socket, the clients, the part files not yet merged."""

    def __init__(self, cfg, listener: socket.socket) -> None:
        self.cfg = cfg
        #: one set of clock anchors for every client: their records' epoch times agree (clock.HostAnchors)
        self.anchors = clock.HostAnchors(cfg.anchor_interval_s)
        self.dir = cfg.trace_dir
        self.listener = listener
        listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.conns: dict[int, _Conn] = {}
        self.conv = Converter()  # converts every client's records of a part file together
        self._parts: list[tuple[str, list[pa.Table]]] = []
        self._parts_bytes = 0
        self._parts_dir = self.dir  # the directory of the parts in _parts (PDTRACE_LAYOUT=hive: a partition)
        self._segment_started = time.monotonic()
        self._seq = 0
        self._start_tag = time.strftime("%Y%m%dT%H%M%S")
        self._host = socket.gethostname().replace("-", "_")
        self._idle_since = time.monotonic()
        self._next_write = time.monotonic() + cfg.flush_interval_s
        self._warned: set[str] = set()
        self.stopping = False
        self.files_written = 0
        self.mark_asked = False  # SIGUSR1: mark a window (retention.SIGNAL_WINDOW_S)
        self._retired: list[_Conn] = []  # ended clients whose records tail retention still holds
        self.retention = TailRetention(cfg, self.dir, self._host) if cfg.retain == "tail" else None
        if self.retention is not None:
            r = self.retention
            log.warning("pdtrace: tail retention on in %s: TTFT >= %.1f ms, TPOT >= %.1f ms, head %.3f, hold %.1f s, "
                        "memory bound %.1f MiB (held records, estimated)", self.dir, cfg.tail_ttft_ms,
                        cfg.tail_tpot_ms, r.head, cfg.tail_hold_s, r.bound / (1 << 20))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until idle for PDTRACE_SINK_IDLE_S with no client, or until SIGTERM; then write, merge, return."""
        interval = self.cfg.flush_interval_s
        ret = self.retention
        while not self.stopping:
            timeout = max(0.0, self._next_write - time.monotonic())
            if not self.conns:
                timeout = min(timeout, max(0.0, self._idle_since + self.cfg.sink_idle_s - time.monotonic()))
            if ret is not None:
                due = ret.next_due_s()
                timeout = min(timeout, 0.5 if due is None else due)  # 0.5: the marks file is looked at
            self._poll(timeout)
            now = time.monotonic()
            if ret is not None:
                try:
                    if self.mark_asked:
                        self.mark_asked = False
                        t = time.time_ns()
                        ret.mark(t - int(SIGNAL_WINDOW_S[0] * 1e9), t + int(SIGNAL_WINDOW_S[1] * 1e9), "signal")
                    ret.tick()
                except Exception as exc:  # noqa: BLE001 - retention's fault must not stop the sink
                    self._warn_once(f"tail-{type(exc).__name__}", "pdtrace: tail retention error %s: %s",
                                    type(exc).__name__, exc)
            if any(c.sync for c in self.conns.values()):
                for _ in range(20):  # take in what every client sent before the sync (an ended client's EOF)
                    if not self._poll(0.0):
                        break
            due = now >= self._next_write
            if due or any(c.asked > c.served or c.final or c.eof or c.sync for c in self.conns.values()):
                self.write_part()
                if due:
                    self._next_write = now + interval
            if not self.conns and not self._parts and not self._retired \
                    and time.monotonic() - self._idle_since >= self.cfg.sink_idle_s:
                self._poll(0.0)  # a client that connected just now is served, not reset
                if not self.conns:
                    return
        # SIGTERM: what the clients sent so far is taken in, everything held is written, every client
        # answered, then the sockets close
        for _ in range(20):
            if not self._poll(0.0):
                break
        for c in self.conns.values():
            c.final = True
        self.write_part()
        self._merge_parts()
        if self.retention is not None:
            self.retention.write_summary()
            self.retention.close()
            log.warning("pdtrace: tail retention summary %s", self.retention.summary())

    def _poll(self, timeout: float) -> int:
        """One select round (``timeout`` s); handle accepts and input. Returns the events handled."""
        try:
            events = self.sel.select(timeout)
        except InterruptedError:
            return 0
        for key, mask in events:
            if key.data is None:
                self._accept()
                continue
            c: _Conn = key.data
            if mask & selectors.EVENT_READ:
                self._read(c)
            if mask & selectors.EVENT_WRITE:
                self._flush_out(c)
        return len(events)

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                _pid, uid = hostsink.peer_cred(s)
            except OSError:
                uid = -1
            if uid != os.getuid():  # abstract sockets have no permission bits: refuse other users
                s.close()
                continue
            s.setblocking(False)
            c = _Conn(s)
            self.conns[s.fileno()] = c
            self.sel.register(s, selectors.EVENT_READ, c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            c.eof = True
            try:
                self.sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            return
        c.inbuf += data
        for m in hostsink.unframe(c.inbuf):
            self._handle(c, pickle.loads(m))

    def _handle(self, c: _Conn, msg: tuple) -> None:
        kind = msg[0]
        sink = c.sink
        try:
            if kind == "recs":
                recs = msg[1]
                if sink is None:  # records before the client's init: nothing to count them on
                    self._warn_once("recs-before-init", "pdtrace: sink: records from a client before its init "
                                    "(ignored)")
                    return
                c.since_tick += len(recs)
                if self.retention is not None:
                    recs = self.retention.admit(sink, recs)
                sink.add(recs)
            elif kind == "tick":
                _, gen, c.traced, mode = msg
                c.since_tick = 0
                if mode != "periodic":
                    c.asked = max(c.asked, gen)
                    c.final = c.final or mode == "final"
            elif kind == "res":  # for records from now on
                sink.convert_received()
                sink.resource = msg[1]
            elif kind == "attrs":
                sink.set_allowed(msg[1])
            elif kind == "init":
                c.sink = Sink(*msg[1:], anchors=self.anchors)
                if self.retention is not None:
                    c.sink.tail_dropped = 0
                    self.retention.add_client(c.sink)
                    c.sink.tail_settings = {"recorder.tail_ttft_ms": float(self.cfg.tail_ttft_ms),
                                            "recorder.tail_tpot_ms": float(self.cfg.tail_tpot_ms),
                                            "recorder.tail_head": float(self.cfg.tail_head)}
            elif kind == "sync":
                c.sync = True
        except Exception as exc:  # never die on one bad batch: count it and go on
            if sink is None:
                self._warn_once(f"bad-{type(exc).__name__}", "pdtrace: sink: bad message %r from a client (%s)",
                                kind, type(exc).__name__)
                return
            sink.write_errors += 1
            if kind == "recs":
                sink.dropped += len(msg[1])
            sink._warn_once(f"sink-{type(exc).__name__}", "pdtrace: sink error %s: %s", type(exc).__name__, exc)

    # ----------------------------------------------------------------- files
    def write_part(self) -> None:
        """Write every client's pending records as one part file; answer, and drop the clients that ended."""
        entries = []  # [conn, tables, rows]
        joint = []  # (conn, segments) converted together
        if self.retention is not None and (any(c.sync for c in self.conns.values()) or not any(
                c.sink is not None and not (c.final or c.eof) for c in self.conns.values())):
            try:
                self.retention.decide_all()  # a sync, or no client left: nothing stays held
            except Exception as exc:  # noqa: BLE001 - retention's fault must not stop the sink
                self._warn_once(f"tail-{type(exc).__name__}", "pdtrace: tail retention error %s: %s",
                                type(exc).__name__, exc)
        retired = {id(c) for c in self._retired}
        for c in list(self.conns.values()) + self._retired:
            c.in_part = False
            if c.sink is None:
                continue
            if id(c) in retired and not c.sink._pending_rows and c.sink.tail_dropped == c.sink.tail_dropped_row:
                continue  # an ended client (EOF or final tick): a row only for records or a changed count
            try:
                got = c.sink.take(c.traced, c.final or c.eof, c.since_tick)
            except Exception as exc:  # noqa: BLE001 - one client's fault must not stop the others
                c.sink.write_errors += 1
                c.sink._warn_once(f"take-{type(exc).__name__}", "pdtrace: sink error %s: %s", type(exc).__name__, exc)
                got = None
            if got is None:
                continue
            tables, segs, rows = got
            e = [c, tables, rows]
            entries.append(e)
            if c.sink.otlp is None or c.sink._closed:  # closed: an ended client's late-decided records
                joint.append((e, segs))
            else:  # its OTLP export needs tables of its own rows (one resource per table)
                t, bad = c.sink.convert_segments(segs)
                e[1], e[2] = tables + t, rows - bad
                for g in _row_groups(e[1]):
                    c.sink.otlp.submit(g)
        if joint:
            segs = [sg for _, ss in joint for sg in ss]
            try:
                table, dropped = self.conv.table_joint(segs)
            except Exception:  # noqa: BLE001 - a record that cannot be converted: each client on its own
                for e, ss in joint:
                    t, bad = e[0].sink.convert_segments(ss)
                    e[1], e[2] = e[1] + t, e[2] - bad
            else:
                it = iter(dropped)
                for e, ss in joint:
                    e[0].sink.credit(sum(next(it) for _ in ss))
                joint[0][0][1] = joint[0][0][1] + [table]  # the joint table rides with the first entry
        if entries:
            groups = _row_groups([t for _, ts, _ in entries for t in ts])
            d = self._part_dir()
            if d != self._parts_dir:
                if self._parts:  # a new hour: the parts held so far become a segment in their own partition
                    self._merge_parts()
                self._parts_dir = d
            name = self._file_name("p")
            try:
                store.write_tables(d, groups, name, compression=store.PART_COMPRESSION)
            except OSError as exc:
                for c, _, rows in entries:
                    c.sink.write_failed(rows, exc, d)
            else:
                self.files_written += 1
                for c, _, rows in entries:
                    c.sink.written_ok(rows)
                    c.in_part = True
                self._parts.append((name, groups))
                self._parts_bytes += sum(g.get_total_buffer_size() for g in groups)
        # rotation before the answers: a client told its final tick is written finds the segment in place
        staying = any(c.sink is not None and not (c.final or c.eof) for c in self.conns.values())
        due = self.cfg.rotate_s > 0 and time.monotonic() - self._segment_started >= self.cfg.rotate_s
        if due or self._parts_bytes >= self.cfg.rotate_bytes or not staying:
            self._merge_parts()
        for c in list(self._retired):
            if c.sink.tail_held <= 0 and not c.sink._pending_rows \
                    and c.sink.tail_dropped == c.sink.tail_dropped_row:
                self._retired.remove(c)
                c.sink.close()
                if self.retention is not None:
                    self.retention.forget(c.sink)
        for c in list(self.conns.values()):
            if c.sink is not None and (c.final or c.eof) and c.sink.tail_held <= 0:
                # its OTLP export done before it is told its records are written (records tail retention
                # still holds are exported when decided: closed when it leaves the retired clients)
                c.sink.close()
            if c.sink is not None and (c.in_part or c.asked > c.served or c.final or c.sink.warnings):
                self._answer(c)
            if c.sync:
                self._send(c, ("synced",))
        for fd, c in list(self.conns.items()):
            if c.final or c.eof or c.sync:
                self._drop(fd, c)

    def _answer(self, c: _Conn) -> None:
        c.served = c.asked
        warnings, c.sink.warnings = c.sink.warnings, []
        self._send(c, ("ack", c.served, c.sink.counters(), warnings))

    def _send(self, c: _Conn, msg: tuple) -> None:
        if c.eof:
            return
        c.outbuf += hostsink.frame(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self._flush_out(c)

    def _flush_out(self, c: _Conn) -> None:
        """Send what the connection's output buffer holds without blocking; wait for writability if needed."""
        try:
            while c.outbuf:
                n = c.sock.send(c.outbuf, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                del c.outbuf[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            c.outbuf.clear()
        try:
            if not c.eof:
                self.sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.outbuf else 0), c)
        except (KeyError, ValueError):
            pass

    def _drop(self, fd: int, c: _Conn) -> None:
        """Forget a connection that ended (after its last answer): close its socket."""
        if c.outbuf and not c.eof:  # its last answer: try once more, blocking briefly
            try:
                c.sock.settimeout(1.0)
                c.sock.sendall(c.outbuf, socket.MSG_NOSIGNAL)
            except OSError:
                pass
        if c.sink is not None:
            if c.sink.tail_held > 0:  # tail retention holds some of its records: written when decided
                self._retired.append(c)
            else:
                c.sink.close()
                if self.retention is not None:
                    self.retention.forget(c.sink)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        del self.conns[fd]
        if not self.conns:
            self._idle_since = time.monotonic()

    def _part_dir(self) -> str:
        """The directory of the next part file: the trace directory (layout ``flat``) or, with
        ``hive``, its partition of the current UTC hour and this host (:func:`layout.partition`)."""
        if self.cfg.layout != "hive":
            return self.dir
        return os.path.join(self.dir, layout.partition(time.time_ns(), socket.gethostname()))

    def _file_name(self, kind: str) -> str:
        self._seq += 1
        return f"sink-{self._host}-{os.getpid()}-{self._start_tag}-{kind}{self._seq:06d}.parquet"

    def _merge_parts(self) -> None:
        if self.retention is not None:
            self.retention.write_summary()
        parts, self._parts, self._parts_bytes = self._parts, [], 0
        self._segment_started = time.monotonic()
        if len(parts) <= 1:
            return
        try:
            store.merge_parts(self._parts_dir, parts, self._file_name("s"))
        except OSError as exc:
            for c in self.conns.values():
                if c.sink is not None:
                    c.sink.write_errors += 1
                    c.sink._warn_once(f"merge-{exc.errno}", "pdtrace: cannot merge trace files in %s (%s); "
                                      "parts kept", self.dir, exc.strerror or exc)
            self._warn_once(f"merge-{exc.errno}", "pdtrace: cannot merge trace files in %s (%s); parts kept",
                            self.dir, exc.strerror or exc)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def main(argv: list[str], listen: tuple[str, socket.socket]) -> int:
    """Entry point: ``python -m pdtrace.instrument.sink --dir DIR --by PID`` (after :func:`_daemonize`)."""
    d, sock = listen
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:
        pass
    try:
        os.chdir("/")  # hold no directory of the process that started it
    except OSError:
        pass
    logging.basicConfig(format="%(asctime)s pdtrace-sink %(process)d %(message)s")
    cfg = dataclasses.replace(config.from_env(), trace_dir=d)
    col = Collector(cfg, sock)

    def _term(signum, frame):
        col.stopping = True

    signal.signal(signal.SIGTERM, _term)

    def _usr1(signum, frame):
        col.mark_asked = True

    signal.signal(signal.SIGUSR1, _usr1)
    if _EARLY_USR1:
        col.mark_asked = True
    # A process inherits the signal mask of the thread that started it: a traced process's writer
    # thread, which blocks SIGTERM (recorder's Writer.start). Unblocked here, or SIGTERM stays pending.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
    col.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv, _LISTEN))
