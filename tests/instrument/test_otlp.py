"""OTLP export against a real OTLP/HTTP receiver on loopback that decodes the protobuf."""
import gzip
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import duckdb
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from pdtrace.instrument import config, recorder  # noqa: E402


class _Receiver:
    def __init__(self):
        self.requests = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                outer.requests.append((self.path, req))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self):
        out = []
        for _, req in self.requests:
            for rs in req.resource_spans:
                res = {a.key: a.value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append((res, s))
        return out


def _val(v):
    k = v.WhichOneof("value")
    return getattr(v, k)


def test_spans_reach_a_real_otlp_receiver(tmp_path):
    rx = _Receiver()
    t = recorder.Tracer()
    t.configure(config.from_env({"PDTRACE_DIR": str(tmp_path), "PDTRACE_ROLE": "decode",
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{rx.port}/v1/traces"}))
    t0 = t.now()
    root = t.record("router.request", "X7", t0, t0 + 9_000_000, {"request.mode": "push", "gen_ai.usage.input_tokens": 70})
    kv = t.record("kv.transfer", "X7", t0 + 1_000_000, t0 + 3_000_000, {"kv.bytes": 65536, "kv.op": "WRITE"},
                  parent=root, kind=5)
    t.event("router.first_token", "X7", span_id=root, time_ns=t0 + 8_000_000)
    assert t.shutdown(10)
    spans = rx.spans()
    by = {s.name: (res, s) for res, s in spans}
    assert set(by) == {"router.request", "kv.transfer"}
    res, s = by["kv.transfer"]
    assert res["service.name"].string_value == "pdtrace-decode"
    assert s.trace_id.hex() == t.trace_id("X7")
    assert int.from_bytes(s.span_id, "big") == kv
    assert int.from_bytes(s.parent_span_id, "big") == root
    assert s.kind == 5
    attrs = {a.key: _val(a.value) for a in s.attributes}
    assert attrs["kv.bytes"] == 65536 and attrs["kv.op"] == "WRITE" and attrs["pdtrace.request_id"] == "X7"
    # times equal the Parquet rows exactly
    (ps, pe), = duckdb.sql(f"select start_ns, end_ns from read_parquet('{tmp_path}/*.parquet') "
                           "where name='kv.transfer'").fetchall()
    assert (s.start_time_unix_nano, s.end_time_unix_nano) == (ps, pe)
    assert pe - ps == 2_000_000
    _, r = by["router.request"]
    assert [e.name for e in r.events] == ["router.first_token"]
    assert r.events[0].time_unix_nano - r.start_time_unix_nano == 8_000_000
    rx.server.shutdown()


def test_collector_down_counts_errors_parquet_unaffected(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    t = recorder.Tracer()
    t.configure(config.from_env({"PDTRACE_DIR": str(tmp_path),
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
                                 "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"}))
    for i in range(50):
        t.record("decode.step", None, i, i + 1)
    t.force_flush(10)
    import time
    deadline = time.time() + 30
    while t.stats()["export_errors"] < 50 and time.time() < deadline:
        time.sleep(0.1)
        t.force_flush(10)  # the sink reports its counters when it answers a flush
    assert t.stats()["export_errors"] >= 50
    t.shutdown(5)
    (n,), = duckdb.sql(f"select count(*) from read_parquet('{tmp_path}/*.parquet') where name='decode.step'").fetchall()
    assert n == 50
