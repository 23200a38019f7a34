"""The span store's schema: one Parquet row per span, event, clock anchor or
recorder-stats sample.

A store is a directory of Parquet files (zstd) written by one writer per
process (see :mod:`pdtrace.instrument.writer`). Every file carries the schema
version in its key-value metadata (``pdtrace.schema_version``) and in the
``schema_version`` column. Readers accept any ``1.x`` file (newer minors may add
columns at the end) and skip, naming it, a file of another major.

The model follows OpenTelemetry's span (trace id, span id, parent, name, kind,
start/end, status, attributes, events, resource) with typed columns for what
the analysis filters on. Records of five types share the table, told apart by
``record``:

==========  ===============================================================
record      meaning of the row
==========  ===============================================================
``span``    one stage interval (DESIGN.md §2 stage name in ``name``)
``event``   an instant on a span or request (``start_ns == end_ns``);
            ``span_id`` is the span it belongs to (null: the request)
``clock``   a (monotonic, wall) anchor pair of the writing process:
            ``start_ns`` = wall ns, ``attr_int['clock.mono_ns']`` = the
            monotonic reading, ``attr_int['clock.uncertainty_ns']`` = half the
            read window, ``attr_int['clock.read_cost_ns']`` = median cost of a
            monotonic read, ``attr_int['clock.test_offset_ns']`` = the
            test-only wall shift applied (0 in production),
            ``attr_str['clock.source']`` = the clock implementation
``stats``   the recorder's own counters at flush time (``attr_int``:
            ``recorder.recorded``, ``recorder.dropped``, ``recorder.written``,
            ``recorder.write_errors``, ``recorder.export_errors``,
            ``recorder.dropped_attributes``, ``recorder.writer_cpu_ns``,
            ``recorder.sink_cpu_ns``, ``recorder.hook_errors``; cumulative
            since process start; ``attr_float``: ``recorder.sample``,
            ``recorder.step_sample``, the sampling in force; ``attr_str``:
            ``pdtrace.activation``, ``recorder.hook_error_first`` once a
            hook error was swallowed)
``open``    (since 1.1) the state of a span still open at a flush: written
            at each flush while a span has been open at least
            ``PDTRACE_OPEN_AFTER_S``; ``span_id`` = the open span's id (its
            final ``span`` row, when it ends, has the same id), ``start_ns``
            = its start, ``end_ns`` = the flush instant (the state's "as
            of"), attributes = its latest ones plus ``open.state``
            (``'open'``; ``'abandoned'`` on the last row of a span dropped
            without a ``span`` row). A reader takes the latest row per
            ``span_id`` and ignores spans that have a ``span`` row.
==========  ===============================================================

Times are integer ns since the Unix epoch, converted from the process's
monotonic clock through its latest anchor when the row is written (the raw
times the analysis corrects for skew between processes and hosts).
"""
from __future__ import annotations

# pyarrow is imported only when COLUMNS or SCHEMA is first read (module
# __getattr__ below): the recorder needs the constants of this module, and a
# traced process never needs pyarrow (its sink converts, pdtrace.instrument.sink).

#: Major.minor of the store's schema. Bump the minor for added columns or record
#: types (readers of the same major must still work: they select the record types
#: they know), the major for anything else. 1.1 added the ``open`` record type.
SCHEMA_VERSION = "1.1"
SCHEMA_MAJOR = 1

#: Parquet key-value metadata key that carries :data:`SCHEMA_VERSION`.
VERSION_KEY = b"pdtrace.schema_version"

#: Parquet key-value metadata key naming a pdtrace file that is *not* a span
#: store file (e.g. ``b"client-records"``: the lab client's per-request view,
#: written beside the spans). Readers of the store pass over such files without
#: a warning; a Parquet file with neither key is foreign and is warned about.
ARTIFACT_KEY = b"pdtrace.artifact"

#: OTLP span kinds (opentelemetry-proto ``Span.SpanKind`` numbering).
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT, KIND_PRODUCER, KIND_CONSUMER = 1, 2, 3, 4, 5

#: OTLP status codes.
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2

RECORD_TYPES = ("span", "event", "clock", "stats", "open")

#: The column names of a resource (constant per process).
RESOURCE_COLUMNS = (
    "run_id", "service_name", "role", "engine_id", "host", "pid",
    "pdtrace_version", "vllm_version", "connector", "config_hash",
)

#: OpenTelemetry semantic-conventions schema URL recorded with each file.
OTEL_SCHEMA_URL = "https://opentelemetry.io/schemas/1.26.0"


