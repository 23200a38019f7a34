"""Thread CPU per request of pdtrace's API-server middleware (``FrontendMiddleware``), tracing on.

    python benchmarks/middleware_cost.py [--rounds 9] [--requests 400] [--against OLD_MIDDLEWARE_PY]

The middleware runs on vLLM's API-server event loop (a hot path, issue 18): this
prints what it adds per request to the ASGI app it wraps, for the response shapes
a vLLM API server writes, each a stand-in app that writes vLLM's bytes (no engine:
the app's own cost is measured alone and subtracted):

- ``stream 64``: a ``/v1/completions`` stream of 64 token chunks, a finish chunk,
  a usage-only chunk and ``data: [DONE]`` (vLLM's compact JSON);
- ``chat 64``: a ``/v1/chat/completions`` stream, role chunk first, the same;
- ``non-stream``: one JSON body with one token (P's answer to the router in pull);
- ``abort``: a chat stream its engine aborted before the first token: the role
  chunk, then ``data: [DONE]`` (what vLLM 0.32 writes: vllm-project/vllm#57082).

Rounds interleave the bare app and the middleware (order alternating); the
figure is the median over rounds of (middleware - bare) in µs of this thread's
CPU (``time.thread_time``) per request, with the min-max over rounds. The
recorder writes to a temporary ``PDTRACE_DIR`` (its writer thread's CPU is not
this thread's). ``--against FILE`` loads another version of
``connector/traced/middleware.py`` (e.g. ``git show REV:connector/traced/middleware.py
> FILE``) into the same process and interleaves it too, printing the paired
difference per round (this version - that one): on a loaded machine a
comparison within one process holds where two runs would not.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time


def _ev(o) -> bytes:
    return b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n"


def _shapes() -> dict[str, tuple[str, list[bytes]]]:
    """{name: (path, body chunks)} as a vLLM API server writes them."""
    def cmpl(text, fr=None):
        return _ev({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fr, "stop_reason": None}],
                    "usage": None})

    def chat(delta, fr=None):
        return _ev({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}]})

    usage = _ev({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 64}})
    done = b"data: [DONE]\n\n"
    whole = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 1}, "kv_transfer_params": {"remote_block_ids": [1, 2]}},
        separators=(",", ":")).encode()
    return {
        "stream 64": ("/v1/completions", [cmpl("tok") for _ in range(64)] + [cmpl("", "length"), usage, done]),
        "chat 64": ("/v1/chat/completions", [chat({"role": "assistant", "content": ""})]
                    + [chat({"content": "tok"}) for _ in range(64)] + [chat({}, "stop"), usage, done]),
        "non-stream": ("/v1/completions", [whole]),
        "abort": ("/v1/chat/completions", [chat({"role": "assistant", "content": ""}), done]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=400, help="requests per round and handler")
    ap.add_argument("--against", help="another version of connector/traced/middleware.py to compare with")
    args = ap.parse_args()
    os.environ["PDTRACE_DIR"] = tempfile.mkdtemp(prefix="pdtrace-mw-cost-")
    from pdtrace.connector.traced.middleware import FrontendMiddleware
    from pdtrace.instrument import tracer

    other = None
    if args.against:
        import importlib.util

        spec = importlib.util.spec_from_file_location("pdtrace.connector.traced.middleware_against", args.against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)

    async def send(m):
        pass

    async def receive():
        return {"type": "http.request", "body": b"{}"}

    def app_of(chunks):
        async def app(scope, rcv, snd):
            await snd({"type": "http.response.start", "status": 200, "headers": []})
            for b in chunks:
                await snd({"type": "http.response.body", "body": b, "more_body": True})
            await snd({"type": "http.response.body", "body": b"", "more_body": False})
        return app

    async def block(handler, path, tag):
        t = time.thread_time()
        for i in range(args.requests):
            scope = {"type": "http", "method": "POST", "path": path,
                     "headers": [(b"x-request-id", f"{tag}-{i}".encode())]}
            await handler(scope, receive, send)
        return (time.thread_time() - t) / args.requests * 1e6

    async def run():
        print(f"pdtrace API-server middleware, µs of thread CPU per request (tracing on), {args.rounds} rounds of "
              f"{args.requests}; load {os.getloadavg()[0]:.1f}")
        for name, (path, chunks) in _shapes().items():
            bare = app_of(chunks)
            h = {"bare": bare, "mw": FrontendMiddleware(bare, role="decode")}
            if other is not None:
                h["against"] = other.FrontendMiddleware(bare, role="decode")
            got = {k: [] for k in h}
            for r in range(args.rounds):
                for k in (list(h) if r % 2 else list(h)[::-1]):
                    got[k].append(await block(h[k], path, f"{name}{r}{k}"))
            diffs = [m - b for m, b in zip(got["mw"], got["bare"])]
            line = (f"  {name:10s}: middleware {statistics.median(diffs):6.1f} µs/request "
                    f"({min(diffs):.1f}-{max(diffs):.1f}); the stand-in app alone {statistics.median(got['bare']):.1f}")
            if other is not None:
                paired = sorted(m - a for m, a in zip(got["mw"], got["against"]))
                line += (f"; minus --against: {statistics.median(paired):+.1f} µs "
                         f"({paired[0]:+.1f} to {paired[-1]:+.1f})")
            print(line)

    asyncio.run(run())
    tracer.shutdown()


if __name__ == "__main__":
    main()
