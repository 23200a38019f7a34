"""API-server middleware: the ``prefill.frontend`` / ``decode.frontend`` spans.

Use with vLLM's own hook (a pure ASGI class, so streaming is not buffered)::

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware pdtrace.connector.traced.middleware.FrontendMiddleware

or let pdtrace's vLLM plugin add it (``PDTRACE_DIR`` set, no ``--middleware``:
:mod:`pdtrace.connector.plugin`). Building it starts the API server's recorder.

Side: the API-server process, its asyncio event-loop thread. For each POST
to ``/v1/completions`` or ``/v1/chat/completions`` it records one span named
by the engine's role (``prefill.frontend`` on a ``kv_producer``,
``decode.frontend`` on a ``kv_consumer``; the role comes from the
``--kv-transfer-config`` on the command line or ``PDTRACE_ROLE``) from the
moment the HTTP request reaches the app to the moment the last response body
chunk has been handed to the server, with a ``token`` event at the first body
chunk of a 2xx response that carries a generated token
(:func:`pdtrace.connector.sse.chunk_has_token`: not a chat stream's role chunk;
for a ``stream: false`` body, ``usage.completion_tokens`` > 0). A stream's
chunks are read up to its first token and second chunk (:data:`PARSE_CHUNKS`
at most), never after them, and never any text; a chunk before the first token
also for a finish reason (:func:`_finish_in`).

A 2xx response the engine gave up on before its first token gets no ``token``
event but a ``response.tokenless`` event at its last chunk, before that chunk
is handed on (``lifecycle.cause``: why, :func:`_tokenless`). vLLM answers HTTP 200 and ends such a stream with
``data: [DONE]`` -- after the role chunk (chat), a usage chunk when asked for,
or an ``{"error": ...}`` event for a finish ``error`` -- when its engine
aborted the request (engine shutdown, a sleep or scale-down pause, an abort:
vllm-project/vllm#57082), so a client that checks the status and ``[DONE]``
counts it complete. A response given up after its first token is EngineCore's
to record (the scheduler hook's ``request.abort`` for vLLM's
``FINISHED_ABORTED``). Echoed prompt text (``echo``) reads as a token.

The frontend is recorded as **two spans of the same name** (DESIGN.md §2):
``frontend.part = "in"``: HTTP received → the request handed to EngineCore
(parse, tokenize, input processing; end = ``AsyncLLM._add_request`` entered),
and ``frontend.part = "out"``: EngineCore emitted the request's first output
(``OutputProcessor.process_outputs``, the outputs' own timestamp) → the last body chunk written
(detokenize, serialize, write; the analysis clips it at the first token). The
engine's own stages (queue, compute, handoff, first step), recorded in
EngineCore on the same host's monotonic clock, lie between the two parts, so
one frontend span over the whole exchange would hide them all. The two vLLM
methods are wrapped once per API-server process when the middleware is built
(tracing on only; both, and every vLLM name read here, listed in :mod:`pdtrace.connector.vllm_compat`). When a
part's boundary is unknown (a hook missing), one span over the whole exchange
is recorded with ``frontend.part = "whole"``.

Clock domain: the rows carry the engine's ``engine_id`` (``engine_id`` in
``--kv-transfer-config`` when given, else ``app.state.vllm_config``'s
``kv_transfer_config.engine_id`` read on the first request), so the analysis
corrects them with the engine's clock offset (one host clock; DESIGN.md §3).

Request id: the ``X-Request-Id`` header (the router's X), else none (the span
is then dropped). While the exchange lasts the span is open (``tracer.start``,
``wait.for = "engine"``): a request stuck in EngineCore shows in view
``in_flight`` before it ends; its rows are recorded as above and the open
span is closed (same span id as the ``out``/``whole`` part). Never raises into the server: errors are swallowed
and counted (:mod:`pdtrace.connector.traced.safety`; the count reaches the process's ``recorder.stats`` rows).
"""
from __future__ import annotations

import json
import sys

from pdtrace.instrument import activate, tracer
from pdtrace.instrument import attributes as _attrs
from pdtrace.instrument import config, stages

from .. import sse
from .common import SPLIT_CACHE, split_id
from .safety import safe

