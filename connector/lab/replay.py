"""Open-loop replay of a :class:`~pdtrace.connector.lab.workload.Workload` against the router.

Each request is sent at its scheduled arrival time whether or not earlier ones
finished (open loop), as a streaming ``/v1/completions`` call with a token-id
prompt, ``max_tokens`` from the trace (scaled) and ``ignore_eos`` so the output
length is the trace's. ``stream_options.continuous_usage_stats`` gives the exact
token count of every chunk, so each generated token gets a client-side time.

What the client saw is written per request to ``<out>/client/requests.parquet``
(no prompt or completion text): times are integer ns since the Unix epoch
(``time.time_ns`` anchored once, advanced by the monotonic clock).

Columns: ``run_id``, ``request_index``, ``trace_index``, ``router_request_id``
(the X the router used, from the response header; empty when the router sends
none, as ``vllm-router`` does), ``response_id`` (the ``id`` of the first
stream chunk: vLLM's ``cmpl-<id its API server got>``, so
:func:`engine_request_id` of it is pdtrace's ``request_id`` behind any router
that relays D's stream; empty if no chunk came), ``prompt_tokens``,
``max_tokens``, ``shared_prefix_tokens``, ``scheduled_ns`` (planned send),
``send_ns``, ``first_token_ns`` (null if none), ``end_ns``, ``token_times_ns``
(list, one per generated token), ``output_tokens``, ``status`` (``ok``,
``http_error``, ``stream_error``, ``timeout``, ``connection_error``; ``ok``
only for a stream that ended with ``data: [DONE]``, carried no error
event and no choice finished with ``finish_reason`` ``abort`` or ``error``;
``stream_error`` with ``error_type`` ``stream_truncated`` for one whose bytes
stopped before it, ``no_token`` for one that ended with it but carried no
token (vLLM's answer to a request its engine aborted before the first token),
``finish_abort`` / ``finish_error`` for one the engine ended so (a router that relays D's stream verbatim, as vllm-router does, passes
vLLM's graceful-shutdown abort on as a clean end), ``http_status``,
``error_type``.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from pdtrace.instrument import clock

from ..sse import SSEDecoder, finish_reasons
from .workload import ReplayRequest, Workload


@dataclass
class ClientRecord:
    request_index: int
    trace_index: int
    prompt_tokens: int
    max_tokens: int
    shared_prefix_tokens: int
    scheduled_ns: int = 0
    send_ns: int = 0
    first_token_ns: int | None = None
    end_ns: int = 0
    token_times_ns: list[int] = field(default_factory=list)
    status: str = "pending"
    http_status: int = 0
    error_type: str = ""
    router_request_id: str = ""
    response_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Clock:
    """Epoch ns from the monotonic clock, anchored once (:func:`pdtrace.instrument.clock.wall_minus_mono_ns`)."""

    def __init__(self):
        self.offset = clock.wall_minus_mono_ns()

    def now(self) -> int:
        return clock.now_ns() + self.offset


def _count_tokens(obj: dict, prev: int) -> tuple[int, int]:
    """(new tokens in this chunk, running total) from usage or, failing that, non-empty text."""
    usage = obj.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        total = int(usage["completion_tokens"])
        return max(0, total - prev), max(total, prev)
    n = sum(1 for c in obj.get("choices") or () if c.get("text"))
    return n, prev + n


async def send_one(session: aiohttp.ClientSession, url: str, req: ReplayRequest, rec: ClientRecord,
                   clock: _Clock, timeout_s: float, extra_headers: dict | None = None,
                   extra_body: dict | None = None) -> ClientRecord:
    """Send one streaming completion and fill ``rec``; never raises (status says what happened)."""
    body = {"model": "lab", "prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if extra_body:
        body.update(extra_body)
    headers = {"X-Request-Id": f"replay-{req.index}"}
    if extra_headers:
        headers.update(extra_headers)
    rec.send_ns = clock.now()
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers=headers) as r:
                rec.http_status = r.status
                rec.router_request_id = r.headers.get("X-Request-Id", "")
                if r.status != 200:
                    await r.read()
                    rec.status = "http_error"
                    try:
                        rec.error_type = json.loads(await r.read()).get("error", {}).get("type", "")[:64]
                    except (ValueError, AttributeError):
                        pass
                    return rec
                dec = SSEDecoder()
                async for data in r.content.iter_any():
                    t = clock.now()
                    for obj in dec.feed(data):
                        if "error" in obj:
                            rec.status = "stream_error"
                            err = obj["error"] if isinstance(obj["error"], dict) else {}
                            rec.error_type = str(err.get("type", ""))[:64]
                            rec.http_status = int(err.get("code") or 0) if str(err.get("code", "")).isdigit() else rec.http_status
                            continue
                        bad = finish_reasons(obj) & {"abort", "error"}
                        if bad and rec.status == "pending":
                            rec.status = "stream_error"
                            rec.error_type = "finish_error" if "error" in bad else "finish_abort"
                        if not rec.response_id and isinstance(obj.get("id"), str):
                            rec.response_id = obj["id"][:256]
                        new, total = _count_tokens(obj, total)
                        if new:
                            if rec.first_token_ns is None:
                                rec.first_token_ns = t
                            rec.token_times_ns.extend([t] * new)
                if rec.status == "pending":
                    if dec.done and rec.first_token_ns is None:
                        # [DONE] with no token: vLLM ends so a request its engine aborted before the first
                        # token (vllm-project/vllm#57082), HTTP 200 all the same
                        rec.status = "stream_error"
                        rec.error_type = "no_token"
                    elif dec.done:
                        rec.status = "ok"
                    else:  # the bytes stopped before "data: [DONE]": cut short, not complete
                        rec.status = "stream_error"
                        rec.error_type = "stream_truncated"
    except TimeoutError:
        rec.status = "timeout"
    except (aiohttp.ClientError, ConnectionError) as exc:
        rec.status = "connection_error"
        rec.error_type = type(exc).__name__
    finally:
        rec.end_ns = clock.now()
    return rec


async def replay(workload: Workload, router_url: str, *, timeout_s: float = 300.0, progress: bool = True,
                 extra_headers: dict | None = None, live: list | None = None) -> list[ClientRecord]:
    """Replay ``workload`` open-loop against ``router_url``; return one record per request (in order).

    ``live``: a list that receives the records before the first request is sent; they fill in
    place while the requests run (tokens as they arrive), so a caller can watch them.
    """
    from tqdm import tqdm

    clock = _Clock()
    url = router_url.rstrip("/") + "/v1/completions"
    recs = [ClientRecord(r.index, r.trace_index, len(r.prompt), r.max_tokens, r.shared_prefix_tokens)
            for r in workload.requests]
    if live is not None:
        live.extend(recs)
    bar = tqdm(total=len(recs), desc=f"replay {workload.name}", unit="req", disable=not progress,
               dynamic_ncols=True)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start_mono = time.monotonic()
        start_epoch = clock.now()

        async def one(req: ReplayRequest, rec: ClientRecord):
            delay = start_mono + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.scheduled_ns = start_epoch + int(req.arrival_s * 1e9)
            await send_one(session, url, req, rec, clock, timeout_s, extra_headers)
            bar.update(1)
            bar.set_postfix(failed=sum(1 for x in recs if x.status not in ("ok", "pending")))

        await asyncio.gather(*(one(r, c) for r, c in zip(workload.requests, recs)))
    bar.close()
    return recs


def write_records(recs: list[ClientRecord], out_dir, run_id: str) -> str:
    """Write the client records as Parquet (zstd) under ``out_dir``; return the file path."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cols = {
        "run_id": [run_id] * len(recs),
        "request_index": [r.request_index for r in recs],
        "trace_index": [r.trace_index for r in recs],
        "router_request_id": [r.router_request_id for r in recs],
        "response_id": [r.response_id for r in recs],
        "prompt_tokens": [r.prompt_tokens for r in recs],
        "max_tokens": [r.max_tokens for r in recs],
        "shared_prefix_tokens": [r.shared_prefix_tokens for r in recs],
        "scheduled_ns": [r.scheduled_ns for r in recs],
        "send_ns": [r.send_ns for r in recs],
        "first_token_ns": [r.first_token_ns for r in recs],
        "end_ns": [r.end_ns for r in recs],
        "token_times_ns": [r.token_times_ns for r in recs],
        "output_tokens": [len(r.token_times_ns) for r in recs],
        "status": [r.status for r in recs],
        "http_status": [r.http_status for r in recs],
        "error_type": [r.error_type for r in recs],
    }
    schema = pa.schema([
        ("run_id", pa.string()), ("request_index", pa.int32()), ("trace_index", pa.int32()),
        ("router_request_id", pa.string()), ("response_id", pa.string()), ("prompt_tokens", pa.int32()), ("max_tokens", pa.int32()),
        ("shared_prefix_tokens", pa.int32()), ("scheduled_ns", pa.int64()), ("send_ns", pa.int64()),
        ("first_token_ns", pa.int64()), ("end_ns", pa.int64()), ("token_times_ns", pa.list_(pa.int64())),
        ("output_tokens", pa.int32()), ("status", pa.string()), ("http_status", pa.int32()),
        ("error_type", pa.string()),
    ])
    from pdtrace.instrument.schema import ARTIFACT_KEY

    # Marked as a pdtrace artifact so the span store's readers pass over it quietly.
    table = pa.table(cols, schema=schema.with_metadata({ARTIFACT_KEY: b"client-records"}))
    path = out / "requests.parquet"
    tmp = out / ".requests.parquet.tmp"
    pq.write_table(table, tmp, compression="zstd")
    tmp.rename(path)
    return str(path)


