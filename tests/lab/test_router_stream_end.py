"""A decode stream is whole only when it ends with ``data: [DONE]``: router and client both check.

The upstream engines here are stand-ins (small aiohttp apps), not vLLM: the
failure is a D whose stream stops early *without* an exception reaching the
router -- what CI saw once when killing D mid-stream made a 753-of-6,000-token
stream pass as ``ok`` -- and killing a real engine ends its stream in either
way depending on timing (``tests/lab/test_push.py::test_kill_decode_mid_run``
kills a real D). The router and the client under test are the real ones.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from pdtrace.connector.lab import procs, replay
from pdtrace.connector.lab.router import Router
from pdtrace.connector.lab.workload import ReplayRequest

TOKENS = 3


def _upstreams(done: bool, finish: str | None = None, split: bool = False, tokens: int = TOKENS) -> web.Application:
    """A stand-in P (answers with kv_transfer_params) and D (streams ``tokens`` chunks, then [DONE] or not).

    ``finish`` (e.g. ``"abort"``): D's last chunk is a tokenless one finished with that reason, the
    shape vLLM 0.32's API server sends to each open stream when SIGTERM starts its graceful shutdown
    (seen for real by ``tests/lab/test_pull.py::test_sigterm_decode_mid_stream``); a non-streaming D
    leg answers with that finish reason. ``split``: every event is written in two halves 50 ms apart,
    so the router reads an event's start and its end separately. ``tokens=0`` with ``done``: the stream is
    ``data: [DONE]`` alone (non-streaming: ``completion_tokens`` 0), what vLLM 0.32's completions server
    writes for a request its engine aborted before the first token (vllm-project/vllm#57082; read from
    ``OpenAIServingCompletion.completion_stream_generator``).
    """

    async def completions(request: web.Request):
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):  # the prefill leg
            return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}],
                                      "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [0]}})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "t" * tokens, "finish_reason": finish or "length"}],
                                      "usage": {"completion_tokens": tokens}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(event: bytes):
            if split:
                await resp.write(event[:len(event) // 2])
                await asyncio.sleep(0.05)
                await resp.write(event[len(event) // 2:])
                await asyncio.sleep(0.05)
            else:
                await resp.write(event)

        for i in range(tokens):
            chunk = {"choices": [{"index": 0, "text": "t", "finish_reason": None}],
                     "usage": {"completion_tokens": i + 1}}
            await send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if finish:
            chunk = {"choices": [{"index": 0, "text": "", "finish_reason": finish}],
                     "usage": {"completion_tokens": TOKENS}}
            await send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if done:
            await send(b"data: [DONE]\n\n")
        await resp.write_eof()  # a clean end of the HTTP body either way: no exception for the router
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _one_request(done: bool, finish: str | None = None, split: bool = False,
                       tokens: int = TOKENS) -> replay.ClientRecord:
    up_port, r_port = procs.free_ports(2)
    up = await _serve(_upstreams(done, finish, split, tokens), up_port)
    url = f"http://127.0.0.1:{up_port}"
    router = Router({"mode": "pull", "prefill": [{"url": url, "engine_id": "p"}],
                     "decode": [{"url": url, "engine_id": "d"}], "timeout_s": 30})
    rt = await _serve(router.app(), r_port)
    try:
        req = ReplayRequest(0, 0, 0.0, [11, 12, 13], TOKENS)
        rec = replay.ClientRecord(0, 0, 3, TOKENS, 0)
        async with aiohttp.ClientSession() as s:
            await replay.send_one(s, f"http://127.0.0.1:{r_port}/v1/completions", req, rec, replay._Clock(), 30)
        return rec
    finally:
        await rt.cleanup()
        await up.cleanup()


@pytest.mark.parametrize("split", [False, True], ids=["whole-events", "split-events"])
@pytest.mark.parametrize("done, finish, status, error_type", [
    (True, None, "ok", ""),
    (True, "length", "ok", ""),
    (False, None, "stream_error", "stream_truncated"),
    (True, "abort", "stream_error", "decode_aborted"),  # D's graceful shutdown: a clean end, yet not whole
    (True, "error", "stream_error", "decode_failed"),
])
def test_stream_without_done_is_an_error(done, finish, status, error_type, split):
    """Every token before the end reaches the client, and the end is judged, whether D's events arrive
    whole or each in two reads (the router relays whole events only: an error event it adds never lands
    inside a half-relayed one)."""
    rec = asyncio.run(_one_request(done, finish, split))
    assert (rec.status, rec.error_type) == (status, error_type)
    assert rec.http_status == (200 if status == "ok" else 502)  # the in-stream error event carries the router's 502
    assert len(rec.token_times_ns) == TOKENS  # the tokens before the cut still reached the client


@pytest.mark.parametrize("split", [False, True], ids=["whole-events", "split-events"])
def test_stream_without_any_token_is_an_error(split):
    """[DONE] with no token before it (HTTP 200): the router ends the stream with its error decode_no_token
    instead of relaying [DONE], and the client sees no token."""
    rec = asyncio.run(_one_request(True, split=split, tokens=0))
    assert (rec.status, rec.error_type, rec.http_status, len(rec.token_times_ns)) == \
        ("stream_error", "decode_no_token", 502, 0)


async def _client_only(done: bool, finish: str | None = None, tokens: int = TOKENS) -> replay.ClientRecord:
    """The real client straight against the stand-in D (no router in between)."""
    (port,) = procs.free_ports(1)
    up = await _serve(_upstreams(done, finish, tokens=tokens), port)
    try:
        rec = replay.ClientRecord(0, 0, 3, TOKENS, 0)
        async with aiohttp.ClientSession() as s:
            await replay.send_one(s, f"http://127.0.0.1:{port}/v1/completions",
                                  ReplayRequest(0, 0, 0.0, [1, 2, 3], TOKENS), rec, replay._Clock(), 30)
        return rec
    finally:
        await up.cleanup()


@pytest.mark.parametrize("done, finish, status, error_type", [
    (True, None, "ok", ""),
    (False, None, "stream_error", "stream_truncated"),  # bytes that stop before [DONE]
    # behind a router that relays D's stream verbatim (vllm-router), an abort or error finish followed by
    # [DONE] reaches the client as a clean end
    (True, "abort", "stream_error", "finish_abort"),
    (True, "error", "stream_error", "finish_error"),
])
def test_client_judges_the_end_itself(done, finish, status, error_type):
    """The client's own check, without the router."""
    rec = asyncio.run(_client_only(done, finish))
    assert (rec.status, rec.error_type, len(rec.token_times_ns)) == (status, error_type, TOKENS)


