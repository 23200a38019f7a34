"""Foreign OTLP spans → store records: the mapping ``pdtrace collect`` applies (DESIGN.md §6, "any router").

(Over 400 lines on purpose: the mapping from foreign spans to store records is one set of rules
(ids, roles, stages, attributes, units), kept together so a rule and its exceptions are read side by side.)

Input: decoded ``ExportTraceServiceRequest`` messages (opentelemetry-proto) from
routers and engines pdtrace did not instrument -- vLLM's own ``llm_request``
spans (``--otlp-traces-endpoint``), a foreign router's spans, anything else.
Output: record tuples in the recorder's layout (recorder.py; converted by
:class:`pdtrace.instrument.convert.Converter`, so the attribute allowlist and
its drop counter apply exactly as for pdtrace's own spans) grouped by resource,
plus each row's original W3C trace id. :mod:`pdtrace.instrument.collect`
receives the bodies and writes the files.

Every foreign span is kept as one ``span`` row with its original name, ids,
kind, times (ns since the Unix epoch, the sender's clock), status code (never
the status message: it can echo prompt text) and the attributes that pass the
allowlist (:mod:`pdtrace.instrument.attributes`; a non-allowlisted key, or an
array / map / bytes value, is dropped and counted). Its events become
``event`` rows on it, through the same allowlist. Links are not kept.

Request id (``request_id``, ``prompt_index``), first rule that gives one; the
rule is recorded in ``attr_str['otlp.join']``:

1. ``pdtrace.request_id`` attribute (pdtrace's own OTLP export, re-collected);
2. ``gen_ai.request.id`` (vLLM's ``llm_request``: the external id ``cmpl-X-i`` /
   ``chatcmpl-X``, taken apart by :func:`pdtrace.instrument.ids.parse_request_id`
   back to X and i);
3. ``trace_id``: the W3C trace id of a span whose trace another span already
   mapped (a router that propagates ``traceparent`` to the engines shares its
   trace with their ``llm_request`` spans). A span that rules 1-2 do not map
   waits up to ``join_wait_s`` for its trace to map;
4. ``x-request-id``: the ``http.request.header.x-request-id`` attribute (the
   OpenTelemetry HTTP semantic conventions' captured header, a string array or
   a string), parsed like rule 2. On an engine's span it applies at once
   (before rule 3: it is the id the engine saw); on a router's span only after
   the wait, so that a router whose client sent its own X-Request-Id still
   joins the id the engines saw when the trace says so;
5. none: written with ``request_id`` NULL and ``otlp.join = 'none'``, counted as
   unjoined (``collect.unjoined_spans``; SQL view ``collected_spans``).

An id found by rule 1, 2 or 4 on a span of a non-router role (rule 1 on any)
teaches its trace id to rule 3. Events take their span's id.

Role (``role`` column), per resource: the resource attribute ``pdtrace.role``
when set (e.g. ``OTEL_RESOURCE_ATTRIBUTES=pdtrace.role=decode``); else from
``service.name``: containing ``prefill`` → ``prefill``, ``decode`` →
``decode``, ``router`` / ``proxy`` / ``gateway`` → ``router``; else a vLLM
process (resource ``vllm.instrumenting_module_name`` or ``vllm.process_id``)
→ ``engine`` (prefill or decode not known: set ``OTEL_SERVICE_NAME=vllm-prefill``
/ ``vllm-decode`` on the engines); else ``router`` (a non-vLLM service sending
HTTP spans into a P/D trace is the router or a proxy in front of it). Other
resource columns: ``pdtrace.<column>`` attributes when present (pdtrace's own
export), else ``engine_id`` = ``service.instance.id`` or
``<service.name>@<host>/<pid>`` (engines only: a router's rows are on the
``router`` clock domain), ``host`` = ``host.name``, ``pid`` = ``process.pid`` /
``vllm.process_id``, ``run_id`` = the collector's run id.

Router root → TTFT window. A span of role ``router``, kind SERVER, with no
parent or a remote one (``Span.flags``: the client sent a ``traceparent``),
that carries a **first-token instant** also yields the rows the
analysis reads as pdtrace's router root (module ``request_base``): a derived
``router.request`` span (same times, ``otlp.derived_from`` = the root's span id
in hex), a ``router.first_token`` event and a ``router.last_token`` event. The
first-token instant is, first found: an event named in
:data:`FIRST_TOKEN_EVENTS` (its time), or the attribute
``gen_ai.server.time_to_first_token`` (seconds after the span's start). The
last-token instant is an event named in :data:`LAST_TOKEN_EVENTS`, else the
root's end (``otlp.last_token_source = 'span_end'``: the last byte written,
which follows the last token chunk). A root without a first-token instant is
kept as it is and gives no router window (the request then has no router
record).

vLLM ``llm_request`` spans also get ``gen_ai.usage.input_tokens`` (= vLLM's
``gen_ai.usage.prompt_tokens``), the prompt-token attribute the analysis reads.
"""
from __future__ import annotations

