"""The sink: a helper process that turns one traced process's records into Parquet files.

Started by the traced process's ``pdtrace-writer`` thread
(:mod:`pdtrace.instrument.writer`) as ``python -m pdtrace.instrument.sink
RFD WFD``; it reads pickled messages from pipe RFD and answers on WFD
(``multiprocessing.connection`` framing). Conversion to Arrow, Parquet
encoding, file I/O and OTLP export all happen here, so none of it holds the
traced process's GIL (BENCHMARKS.md, Recorder, says why this matters).

Messages from the writer (tuples):

``("init", cfg, resource, pid, start_tag, activation)``  settings, resource columns, the traced pid,
                                             how its tracing was switched on
``("res", resource)``                        new resource columns for records from now on
``("attrs", {key: Attr})``                   the traced process's attribute allowlist (keys
                                             plug-ins registered there), before records using it
``("recs", [record tuple, ...])``            records, recorder.py layout
``("tick", gen, traced, final)``             write the pending records as one part file now;
                                             ``traced``: the writer's counters (recorded,
                                             dropped, writer_cpu_ns); ``final``: merge and end.
                                             Answered by ``("ack", gen, counters)``.

Files. Each tick writes one complete *part* file
(``<role>-<host>-<pid>-<start>-p<seq>.parquet``) through a temporary name and
a rename. At least every PDTRACE_ROTATE_S (or PDTRACE_ROTATE_BYTES of parts,
Arrow buffer bytes) the parts are merged into one *segment* file
(``-s<seq>.parquet``) and then deleted; a reader that lists the directory
between the rename and the deletes sees those rows twice, which readers remove
by ``record_id``.

Priority. The sink runs at :data:`NICE` so that it never takes a core from
the engine it traces.

Lifetime. The sink ignores SIGINT and SIGTERM (a service manager signals the
whole process group; the traced process flushes through it first) and ends at
a final tick or at end of file on RFD: when the traced process exits or is
killed, whatever reached the sink is still written.

Failures. An OSError while writing (directory not writable, deleted, disk
full) drops that file's rows, counts them (``dropped``, ``write_errors``) and
logs one warning per kind of error; the sink keeps running and retries at the
next tick (re-creating the directory).
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import sys
import time
from multiprocessing.connection import Connection


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


if __name__ == "__main__":  # only in the sink process, before pyarrow is imported
    sys.meta_path.insert(0, _NoPandas)

import pyarrow as pa  # noqa: E402

from . import attributes, clock, schema, store  # noqa: E402
from .convert import Converter  # noqa: E402
from .recorder import R_CLOCK, R_STATS  # noqa: E402
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
attributes.register("recorder.writer_cpu_ns", int,
                    "CPU time of the traced process's pdtrace-writer thread since it started (thread CPU clock), ns")
attributes.register("recorder.sink_cpu_ns", int,
                    "CPU time of the traced process's sink process since it started (process CPU clock), ns")
attributes.register("recorder.sample", float, "fraction of requests the process traces (PDTRACE_SAMPLE, 0..1)")
attributes.register("recorder.step_sample", float,
                    "fraction of engine steps whose step spans the process keeps (PDTRACE_STEP_SAMPLE, 0..1)")

#: Thread name written on the sink's own rows (clock anchors, stats).
THREAD = "pdtrace-sink"

#: Niceness the sink adds to its own: when the CPU is short, the engine's threads come first
#: (at nice +10 the sink still gets ~10 % of a contended core, CFS weights 110 vs 1024,
#: about 30,000 records/s at ~3 µs each).
NICE = 10

#: Records joined into one Parquet row group.
ROW_GROUP = 8192

#: Records received and kept as tuples before they are converted to one Arrow table
#: together: the writer sends chunks of 32-512 records, and a table per chunk would
#: repeat the per-table work (resource columns, dictionaries) for every few hundred rows.
CONVERT_BATCH = 4096


class Sink:
    """Converts and writes the records of one traced process (state of the sink process)."""

    def __init__(self, cfg, resource: dict, pid: int, start_tag: str, activation: str = "explicit") -> None:
        self.cfg = cfg
        self.activation = activation  # written as pdtrace.activation on every stats row
        self.dir = cfg.trace_dir
        self.resource = resource
        self.pid = pid
        self.start_tag = start_tag
        self.conv = Converter()
        self._ids = iter(range((random.SystemRandom().getrandbits(31) << 32) | 1, 1 << 64))
        self._raw: list[tuple] = []  # received, not yet converted (< CONVERT_BATCH)
        self._pending: list[pa.Table] = []
        self._pending_rows = 0  # records received since the last part file (in _raw and _pending)
        self._parts: list[tuple[str, list[pa.Table]]] = []
        self._parts_bytes = 0
        self._segment_started = time.monotonic()
        self._seq = 0
        self._anchor = clock.take_anchor(cfg.test_wall_offset_ns)
        self._anchor_due = 0.0
        self._read_cost = clock.read_cost_ns()
        self._clock_source = clock.clock_source()
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self._warned: set[str] = set()
        self.otlp = None
        if cfg.otlp:
            try:
                from .otlp import OtlpExporter

                self.otlp = OtlpExporter(cfg)
            except Exception as exc:  # missing package or bad settings: Parquet goes on
                self._warn_once("otlp-init", "pdtrace: OTLP export disabled (%s: %s)", type(exc).__name__, exc)

    def counters(self) -> dict[str, int]:
        """written, dropped (failed writes), write_errors, export_errors, dropped_attributes, sink_cpu_ns."""
        return {"written": self.written, "dropped": self.dropped, "write_errors": self.write_errors,
                "export_errors": self.otlp.errors if self.otlp is not None else 0,
                "dropped_attributes": self.conv.dropped_attributes, "sink_cpu_ns": time.process_time_ns()}

    def add(self, recs: list[tuple]) -> None:
        """Take records into the pending part, converted (monotonic times → epoch ns through the
        current anchor) :data:`CONVERT_BATCH` at a time."""
        if recs:
            self._raw.extend(recs)
            self._pending_rows += len(recs)
            if len(self._raw) >= CONVERT_BATCH:
                self.convert_received()

    def convert_received(self) -> None:
        """Convert the records received so far with the current resource, allowlist and anchor.

        A batch that fails to convert is converted again record by record: a record that still
        fails is dropped and counted (``dropped``, one warning per exception class), never kept
        to fail every later batch; the others are kept. ``dropped_attributes`` counts the kept
        records' dropped attributes once, whatever the retries.
        """
        if not self._raw:
            return
        raw, self._raw = self._raw, []
        res, offset = self.resource, self._anchor.offset_ns
        conv = self.conv
        before = conv.dropped_attributes
        try:
            self._pending.append(conv.table(raw, res, offset))
            return
        except Exception:  # noqa: BLE001 - the record at fault is found below
            pass
        good = []
        for r in raw:
            try:
                conv.table([r], res, offset)
            except Exception as exc:  # noqa: BLE001
                self._drop_unconvertible(1, exc)
            else:
                good.append(r)
        conv.dropped_attributes = before
        if good:
            try:
                self._pending.append(conv.table(good, res, offset))
            except Exception as exc:  # noqa: BLE001 - each converts alone, but not together
                conv.dropped_attributes = before
                self._drop_unconvertible(len(good), exc)

    def _drop_unconvertible(self, n: int, exc: Exception) -> None:
        """Count ``n`` received records as dropped (not written) and warn once per exception class."""
        self.dropped += n
        self._pending_rows -= n
        # the class only: an encoding error's message quotes the offending text
        self._warn_once(f"convert-{type(exc).__name__}", "pdtrace: a record could not be converted "
                        "(%s); such records are dropped and counted", type(exc).__name__)

    def tick(self, traced: dict, final: bool) -> None:
        """Write the pending records (with a stats row, and a clock anchor when due) as one part file."""
        if not self._pending_rows and not final and time.monotonic() < self._anchor_due:
            return
        self.convert_received()  # before the anchor may be renewed: received records keep the anchor of their time
        rows = self._pending_rows
        meta = self._meta_records(traced, final, rows)
        self._pending.append(self.conv.table(meta, self.resource, self._anchor.offset_ns))
        groups = _row_groups(self._pending)
        self._pending, self._pending_rows = [], 0
        if self.otlp is not None:
            for g in groups:
                self.otlp.submit(g)
        name = self._file_name("p")
        try:
            store.write_tables(self.dir, groups, name)
        except OSError as exc:
            self.write_errors += 1
            self.dropped += rows
            self._warn_once(f"os-{exc.errno}", "pdtrace: cannot write trace file in %s (%s); "
                            "spans are dropped and counted, tracing goes on", self.dir, exc.strerror or exc)
            return
        self.written += rows
        self._parts.append((name, groups))
        self._parts_bytes += sum(g.get_total_buffer_size() for g in groups)
        due = self.cfg.rotate_s > 0 and time.monotonic() - self._segment_started >= self.cfg.rotate_s
        if final or due or self._parts_bytes >= self.cfg.rotate_bytes:
            self._merge_parts()

    def close(self) -> None:
        """Stop the OTLP exporter (waits up to half the flush interval, at least 0.1 s)."""
        if self.otlp is not None:
            self.otlp.shutdown(max(0.1, self.cfg.flush_interval_s / 2))

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _meta_records(self, traced: dict, final: bool, rows: int) -> list[tuple]:
        """Clock anchor (when due) and recorder stats rows, in record-tuple layout.

        The stats row counts the ``rows`` of the file it is written in as written.
        """
        out = []
        now = time.monotonic()
        if now >= self._anchor_due or final:
            self._anchor = a = clock.take_anchor(self.cfg.test_wall_offset_ns)
            self._anchor_due = now + self.cfg.anchor_interval_s
            out.append((R_CLOCK, next(self._ids), None, None, "clock.anchor", schema.KIND_INTERNAL,
                        a.mono_ns, a.mono_ns, 0, None, None, 0, 0, None, THREAD,
                        "clock.mono_ns", "clock.uncertainty_ns", "clock.read_cost_ns", "clock.test_offset_ns",
                        "clock.source", a.mono_ns, a.uncertainty_ns, self._read_cost, a.test_offset_ns,
                        self._clock_source))
        st = stats(traced, self.counters())
        st["written"] += rows
        t = clock.now_ns()
        attrs = {f"recorder.{k}": v for k, v in st.items()}
        attrs["pdtrace.activation"] = self.activation
        # the sampling in force, so that a reader (pdtrace check, view processes) can say what was traced
        attrs["recorder.sample"], attrs["recorder.step_sample"] = float(self.cfg.sample), float(self.cfg.step_sample)
        out.append((R_STATS, next(self._ids), None, None, "recorder.stats", schema.KIND_INTERNAL,
                    t, t, 0, None, None, 0, 0, None, THREAD, *attrs, *attrs.values()))
        return out

    def _file_name(self, kind: str) -> str:
        self._seq += 1
        role = str(self.resource.get("role") or "proc")
        host = str(self.resource.get("host") or "host").replace("-", "_")
        return f"{role}-{host}-{self.pid}-{self.start_tag}-{kind}{self._seq:06d}.parquet"

    def _merge_parts(self) -> None:
        parts, self._parts, self._parts_bytes = self._parts, [], 0
        self._segment_started = time.monotonic()
        if len(parts) <= 1:
            return
        try:
            store.merge_parts(self.dir, parts, self._file_name("s"))
        except OSError as exc:
            self.write_errors += 1
            self._warn_once(f"merge-{exc.errno}", "pdtrace: cannot merge trace files in %s (%s); parts kept",
                            self.dir, exc.strerror or exc)


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


def serve(inp: Connection, out: Connection) -> None:
    """Answer one writer until its final tick or end of file on ``inp``."""
    sink = None
    traced: dict = {}
    while True:
        try:
            msg = pickle.loads(inp.recv_bytes())
        except (EOFError, OSError):
            break
        kind = msg[0]
        try:
            if kind == "recs":
                sink.add(msg[1])
            elif kind == "tick":
                _, gen, traced, final = msg
                sink.tick(traced, final)
                if final:
                    sink.close()
                try:
                    out.send_bytes(pickle.dumps(("ack", gen, sink.counters())))
                except OSError:  # the writer is gone (its process was killed): not a sink error
                    pass
                if final:
                    return
            elif kind == "res":  # for records from now on
                sink.convert_received()
                sink.resource = msg[1]
            elif kind == "attrs":
                sink.convert_received()
                attributes.ALLOWED.update(msg[1])
            elif kind == "init":
                logging.basicConfig(format="%(message)s")
                sink = Sink(*msg[1:])
        except Exception as exc:  # never die on one bad batch: count it and go on
            if sink is None:
                raise
            sink.write_errors += 1
            if kind == "recs":
                sink.dropped += len(msg[1])
            sink._warn_once(f"sink-{type(exc).__name__}", "pdtrace: sink error %s: %s", type(exc).__name__, exc)
    if sink is not None:  # the traced process ended without a final tick (killed, or exited abruptly)
        sink.tick(traced, final=True)
        sink.close()


def main(argv: list[str]) -> int:
    """Entry point: ``python -m pdtrace.instrument.sink RFD WFD``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inp = Connection(int(argv[1]), writable=False)
    out = Connection(int(argv[2]), readable=False)
    serve(inp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