_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Body chunks of a 2xx response read at most while looking for the first token, role chunks not counted
#: (vLLM's tokenless answer to an aborted chat stream is the role chunk of each choice, a usage chunk,
#: [DONE]); after them, with no token found and no [DONE], the first chunk's time stands for it.
PARSE_CHUNKS = 4

_attrs.register("frontend.part", str, "which part of a frontend span: 'in' (HTTP received -> handed to "
                "EngineCore), 'out' (first output back -> last chunk written) or 'whole' (boundaries unknown)")


def _kv_config_from_argv(argv) -> dict | None:
    """The ``--kv-transfer-config`` JSON object on the command line, or None."""
    for i, a in enumerate(argv):
        val = None
        if a in ("--kv-transfer-config", "--kv_transfer_config") and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(("--kv-transfer-config=", "--kv_transfer_config=")):
            val = a.split("=", 1)[1]
        if val:
            try:
                cfg = json.loads(val)
            except Exception:  # noqa: BLE001
                return None
            return cfg if isinstance(cfg, dict) else None
    return None


def role_of(kv_role: str | None) -> str | None:
    """pdtrace's role of a ``kv_role`` from ``--kv-transfer-config``: 'prefill' (kv_producer), 'decode'
    (kv_consumer), None for another value or none (no frontend span name can be chosen)."""
    return stages.role_of_kv_role(kv_role)


def _role_from_argv(argv) -> str | None:
    cfg = _kv_config_from_argv(argv)
    return role_of(cfg.get("kv_role") if cfg else None)


def _engine_id_from_argv(argv) -> str | None:
    """``engine_id`` from ``--kv-transfer-config`` when given there (else vLLM draws a uuid4)."""
    cfg = _kv_config_from_argv(argv)
    e = cfg.get("engine_id") if cfg else None
    return str(e) if e else None


def _engine_id_from_app(app) -> str | None:
    """``app.state.vllm_config.kv_transfer_config.engine_id`` (vLLM's API server sets
    ``state.vllm_config``; the EngineCore it spawns gets the same config, so the same id)."""
    state = getattr(app, "state", None)  # Starlette's app state; another ASGI app of the chain has none
    # set by vLLM's app-state initialisation, after the middleware is built: absent until then
    # (vllm_compat.HOOKS: app_state assigns vllm_config)
    vllm_config = getattr(state, "vllm_config", None)
    cfg = vllm_config.kv_transfer_config if vllm_config is not None else None  # None: no --kv-transfer-config
    e = cfg.engine_id if cfg is not None else None
    return str(e) if e else None


# X -> monotonic ns: request handed to EngineCore / first output back (this API-server process)
_sent: dict[str, int] = {}
_first_out: dict[str, int] = {}
_installed = False


def _x_of(request_id) -> str | None:
    return split_id(str(request_id))[0]


def _note(d: dict, request_id) -> None:
    x = _x_of(request_id)
    if x and x not in d:
        if len(d) > 100_000:
            d.clear()
        d[x] = tracer.now()


def _note_outputs(outputs, ts) -> None:
    """Note each request's first output time (X -> ns in ``_first_out``): EngineCore's own timestamp of
    the outputs ``ts`` (monotonic s, same host clock) when sound, else now. Called on every batch of
    outputs (every engine step of a decode server): a request already noted costs two dict lookups
    (:data:`pdtrace.connector.traced.common.SPLIT_CACHE` read inline, then ``_first_out``)."""
    t = None
    ids, first = SPLIT_CACHE, _first_out
    for o in outputs or ():
        rid = o.request_id
        v = ids.get(rid)
        x = v[0] if v is not None else _x_of(rid)
        if x and x not in first:
            if t is None:
                t_now = tracer.now()
                t = int(ts * 1e9) if ts and 0 < int(ts * 1e9) <= t_now else t_now
            if len(first) > 100_000:
                first.clear()
            first[x] = t


