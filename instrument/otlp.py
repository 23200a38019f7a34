"""Optional OTLP export of the same rows that go to Parquet.

Switched on by the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables (or ``PDTRACE_OTLP=1``), which
opentelemetry-exporter-otlp-proto-http reads itself (endpoint, headers,
timeout, compression). The writer thread hands each written table to
:meth:`OtlpExporter.submit`; a separate ``pdtrace-otlp`` thread converts the
rows to OpenTelemetry ``ReadableSpan`` objects and exports them, so a slow or
dead collector never delays the Parquet files nor the traced process. A full
queue drops the table and counts its spans in ``export_errors``, as does a
failed export.

Mapping: span rows become spans (ids, parent, kind, start/end, status,
attributes plus ``pdtrace.request_id``, ``pdtrace.attempt``,
``pdtrace.tp_rank``); event rows become events of their span when it is in
the same table, else zero-length spans named after the event and parented on
that span; clock and stats rows are not exported. Per-step spans (no request
id) get a trace id derived from their own span id. The resource carries
``service.name`` and the pdtrace resource columns as ``pdtrace.*``.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading

import pyarrow as pa

log = logging.getLogger("pdtrace")

#: Tables waiting for export before new ones are dropped (the writer submits groups of
#: up to 8,192 rows: 512 groups bound the queue at ~4M spans).
QUEUE_TABLES = 512


class OtlpExporter:
    """Background OTLP/HTTP exporter of store tables (one per process writer).

    Raises ImportError at construction when opentelemetry-sdk or the OTLP
    HTTP exporter is not installed (``pip install pdtrace[otlp]``).
    """

    def __init__(self, cfg, exporter=None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if exporter is None:
            kw = {}
            if cfg.otlp_endpoint:
                kw["endpoint"] = cfg.otlp_endpoint
            if cfg.otlp_timeout_s:
                kw["timeout"] = cfg.otlp_timeout_s
            exporter = OTLPSpanExporter(**kw)
        self._exporter = exporter
        self._q: queue.Queue = queue.Queue(QUEUE_TABLES)
        self.errors = 0
        self.exported = 0
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="pdtrace-otlp", daemon=True)
        self._thread.start()

    def submit(self, table: pa.Table) -> None:
        """Queue ``table`` for export; never blocks (a full queue drops and counts)."""
        try:
            self._q.put_nowait(table)
        except queue.Full:
            self.errors += table.num_rows

    def shutdown(self, timeout: float) -> bool:
        """Export what is queued, then stop; False if ``timeout`` (s) passed first."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        ok = not self._thread.is_alive()
        try:
            self._exporter.shutdown()
        except Exception:
            pass
        return ok

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        while True:
            table = self._q.get()
            if table is None:
                return
            try:
                spans = to_readable_spans(table)
                if not spans:
                    continue
                result = self._exporter.export(spans)
                if result == SpanExportResult.SUCCESS:
                    self.exported += len(spans)
                else:
                    self.errors += len(spans)
                    self._warn("export failed (collector unreachable or refused)")
            except Exception as exc:  # never let the thread die
                self.errors += table.num_rows
                self._warn(f"{type(exc).__name__}")

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("pdtrace: OTLP export error: %s; spans counted in export_errors, Parquet unaffected", why)


def _fallback_trace_id(row: dict) -> int:
    h = hashlib.sha256(f"{row['host']}:{row['pid']}:{row['span_id']}".encode()).digest()
    return int.from_bytes(h[:16], "big")


def to_readable_spans(table: pa.Table) -> list:
    """Convert the span and event rows of a store table to OpenTelemetry ReadableSpans.

    Shape: one ReadableSpan per span row, plus one per event row whose span is
    not in ``table``. Raises ImportError without opentelemetry-sdk.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    from .schema import OTEL_SCHEMA_URL, RESOURCE_COLUMNS

    rows = table.to_pylist()
    if not rows:
        return []
    first = rows[0]
    res_attrs = {"service.name": first.get("service_name") or "pdtrace"}
    for c in RESOURCE_COLUMNS:
        v = first.get(c)
        if v is not None and c != "service_name":
            res_attrs[f"pdtrace.{c}"] = v
    resource = Resource(res_attrs, schema_url=OTEL_SCHEMA_URL)
    events_by_span: dict[int, list] = {}
    span_rows = []
    orphan_events = []
    span_ids = {r["span_id"] for r in rows if r["record"] == "span"}
    for r in rows:
        if r["record"] == "span":
            span_rows.append(r)
        elif r["record"] == "event":
            if r["span_id"] in span_ids:
                events_by_span.setdefault(r["span_id"], []).append(r)
            else:
                orphan_events.append(r)
    out = []
    kinds = {1: SpanKind.INTERNAL, 2: SpanKind.SERVER, 3: SpanKind.CLIENT, 4: SpanKind.PRODUCER, 5: SpanKind.CONSUMER}

    def attrs_of(r: dict) -> dict:
        a: dict = {}
        for col in ("attr_int", "attr_float", "attr_str"):
            for k, v in r[col] or []:
                a[k] = v
        if r.get("request_id") is not None:
            a["pdtrace.request_id"] = r["request_id"]
        a["pdtrace.attempt"] = r["attempt"] or 0
        if r.get("tp_rank") is not None:
            a["pdtrace.tp_rank"] = r["tp_rank"]
        if r.get("thread"):
            a["thread.name"] = r["thread"]
        return a

    def ctx(r: dict, span_id: int) -> SpanContext:
        tid = int(r["trace_id"], 16) if r.get("trace_id") else _fallback_trace_id(r)
        return SpanContext(tid, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    for r in span_rows:
        parent = None
        if r["parent_span_id"]:
            parent = SpanContext(ctx(r, r["span_id"]).trace_id, r["parent_span_id"], is_remote=False,
                                 trace_flags=TraceFlags(TraceFlags.SAMPLED))
        evs = [Event(e["name"], attrs_of(e), timestamp=e["start_ns"]) for e in events_by_span.get(r["span_id"], [])]
        code = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}.get(r["status_code"], StatusCode.UNSET)
        out.append(ReadableSpan(
            name=r["name"], context=ctx(r, r["span_id"]), parent=parent, resource=resource,
            attributes=attrs_of(r), events=evs, kind=kinds.get(r["kind"], SpanKind.INTERNAL),
            status=Status(code, r["status_message"] if code == StatusCode.ERROR else None),
            start_time=r["start_ns"], end_time=r["end_ns"],
        ))
    for e in orphan_events:
        parent = None
        if e["span_id"]:
            parent = SpanContext(ctx(e, e["span_id"]).trace_id, e["span_id"], is_remote=False,
                                 trace_flags=TraceFlags(TraceFlags.SAMPLED))
        out.append(ReadableSpan(
            name=e["name"], context=ctx(e, e["record_id"] & 0xFFFFFFFFFFFFFFFF), parent=parent, resource=resource,
            attributes=attrs_of(e), kind=SpanKind.INTERNAL, start_time=e["start_ns"], end_time=e["end_ns"],
        ))
    return out
