"""API-server middleware: the ``prefill.frontend`` / ``decode.frontend`` spans.

Use with vLLM's own hook (a pure ASGI class, so streaming is not buffered)::

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware pdtrace.connector.traced.middleware.FrontendMiddleware

Side: the API-server process, its asyncio event-loop thread. For each POST
to ``/v1/completions`` or ``/v1/chat/completions`` it records one span named
by the engine's role (``prefill.frontend`` on a ``kv_producer``,
``decode.frontend`` on a ``kv_consumer``; the role comes from the
``--kv-transfer-config`` on the command line or ``PDTRACE_ROLE``) from the
moment the HTTP request reaches the app to the moment the last response body
chunk has been handed to the server, with a ``token`` event at the first body
chunk (the first output chunk written, for a stream). The engine's own stages
(queue, compute, handoff, first step), recorded in EngineCore, lie inside this
interval on the same host's monotonic clock: the frontend owns only the parts
no engine stage covers (parsing/tokenizing before the request is queued, and
detokenizing/writing after the output) — the analysis clips it.

Request id: the ``X-Request-Id`` header (the router's X), else none (the span
is then dropped). Never raises into the server: errors are counted in
:mod:`pdtrace.connector.traced.safety`.
"""
from __future__ import annotations

import json
import os
import sys

from pdtrace.instrument import tracer

from .safety import safe

_PATHS = ("/v1/completions", "/v1/chat/completions")


def _role_from_argv(argv) -> str | None:
    for i, a in enumerate(argv):
        val = None
        if a in ("--kv-transfer-config", "--kv_transfer_config") and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith("--kv-transfer-config="):
            val = a.split("=", 1)[1]
        if val:
            try:
                r = json.loads(val).get("kv_role")
            except Exception:  # noqa: BLE001
                return None
            return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(r)
    return None


class FrontendMiddleware:
    """Pure ASGI middleware recording the frontend span of each completion request."""

    def __init__(self, app, role: str | None = None) -> None:
        self.app = app
        self.role = role or _role_from_argv(sys.argv) or os.environ.get("PDTRACE_ROLE") or "decode"
        if self.role not in ("prefill", "decode"):
            self.role = "decode"
        self.name = f"{self.role}.frontend"
        if tracer.on:
            safe(tracer.set_resource, role=self.role, service_name=f"pdtrace-{self.role}-api")

    async def __call__(self, scope, receive, send):
        if not tracer.on or scope.get("type") != "http" or scope.get("method") != "POST" \
                or scope.get("path") not in _PATHS:
            return await self.app(scope, receive, send)
        t0 = tracer.now()
        st = safe(self._start, scope)
        if st is None:
            return await self.app(scope, receive, send)

        async def _send(message):
            safe(self._on_send, st, message)
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            safe(self._finish, st, t0)

    def _start(self, scope):
        x = None
        for k, v in scope.get("headers") or ():
            if k.lower() == b"x-request-id":
                x = v.decode("latin-1")
                break
        if not x or not tracer.sampled(x):
            return None
        return {"x": x, "status": 0, "first": 0, "chunks": 0, "sid": tracer.new_id()}

    def _on_send(self, st, message) -> None:
        typ = message.get("type")
        if typ == "http.response.start":
            st["status"] = int(message.get("status", 0))
        elif typ == "http.response.body" and message.get("body"):
            st["chunks"] += 1
            if not st["first"]:
                st["first"] = tracer.now()

    def _finish(self, st, t0) -> None:
        t1 = tracer.now()
        if st["first"]:
            tracer.event("token", st["x"], span_id=st["sid"], time_ns=st["first"],
                         attrs={"request.stream": int(st["chunks"] > 1)})
        tracer.record(self.name, st["x"], t0, t1,
                      {"http.response.status_code": st["status"], "request.stream": int(st["chunks"] > 1)},
                      span_id=st["sid"])