def install_engine_hooks() -> bool:
    """Wrap ``AsyncLLM._add_request`` and ``OutputProcessor.process_outputs`` (once per process)."""
    global _installed
    if _installed:
        return True
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    orig_add = AsyncLLM._add_request
    orig_process = OutputProcessor.process_outputs

    async def _add_request(self, request, *args, **kwargs):
        # Noted on entry: input processing is done (``request`` is the EngineCoreRequest) and the
        # send follows without another await before it; after the return would add however long
        # the event loop takes to resume this coroutine (seen: 140 ms on a loaded decode server).
        if tracer.on:
            safe(_note, _sent, request.request_id)
        return await orig_add(self, request, *args, **kwargs)

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, *args, **kwargs):
        # The out part starts when EngineCore emitted the request's first output (the outputs'
        # own monotonic timestamp, same host clock), not when this busy event loop got to it.
        if tracer.on:
            safe(_note_outputs, engine_core_outputs, engine_core_timestamp)
        return orig_process(self, engine_core_outputs, engine_core_timestamp, *args, **kwargs)

    AsyncLLM._add_request = _add_request
    OutputProcessor.process_outputs = process_outputs
    _installed = True
    return True


class FrontendMiddleware:
    """Pure ASGI middleware recording the frontend span of each completion request."""

    def __init__(self, app, role: str | None = None, activation: str = "explicit") -> None:
        """``activation``: 'explicit' (``--middleware``) or 'plugin' (added by pdtrace's vLLM plugin).

        Starts this process's recorder (on iff ``PDTRACE_DIR`` is set)."""
        self.app = app
        self.role = role or _role_from_argv(sys.argv) or config.raw("PDTRACE_ROLE") or "decode"
        if self.role not in stages.ENGINE_ROLES:
            self.role = "decode"
        self.name = f"{self.role}.frontend"
        # engine_id puts this process's rows in its engine's clock domain (same host clock), so the
        # analysis corrects them with the engine's offset: from argv now, else from the app's
        # vLLM config on the first request (set after the middleware is built).
        self.engine_id = _engine_id_from_argv(sys.argv)
        # the resource goes with the start, so that no row of this process is written without its role
        res = {"role": self.role, "service_name": f"pdtrace-{self.role}-api"}
        if self.engine_id:
            res["engine_id"] = self.engine_id
        safe(activate, activation, **res)
        if tracer.on:
            safe(install_engine_hooks)

    def _resolve_engine_id(self, scope) -> None:
        e = _engine_id_from_app(scope.get("app")) or _engine_id_from_app(self.app)
        self.engine_id = e or ""        # "" : looked, not found; never looked again
        if e:
            tracer.set_resource(engine_id=e)

    async def __call__(self, scope, receive, send):
        if not tracer.on or scope.get("type") != "http" or scope.get("method") != "POST" \
                or scope.get("path") not in _PATHS:
            return await self.app(scope, receive, send)
        t0 = tracer.now()
        if self.engine_id is None:
            safe(self._resolve_engine_id, scope)
        st = safe(self._start, scope, t0)
        if st is None:
            return await self.app(scope, receive, send)

        async def _send(message):
            # once the status, the first token chunk's time and a second chunk (request.stream) are noted, the
            # rest of a stream needs nothing: no hook per streamed chunk on the event loop
            if not st["seen"]:
                safe(self._on_send, st, message)
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            safe(self._finish, st, t0)

    def _start(self, scope, t0):
        x = None
        for k, v in scope.get("headers") or ():
            if k.lower() == b"x-request-id":
                x = v.decode("latin-1")
                break
        if not x or not tracer.sampled(x):
            return None
        # open while the exchange lasts (an ``open`` row while it waits for EngineCore; view in_flight)
        sid = tracer.start(self.name, x, start_ns=t0, attrs={"wait.for": "engine", "frontend.part": "whole"})
        # chunks: body chunks read (request.stream = more than one); t_body: when the first was handed on (the
        # token's instant when no chunk could be read); first: when the first chunk carrying a token was; finish:
        # a finish reason read in a chunk without a token before that; sse: the stream's decoder (None: not a
        # stream); error_event / read_whole: see _has_token; seen: nothing more to note
        return {"x": x, "status": 0, "first": 0, "t_body": 0, "chunks": 0, "sid": sid or tracer.new_id(),
                "seen": False, "sse": None, "finish": None, "error_event": False, "read_whole": False,
                "role_chunks": 0, "t_last": 0}

    def _on_send(self, st, message) -> None:
        typ = message.get("type")
        if typ == "http.response.start":
            st["status"] = int(message.get("status", 0))
        elif typ == "http.response.body" and message.get("body"):
            body = message["body"]
            st["chunks"] += 1
            t = 0
            if not st["t_body"]:
                st["t_body"] = t = tracer.now()
            ok = 200 <= st["status"] < 300
            if ok and not st["first"]:
                if _has_token(st, body):
                    st["first"] = t or tracer.now()
                else:  # a chunk without a token may say why (a finish abort / error)
                    st["t_last"] = t or tracer.now()  # before it is handed on: a tokenless end's instant
                    fin = _finish_in(body)
                    if fin:
                        st["finish"] = fin
            # request.stream known (a second chunk) and the first token found, or not to be found: an error
            # status, or PARSE_CHUNKS chunks without one besides role chunks (a body shape not read here: _finish)
            if st["chunks"] > 1 and (st["first"] or not ok or st["chunks"] - st["role_chunks"] >= PARSE_CHUNKS):
                st["seen"] = True

    def _finish(self, st, t0) -> None:
        t1 = tracer.now()
        x = st["x"]
        t_in = _sent.pop(x, 0)
        t_out = _first_out.pop(x, 0)
        a = {"http.response.status_code": st["status"], "request.stream": int(st["chunks"] > 1)}
        if t0 <= t_in <= t_out <= t1:
            tracer.record(self.name, x, t0, t_in, {**a, "frontend.part": "in"})
            tracer.record(self.name, x, t_out, t1, {**a, "frontend.part": "out"}, span_id=st["sid"])
        else:
            tracer.record(self.name, x, t0, t1, {**a, "frontend.part": "whole"}, span_id=st["sid"])
        tracer.close(st["sid"])
        tokenless = _tokenless(st) if 200 <= st["status"] < 300 and not st["first"] else None
        # the first chunk that carried a token; when no chunk could be read (a body shape chunk_has_token does not
        # know) and nothing says the response had none, the first body chunk. An error status (e.g. 500 after a
        # failed KV load) is no token.
        first = st["first"] or (st["t_body"] if 200 <= st["status"] < 300 and tokenless is None else 0)
        if first:
            tracer.event("token", x, span_id=st["sid"], time_ns=first,
                         attrs={"request.stream": int(st["chunks"] > 1)})
        if tokenless:
            # the engine gave the request up and the server still answered 200 (vllm-project/vllm#57082): the
            # analysis reads it as a failure of the request (incomplete_requests, cause abort)
            tracer.event("response.tokenless", x, span_id=st["sid"], time_ns=st["t_last"] or t1,
                         attrs={"lifecycle.cause": tokenless, "request.stream": int(st["chunks"] > 1)})


