"""The background writer: drains the recorder's buffer, converts, writes Parquet.

Contract (the *exporter* role of OpenTelemetry's SDK): all I/O and all
conversion happen here, on the ``pdtrace-writer`` daemon thread, never on a
caller's thread.

Files. Every flush interval (PDTRACE_FLUSH_INTERVAL_S, default 1 s) the rows
drained since the last flush are written as one complete *part* file
(``<role>-<host>-<pid>-<start>-p<seq>.parquet``), through a temporary name
and a rename, so a SIGKILL loses at most one interval and leaves no partial
file. At least every PDTRACE_ROTATE_S (or PDTRACE_ROTATE_BYTES of parts) the
process's parts are merged into one *segment* file (``-s<seq>.parquet``) and
then deleted; a reader that lists the directory between the rename and the
deletes sees those rows twice, which readers remove by ``record_id``.

GIL. A thread waiting for the GIL only forces a switch after the
interpreter's switch interval (5 ms by default), and pdtrace does not change
that process-wide setting. So the writer yields on its own: conversion runs in
chunks of :data:`CHUNK` records with yield points (:meth:`Writer._yield`)
between steps, and whenever it has held the GIL for :data:`HOLD_NS` it
sleeps :data:`YIELD_S`, long enough for a waiting thread to take the GIL.
Parquet encoding and compression run in pyarrow's C++ code without the GIL.
The longest stall a busy thread sees is measured in BENCHMARKS.md.

Failures. An OSError while writing (directory not writable, deleted, disk
full) drops that file's rows, counts them (``dropped``, ``write_errors``) and
logs one warning per kind of error; the writer keeps running and retries at
the next interval (re-creating the directory).
"""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pyarrow as pa

from . import attributes, clock, schema, store
from .recorder import R_CLOCK, R_EVENT, R_SPAN, R_STATS

log = logging.getLogger("pdtrace")

#: Records converted per step before the writer yields the GIL.
CHUNK = 512

#: Longest stretch (ns) the writer runs Python/arrow conversion before yielding.
HOLD_NS = 400_000

#: Chunk tables (of CHUNK records) joined into one group, i.e. one Parquet row group (8,192 rows).
CONCAT_GROUP = 16

#: Sleep (s) at a yield point: a real sleep, so a thread blocked on the GIL wakes
#: and takes it (``sleep(0)`` re-takes the GIL before a waiter can wake).
YIELD_S = 0.00005

_RTYPES = pa.array(list(schema.RECORD_TYPES), pa.string())
_T = {name: typ for name, typ, _ in schema.COLUMNS}

attributes.register("clock.mono_ns", int, "monotonic reading of a clock anchor (ns)")
attributes.register("clock.uncertainty_ns", int, "half the read window of a clock anchor (ns)")
attributes.register("clock.read_cost_ns", int, "median cost of one monotonic clock read (ns)")
attributes.register("clock.test_offset_ns", int, "TEST ONLY wall shift applied to this process's anchors (ns)")
attributes.register("clock.source", str, "implementation of the monotonic clock")
for _k in ("recorded", "dropped", "written", "write_errors", "export_errors", "dropped_attributes"):
    attributes.register(f"recorder.{_k}", int, f"recorder counter '{_k}', cumulative since process start (records)")
attributes.register("recorder.writer_cpu_ns", int,
                    "CPU time of the pdtrace-writer thread since it started (thread CPU clock), ns")