import base64
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from . import ids, schema
from .stages import DECODE, PREFILL, ROUTER

R_SPAN = schema.RECORD_TYPES.index("span")
R_EVENT = schema.RECORD_TYPES.index("event")

#: Event names on a foreign router root whose time is the first token written to the client.
FIRST_TOKEN_EVENTS = ("router.first_token", "first_token", "gen_ai.first_token")
#: Event names on a foreign router root whose time is the last token written.
LAST_TOKEN_EVENTS = ("router.last_token", "last_token", "gen_ai.last_token")
#: Attribute of a foreign router root: span start -> first token written (seconds).
FIRST_TOKEN_ATTR = "gen_ai.server.time_to_first_token"
#: The captured X-Request-Id header (OpenTelemetry HTTP semantic conventions).
X_REQUEST_ID_ATTR = "http.request.header.x-request-id"

#: OTLP Span.flags bits: "has is_remote" (0x100) and "parent is remote" (0x200) (SpanFlags in trace.proto).
_REMOTE_PARENT = 0x300

#: Trace ids remembered for rule 3 (least recently mapped forgotten first).
TRACE_MAP_MAX = 262_144

#: Attribute keys :meth:`Ingest._span` looks at (besides ``pdtrace.*``).
_SPECIAL_KEYS = frozenset((X_REQUEST_ID_ATTR, "pdtrace.request_id", "gen_ai.request.id", "gen_ai.usage.prompt_tokens"))
#: AnyValue kinds the store holds (bool as int).
_SCALARS = frozenset(("string_value", "int_value", "double_value", "bool_value"))

#: (word in service.name, role) in the order tried: the role of a resource without ``pdtrace.role``.
_ROLE_WORDS = ((PREFILL, PREFILL), (DECODE, DECODE), (ROUTER, ROUTER), ("proxy", ROUTER), ("gateway", ROUTER))
_U64 = (1 << 64) - 1


def _u64(b: bytes) -> int | None:
    """An 8-byte OTLP span id as uint64 (None for an empty / all-zero id)."""
    if len(b) != 8:
        return None
    v = int.from_bytes(b, "big")
    return v or None


