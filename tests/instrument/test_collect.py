"""`pdtrace collect`: real OpenTelemetry SDK exporters (OTLP/HTTP protobuf) send to the real receiver.

Each test starts a :class:`~pdtrace.instrument.collect.Collector` on a free
port, exports spans with opentelemetry-sdk's ``OTLPSpanExporter`` (the
exporter vLLM and most routers use), stops the collector (which writes
everything received) and reads the store back through the analysis views.
Only the bad-input bodies and the OTLP/JSON body are built by hand: the SDK
sends neither.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry import trace as otel_trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.http import Compression  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from pdtrace.analysis import db  # noqa: E402
from pdtrace.instrument import ids  # noqa: E402
from pdtrace.instrument.collect import Collector  # noqa: E402

T0 = 1_800_000_000_000_000_000  # ns since the epoch
MS = 1_000_000


@pytest.fixture
def collector(tmp_path):
    made = []

    def start(**kw):
        kw.setdefault("flush_interval_s", 0.1)
        kw.setdefault("join_wait_s", 30.0)
        c = Collector(tmp_path / f"store{len(made)}", port=0, **kw).start()
        made.append(c)
        return c

    yield start
    for c in made:
        c.stop()


def provider(col, service: str, batch: bool = False, **res):
    exp = OTLPSpanExporter(endpoint=col.endpoint, compression=Compression.Gzip)
    p = TracerProvider(resource=Resource.create({"service.name": service, **res}))
    p.add_span_processor(BatchSpanProcessor(exp) if batch else SimpleSpanProcessor(exp))
    return p


def vllm_span(tracer, rid: str, start: int, ctx=None, ttft_s=0.030, queue_s=0.005, prefill_s=0.020, **extra):
    """A span shaped as vLLM's output processor makes it (vllm/v1/engine/output_processor.py do_tracing)."""
    attrs = {"gen_ai.latency.time_to_first_token": ttft_s, "gen_ai.latency.e2e": ttft_s + 0.1,
             "gen_ai.latency.time_in_queue": queue_s, "gen_ai.usage.prompt_tokens": 64,
             "gen_ai.usage.completion_tokens": 8, "gen_ai.latency.time_in_model_prefill": prefill_s,
             "gen_ai.latency.time_in_model_decode": 0.09, "gen_ai.latency.time_in_model_inference": 0.11,
             "gen_ai.request.id": rid, "gen_ai.request.max_tokens": 8, **extra}
    s = tracer.start_span("llm_request", context=ctx, kind=SpanKind.SERVER, attributes=attrs, start_time=start)
    s.end(end_time=start + int((ttft_s + 0.1) * 1e9))
    return s


def test_vllm_spans_land_with_their_request_role_and_no_text(collector):
    col = collector()
    for service in ("vllm-prefill", "vllm-decode"):
        p = provider(col, service, **{"vllm.process_id": "4242"})
        vllm_span(p.get_tracer("vllm"), "cmpl-req7-0-1a2b3c4d", T0, **{"gen_ai.prompt": "SECRET PROMPT TEXT"})
        p.shutdown()
    col.stop()
    assert col.stats["received_spans"] == 2 and col.stats["written_spans"] == 2
    assert col.stats["dropped_attributes"] == 2  # gen_ai.prompt on each: not allowlisted, dropped and counted
    for f in os.listdir(col.dir):
        table = pq.read_table(os.path.join(col.dir, f))
        assert "SECRET" not in json.dumps(table.to_pylist(), default=str)
    with db.open_trace(col.dir) as tr:
        rows = tr.query("SELECT request_id, prompt_index, role, stage, attr_str['otlp.join'] AS j, "
                        "attr_int['gen_ai.usage.input_tokens'] AS input_tokens, engine_id FROM spans ORDER BY role")
        coarse = tr.query("SELECT * FROM coarse_breakdown ORDER BY role")
        stats = tr.query("SELECT * FROM collect_stats")
    assert [(r["request_id"], r["prompt_index"], r["role"], r["stage"], r["j"], r["input_tokens"]) for r in rows] == [
        ("req7", 0, "decode", "llm_request", "gen_ai.request.id", 64),
        ("req7", 0, "prefill", "llm_request", "gen_ai.request.id", 64)]
    assert all(r["engine_id"] for r in rows)
    c = coarse[0]
    assert (c["queue_ms"], c["prefill_ms"], c["engine_ttft_ms"], c["output_tokens"]) == pytest.approx((5.0, 20.0, 30.0, 8))
    assert c["other_ms"] == pytest.approx(5.0) and c["coarse"] and c["joined"]
    assert stats[0]["written_spans"] == 2 and stats[0]["dropped_attributes"] == 2 and stats[0]["bad_bodies"] == 0