def engine_request_id(response_id: str) -> str:
    """pdtrace's ``request_id`` (the id both engines got) from a completion's response ``id``.

    vLLM's completions API answers with ``id = "cmpl-" + <the request id its API
    server got>`` (``X-Request-Id``, or the id a router generated), and chat with
    ``"chatcmpl-" + ...``; pdtrace strips the same prefix from the engines' ids
    (:func:`pdtrace.instrument.ids.parse_request_id`). Returns ``""`` for ``""``;
    an id without either prefix is returned unchanged.
    """
    for prefix in ("chatcmpl-", "cmpl-"):
        if response_id.startswith(prefix):
            return response_id[len(prefix):]
    return response_id


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_summary(recs: list[ClientRecord]) -> dict:
    """Client-side TTFT, TPOT and ITL (ms) p50/p90/p99 over successful requests, plus counts.

    TTFT = first token received − sent; TPOT = (last − first token) / (tokens − 1)
    per request; ITL = every gap between consecutive tokens (chunks carrying
    several tokens give gaps of 0).
    """
    ok = [r for r in recs if r.ok and r.first_token_ns is not None]
    ttft = [(r.first_token_ns - r.send_ns) / 1e6 for r in ok]
    tpot = [(r.token_times_ns[-1] - r.token_times_ns[0]) / 1e6 / (len(r.token_times_ns) - 1)
            for r in ok if len(r.token_times_ns) > 1]
    itl = [(b - a) / 1e6 for r in ok for a, b in zip(r.token_times_ns, r.token_times_ns[1:])]
    out = {"requests": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
           "statuses": {s: sum(1 for r in recs if r.status == s) for s in sorted({r.status for r in recs})}}
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        out[name] = {f"p{int(q * 100)}": _pct(xs, q) for q in (0.5, 0.9, 0.99)}
        out[name]["n"] = len(xs)
    return out


def format_summary(s: dict) -> str:
    lines = [f"requests: {s['requests']}  ok: {s['ok']}  failed: {s['failed']}  {s['statuses']}",
             f"{'client-side':<12}{'p50':>10}{'p90':>10}{'p99':>10}   (ms, n)"]
    for k, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        v = s[k]
        cells = "".join(f"{v[p]:>10.2f}" if v[p] is not None else f"{'-':>10}" for p in ("p50", "p90", "p99"))
        lines.append(f"{label:<12}{cells}   n={v['n']}")
    return "\n".join(lines)