def _tokenless(st: dict) -> str | None:
    """Why a 2xx response that carried no token (as read) had none, or None when nothing read says so
    (then its first chunk stands for the token, as for any body shape not read here).

    ``finish_abort`` / ``finish_error``: a choice finished so (:data:`pdtrace.connector.sse.GAVE_UP`);
    ``error_event``: a ``data: {"error": ...}`` event (vLLM turns a finish ``error`` into one, then
    ``[DONE]``); ``no_token``: the stream reached ``data: [DONE]``, or the ``stream: false`` body was read,
    with no token -- what vLLM 0.32 writes for a request its engine aborted before the first token (a chat
    stream: the role chunk, a usage chunk when asked for, ``[DONE]``; a completions stream: ``[DONE]`` alone);
    ``stream_cut``: the stream ended without ``[DONE]`` and every chunk of it was read, none with a token.
    """
    if st["finish"] in sse.GAVE_UP:
        return f"finish_{st['finish']}"
    if st["error_event"]:
        return "error_event"
    dec = st["sse"]
    if dec is not None:
        if dec.done:
            return "no_token"
        # every chunk was read (reading stops only at a token or after PARSE_CHUNKS): none had a token
        return "stream_cut" if not st["seen"] else None
    return "no_token" if st["read_whole"] else None