def _build() -> dict:
    """COLUMNS and SCHEMA, built with pyarrow on first use."""
    import pyarrow as pa

    _str = pa.string()
    _dict_str = pa.dictionary(pa.int32(), pa.string())
    columns = [
        ("schema_version", _dict_str, "store schema major.minor, e.g. '1.0'"),
        ("record", _dict_str, "row type: span | event | clock | stats | open"),
        ("record_id", pa.uint64(), "unique id of this row across the store (spans: = span_id); duplicates of a row are the same row"),
        ("trace_id", _str, "W3C trace id, 32 lowercase hex; derived from request_id (sha256) so router, P and D agree; null for step spans"),
        ("span_id", pa.uint64(), "span rows: this span's id; event rows: the span the event is on (null: on the request)"),
        ("parent_span_id", pa.uint64(), "parent span's id, null for a root or an unparented stage"),
        ("name", _dict_str, "span: DESIGN.md stage name (e.g. 'kv.transfer'); event: event name; clock: 'clock.anchor'; stats: 'recorder.stats'"),
        ("kind", pa.int8(), "OTLP span kind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer"),
        ("start_ns", pa.int64(), "start, ns since the Unix epoch, on the writing process's clock (events, clock, stats: the instant)"),
        ("end_ns", pa.int64(), "end, ns since the Unix epoch, on the writing process's clock; >= start_ns"),
        ("status_code", pa.int8(), "OTLP status: 0 unset, 1 ok, 2 error"),
        ("status_message", _str, "error class and code only (never a message text, which can echo prompts)"),
        ("request_id", _str, "base request id X (the router's X-Request-Id, vLLM prefix/index/suffix stripped); null for per-step spans"),
        ("prompt_index", pa.int32(), "index i of the prompt in a batched completion (cmpl-X-i); 0 otherwise"),
        ("attempt", pa.int32(), "0 for the first dispatch; +1 per router retry or local recompute after preemption/load failure"),
        ("tp_rank", pa.int16(), "tensor-parallel rank of the worker that recorded the row; null on scheduler/API/router processes"),
        ("thread", _dict_str, "name of the thread that recorded the row (e.g. 'MainThread', 'nixl-push-writer')"),
        ("attr_int", pa.map_(_str, pa.int64()), "integer attributes (allowlisted keys, see pdtrace.instrument.attributes); units in the key's doc"),
        ("attr_float", pa.map_(_str, pa.float64()), "float attributes (allowlisted keys)"),
        ("attr_str", pa.map_(_str, _str), "short string attributes (allowlisted keys, <= 256 chars)"),
        # --- resource: constant per process (and so per file) ---------------------
        ("run_id", _dict_str, "run id (PDTRACE_RUN_ID), shared by the router and engines of one deployment run"),
        ("service_name", _dict_str, "OpenTelemetry service.name, e.g. 'pdtrace-router', 'vllm-prefill'"),
        ("role", _dict_str, "router | prefill | decode | client | bench (free text for others)"),
        ("engine_id", _dict_str, "vLLM engine id of the recording engine (null for the router)"),
        ("host", _dict_str, "host name of the recording process"),
        ("pid", pa.int32(), "process id of the recording process"),
        ("pdtrace_version", _dict_str, "pdtrace package version"),
        ("vllm_version", _dict_str, "vLLM version of the recording process (null if vLLM not imported)"),
        ("connector", _dict_str, "KV connector class of the engine (e.g. 'TracedNixlPushConnector')"),
        ("config_hash", _dict_str, "hash of the engine/router configuration that matters for comparisons"),
    ]
    schema = pa.schema(
        [pa.field(name, typ, metadata={b"doc": doc.encode()}) for name, typ, doc in columns],
        metadata={VERSION_KEY: SCHEMA_VERSION.encode(), b"pdtrace.schema_url": OTEL_SCHEMA_URL.encode()},
    )
    return {"COLUMNS": columns, "SCHEMA": schema}


def __getattr__(name: str):
    """``COLUMNS``: [(column, arrow type, description with unit)] in the file's order;
    ``SCHEMA``: the pyarrow schema of a store file (field docs and version in its metadata).

    Built once, on first access. Raises AttributeError for other names.
    """
    if name in ("COLUMNS", "SCHEMA"):
        g = globals()
        if "SCHEMA" not in g:
            g.update(_build())
        return g[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def column_docs() -> dict[str, str]:
    """Return {column name: description with unit} for every store column."""
    return {name: doc for name, _, doc in __getattr__("COLUMNS")}


def major_of(version: str) -> int:
    """Return the major number of a ``"major.minor"`` version string.

    Raises ValueError when the string is not of that form.
    """
    major, _, minor = version.partition(".")
    if not major.isdigit() or not minor.isdigit():
        raise ValueError(f"not a major.minor schema version: {version!r}")
    return int(major)