def test_client_judges_a_stream_without_any_token():
    """Behind a router that relays D's stream verbatim, [DONE] with no token reaches the client as a clean
    end: the client's own check calls it an error (no_token)."""
    rec = asyncio.run(_client_only(True, tokens=0))
    assert (rec.status, rec.error_type, rec.token_times_ns) == ("stream_error", "no_token", [])


@pytest.mark.parametrize("finish, tokens, status, kind", [
    ("length", TOKENS, 200, None), ("abort", TOKENS, 502, "decode_aborted"), ("error", TOKENS, 502, "decode_failed"),
    ("length", 0, 502, "decode_no_token")])
def test_non_streaming_abort_or_error_finish_is_an_error(finish, tokens, status, kind):
    """A non-streaming request: D's answer finished with ``abort`` or ``error``, or without any token
    (``completion_tokens`` 0), becomes the router's 502."""

    async def run():
        up_port, r_port = procs.free_ports(2)
        up = await _serve(_upstreams(True, finish, tokens=tokens), up_port)
        url = f"http://127.0.0.1:{up_port}"
        router = Router({"mode": "pull", "prefill": [{"url": url, "engine_id": "p"}],
                         "decode": [{"url": url, "engine_id": "d"}], "timeout_s": 30})
        rt = await _serve(router.app(), r_port)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{r_port}/v1/completions",
                                  json={"model": "lab", "prompt": [1, 2, 3], "max_tokens": TOKENS}) as r:
                    return r.status, await r.json()
        finally:
            await rt.cleanup()
            await up.cleanup()

    got_status, body = asyncio.run(run())
    assert got_status == status, body
    if kind is None:
        assert body["choices"][0]["finish_reason"] == "length"
    else:
        assert body["error"]["type"] == kind and body["error"]["leg"] == "decode", body