def test_a_foreign_router_root_gives_the_router_window_joined_by_trace_id(collector):
    """The router's root carries the client's X-Request-Id; the engines saw X1. The root waits for its trace."""
    col = collector()
    router = provider(col, "my-gateway")
    root = router.get_tracer("gw").start_span(
        "POST /v1/completions", kind=SpanKind.SERVER, start_time=T0,
        attributes={"http.request.header.x-request-id": ["client-abc"], "http.request.method": "POST",
                    "http.route": "/v1/completions"})
    root.add_event("first_token", timestamp=T0 + 50 * MS)
    root.add_event("last_token", timestamp=T0 + 180 * MS)
    ctx = otel_trace.set_span_in_context(root)
    root.end(end_time=T0 + 200 * MS)  # exported first: arrives before any engine span of its trace
    router.shutdown()
    eng = provider(col, "vllm-prefill")
    vllm_span(eng.get_tracer("vllm"), "cmpl-X1-0", T0 + 2 * MS, ctx=ctx)
    eng.shutdown()
    col.stop()
    with db.open_trace(col.dir) as tr:
        spans = tr.query("SELECT stage, role, request_id, trace_id, attr_str['otlp.join'] AS j FROM spans ORDER BY stage")
        req = tr.query("SELECT request_id, status, ttft_ms, tpot_ms, arrival_ns FROM requests")
        joined = tr.query("SELECT role, joined_by, spans, unjoined, router_roots FROM collected_spans ORDER BY role, joined_by")
    tid = format(root.get_span_context().trace_id, "032x")
    assert [(s["stage"], s["role"], s["request_id"], s["j"]) for s in spans] == [
        ("POST /v1/completions", "router", "X1", "trace_id"),   # the original, kept under its own name
        ("llm_request", "prefill", "X1", "gen_ai.request.id"),
        ("router.request", "router", "X1", None)]               # derived: what request_base reads as the root
    assert {s["trace_id"] for s in spans} == {tid}
    assert req == [{"request_id": "X1", "status": "complete", "ttft_ms": 50.0, "tpot_ms": None, "arrival_ns": T0}]
    assert joined == [
        {"role": "prefill", "joined_by": "gen_ai.request.id", "spans": 1, "unjoined": 0, "router_roots": 0},
        {"role": "router", "joined_by": "trace_id", "spans": 1, "unjoined": 0, "router_roots": 0},
        {"role": "router", "joined_by": None, "spans": 1, "unjoined": 0, "router_roots": 1}]