def _has_token(st: dict, body: bytes) -> bool:
    """True if the 2xx body chunk ``body`` carries a generated token (:func:`pdtrace.connector.sse.chunk_has_token`).

    A server-sent-event stream is read event by event: a chunk that is one whole event (what vLLM writes)
    at once -- a completions chunk holding a ``text`` key and an unfinished choice
    (``"finish_reason":null``), a chat chunk whose delta starts with ``content``, or one announcing the
    role, without decoding it; any other by decoding its JSON -- and anything else through an
    incremental decoder (``st["sse"]``, which notes ``data: [DONE]``); an ``{"error": ...}`` event sets
    ``st["error_event"]``. A ``stream: false`` body is
    one JSON object whose ``usage.completion_tokens`` says it (0 for a request the engine aborted before its
    first token); ``st["read_whole"]`` notes that it was read. A body that is neither (not JSON, or one split
    over several chunks) counts as no token here, unread (see :func:`_tokenless`).
    """
    dec = st["sse"]
    if dec is None and body[:5] == b"data:":
        dec = st["sse"] = sse.SSEDecoder()
    if dec is not None:
        if body[:7] == b"data: {" and body[-2:] == b"\n\n" and body.count(b"\n\n") == 1 and not dec.pending:
            if b'"finish_reason":null' in body:
                if b'"text":' in body:
                    return True  # vLLM's completions token chunk (sse.chunk_has_token counts a text key so)
                if b'"delta":{"content":' in body:
                    return True  # vLLM's chat token chunk (content, even "": sse.chunk_has_token)
                if b'"delta":{"role":' in body:
                    st["role_chunks"] += 1  # a chat stream's role chunk (one per choice): no token, not counted
                    return False
            if body[:15] == b'data: {"error":':
                st["error_event"] = True
                return False
            try:
                return sse.chunk_has_token(json.loads(body[6:]))
            except ValueError:
                return False
        objs = dec.feed(body)
        if any(isinstance(o, dict) and "error" in o for o in objs):
            st["error_event"] = True
        return any(sse.chunk_has_token(o) for o in objs if isinstance(o, dict))
    k = body.rfind(_TOKENS_KEY)  # usage ends a vLLM body
    if k >= 0:
        digits = body[k + len(_TOKENS_KEY):k + len(_TOKENS_KEY) + 24].lstrip()
        n = len(digits) - len(digits.lstrip(b"0123456789"))
        if n:
            st["read_whole"] = True
            return int(digits[:n]) > 0
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    if not isinstance(obj, dict):
        return False
    st["read_whole"] = True
    return sse.chunk_has_token(obj)


_TOKENS_KEY = b'"completion_tokens":'
_FINISH_KEY = b'"finish_reason":'


def _finish_in(body: bytes) -> str | None:
    """The finish reason in a body chunk (a stream's chunk, or a whole ``stream: false`` body), cut to 16
    characters; one choice given up (:data:`pdtrace.connector.sse.GAVE_UP`) is the response given up; None
    when no choice in it has finished.

    Read from the bytes, not decoded: in the last event holding a ``"finish_reason":`` key, each value that
    is a quoted string (``null``: not finished). JSON escapes a quote inside a string value, so the key
    cannot match text. Never reads or keeps any text. About 1 µs for a one-choice chunk.
    """
    k = body.rfind(_FINISH_KEY)
    if k < 0:
        return None
    if body.count(_FINISH_KEY) == 1:  # one choice (n = 1): the common case
        return _reason_at(body, k)
    start = max(body.rfind(b"data:", 0, k), 0) if body[:5] == b"data:" else 0
    reasons = []
    while k >= 0:
        r = _reason_at(body, k)
        if r:
            reasons.append(r)
        k = body.rfind(_FINISH_KEY, start, k)
    if not reasons:
        return None
    gave = sorted(r for r in reasons if r in sse.GAVE_UP)
    return (gave or sorted(reasons))[0]


def _reason_at(body: bytes, k: int) -> str | None:
    """The string value of the ``"finish_reason":`` key at byte ``k`` of ``body`` (16 characters at most),
    None for ``null`` or anything else."""
    v = body[k + len(_FINISH_KEY):k + len(_FINISH_KEY) + 40]
    if v[:1] != b'"':
        v = v.lstrip()
        if v[:1] != b'"':
            return None
    end = v.find(b'"', 1)
    return v[1:min(end, 17)].decode("ascii", "replace") if end > 1 else None
