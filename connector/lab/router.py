"""P/D router (proxy): OpenAI ``/v1/completions`` and ``/v1/chat/completions`` over P and D engines.

(Over 400 lines on purpose: one request's path -- dispatch of both legs, relay of D's stream, the
join watchdog, aborts and the router's spans -- is one piece of state, ``ctx``, threaded through
``_serve`` and ``_relay_decode``; split across modules it would be harder to check.)

aiohttp server and client. For each client request the router makes one id X
(``<prefix><16 hex>``), sends it as ``X-Request-Id`` on both legs and a W3C
``traceparent`` whose trace id is derived from X (``pdtrace.instrument.ids``).

- **pull**: P gets the request with ``max_tokens=1`` and
  ``kv_transfer_params.do_remote_decode``; D then gets the client's request with
  the ``kv_transfer_params`` P returned (D READs the KV).
- **push**: P and D legs are dispatched concurrently (``push_dispatch:
  "concurrent"``, the default) or D only after P answered (``"serial"``: a
  router without the overlap, the perturbation that exposes D's registration on
  the critical path); D gets ``do_remote_prefill`` plus P's engine id,
  side-channel host/port and TP size (known in advance: the lab fixes P's
  ``engine_id``); P WRITEs into D's blocks.
  P matches D's registration by the request id, so both legs **must** carry
  the same X-Request-Id. Guards: the router refuses to dispatch push legs whose
  ids differ (HTTP 500), and a join watchdog fails the request with HTTP 504
  (or an in-stream error) when D has produced no token ``push_join_timeout_s``
  seconds after P answered — instead of hanging until vLLM's registration
  timeout (480 s by default).

D's stream is relayed chunk by chunk. Errors from a leg keep their HTTP status;
a failure after the stream started becomes an in-stream ``{"error": ...}``
event; a D stream that ends without its final ``data: [DONE]`` is such a
failure (type ``stream_truncated``), never a complete response; so is a D
response whose choice finished with ``finish_reason`` ``error`` (type
``decode_failed``, e.g. the KV load failed) or ``abort`` (type
``decode_aborted``: D aborted it, as vLLM's API server does to every open
request when SIGTERM starts its graceful shutdown), and so is a D response
without any token (type ``decode_no_token``: ``data: [DONE]`` before any token,
or a non-streamed body with ``completion_tokens`` 0 -- what vLLM writes, HTTP
200, for a request its engine aborted before the first token;
vllm-project/vllm#57082). A per-request timeout (``timeout_s``) applies; when one leg fails or the
client disconnects, the other leg is cancelled (closing its connection makes
vLLM abort it). Engines are picked round-robin.

Spans (through ``pdtrace.instrument.tracer``, when ``PDTRACE_DIR`` is set):
``router.request`` (root), ``router.dispatch`` (one per leg: router work
before the leg is sent), ``router.wait`` (one per leg: sent → P's response /
D's first token chunk received), the event ``router.first_token`` on the root
at the instant the first chunk carrying a generated token is handed to the
client's connection (read just before the write, so it never falls after the
client could have the token; TTFT end, DESIGN.md §3), ``router.last_token`` (the last chunk with a
token; a non-streamed response hands every token over in one write, so both events carry that write's
instant) and ``router.leg_failed``. No prompt or completion
text is recorded or logged.

The router also keeps its own added latency per request (``GET /_lab/stats``):
TTFT on its clock minus the time it spent waiting on engines on the TTFT path
(pull: P's round trip + D's time to first token chunk; push: D's).

Test hooks (only with ``test_hooks: true`` in the config): request header
``X-Pdtrace-Lab-Hold: 1`` parks D's leg until ``POST /_lab/release`` (pull:
after P answered; push: before D's leg is sent, so D sends no registration
and P holds its KV waiting for one); ``GET /_lab/held`` lists parked ids; header
``X-Pdtrace-Lab-Fault: split-id`` gives D a different request id *after* the
guard (simulates an intermediary rewriting ids).

Run: ``python -m pdtrace.connector.lab.router --config router.json`` (written by
:class:`pdtrace.connector.lab.launcher.Lab`).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import logging
import secrets
import signal
import time

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from . import inject as _inject
from ..sse import SSEDecoder, chunk_has_token, finish_reasons

try:  # the recorder (issue 2); the router works without it
    from pdtrace.instrument import ids as _ids
    from pdtrace.instrument import tracer as _tracer
except ImportError:  # pragma: no cover
    _tracer, _ids = None, None

log = logging.getLogger("pdtrace.router")

HOLD_HEADER = "X-Pdtrace-Lab-Hold"
FAULT_HEADER = "X-Pdtrace-Lab-Fault"
INDEX_HEADER = "X-Pdtrace-Prompt-Index"
STATUS_ERROR = 2
# push: "concurrent" sends both legs at once; "serial" sends D only after P answered.
PUSH_DISPATCH = ("concurrent", "serial")


class LegError(Exception):
    """A leg failed: ``status`` is the HTTP status to give the client, ``body`` a JSON-able error."""

    def __init__(self, status: int, message: str, leg: str, kind: str, upstream_body: bytes | None = None):
        super().__init__(message)
        self.status, self.message, self.leg, self.kind = status, message, leg, kind
        self.upstream_body = upstream_body

    def payload(self) -> dict:
        err = {"message": self.message, "type": self.kind, "code": self.status, "leg": self.leg}
        if self.upstream_body:
            try:
                err["upstream"] = json.loads(self.upstream_body)
            except ValueError:
                pass
        return {"error": err}


def finish_failure(obj: dict) -> LegError | None:
    """The failure a D response chunk (a parsed JSON object) reports in its choices' ``finish_reason``.

    ``"error"`` -> 502 ``decode_failed`` (vLLM finishes a request so when its KV
    load from P failed); ``"abort"`` -> 502 ``decode_aborted`` (the engine
    aborted it: vLLM's API server ends every open request so when SIGTERM starts
    its graceful shutdown, ``vllm/entrypoints/launchers/launcher.py``); any
    other reason, or none -> ``None``.
    """
    reasons = finish_reasons(obj)
    if "error" in reasons:
        return LegError(502, "decode engine finished the request with an error "
                             "(e.g. KV load from the prefill engine failed)", "decode", "decode_failed")
    if "abort" in reasons:
        return LegError(502, "decode engine aborted the request before it finished "
                             "(the engine is shutting down, or the request was aborted on it)",
                        "decode", "decode_aborted")
    return None


def check_shared_id(p_headers: dict, d_headers: dict) -> None:
    """Push guard: raise :class:`LegError` (500) unless both legs carry the same X-Request-Id."""
    a, b = p_headers.get("X-Request-Id"), d_headers.get("X-Request-Id")
    if not a or a != b:
        raise LegError(500, "push mode needs the same X-Request-Id on the prefill and decode legs "
                            "(P matches D's registration by it); refusing to dispatch", "router", "push_id_mismatch")


class _Spans:
    """Thin guard over the tracer: every method is a no-op when tracing is off."""

    def __init__(self):
        self.t = _tracer if (_tracer is not None and getattr(_tracer, "on", False)) else None

    def start(self, name, rid, parent=None, attrs=None, start_ns=None, pidx=0):
        return self.t.start(name, rid, start_ns=start_ns, parent=parent, attrs=attrs, prompt_index=pidx) if self.t else 0

    def end(self, sid, attrs=None, status=0, error=None, end_ns=None):
        if self.t and sid:
            self.t.end(sid, end_ns=end_ns, attrs=attrs, status=status, error=error)

    def record(self, name, rid, t0, t1, attrs=None, parent=None, pidx=0):
        return self.t.record(name, rid, t0, t1, attrs=attrs, parent=parent, prompt_index=pidx) if self.t else 0

    def event(self, name, rid, sid, t=None, attrs=None, pidx=0):
        if self.t:
            self.t.event(name, rid, span_id=sid, time_ns=t, attrs=attrs, prompt_index=pidx)


def _now() -> int:
    return time.monotonic_ns()


class Router:
    """The router application. ``cfg`` keys: mode, host, port, prefill, decode,
    timeout_s, push_join_timeout_s, push_dispatch, test_hooks, id_prefix."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.mode = cfg["mode"]
        if self.mode not in ("pull", "push"):
            raise ValueError(f"mode must be 'pull' or 'push', not {self.mode!r}")
        if not cfg.get("prefill") or not cfg.get("decode"):
            raise ValueError("the router needs at least one prefill and one decode engine")
        self.prefill = list(cfg["prefill"])
        self.decode = list(cfg["decode"])
        self._p_rr = itertools.cycle(range(len(self.prefill)))
        self._d_rr = itertools.cycle(range(len(self.decode)))
        self.timeout_s = float(cfg.get("timeout_s", 120))
        self.join_timeout_s = float(cfg.get("push_join_timeout_s", 60))
        self.push_dispatch = cfg.get("push_dispatch", "concurrent")
        if self.push_dispatch not in PUSH_DISPATCH:
            raise ValueError(f"push_dispatch must be one of {PUSH_DISPATCH}, not {self.push_dispatch!r}")
        self.hooks = bool(cfg.get("test_hooks", False))
        self.prefix = cfg.get("id_prefix", "lab-")
        self.session: ClientSession | None = None
        self.held: dict[str, asyncio.Event] = {}
        self._bg: set[asyncio.Task] = set()  # push P legs finishing after the client's response
        self.stats = collections.deque(maxlen=200_000)  # (id, status, ttft_ns, overhead_ns)
        self.spans = _Spans()

    # -- app -------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/_lab/stats", self.get_stats)
        app.router.add_get("/_lab/held", self.get_held)
        app.router.add_post("/_lab/release", self.release)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app):
        self.session = ClientSession(connector=TCPConnector(limit=0, force_close=False),
                                     timeout=ClientTimeout(total=None, sock_connect=10))

    async def _cleanup(self, app):
        # P legs still finishing in the background get a few seconds to end with P's answer, then are
        # cancelled (their router.wait is then recorded as an error) before the session closes
        if self._bg:
            _, pending = await asyncio.wait(set(self._bg), timeout=5.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self.session:
            await self.session.close()

    async def health(self, request):
        return web.json_response({"status": "ok", "mode": self.mode, "push_dispatch": self.push_dispatch,
                                  "prefill": len(self.prefill), "decode": len(self.decode)})

    async def models(self, request):
        async with self.session.get(self.decode[0]["url"] + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def get_stats(self, request):
        rows = list(self.stats)
        return web.json_response({"requests": [
            {"id": i, "status": s, "ttft_ns": t, "overhead_ns": o} for i, s, t, o in rows]})

    async def get_held(self, request):
        if not self.hooks:
            raise web.HTTPNotFound()
        return web.json_response({"held": sorted(self.held)})

    async def release(self, request):
        if not self.hooks:
            raise web.HTTPNotFound()
        body = await request.json() if request.can_read_body else {}
        ids = [body["id"]] if body.get("id") else list(self.held)
        for i in ids:
            ev = self.held.get(i)
            if ev:
                ev.set()
        return web.json_response({"released": ids})

    # -- request handling ---------------------------------------------------
    def _leg_headers(self, rid: str, parent_sid: int, sampled: bool) -> dict:
        h = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if _ids is not None:
            h["traceparent"] = _ids.traceparent(rid, parent_sid or secrets.randbits(63) | 1, sampled)
        return h

    async def handle(self, request: web.Request):
        t_recv = _now()
        path = request.path
        x = self.prefix + secrets.token_hex(8)
        try:
            pidx = int(request.headers.get(INDEX_HEADER, "0"))
        except ValueError:
            pidx = 0
        sp = self.spans
        sampled = bool(sp.t and sp.t.sampled(x))
        ctx = {"x": x, "pidx": pidx, "t_recv": t_recv, "engine_wait_ns": 0, "first_token_ns": None,
               "status": 0, "first_chunk_rx_ns": None}
        root = sp.start("router.request", x, start_ns=t_recv, pidx=pidx,
                        attrs={"request.mode": self.mode, "router.policy": "round-robin",
                               "request.client_id": request.headers.get("X-Request-Id", "")[:64]}) if sampled else 0
        ctx["root"], ctx["sampled"] = root, sampled
        resp = None
        try:
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise ValueError
            except ValueError:
                raise LegError(400, "request body must be a JSON object", "router", "invalid_request")
            async with asyncio.timeout(self.timeout_s):
                resp = await self._serve(request, path, body, ctx)
            return resp
        except TimeoutError:
            ctx["status"] = 504
            return await self._fail(request, ctx, LegError(
                504, f"request timed out after {self.timeout_s:.0f} s in the router", "router", "timeout"))
        except LegError as e:
            ctx["status"] = e.status
            return await self._fail(request, ctx, e)
        except asyncio.CancelledError:
            if not ctx.get("done"):
                ctx["status"] = 499  # client went away before the response was complete
            raise
        finally:
            # the root ends when the last byte was written (not after the push P leg's late answer)
            t_end = ctx.get("t_done") or _now()
            ttft = (ctx["first_token_ns"] - t_recv) if ctx["first_token_ns"] else -1
            overhead = (ttft - ctx["engine_wait_ns"]) if ctx["first_token_ns"] else -1
            self.stats.append((x, ctx["status"], ttft, overhead))
            if root:
                sp.end(root, end_ns=t_end, attrs={"http.response.status_code": ctx["status"],
                                                  "request.stream": int(bool(ctx.get("stream")))},
                       status=STATUS_ERROR if ctx["status"] >= 400 or ctx["status"] == 0 else 0)

    async def _fail(self, request, ctx, e: LegError):
        self.spans.event("router.leg_failed", ctx["x"], ctx["root"], attrs={
            "http.response.status_code": e.status, "error.type": e.kind, "router.leg": e.leg}, pidx=ctx["pidx"])
        resp = ctx.get("resp")
        if resp is not None and resp.prepared:
            # The stream already started: report in-stream, the client's status stays 200.
            try:
                await resp.write(b"data: " + json.dumps(e.payload()).encode() + b"\n\n")
                await resp.write_eof()
            except (ConnectionError, RuntimeError):
                pass
            return resp
        return web.json_response(e.payload(), status=e.status)

    def _p_body(self, body: dict) -> dict:
        b = dict(body)
        b["max_tokens"] = 1
        if "max_completion_tokens" in b:
            b["max_completion_tokens"] = 1
        b["stream"] = False
        for k in ("stream_options", "min_tokens"):
            b.pop(k, None)
        b["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}
        return b

    async def _post_json(self, url: str, body: dict, headers: dict, leg: str) -> tuple[dict, int]:
        """POST and read a JSON response; returns (json, t_received_ns); raises LegError."""
        try:
            async with self.session.post(url, json=body, headers=headers) as r:
                raw = await r.read()
                t = _now()
                if r.status != 200:
                    raise LegError(r.status, f"{leg} engine answered HTTP {r.status}", leg, "upstream_error", raw)
                return json.loads(raw), t
        except (ClientError, ConnectionError) as exc:
            raise LegError(502, f"{leg} engine unreachable or connection lost ({type(exc).__name__})",
                           leg, "upstream_unreachable") from None

    async def _serve(self, request: web.Request, path: str, body: dict, ctx: dict):
        sp, x, root, pidx = self.spans, ctx["x"], ctx["root"], ctx["pidx"]
        P = self.prefill[next(self._p_rr)]
        D = self.decode[next(self._d_rr)]
        stream = bool(body.get("stream"))
        ctx["stream"] = stream
        hooks = self.hooks
        hold = hooks and request.headers.get(HOLD_HEADER) == "1"
        split = hooks and request.headers.get(FAULT_HEADER) == "split-id"

        p_dispatch = sp.start("router.dispatch", x, start_ns=ctx["t_recv"], parent=root, pidx=pidx,
                              attrs={"router.leg": "prefill", "router.upstream": P["url"][7:]}) if root else 0
        p_headers = self._leg_headers(x, p_dispatch, ctx["sampled"])
        p_body = self._p_body(body)

        if self.mode == "pull":
            await _inject.asleep("router.dispatch", x)  # lab only: PDTRACE_LAB_INJECT (see .inject)
            t_sent = _now()
            sp.end(p_dispatch, end_ns=t_sent)
            p_json, t_p = await self._post_json(P["url"] + path, p_body, p_headers, "prefill")
            ctx["engine_wait_ns"] += t_p - t_sent
            if root:
                sp.record("router.wait", x, t_sent, t_p, {"router.leg": "prefill"}, parent=root, pidx=pidx)
            params = p_json.get("kv_transfer_params")
            if not params:
                raise LegError(502, "prefill engine returned no kv_transfer_params "
                                    "(is it started with kv_role=kv_producer and a NIXL connector?)",
                               "prefill", "no_kv_transfer_params")
            if hold:
                ev = self.held.setdefault(x, asyncio.Event())
                try:
                    await ev.wait()
                finally:
                    self.held.pop(x, None)
            d_dispatch = sp.start("router.dispatch", x, start_ns=t_p if not hold else _now(), parent=root, pidx=pidx,
                                  attrs={"router.leg": "decode", "router.upstream": D["url"][7:]}) if root else 0
            d_body = dict(body)
            d_body["kv_transfer_params"] = params
            d_headers = self._leg_headers(x, d_dispatch, ctx["sampled"])
            return await self._relay_decode(request, path, D, d_body, d_headers, d_dispatch, ctx, None)

        # push: both legs at once (concurrent), or D after P answered (serial)
        serial = self.push_dispatch == "serial"
        # lab only (PDTRACE_LAB_INJECT, see .inject): the router's dispatch work, before it sends any leg
        # (concurrent legs: both dispatch spans hold it; serial: P's). Not inside P's leg alone: with D's
        # leg already running, that would be a later P, not a slower router (D registers while P waits,
        # and P computes faster without D's work beside it on the lab's 2 cores: BENCHMARKS.md
        # "Injected delays")
        await _inject.asleep("router.dispatch", x)

        async def p_leg():
            t_sent = _now()
            sp.end(p_dispatch, end_ns=t_sent)
            # opened now so that a leg cut short (cancelled, failed) still leaves its wait, as an error
            p_wait = sp.start("router.wait", x, start_ns=t_sent, parent=root, pidx=pidx,
                              attrs={"router.leg": "prefill"}) if root else 0
            try:
                _, t_p = await self._post_json(P["url"] + path, p_body, p_headers, "prefill")
            except BaseException as e:
                sp.end(p_wait, end_ns=_now(), error=e)
                raise
            if serial:
                ctx["engine_wait_ns"] += t_p - t_sent  # P's round trip is on the TTFT path
            sp.end(p_wait, end_ns=t_p)
            return t_p

        t_d0 = ctx["t_recv"]
        if serial:
            p_task = asyncio.create_task(p_leg())
            t_d0 = await p_task  # raises the prefill leg's LegError
        elif hold:
            p_task = asyncio.create_task(p_leg())
        if hold:  # test hook: D's leg is not sent (so D never registers) until released
            ev = self.held.setdefault(x, asyncio.Event())
            try:
                await ev.wait()
            except BaseException:
                if not p_task.done():
                    p_task.cancel()
                raise
            finally:
                self.held.pop(x, None)
            t_d0 = _now()
        d_dispatch = sp.start("router.dispatch", x, start_ns=t_d0, parent=root, pidx=pidx,
                              attrs={"router.leg": "decode", "router.upstream": D["url"][7:],
                                     "router.concurrent_legs": 0 if serial else 1}) if root else 0
        d_headers = self._leg_headers(x, d_dispatch, ctx["sampled"])
        check_shared_id(p_headers, d_headers)
        if split:
            d_headers["X-Request-Id"] = x + "-split"
        d_body = dict(body)
        d_body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                        "remote_engine_id": P["engine_id"], "remote_host": P["host"],
                                        "remote_port": P["side_port"], "tp_size": P.get("tp_size", 1),
                                        "remote_block_ids": None, "remote_request_id": None}
        if not serial and not hold:
            p_task = asyncio.create_task(p_leg())
        try:
            return await self._relay_decode(request, path, D, d_body, d_headers, d_dispatch, ctx, p_task)
        finally:
            if not p_task.done():
                # D already sent the client a token (its stream may have ended, or the client closed the
                # connection right after the last chunk, which cancels this handler before "done" is
                # set): let P's leg end on its own so its router.wait is recorded
                if ctx.get("done") or ctx.get("first_token_ns") is not None:
                    self._finish_in_background(p_task, self.timeout_s)
                else:
                    p_task.cancel()
                    await asyncio.gather(p_task, return_exceptions=True)

    def _finish_in_background(self, task: asyncio.Task, limit_s: float) -> None:
        """D already answered the client but P's HTTP answer is still on its way (P's API server can
        lag under load; on the lab's VM every non-engine process was seen frozen for 5-8 s): let P's
        leg end on its own — at most ``limit_s`` s, the per-request timeout — so its ``router.wait``
        ends at P's answer, instead of cancelling it (the handler itself may be cancelled once the
        client closes its connection). Cancelled after all, the wait is recorded as an error."""
        self._bg.add(task)
        timer = asyncio.get_running_loop().call_later(limit_s, task.cancel)

        def done(t: asyncio.Task) -> None:
            timer.cancel()
            self._bg.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: a late P failure does not matter any more

        task.add_done_callback(done)

    async def _relay_decode(self, request, path, D, d_body, d_headers, d_dispatch, ctx, p_task):
        """Send D's leg and relay its response; in push, watch P's leg and the join deadline."""
        sp, x, root, pidx = self.spans, ctx["x"], ctx["root"], ctx["pidx"]
        stream = ctx["stream"]
        t_sent = _now()
        sp.end(d_dispatch, end_ns=t_sent)
        first_rx = None

        async def watch_p():
            """Push: fail fast if P fails, or if D shows no token long after P answered."""
            # shielded: cancelling this watcher (D done) must not cancel P's leg with it
            await asyncio.shield(p_task)
            await asyncio.sleep(self.join_timeout_s)
            raise LegError(504, f"push handoff did not complete: prefill answered but decode produced no token "
                                f"within {self.join_timeout_s:.0f} s; check that both legs carry the same "
                                f"X-Request-Id (P matches D's registration by it)", "decode", "push_join_timeout")

        def note_first(t_rx):
            """D's first token chunk arrived at ``t_rx`` (ns): close the engine wait on the TTFT path."""
            ctx["engine_wait_ns"] += t_rx - t_sent
            if root:
                sp.record("router.wait", x, t_sent, t_rx, {"router.leg": "decode"}, parent=root, pidx=pidx)

        async def run_d():
            nonlocal first_rx
            try:
                async with self.session.post(D["url"] + path, json=d_body, headers=d_headers) as r:
                    if r.status != 200:
                        raw = await r.read()
                        raise LegError(r.status, f"decode engine answered HTTP {r.status}", "decode",
                                       "upstream_error", raw)
                    if not stream:
                        raw = await r.read()
                        first_rx = _now()
                        obj = json.loads(raw)
                        failure = finish_failure(obj)
                        if failure is None and (obj.get("usage") or {}).get("completion_tokens") == 0:
                            failure = LegError(502, "decode engine answered without any token (its engine gave "
                                                    "the request up before the first token)", "decode",
                                               "decode_no_token")
                        if failure is not None:
                            failure.upstream_body = raw
                            raise failure
                        note_first(first_rx)
                        resp = web.Response(status=200, body=raw, content_type="application/json",
                                            headers={"X-Request-Id": x})
                        ctx["status"] = 200
                        t_w = _now()  # before the write: the client cannot have the token earlier
                        await resp.prepare(request)
                        await resp.write_eof()
                        ctx["first_token_ns"] = t_w
                        if ctx["sampled"]:  # an unsampled request leaves no row (PDTRACE_SAMPLE)
                            # one write carries every token: first and last token at the same instant
                            # (without the last, the analysis would flag the request hung)
                            sp.event("router.first_token", x, root, t=t_w, pidx=pidx)
                            sp.event("router.last_token", x, root, t=t_w, pidx=pidx)
                        ctx["done"] = True
                        ctx["t_done"] = _now()
                        return resp
                    resp = web.StreamResponse(status=200, headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": x})
                    ctx["resp"] = resp
                    await resp.prepare(request)
                    ctx["status"] = 200
                    dec = SSEDecoder()
                    last_token_t = None
                    async for data in r.content.iter_any():
                        t_rx = _now()
                        # only whole events are relayed (a partial one waits in the decoder for its end), so
                        # an error event written after a failure always starts on an event boundary
                        has_tok, failure, whole = False, None, []
                        for raw, objs in dec.events(data):
                            for obj in objs:
                                if "error" in obj:
                                    failure = LegError(502, "decode engine reported an error mid-stream",
                                                       "decode", "decode_failed", json.dumps(obj).encode())
                                else:
                                    failure = finish_failure(obj)
                                if failure is not None:
                                    break
                            if failure is None and raw.startswith(b"data: [DONE]") and not has_tok \
                                    and ctx["first_token_ns"] is None:
                                # [DONE] before any token: what vLLM writes for a request its engine aborted
                                # before the first token (no abort chunk: vllm-project/vllm#57082)
                                failure = LegError(502, "decode engine ended its stream without any token (its "
                                                        "engine gave the request up before the first token)",
                                                   "decode", "decode_no_token")
                            if failure is not None:  # neither the failing event nor any after it is relayed
                                break
                            whole.append(raw)
                            has_tok = has_tok or any(chunk_has_token(o) for o in objs)
                        data = b"".join(whole)
                        # the token's instant is read before the write: once written, a busy event loop
                        # can delay this task well after the client has the bytes (TTFT would then
                        # exceed the client's own)
                        t_w = _now() if has_tok else None
                        if data:
                            await resp.write(data)
                        if has_tok:
                            last_token_t = t_w
                            if ctx["first_token_ns"] is None:
                                first_rx = t_rx
                                ctx["first_token_ns"] = t_w
                                note_first(t_rx)
                                if ctx["sampled"]:
                                    sp.event("router.first_token", x, root, t=t_w, pidx=pidx)
                        if failure is not None:
                            if last_token_t and ctx["sampled"]:
                                sp.event("router.last_token", x, root, t=last_token_t, pidx=pidx)
                            raise failure
                    if last_token_t and ctx["sampled"]:
                        sp.event("router.last_token", x, root, t=last_token_t, pidx=pidx)
                    if not dec.done:
                        # an OpenAI stream ends with "data: [DONE]"; without it D's stream was cut short
                        # (D died, or the connection closed) even though no exception said so
                        raise LegError(502, "decode engine's stream ended before its final 'data: [DONE]' "
                                            "event (the engine died or the connection closed mid-stream)",
                                       "decode", "stream_truncated")
                    await resp.write_eof()
                    ctx["done"] = True
                    ctx["t_done"] = _now()
                    return resp
            except (ClientError, ConnectionError) as exc:
                if isinstance(exc, ConnectionResetError) and ctx.get("resp") is not None and request.transport is None:
                    raise asyncio.CancelledError()  # client went away
                raise LegError(502, f"decode engine unreachable or connection lost ({type(exc).__name__})",
                               "decode", "upstream_unreachable") from None

        d_task = asyncio.create_task(run_d())
        w_task = asyncio.create_task(watch_p()) if p_task is not None else None
        try:
            if w_task is None:
                resp = await d_task
            else:
                while True:
                    done, _ = await asyncio.wait({d_task, w_task}, return_when=asyncio.FIRST_COMPLETED)
                    if d_task in done:
                        resp = d_task.result()
                        break
                    exc = w_task.exception()
                    if isinstance(exc, LegError) and exc.kind == "push_join_timeout" and ctx["first_token_ns"]:
                        # D is already streaming: the handoff joined, nothing to watch any more.
                        resp = await d_task
                        break
                    raise exc
        finally:
            for t in (d_task, w_task):
                if t is not None and not t.done():
                    t.cancel()
            await asyncio.gather(*(t for t in (d_task, w_task) if t is not None), return_exceptions=True)
        return resp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="pdtrace lab P/D router")
    ap.add_argument("--config", required=True, help="JSON file written by the lab launcher")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = json.load(f)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    if _tracer is not None:
        # the router process traces (PDTRACE_DIR set); never on import; its role set before any row is written
        _tracer.activate("explicit", role="router", service_name="pdtrace-router")
    router = Router(cfg)

    async def run():
        runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg["host"], cfg["port"], backlog=1024, reuse_address=True)
        await site.start()
        log.info("router listening on %s:%s mode=%s P=%d D=%d", cfg["host"], cfg["port"], router.mode,
                 len(router.prefill), len(router.decode))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())
    if _tracer is not None and getattr(_tracer, "on", False):
        _tracer.shutdown()


if __name__ == "__main__":
    main()