class Writer(threading.Thread):
    """The ``pdtrace-writer`` thread of one recorder (one per process)."""

    def __init__(self, tracer, cfg) -> None:
        super().__init__(name="pdtrace-writer", daemon=True)
        self.tracer = tracer
        self.cfg = cfg
        self.dir = cfg.trace_dir
        self._stop_evt = threading.Event()
        self._flush_req = threading.Event()
        self._flush_done = threading.Condition()
        self._flush_gen = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._parts: list[tuple[str, pa.Table]] = []
        self._parts_bytes = 0
        self._segment_started = time.monotonic()
        self._seq = 0
        self._start_tag = time.strftime("%Y%m%dT%H%M%S")
        self._anchor = clock.take_anchor(cfg.test_wall_offset_ns)
        self._anchor_due = 0.0
        self._read_cost = clock.read_cost_ns()
        self._clock_source = clock.clock_source()
        self.written = 0
        self.drained = 0
        self.dropped_in_writer = 0
        self.write_errors = 0
        self.dropped_attributes = 0
        self._warned: set[str] = set()
        self._held_since = time.perf_counter_ns()
        self._cpu_mark = 0
        self.max_stretch_cpu_ns = 0
        self._trace_ids: dict[str, str] = {}
        self._res_cache: tuple | None = None
        self.otlp = None
        if cfg.otlp:
            try:
                from .otlp import OtlpExporter

                self.otlp = OtlpExporter(cfg)
            except Exception as exc:  # missing package or bad settings: Parquet goes on
                self._warn_once("otlp-init", "pdtrace: OTLP export disabled (%s: %s)", type(exc).__name__, exc)

    # ------------------------------------------------------------- control
    def counters(self) -> dict[str, int]:
        """written, write_errors, export_errors, dropped_attributes (cumulative)."""
        return {
            "written": self.written,
            "write_errors": self.write_errors,
            "export_errors": self.otlp.errors if self.otlp is not None else 0,
            "dropped_attributes": self.dropped_attributes,
        }

    def cpu_ns(self) -> int:
        """CPU time (ns, thread CPU clock) this writer thread has used so far; 0 if unavailable."""
        try:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(self.ident))
        except (AttributeError, OSError, TypeError, OverflowError):
            return 0

    def stats(self) -> dict[str, int]:
        """All recorder counters (see Tracer.stats); ``recorded`` = dropped + written + pending."""
        st = self.counters()
        st["writer_cpu_ns"] = self.cpu_ns()
        st["dropped"] = self.tracer.dropped_count() + self.dropped_in_writer
        st["recorded"] = st["dropped"] + st["written"] + self.pending()
        return st

    def pending(self) -> int:
        """Records drained or buffered but not yet written or dropped."""
        return len(self.tracer._buf) + self._pending_rows

    def flush(self, timeout: float) -> bool:
        """Ask for a flush now and wait up to ``timeout`` s for it; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._flush_done:
            target = self._flush_gen + 1
            self._flush_req.set()
            self.tracer._wake.set()
            while self._flush_gen < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    return False
                self._flush_done.wait(min(left, 0.05))
        return True

    def stop(self, timeout: float) -> bool:
        """Final flush (merging parts into a segment), then end the thread; False on timeout."""
        self._stop_evt.set()
        self.tracer._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        ok = not self.is_alive()
        if self.otlp is not None:
            ok = self.otlp.shutdown(max(0.1, timeout / 2)) and ok
        return ok

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ---------------------------------------------------------------- loop
    def run(self) -> None:
        # Pay pyarrow's one-time initialisation now, not in the middle of the first flush.
        try:
            self._convert([(R_SPAN, 0, 0, None, "warm-up", 1, 0, 0, 0, None, "w", 0, 0, None, "w",
                            {"step.id": 1, "kv.op": "READ"})])
        except Exception:
            pass
        interval = self.cfg.flush_interval_s
        next_flush = time.monotonic() + interval
        wake = self.tracer._wake
        while True:
            wake.wait(max(0.0, next_flush - time.monotonic()))
            wake.clear()
            self._mark()
            stopping = self._stop_evt.is_set()
            # A flush request counts as served only by a drain that began after it.
            asked = self._flush_req.is_set()
            if asked:
                self._flush_req.clear()
            try:
                self._drain()
                now = time.monotonic()
                if stopping or asked or now >= next_flush:
                    self._write_part(final=stopping)
                    next_flush = now + interval
            except Exception as exc:  # never let the thread die: count and go on
                self.write_errors += 1
                self._warn_once(f"loop-{type(exc).__name__}", "pdtrace: writer error %s: %s", type(exc).__name__, exc)
            if asked or stopping:
                with self._flush_done:
                    self._flush_gen += 1
                    self._flush_done.notify_all()
            if stopping:
                return

    def _drain(self) -> None:
        buf = self.tracer._buf
        n = len(buf)
        pop = buf.popleft
        while n > 0:
            k = min(n, CHUNK)
            chunk = [pop() for _ in range(k)]
            n -= k
            self.drained += k
            self._pending.append(self._convert(chunk))
            self._pending_rows += k
            self._yield()

    def _mark(self) -> None:
        """Start a new stretch of GIL-holding work (after a wait or a GIL-free call)."""
        self._held_since = time.perf_counter_ns()
        self._cpu_mark = time.thread_time_ns()

    def _yield(self) -> None:
        """Release the GIL briefly if the writer has held it for HOLD_NS or more.

        Also keeps ``max_stretch_cpu_ns``: the longest run of this thread's CPU
        time between two releases (an upper bound of a GIL hold that, unlike
        wall time, other processes on the machine cannot inflate).
        """
        now = time.perf_counter_ns()
        if now - self._held_since >= HOLD_NS:
            cpu = time.thread_time_ns()
            if cpu - self._cpu_mark > self.max_stretch_cpu_ns:
                self.max_stretch_cpu_ns = cpu - self._cpu_mark
            time.sleep(YIELD_S)
            self._held_since = time.perf_counter_ns()
            self._cpu_mark = time.thread_time_ns()

    # ---------------------------------------------------------- conversion
    def _trace_id(self, rid: str) -> str:
        t = self._trace_ids.get(rid)
        if t is None:
            if len(self._trace_ids) > 65536:
                self._trace_ids.clear()
            t = self._trace_ids[rid] = self.tracer.trace_id(rid)
        return t

    def _convert(self, recs: list[tuple]) -> pa.Table:
        """Turn record tuples (recorder.py layout) into a table of schema.SCHEMA."""
        n = len(recs)
        (rtype, record_id, span_id, parent, name, kind, start, end, status, msg,
         rid, pidx, attempt, rank, thread, attrs) = zip(*recs)
        offset = self._anchor.offset_ns
        res = self.tracer.resource
        cols: dict[str, pa.Array] = dict(self._resource_columns(res, n))  # schema_version + resource columns
        cols["record"] = pa.DictionaryArray.from_arrays(pa.array(rtype, pa.int32()), _RTYPES)
        cols["record_id"] = pa.array(record_id, pa.uint64())
        cols["span_id"] = pa.array(span_id, pa.uint64())
        cols["parent_span_id"] = pa.array(parent, pa.uint64())
        self._yield()
        cols["name"] = pa.array(name, pa.string()).dictionary_encode()
        cols["kind"] = pa.array(kind, pa.int8())
        cols["start_ns"] = pa.array(np.asarray(start, dtype=np.int64) + offset)
        cols["end_ns"] = pa.array(np.asarray(end, dtype=np.int64) + offset)
        self._yield()
        cols["status_code"] = pa.array(status, pa.int8())
        cols["status_message"] = pa.array(msg, pa.string())
        rid_arr = pa.array(rid, pa.string())
        cols["request_id"] = rid_arr
        d = rid_arr.dictionary_encode()
        tids = pa.array([self._trace_id(x) for x in d.dictionary.to_pylist()], pa.string())
        cols["trace_id"] = tids.take(d.indices) if len(tids) else pa.nulls(n, pa.string())
        self._yield()
        cols["prompt_index"] = pa.array(pidx, pa.int32())
        cols["attempt"] = pa.array(attempt, pa.int32())
        default_rank = res.get("tp_rank")
        if default_rank is not None:
            rank = [default_rank if r is None else r for r in rank]
        cols["tp_rank"] = pa.array(rank, pa.int16())
        cols["thread"] = pa.array(thread, pa.string()).dictionary_encode()
        oi, ki, vi = [0], [], []
        of, kf, vf = [0], [], []
        os_, ks, vs = [0], [], []
        allowed = attributes.ALLOWED
        dropped = 0
        yield_ = self._yield
        for j, a in enumerate(attrs):
            if not j & 255:
                yield_()
            if a:
                for k, v in a.items():
                    spec = allowed.get(k)
                    if spec is None:
                        dropped += 1
                        continue
                    t = spec.type
                    tv = type(v)
                    if t is int:
                        if tv is int or tv is bool:
                            ki.append(k)
                            vi.append(int(v))
                        else:
                            dropped += 1
                    elif t is str:
                        if tv is str:
                            ks.append(k)
                            vs.append(v if len(v) <= spec.max_len else v[: spec.max_len])
                        else:
                            dropped += 1
                    elif tv is float or tv is int:
                        kf.append(k)
                        vf.append(float(v))
                    else:
                        dropped += 1
            oi.append(len(ki))
            of.append(len(kf))
            os_.append(len(ks))
        self.dropped_attributes += dropped
        self._yield()
        cols["attr_int"] = pa.MapArray.from_arrays(pa.array(oi, pa.int32()), pa.array(ki, pa.string()), pa.array(vi, pa.int64()))
        self._yield()
        cols["attr_float"] = pa.MapArray.from_arrays(pa.array(of, pa.int32()), pa.array(kf, pa.string()), pa.array(vf, pa.float64()))
        self._yield()
        cols["attr_str"] = pa.MapArray.from_arrays(pa.array(os_, pa.int32()), pa.array(ks, pa.string()), pa.array(vs, pa.string()))
        self._yield()
        arrays = [cols[c].cast(_T[c]) if cols[c].type != _T[c] else cols[c] for c, _, _ in schema.COLUMNS]
        self._yield()
        return pa.Table.from_arrays(arrays, schema=schema.SCHEMA)

    def _groups(self, tables: list[pa.Table]) -> list[pa.Table]:
        """The flush's chunk tables joined in groups of :data:`CONCAT_GROUP` (zero-copy), yielding between groups.

        Joining all of a full buffer's ~800 chunk tables at once holds the GIL
        for milliseconds (the cost grows with the chunks of every column); a
        group of 16 is a short step. Each group is one row group in the file.
        """
        out = []
        for i in range(0, len(tables), CONCAT_GROUP):
            out.append(pa.concat_tables(tables[i:i + CONCAT_GROUP]))
            self._yield()
        return out

    def _paced(self, groups: list[pa.Table]):
        """Iterate ``groups`` for :func:`store.write_tables`, starting a new GIL stretch after each GIL-free encode."""
        for g in groups:
            yield g
            self._mark()

    def _resource_columns(self, res: dict, n: int) -> dict[str, pa.Array]:
        """The constant columns (resource attributes, schema_version) for ``n`` rows, built once.

        Cached for the last (resource dict, n) pair: almost every chunk has
        :data:`CHUNK` rows, and :meth:`Tracer.set_resource` replaces the dict
        (the cache keeps a reference, so an identity match cannot be a reused id).
        """
        c = self._res_cache
        if c is None or c[0] is not res or c[1] != n:
            cols = {"schema_version": _const(schema.SCHEMA_VERSION, n)}
            for name in schema.RESOURCE_COLUMNS:
                v = res.get(name)
                cols[name] = pa.array([v] * n, _T[name]) if name == "pid" else _const(v, n)
            self._res_cache = c = (res, n, cols)
        return c[2]

    def _meta_records(self, final: bool, rows: int) -> list[tuple]:
        """Clock anchor (when due) and recorder stats rows, in record-tuple layout.

        The stats row counts the ``rows`` of the file it is written in as written.
        """
        out = []
        now = time.monotonic()
        ident = threading.current_thread().name
        if now >= self._anchor_due or final:
            self._anchor = a = clock.take_anchor(self.cfg.test_wall_offset_ns)
            self._anchor_due = now + self.cfg.anchor_interval_s
            out.append((R_CLOCK, self.tracer.new_id(), None, None, "clock.anchor", schema.KIND_INTERNAL,
                        a.mono_ns, a.mono_ns, 0, None, None, 0, 0, None, ident,
                        {"clock.mono_ns": a.mono_ns, "clock.uncertainty_ns": a.uncertainty_ns,
                         "clock.read_cost_ns": self._read_cost, "clock.test_offset_ns": a.test_offset_ns,
                         "clock.source": self._clock_source}))
        st = self.stats()
        st["written"] += rows
        t = clock.now_ns()
        out.append((R_STATS, self.tracer.new_id(), None, None, "recorder.stats", schema.KIND_INTERNAL,
                    t, t, 0, None, None, 0, 0, None, ident, {f"recorder.{k}": v for k, v in st.items()}))
        return out

    # ------------------------------------------------------------- writing
    def _file_name(self, kind: str) -> str:
        self._seq += 1
        role = str(self.tracer.resource.get("role") or "proc")
        host = str(self.tracer.resource.get("host") or "host").replace("-", "_")
        return f"{role}-{host}-{os.getpid()}-{self._start_tag}-{kind}{self._seq:06d}.parquet"

    def _write_part(self, final: bool) -> None:
        if not self._pending and not final and time.monotonic() < self._anchor_due:
            return
        rows = self._pending_rows
        self._pending.append(self._convert(self._meta_records(final, rows)))
        self._yield()
        groups = self._groups(self._pending)
        self._pending, self._pending_rows = [], 0
        if self.otlp is not None:
            for g in groups:
                self.otlp.submit(g)
        name = self._file_name("p")
        try:
            self._yield()
            store.write_tables(self.dir, self._paced(groups), name)  # encoding runs without the GIL
            self._mark()
        except OSError as exc:
            self.write_errors += 1
            self.dropped_in_writer += rows
            self._warn_once(f"os-{exc.errno}", "pdtrace: cannot write trace file in %s (%s); "
                            "spans are dropped and counted, tracing goes on", self.dir, exc.strerror or exc)
            return
        self.written += rows
        self._parts.append((name, groups))
        self._parts_bytes += sum(g.nbytes for g in groups)
        due = (self.cfg.rotate_s > 0 and time.monotonic() - self._segment_started >= self.cfg.rotate_s)
        if final or due or self._parts_bytes >= self.cfg.rotate_bytes:
            self._merge_parts()

    def _merge_parts(self) -> None:
        parts, self._parts, self._parts_bytes = self._parts, [], 0
        self._segment_started = time.monotonic()
        if len(parts) <= 1:
            return
        try:
            self._yield()
            store.write_tables(self.dir, self._paced([g for _, gs in parts for g in gs]), self._file_name("s"))
            self._mark()
        except OSError as exc:
            self.write_errors += 1
            self._warn_once(f"merge-{exc.errno}", "pdtrace: cannot merge trace files in %s (%s); parts kept",
                            self.dir, exc.strerror or exc)
            return
        for name, _ in parts:
            try:
                os.unlink(os.path.join(self.dir, name))
            except OSError:
                pass


def _const(value, n: int) -> pa.Array:
    """A dictionary-encoded column holding ``value`` (str or None) n times."""
    if value is None:
        return pa.nulls(n, pa.dictionary(pa.int32(), pa.string()))
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([str(value)]))