def _rid64(*parts: object) -> int:
    """A deterministic uint64 record id from ``parts`` (a retried export writes the same ids: readers dedupe)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _value(v):
    """An OTLP AnyValue as int / float / str, or the AnyValue kind name for one the store cannot hold."""
    k = v.WhichOneof("value")
    if k == "string_value":
        return v.string_value
    if k == "int_value":
        return v.int_value
    if k == "double_value":
        return v.double_value
    if k == "bool_value":
        return int(v.bool_value)
    return _Unstorable  # array, kvlist, bytes, unset: dropped and counted by the converter


class _Unstorable:
    """Marker value of an attribute the store cannot hold (the converter drops and counts it: wrong type)."""


def _header_id(v) -> str | None:
    """The first string of a captured-header AnyValue (string array or string)."""
    k = v.WhichOneof("value")
    if k == "string_value":
        return v.string_value or None
    if k == "array_value":
        for x in v.array_value.values:
            if x.WhichOneof("value") == "string_value" and x.string_value:
                return x.string_value
    return None


@dataclass
class _Unit:
    """One foreign span waiting to be written: its rows (span first, then events), not yet given a request id."""

    res_key: tuple
    trace_hex: str | None
    rows: list            # [fixed slots (15), keys list, values list] per row
    root: tuple | None    # (first_token_ns, last_token_ns | None, last_source) for a router root with a window
    fallback: str | None  # rule 4's raw id
    deadline: float
    router: bool = False
    teach: bool = False


@dataclass
class Counters:
    """What the mapping did (cumulative)."""

    spans: int = 0
    events: int = 0
    unjoined: int = 0
    derived_roots: int = 0
    skipped_pdtrace: int = 0
    joined: dict = field(default_factory=dict)  # rule name -> spans


class Ingest:
    """Stateful mapping of one collector: resources seen, the trace-id map, spans waiting for it.

    Spans of pdtrace's own OTLP export (resource ``pdtrace.pdtrace_version``)
    are skipped and counted (``counters.skipped_pdtrace``) unless
    ``keep_pdtrace``: a traced process already writes them to its store, and
    vLLM's ``--otlp-traces-endpoint`` sets ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    in the engine's processes, which switches pdtrace's exporter on towards the
    same collector (the copies' events would duplicate the store's).

    Not thread-safe: one thread calls :meth:`add` and :meth:`ready`.
    ``run_id``: the run id written on every collected row (a resource's
    ``pdtrace.run_id`` wins); ``join_wait_s``: how long a span without an own id
    waits for its trace to map (rule 3) before rule 4 or 5 applies.
    """

    def __init__(self, run_id: str | None = None, join_wait_s: float = 10.0, keep_pdtrace: bool = False) -> None:
        self.run_id = run_id
        self.join_wait_s = join_wait_s
        self.keep_pdtrace = keep_pdtrace
        self.counters = Counters()
        self.resources: dict[tuple, dict] = {}
        self._traces: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._held: dict[str, list[_Unit]] = {}  # trace hex -> units waiting for it
        self._held_n = 0
        self._ready: list[tuple[_Unit, tuple[str, int] | None, str]] = []

    @property
    def held(self) -> int:
        """Spans waiting for their trace id to map."""
        return self._held_n

    # --- input ------------------------------------------------------------------------------
    def add(self, req, now: float | None = None) -> int:
        """Map every span of one ``ExportTraceServiceRequest``; return the number of spans taken."""
        now = time.monotonic() if now is None else now
        n = 0
        for rs in req.resource_spans:
            res_key, res, role = self._resource(rs.resource)
            if res["pdtrace_version"] is not None and not self.keep_pdtrace:
                self.counters.skipped_pdtrace += sum(len(ss.spans) for ss in rs.scope_spans)
                continue
            is_router = role == ROUTER
            for ss in rs.scope_spans:
                scope = ss.scope.name or None
                for sp in ss.spans:
                    n += 1
                    self._span(sp, res_key, res, is_router, scope, now)
        self.counters.spans += n
        return n

    def _resource(self, resource) -> tuple[tuple, dict, str]:
        attrs = {kv.key: _value(kv.value) for kv in resource.attributes}
        key = tuple(sorted((k, v) for k, v in attrs.items() if v is not _Unstorable))
        res = self.resources.get(key)
        if res is None:
            res = self.resources[key] = self._resource_columns(attrs)
        return key, res, res["role"]

    def _resource_columns(self, a: dict) -> dict:
        def s(k):
            v = a.get(k)
            return str(v) if v is not None and v is not _Unstorable else None

        svc = s("service.name")
        role = s("pdtrace.role")
        if role is None:
            low = (svc or "").lower()
            role = next((r for w, r in _ROLE_WORDS if w in low), None)
        vllm = "vllm.instrumenting_module_name" in a or "vllm.process_id" in a
        if role is None:
            role = "engine" if vllm else ROUTER
        host = s("pdtrace.host") or s("host.name")
        pid = a.get("pdtrace.pid", a.get("process.pid", a.get("vllm.process_id")))
        try:
            pid = int(pid) if pid is not None and pid is not _Unstorable else None
        except ValueError:
            pid = None
        engine = s("pdtrace.engine_id")
        if engine is None and role != ROUTER:
            engine = s("service.instance.id") or f"{svc or 'unknown_service'}@{host or '?'}/{pid if pid is not None else '?'}"
        return {
            "run_id": s("pdtrace.run_id") or self.run_id, "service_name": svc, "role": role,
            "engine_id": engine, "host": host, "pid": pid,
            "pdtrace_version": s("pdtrace.pdtrace_version"), "vllm_version": s("pdtrace.vllm_version"),
            "connector": s("pdtrace.connector"), "config_hash": s("pdtrace.config_hash"),
        }

    def _span(self, sp, res_key, res, is_router: bool, scope: str | None, now: float) -> None:
        span_id = _u64(sp.span_id)
        parent = _u64(sp.parent_span_id)
        trace_hex = sp.trace_id.hex() if len(sp.trace_id) == 16 and any(sp.trace_id) else None
        start = sp.start_time_unix_nano
        end = max(sp.end_time_unix_nano, start)
        kind = sp.kind if 1 <= sp.kind <= 5 else schema.KIND_INTERNAL
        if span_id is None:  # no id: a stable one from what identifies the span
            span_id = _rid64(trace_hex, sp.name, start, end)
        keys, vals = [], []
        own = None  # (rule, raw id)
        header = None
        special = _SPECIAL_KEYS
        for kv in sp.attributes:
            k = kv.key
            av = kv.value
            kind_ = av.WhichOneof("value")
            v = getattr(av, kind_) if kind_ in _SCALARS else _Unstorable
            if kind_ == "bool_value":
                v = int(v)
            if k in special or k.startswith("pdtrace."):
                if k == X_REQUEST_ID_ATTR:
                    header = _header_id(av)
                    continue
                if k == "pdtrace.request_id":
                    if isinstance(v, str) and v:
                        own = ("pdtrace.request_id", v)
                    continue
                if k == "gen_ai.request.id":
                    if isinstance(v, str) and v and own is None:
                        own = ("gen_ai.request.id", v)
                elif k == "gen_ai.usage.prompt_tokens":
                    keys.append("gen_ai.usage.input_tokens")
                    vals.append(v)
                else:  # other pdtrace.* attributes (pdtrace's own export): its columns, not attributes
                    continue
            keys.append(k)
            vals.append(v)
        if scope:
            keys.append("otlp.scope")
            vals.append(scope)
        code = sp.status.code if sp.status.code in (0, 1, 2) else 0
        rows = [[R_SPAN, span_id, span_id, parent, sp.name, kind, start, end, code, None, None, 0, 0, None, None,
                 keys, vals]]
        first = last = None
        for i, ev in enumerate(sp.events):
            t = ev.time_unix_nano
            ek, evs = [], []
            for kv in ev.attributes:
                if not kv.key.startswith("pdtrace."):
                    ek.append(kv.key)
                    evs.append(_value(kv.value))
            rows.append([R_EVENT, _rid64(span_id, i, ev.name, t), span_id, None, ev.name, schema.KIND_INTERNAL,
                         t, t, 0, None, None, 0, 0, None, None, ek, evs])
            if ev.name in FIRST_TOKEN_EVENTS and first is None:
                first = t
            elif ev.name in LAST_TOKEN_EVENTS:
                last = t if last is None else max(last, t)
            self.counters.events += 1
        root = None
        if is_router and kind == schema.KIND_SERVER and (parent is None or sp.flags & _REMOTE_PARENT == _REMOTE_PARENT):
            if first is None:
                for k, v in zip(keys, vals):
                    if k == FIRST_TOKEN_ATTR and isinstance(v, (int, float)) and v >= 0:
                        first = start + int(round(v * 1e9))
                        break
            if first is not None:
                root = (first, last if last is not None else end, "event" if last is not None else "span_end")
        unit = _Unit(res_key, trace_hex, rows, root, header, now + self.join_wait_s, router=is_router)
        if own is not None:
            unit.teach = not is_router or own[0] == "pdtrace.request_id"
            self._resolve(unit, own[1], own[0])
            return
        if header is not None and not is_router:  # an engine's X-Request-Id is the id the engine saw
            unit.teach = True
            self._resolve(unit, header, "x-request-id")
            return
        if trace_hex is not None:
            hit = self._traces.get(trace_hex)
            if hit is not None:
                self._traces.move_to_end(trace_hex)
                self._finish(unit, hit, "trace_id")
                return
            self._held.setdefault(trace_hex, []).append(unit)
            self._held_n += 1
            return
        self._expire(unit)

    # --- resolution -------------------------------------------------------------------------
    def _resolve(self, unit: _Unit, raw: str, rule: str) -> None:
        p = ids.parse_request_id(raw)
        key = (p.base, p.prompt_index)
        if unit.teach and unit.trace_hex is not None:
            self._learn(unit.trace_hex, key)
        self._finish(unit, key, rule)

    def _learn(self, trace_hex: str, key: tuple[str, int]) -> None:
        self._traces[trace_hex] = key
        self._traces.move_to_end(trace_hex)
        if len(self._traces) > TRACE_MAP_MAX:
            self._traces.popitem(last=False)
        waiting = self._held.pop(trace_hex, None)
        if waiting:
            self._held_n -= len(waiting)
            for u in waiting:
                self._finish(u, key, "trace_id")

    def _expire(self, unit: _Unit) -> None:
        if unit.fallback:
            unit.teach = not unit.router
            self._resolve(unit, unit.fallback, "x-request-id")
        else:
            self._finish(unit, None, "none")

    def _finish(self, unit: _Unit, key: tuple[str, int] | None, rule: str) -> None:
        c = self.counters
        c.joined[rule] = c.joined.get(rule, 0) + 1
        if key is None:
            c.unjoined += 1
        self._ready.append((unit, key, rule))

    def ready(self, now: float | None = None, final: bool = False) -> dict[tuple, tuple[list[tuple], list]]:
        """Rows ready to write, by resource key: ``{res_key: (record tuples, trace ids (hex or None))}``.

        Spans still waiting for their trace past their deadline (every one when
        ``final``) fall back to rule 4 or 5 first.
        """
        now = time.monotonic() if now is None else now
        if self._held:
            for th in list(self._held):
                units = self._held[th]
                due = units if final else [u for u in units if u.deadline <= now]
                if not due:
                    continue
                rest = [] if final else [u for u in units if u.deadline > now]
                if rest:
                    self._held[th] = rest
                else:
                    del self._held[th]
                self._held_n -= len(due)
                for u in due:
                    self._expire(u)
        out: dict[tuple, tuple[list, list]] = {}
        for unit, key, rule in self._ready:
            recs, tids = out.setdefault(unit.res_key, ([], []))
            rid, pidx = key if key is not None else (None, 0)
            for r in unit.rows:
                r[10], r[11] = rid, pidx
                ks, vs = r[15], r[16]
                if r[0] == R_SPAN:
                    ks = ks + ["otlp.join"]
                    vs = vs + [rule]
                recs.append(tuple(r[:15]) + tuple(ks) + tuple(vs))
                tids.append(unit.trace_hex)
            if unit.root is not None:
                self.counters.derived_roots += 1
                self._derived(unit, rid, pidx, recs, tids)
        self._ready = []
        return out

    def _derived(self, unit: _Unit, rid, pidx, recs: list, tids: list) -> None:
        """The router.request span and router.first_token / router.last_token events of a foreign root."""
        src = unit.rows[0]
        first, last, last_src = unit.root
        orig = f"{src[2]:016x}"
        sid = _rid64("router.request", src[2]) & _U64
        ks, vs = ["otlp.derived_from"], [orig]
        for k, v in zip(src[15], src[16]):
            if k in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "http.response.status_code"):
                ks.append(k)
                vs.append(v)
        start, end = src[6], max(src[7], first, last)
        recs.append((R_SPAN, sid, sid, None, "router.request", schema.KIND_SERVER, start, end, src[8], None,
                     rid, pidx, 0, None, None, *ks, *vs))
        recs.append((R_EVENT, _rid64("router.first_token", src[2]), sid, None, "router.first_token",
                     schema.KIND_INTERNAL, first, first, 0, None, rid, pidx, 0, None, None,
                     "otlp.derived_from", orig))
        recs.append((R_EVENT, _rid64("router.last_token", src[2]), sid, None, "router.last_token",
                     schema.KIND_INTERNAL, last, last, 0, None, rid, pidx, 0, None, None,
                     "otlp.derived_from", "otlp.last_token_source", orig, last_src))
        tids.extend([unit.trace_hex] * 3)


# --- decoding ---------------------------------------------------------------------------------
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids_to_b64(obj) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping expects base64: convert in place."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _ID_FIELDS and isinstance(v, str):
                try:
                    obj[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError as exc:
                    raise ValueError(f"OTLP/JSON {k} is not hex") from exc
            else:
                _hex_ids_to_b64(v)
    elif isinstance(obj, list):
        for v in obj:
            _hex_ids_to_b64(v)


def decode(body: bytes, content_type: str):
    """Decode an OTLP/HTTP traces body: ``application/x-protobuf`` (or ``application/protobuf``) or ``application/json``.

    Returns an ``ExportTraceServiceRequest``. Raises ValueError when the body
    does not decode, LookupError for another content type.
    """
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    msg = ExportTraceServiceRequest()
    if content_type in ("application/x-protobuf", "application/protobuf"):
        try:
            msg.ParseFromString(body)
        except DecodeError as exc:
            raise ValueError(f"OTLP protobuf body does not decode: {type(exc).__name__}") from exc
        return msg
    if content_type == "application/json":
        try:
            obj = json.loads(body)
            _hex_ids_to_b64(obj)
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
        except (ValueError, TypeError, AttributeError, json_format.ParseError) as exc:
            raise ValueError(f"OTLP/JSON body does not decode: {type(exc).__name__}") from exc
        return msg
    raise LookupError(f"unsupported content type {content_type!r}")


def span_count(req) -> int:
    """Number of spans in an ``ExportTraceServiceRequest``."""
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
