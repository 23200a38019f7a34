"""``pdtrace collect DIR``: an OTLP/HTTP receiver that writes the spans it receives into a span store.

Why in ``instrument/``: it *records* -- it is a span source like the recorder,
writing store files through the same path (:func:`pdtrace.instrument.store.write_tables`:
a hidden temporary name, then a rename, so readers only ever see whole files;
rows converted by :class:`pdtrace.instrument.convert.Converter` under the
attribute allowlist), while ``analysis/`` only reads a store and never writes
into it (DESIGN.md §6).

Protocol: OTLP/HTTP, ``POST /v1/traces`` with an ``ExportTraceServiceRequest``
as ``application/x-protobuf`` (opentelemetry-proto decodes it) or OTLP/JSON
(``application/json``, hex ids); gzip / deflate bodies are decompressed by
aiohttp. The answer is an ``ExportTraceServiceResponse`` in the request's
encoding: 200, with ``partial_success.rejected_spans`` when the queue was full.
A body that does not decode gets 400, one over :data:`MAX_BODY` 413, another
content type 415; each is counted (``collect.bad_bodies``) and the receiver
keeps serving. It listens on 127.0.0.1 unless ``--host`` says otherwise.

Never blocks the senders: the handler only decodes and puts the message on a
queue bounded at ``max_queue_spans`` spans; a message that would overflow it is
dropped and counted (``collect.dropped_spans``). One ``pdtrace-collect-writer``
thread maps queued messages (:mod:`pdtrace.instrument.otlp_ingest`: request
id, role, router root → TTFT window) and, every ``flush_interval_s``, writes the
rows ready as one *part* file ``collect-<host>-<pid>-<start>-p<seq>.parquet``
with a ``collect.stats`` row (record ``stats``: the counters below, cumulative);
every ``rotate_s`` the parts are merged into one segment (``-s<seq>``) and
deleted, as the recorder's sink does (readers drop the rows a listing sees
twice by ``record_id``). A failed write drops that file's rows and counts
them (``collect.write_errors``, ``collect.dropped_spans``); the next flush
retries. Spans of pdtrace's own OTLP export are skipped and counted
(``collect.skipped_pdtrace_spans``; ``--keep-pdtrace`` keeps them):
:class:`~pdtrace.instrument.otlp_ingest.Ingest` says why. SIGINT / SIGTERM
(or :meth:`Collector.stop`) write everything
received, spans still waiting for their trace included (unjoined if nothing
mapped them).

Times are the senders' (ns since the Unix epoch); the collector adds no clock
anchor for them: they are corrected for skew per clock domain like any row.
``trace_id`` holds each span's own W3C trace id (not the one pdtrace derives
from the request id).
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import socket
import threading
import time

from . import otlp_ingest, schema, store

log = logging.getLogger("pdtrace")

#: Largest request body accepted (bytes); an OTLP exporter batch of 512 spans is well under 1 MiB.
MAX_BODY = 64 << 20
#: Default OTLP/HTTP port (the OTLP specification's).
DEFAULT_PORT = 4318

_STATS_KEYS = ("received_spans", "written_spans", "dropped_spans", "bad_bodies", "unjoined_spans",
               "dropped_attributes", "write_errors", "held_spans", "skipped_pdtrace_spans")


class Collector:
    """The receiver: an aiohttp server on its own event loop thread plus the writer thread.

    ``directory``: the store to write into (created if missing). ``port`` 0 picks
    a free port (:attr:`port` after :meth:`start`). ``run_id``: written on every
    collected row (a sender resource's ``pdtrace.run_id`` wins).
    ``join_wait_s``: how long a span waits for its trace id to map;
    ``keep_pdtrace``: store pdtrace's own OTLP export too
    (:class:`~pdtrace.instrument.otlp_ingest.Ingest`). Raises OSError from
    :meth:`start` when the address cannot be bound.
    """

    def __init__(self, directory, host: str = "127.0.0.1", port: int = DEFAULT_PORT, run_id: str | None = None,
                 flush_interval_s: float = 1.0, rotate_s: float = 60.0, join_wait_s: float = 10.0,
                 max_queue_spans: int = 262_144, keep_pdtrace: bool = False) -> None:
        from .convert import Converter

        self.dir = os.fspath(directory)
        self.host, self.port = host, port
        self.flush_interval_s, self.rotate_s = flush_interval_s, rotate_s
        self.max_queue_spans = max_queue_spans
        self.ingest = otlp_ingest.Ingest(run_id, join_wait_s, keep_pdtrace)
        self.conv = Converter()
        self.stats = dict.fromkeys(_STATS_KEYS, 0)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0
        self._qlock = threading.Lock()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._server_thread: threading.Thread | None = None
        self._writer = threading.Thread(target=self._write_loop, name="pdtrace-collect-writer", daemon=True)
        self._host_name = socket.gethostname()
        self._start_tag = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self._seq = 0
        self._parts: list[tuple[str, list]] = []
        self._segment_started = time.monotonic()
        self._resource = {"run_id": run_id, "service_name": "pdtrace-collect", "role": "collect",
                          "engine_id": None, "host": self._host_name, "pid": os.getpid(),
                          "pdtrace_version": _pdtrace_version(), "vllm_version": None, "connector": None,
                          "config_hash": None}

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Collector":
        """Bind and start serving (returns when the port is bound); start the writer thread."""
        from aiohttp import web

        os.makedirs(self.dir, exist_ok=True)
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/traces", self._handle)
        loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            loop.run_until_complete(site.start())
        except BaseException:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()
            raise
        self.port = self._runner.addresses[0][1]
        self._loop = loop
        self._server_thread = threading.Thread(target=loop.run_forever, name="pdtrace-collect-http", daemon=True)
        self._server_thread.start()
        self._writer.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving, write everything received (held spans included), merge the parts. Safe to call twice."""
        loop = self._loop
        if loop is not None:
            self._loop = None

            async def _shutdown():
                await self._runner.cleanup()

            try:
                asyncio.run_coroutine_threadsafe(_shutdown(), loop).result(timeout)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                self._server_thread.join(timeout)
                loop.close()
        self._stop.set()
        self._q.put(None)  # wake the writer
        if self._writer.is_alive():
            self._writer.join(timeout)

    @property
    def endpoint(self) -> str:
        """The traces URL to give exporters (``http://HOST:PORT/v1/traces``)."""
        return f"http://{self.host}:{self.port}/v1/traces"

    # --- HTTP -----------------------------------------------------------------------------------
    async def _handle(self, request):
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        ctype = request.content_type
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count("bad_bodies")
            return web.Response(status=413, text=f"OTLP body over {MAX_BODY} bytes")
        try:
            msg = otlp_ingest.decode(body, ctype)
        except LookupError as exc:
            self._count("bad_bodies")
            return web.Response(status=415, text=str(exc))
        except ValueError as exc:
            self._count("bad_bodies")
            return web.Response(status=400, text=str(exc))
        n = otlp_ingest.span_count(msg)
        resp = ExportTraceServiceResponse()
        with self._qlock:
            self.stats["received_spans"] += n
            ok = self._queued + n <= self.max_queue_spans
            if ok:
                self._queued += n
            else:
                self.stats["dropped_spans"] += n
        if ok:
            self._q.put((msg, n))
        else:
            resp.partial_success.rejected_spans = n
            resp.partial_success.error_message = "pdtrace collect: queue full, spans dropped"
        if ctype == "application/json":
            from google.protobuf import json_format

            return web.json_response(json_format.MessageToDict(resp))
        return web.Response(body=resp.SerializeToString(), content_type="application/x-protobuf")

    # --- writing ---------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        due = time.monotonic() + self.flush_interval_s
        while not self._stop.is_set():
            try:
                item = self._q.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                item = None
            if item is not None:
                self._take(*item)
            if time.monotonic() >= due:
                self._safe_flush(final=False)
                due = time.monotonic() + self.flush_interval_s
        while True:  # stopping: everything received, then the final file
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._take(*item)
        self._safe_flush(final=True)

    def _take(self, msg, n: int) -> None:
        with self._qlock:
            self._queued -= n
        try:
            self.ingest.add(msg)
        except Exception as exc:  # noqa: BLE001 - a message the mapping cannot take: drop, count, go on
            self._count("dropped_spans", n)
            log.warning("pdtrace collect: a message could not be mapped (%s); its spans are dropped and counted",
                        type(exc).__name__)

    def _count(self, key: str, n: int = 1) -> None:
        with self._qlock:
            self.stats[key] += n

    def _safe_flush(self, final: bool) -> None:
        try:
            self._flush(final)
        except Exception as exc:  # noqa: BLE001 - the writer thread must outlive any one bad flush
            log.warning("pdtrace collect: a flush failed (%s); its rows are lost", type(exc).__name__)

    def _flush(self, final: bool) -> None:
        import pyarrow as pa

        ready = self.ingest.ready(final=final)
        tables, rows, spans = [], 0, 0
        for res_key, (recs, tids) in ready.items():
            res = self.ingest.resources[res_key]
            try:
                t = self.conv.table(recs, res, 0)
            except Exception as exc:  # noqa: BLE001 - e.g. a string that is not valid Unicode
                t = self._table_rowwise(recs, tids, res, exc)
                if t is None:
                    continue
            else:
                t = t.set_column(t.schema.get_field_index("trace_id"), "trace_id", pa.array(tids, pa.string()))
            tables.append(t)
            rows += t.num_rows
            spans += sum(1 for r in recs if r[0] == otlp_ingest.R_SPAN)
        if not tables and not final and not self._parts_due():
            return
        c = self.ingest.counters
        self.stats["unjoined_spans"] = c.unjoined
        self.stats["dropped_attributes"] = self.conv.dropped_attributes
        self.stats["held_spans"] = self.ingest.held
        self.stats["skipped_pdtrace_spans"] = c.skipped_pdtrace
        st = dict(self.stats)
        st["written_spans"] += spans
        t_ns = time.time_ns()
        stats_rec = (schema.RECORD_TYPES.index("stats"), otlp_ingest._rid64("collect.stats", os.getpid(), t_ns, self._seq),
                     None, None, "collect.stats", schema.KIND_INTERNAL, t_ns, t_ns, 0, None, None, 0, 0, None,
                     "pdtrace-collect-writer", *(f"collect.{k}" for k in st), *st.values())
        tables.append(self.conv.table([stats_rec], self._resource, 0))
        name = self._file_name("p")
        try:
            store.write_tables(self.dir, tables, name)
        except OSError as exc:
            self._count("write_errors")
            self._count("dropped_spans", spans)
            log.warning("pdtrace collect: cannot write %s (%s); its spans are dropped and counted",
                        name, exc.strerror or type(exc).__name__)
            return
        self._count("written_spans", spans)
        self._parts.append((name, tables))
        if final or self._parts_due():
            self._merge()

    def _table_rowwise(self, recs, tids, res, exc):
        """Convert record by record when a batch fails; drop (and count) the records that still fail."""
        import pyarrow as pa

        good, gtids = [], []
        for r, tid in zip(recs, tids):
            try:
                self.conv.table([r], res, 0)
            except Exception:  # noqa: BLE001
                if r[0] == otlp_ingest.R_SPAN:
                    self._count("dropped_spans")
                continue
            good.append(r)
            gtids.append(tid)
        log.warning("pdtrace collect: a record could not be converted (%s); such records are dropped and counted",
                    type(exc).__name__)
        if not good:
            return None
        t = self.conv.table(good, res, 0)
        return t.set_column(t.schema.get_field_index("trace_id"), "trace_id", pa.array(gtids, pa.string()))

    def _parts_due(self) -> bool:
        return bool(self._parts) and self.rotate_s > 0 and time.monotonic() - self._segment_started >= self.rotate_s

    def _file_name(self, kind: str) -> str:
        self._seq += 1
        host = self._host_name.replace("-", "_")
        return f"collect-{host}-{os.getpid()}-{self._start_tag}-{kind}{self._seq:06d}.parquet"

    def _merge(self) -> None:
        parts, self._parts = self._parts, []
        self._segment_started = time.monotonic()
        if len(parts) <= 1:
            return
        try:
            store.merge_parts(self.dir, parts, self._file_name("s"))
        except OSError as exc:
            self._count("write_errors")
            log.warning("pdtrace collect: cannot merge part files (%s); parts kept", exc.strerror or exc)


def _pdtrace_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("pdtrace")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return None


def serve(directory, host: str, port: int, **kw) -> None:
    """Run a :class:`Collector` until SIGINT or SIGTERM, then write everything received and return."""
    col = Collector(directory, host, port, **kw).start()
    print(f"pdtrace collect: receiving OTLP/HTTP traces at {col.endpoint}, writing to {col.dir}", flush=True)
    done = threading.Event()
    old = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        col.stop()
        st = col.stats
        print(f"pdtrace collect: stopped; {st['written_spans']} spans written, {st['unjoined_spans']} unjoined, "
              f"{st['dropped_spans']} dropped, {st['bad_bodies']} bad bodies", flush=True)


def _command():
    import click

    from . import config

    @click.command("collect")
    @click.argument("directory", type=click.Path(file_okay=False))
    @click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
                  help="TCP port (0: any free port, printed).")
    @click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
    @click.option("--run-id", default=None,
                  help="Run id written on collected rows (default: PDTRACE_RUN_ID; a sender's pdtrace.run_id wins).")
    @click.option("--flush-interval", "flush_interval_s", type=click.FloatRange(0.05, 3600), default=1.0,
                  show_default=True, help="Seconds between part files.")
    @click.option("--join-wait", "join_wait_s", type=click.FloatRange(0, 3600), default=10.0, show_default=True,
                  help="Seconds a span without its own request id waits for its trace id to map.")
    @click.option("--keep-pdtrace", is_flag=True,
                  help="Also store spans from pdtrace's own OTLP export (skipped by default: already in its store).")
    def collect(directory, port, host, run_id, flush_interval_s, join_wait_s, keep_pdtrace):
        """Receive OTLP/HTTP spans (POST /v1/traces) from routers and engines pdtrace did not instrument
        and write them into the store DIRECTORY.

        vLLM engines: --otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces with
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf and OTEL_SERVICE_NAME=vllm-prefill / vllm-decode.
        """
        if run_id is None:
            run_id = config.from_env().run_id
        import importlib.util

        missing = [m for m in ("aiohttp", "opentelemetry.proto") if importlib.util.find_spec(m.split(".")[0]) is None
                   or importlib.util.find_spec(m) is None]
        if missing:
            raise click.ClickException(f"pdtrace collect needs {', '.join(missing)}: pip install 'pdtrace[otlp]'")
        try:
            serve(directory, host, port, run_id=run_id, flush_interval_s=flush_interval_s, join_wait_s=join_wait_s,
                  keep_pdtrace=keep_pdtrace)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc

    return collect


def __getattr__(name: str):
    """``collect``: the click command (built on first access, so importing this module needs no click)."""
    if name == "collect":
        cmd = globals()["collect"] = _command()
        return cmd
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
