"""`pdtrace collect` throughput: spans/s into the store, the receiver pinned to one CPU.

The receiver runs as its own process, ``taskset -c CPU pdtrace collect DIR
--port 0``; this process (pinned to another CPU when there is one) exports
``--spans`` spans shaped like vLLM's ``llm_request`` (14 attributes, one
request id and trace each) with opentelemetry-sdk's real ``OTLPSpanExporter``
(OTLP/HTTP protobuf), in batches of ``--batch`` (the SDK's
BatchSpanProcessor default is 512), as fast as the receiver answers. The spans
are built, and encoded by the exporter's own encoder (``encode_spans``), before
timing; the exporter's own HTTP client (``OTLPSpanExporter._client``, a
private attribute of opentelemetry-exporter-otlp-proto-http 1.45) posts the
bodies, so the sender's Python encoding (~50 µs a span) does not bound the
rate (``--sdk-encode`` times ``OTLPSpanExporter.export`` whole instead).
Then SIGTERM: the receiver writes everything it received and exits.

Prints, per round and as the median over ``--rounds``:
  - spans/s end to end: spans / (first export -> receiver exited, every span
    written; mapping, Arrow conversion and Parquet included)
  - spans/s received: spans / time of the export loop (decode + enqueue)
  - spans per CPU-second of the receiver process (user + system, /proc)
and checks that every span was written (the store read back with DuckDB).
A single round hides scheduler noise: the machine is shared.

Run:  .venv/bin/python benchmarks/collect_bench.py [--spans 200000] [--rounds 3] [--cpu 0]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def build_spans(n: int):
    """``n`` finished SDK spans shaped like vLLM's ``llm_request`` (14 attributes, one request id each), made once
    before timing with the in-memory exporter; returns the list of ReadableSpan."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    mem = InMemorySpanExporter()
    p = TracerProvider(resource=Resource.create({"service.name": "vllm-decode", "vllm.process_id": "1"}))
    p.add_span_processor(SimpleSpanProcessor(mem))
    t = p.get_tracer("vllm.bench")
    t0 = time.time_ns()
    for i in range(n):
        s = t.start_span("llm_request", kind=SpanKind.SERVER, start_time=t0 + i * 1000, attributes={
            "gen_ai.latency.time_to_first_token": 0.031, "gen_ai.latency.e2e": 0.5,
            "gen_ai.latency.time_in_queue": 0.002, "gen_ai.usage.prompt_tokens": 512,
            "gen_ai.usage.completion_tokens": 64, "gen_ai.latency.time_in_model_prefill": 0.02,
            "gen_ai.latency.time_in_model_decode": 0.4, "gen_ai.latency.time_in_model_inference": 0.45,
            "gen_ai.request.id": f"cmpl-bench{i:08d}-0", "gen_ai.request.max_tokens": 64,
            "gen_ai.request.temperature": 0.7, "gen_ai.request.top_p": 0.9, "gen_ai.request.n": 1,
            "gen_ai.response.model": "lab"})
        s.end(end_time=t0 + i * 1000 + 500_000_000)
    return mem.get_finished_spans()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (``/proc/<pid>/stat`` fields 14-15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(spans, batch: int, cpu: int, sdk_encode: bool) -> dict:
    """One receiver (``pdtrace collect`` pinned to ``cpu``) fed every span in batches of ``batch``, then stopped.

    Returns the round's figures (spans/s end to end, received, per receiver CPU-second; see ``main``).
    ``sdk_encode``: time the exporter's full ``export()`` (its Python encoding included) instead of posting
    pre-encoded batches."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    store = tempfile.mkdtemp(prefix="collect-bench-")
    cmd = ["taskset", "-c", str(cpu), sys.executable, "-m", "pdtrace.cli.main", "collect", store, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    url = line.split(" at ", 1)[1].split(",", 1)[0]
    exp = OTLPSpanExporter(endpoint=url, timeout=60)
    batches = [spans[i:i + batch] for i in range(0, len(spans), batch)]
    if not sdk_encode:  # the exporter's own encoder, before timing; its own HTTP client sends the bytes
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        bodies = [encode_spans(b).SerializePartialToString() for b in batches]
    cpu0 = cpu_seconds(proc.pid)
    t0 = time.perf_counter()
    if sdk_encode:
        for b in batches:
            if exp.export(b) is not SpanExportResult.SUCCESS:
                raise RuntimeError("export failed")
    else:
        for body in bodies:
            if not exp._client.export(body).success:
                raise RuntimeError("export failed")
    t_sent = time.perf_counter()
    cpu1 = None
    proc.send_signal(signal.SIGTERM)
    # CPU of the process just before it exits: poll until it is gone
    while proc.poll() is None:
        try:
            cpu1 = cpu_seconds(proc.pid)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            break
        time.sleep(0.01)
    t_done = time.perf_counter()
    out = proc.stdout.read()
    exp.shutdown()
    import duckdb

    written = duckdb.sql(f"SELECT count(*) FROM read_parquet('{store}/*.parquet') WHERE record = 'span'").fetchall()[0][0]
    subprocess.run(["rm", "-rf", store], check=False)
    n = len(spans)
    if written != n:
        raise RuntimeError(f"{written} of {n} spans written; receiver said: {out.strip()}")
    used = (cpu1 or cpu0) - cpu0
    return {"end_to_end": n / (t_done - t0), "received": n / (t_sent - t0),
            "per_cpu_s": n / used if used > 0 else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0, help="CPU the receiver is pinned to")
    ap.add_argument("--sdk-encode", action="store_true",
                    help="encode each batch inside the timed loop (OTLPSpanExporter.export as a BatchSpanProcessor "
                         "calls it): the sender's encoding then bounds the rate on a 2-core machine")
    a = ap.parse_args()
    others = sorted(os.sched_getaffinity(0) - {a.cpu})
    if others:
        os.sched_setaffinity(0, {others[0]})
    spans = build_spans(a.spans)
    print(f"pdtrace collect, {a.spans} llm_request-shaped spans in OTLP/HTTP protobuf batches of {a.batch} "
          f"({'encoded while timed' if a.sdk_encode else 'pre-encoded'}), receiver pinned to CPU {a.cpu}, sender on CPU {others[0] if others else a.cpu}")
    res = []
    for r in range(a.rounds):
        x = one_round(spans, a.batch, a.cpu, a.sdk_encode)
        res.append(x)
        print(f"  round {r + 1}: end to end {x['end_to_end']:,.0f} spans/s, received {x['received']:,.0f} spans/s, "
              f"{x['per_cpu_s']:,.0f} spans per receiver CPU-second")
    med = {k: statistics.median(x[k] for x in res) for k in res[0]}
    print(f"median: end to end {med['end_to_end']:,.0f} spans/s, received {med['received']:,.0f} spans/s, "
          f"{med['per_cpu_s']:,.0f} spans per receiver CPU-second")


if __name__ == "__main__":
    main()