def test_router_root_with_ttft_attribute_and_only_its_header_id(collector):
    """No engine span in the trace: after the wait the root joins by its X-Request-Id; TTFT from the attribute.

    The client sent a traceparent: the root's parent is remote, and it is still the router's root."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    client = TraceContextTextMapPropagator().extract({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})
    col = collector(join_wait_s=0.2)
    router = provider(col, "edge-proxy")
    s = router.get_tracer("p").start_span("proxy", context=client, kind=SpanKind.SERVER, start_time=T0, attributes={
        "http.request.header.x-request-id": ["cmpl-R9-0"], "gen_ai.server.time_to_first_token": 0.075})
    s.end(end_time=T0 + 300 * MS)
    router.shutdown()
    deadline = time.monotonic() + 30
    while col.stats["written_spans"] < 1:  # released by the join wait (0.2 s), not by stop's final write
        assert time.monotonic() < deadline, col.stats
        time.sleep(0.02)
    col.stop()
    with db.open_trace(col.dir) as tr:
        req = tr.query("SELECT request_id, status, ttft_ms, last_token_ns FROM requests")
        j = tr.query("SELECT attr_str['otlp.join'] AS j, parent_span_id, trace_id FROM spans WHERE stage = 'proxy'")
        ev = tr.query("SELECT event, attr_str['otlp.last_token_source'] AS src FROM events ORDER BY event")
    assert req == [{"request_id": "R9", "status": "complete", "ttft_ms": 75.0, "last_token_ns": T0 + 300 * MS}]
    assert j == [{"j": "x-request-id", "parent_span_id": int("cd" * 8, 16), "trace_id": "ab" * 16}]
    assert ev == [{"event": "router.first_token", "src": None}, {"event": "router.last_token", "src": "span_end"}]


def test_a_span_with_no_id_that_maps_is_kept_and_counted_unjoined(collector):
    col = collector(join_wait_s=0.0)
    p = provider(col, "some-sidecar")
    s = p.get_tracer("x").start_span("health", kind=SpanKind.INTERNAL, start_time=T0)
    s.end(end_time=T0 + MS)
    p.shutdown()
    col.stop()
    assert col.stats["unjoined_spans"] == 1 and col.stats["written_spans"] == 1
    with db.open_trace(col.dir) as tr:
        rows = tr.query("SELECT stage, request_id, dur_ns FROM spans")
        joined = tr.query("SELECT joined_by, spans, unjoined FROM collected_spans")
        stats = tr.query("SELECT unjoined_spans FROM collect_stats")
    assert rows == [{"stage": "health", "request_id": None, "dur_ns": MS}]
    assert joined == [{"joined_by": "none", "spans": 1, "unjoined": 1}]
    assert stats == [{"unjoined_spans": 1}]


def _post(url: str, body: bytes, ctype: str) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_bad_bodies_get_an_error_and_a_counter_and_the_receiver_keeps_serving(collector):
    col = collector()
    assert _post(col.endpoint, b"\xff\xff\xff not protobuf", "application/x-protobuf") == 400
    assert _post(col.endpoint, b"{not json", "application/json") == 400
    assert _post(col.endpoint, b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
                 "application/json") == 400
    assert _post(col.endpoint, b"hello", "text/plain") == 415
    p = provider(col, "vllm-decode")
    vllm_span(p.get_tracer("vllm"), "chatcmpl-ok1", T0)
    p.shutdown()
    col.stop()
    assert col.stats["bad_bodies"] == 4 and col.stats["written_spans"] == 1
    with db.open_trace(col.dir) as tr:
        assert tr.query("SELECT request_id FROM spans") == [{"request_id": "ok1"}]
        assert tr.query("SELECT bad_bodies FROM collect_stats") == [{"bad_bodies": 4}]


def test_otlp_json_bodies_are_accepted_with_hex_ids(collector):
    col = collector()
    tid, sid = "0123456789abcdef0123456789abcdef", "00000000000000ff"
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm-decode"}}]},
                               "scopeSpans": [{"spans": [{
                                   "traceId": tid, "spanId": sid, "name": "llm_request", "kind": 2,
                                   "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0 + 5 * MS),
                                   "attributes": [{"key": "gen_ai.request.id", "value": {"stringValue": "cmpl-J1-0"}},
                                                  {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": 0.001}}]}]}]}]}
    assert _post(col.endpoint, json.dumps(body).encode(), "application/json") == 200
    col.stop()
    with db.open_trace(col.dir) as tr:
        rows = tr.query("SELECT request_id, role, trace_id, span_id, start_ns, end_ns FROM spans")
    assert rows == [{"request_id": "J1", "role": "decode", "trace_id": tid, "span_id": 255, "start_ns": T0,
                     "end_ns": T0 + 5 * MS}]


def test_a_full_queue_drops_and_counts_never_blocks(collector):
    col = collector(max_queue_spans=3)
    p = provider(col, "vllm-decode", batch=True)
    t = p.get_tracer("vllm")
    for i in range(5):
        vllm_span(t, f"cmpl-q{i}-0", T0 + i * MS)
    assert p.force_flush(10_000)  # one export request of 5 spans > the bound of 3
    p.shutdown()
    col.stop()
    assert col.stats["received_spans"] == 5 and col.stats["dropped_spans"] == 5 and col.stats["written_spans"] == 0
    with db.open_trace(col.dir) as tr:
        assert tr.query("SELECT dropped_spans, written_spans FROM collect_stats") == [
            {"dropped_spans": 5, "written_spans": 0}]


def test_pdtraces_own_export_is_skipped_unless_asked(collector):
    for keep, expect in ((False, 0), (True, 1)):
        col = collector(keep_pdtrace=keep)
        p = provider(col, "pdtrace-router", **{"pdtrace.pdtrace_version": "0.1.0", "pdtrace.role": "router"})
        s = p.get_tracer("pdtrace").start_span("router.dispatch", start_time=T0, attributes={"pdtrace.request_id": "P1"})
        s.end(end_time=T0 + MS)
        p.shutdown()
        col.stop()
        assert col.stats["written_spans"] == expect and col.stats["skipped_pdtrace_spans"] == 1 - expect
        with db.open_trace(col.dir) as tr:
            rows = tr.query("SELECT request_id, role, attr_str['otlp.join'] AS j FROM spans")
        assert rows == ([{"request_id": "P1", "role": "router", "j": "pdtrace.request_id"}] if keep else [])


def test_cli_serves_until_sigterm_and_writes_what_it_received(tmp_path):
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "pdtrace.cli.main", "collect", str(store), "--port", "0",
                             "--flush-interval", "0.1"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "receiving OTLP/HTTP traces at http://127.0.0.1:" in line, line
        url = line.split(" at ", 1)[1].split(",", 1)[0]

        class _Col:
            endpoint = url
        p = provider(_Col, "vllm-decode")
        vllm_span(p.get_tracer("vllm"), "cmpl-cli1-0", T0)
        p.shutdown()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "1 spans written, 0 unjoined, 0 dropped, 0 bad bodies" in out, out
    with db.open_trace(store) as tr:
        assert tr.query("SELECT request_id FROM spans") == [{"request_id": "cli1"}]


def test_trace_id_of_pdtraces_router_is_kept(collector):
    """An engine behind pdtrace's router: the trace id vLLM propagates is the one pdtrace derives from X."""
    col = collector()
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": ids.traceparent("X77", 5, True)})
    p = provider(col, "vllm-decode")
    vllm_span(p.get_tracer("vllm"), "cmpl-X77-0", T0, ctx=ctx)
    p.shutdown()
    col.stop()
    with db.open_trace(col.dir) as tr:
        assert tr.query("SELECT request_id, trace_id, parent_span_id FROM spans") == [
            {"request_id": "X77", "trace_id": ids.trace_id("X77"), "parent_span_id": 5}]
