"""pdtrace's helper processes with N traced processes: one sink per process (before) vs one per host (after).

N traced processes (default 1, 4, 8, 16) each record at a lab-like rate: the 1P1D lab writes
about 114 records per request at 2 requests/s, i.e. 228 records/s per P/D process pair, so each
traced process here records 114 records/s (batches every 0.1 s of the lab's shapes: per-step
spans without a request id, per-request stage spans and events with one; allowlisted attributes)
and the N processes stand for N/2 pairs serving N requests/s in all. After ``--warmup`` s, for
``--seconds`` s, the script reads from outside (psutil):

- helper processes: every ``pdtrace.instrument.sink`` process serving these traced processes
  (before: their children; after: ``hostsink.find`` of the trace directory), and their total RSS
  (MiB, the largest of the samples taken every 0.5 s);
- sink CPU: user + system CPU of those processes over the window, per request (ms; N requests/s)
  and per 1,000 records;
- writer CPU: the traced processes' ``pdtrace-writer`` thread CPU over the window (its thread
  CPU clock, read inside each traced process), per request; background = sink + writer;
- files per minute: store files created in the window (names seen in the directory, listed every
  0.2 s; parts live until their merge, at least PDTRACE_ROTATE_S = 60 s, so none is missed).

"before" runs the code of another tree (``--before-python``, default /work/main's venv: one sink
per traced process); "after" this tree's. The two alternate for each N in one run, so both meet
the same machine load. Run:  .venv/bin/python benchmarks/collector_bench.py [--n 1,4,8,16]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

#: Records per second of one traced process (114 records per request x 2 requests/s per pair of processes / 2).
RATE = 114

WORKER = """
import json, os, sys, threading, time
from pdtrace.instrument import tracer
tracer.activate()
tracer.set_resource(role=sys.argv[1], engine_id=sys.argv[1] + "-0")
rate = float(sys.argv[2])
print("ready", flush=True)
stop = threading.Event()
def writer_cpu_ns():
    for t in threading.enumerate():
        if t.name == "pdtrace-writer":
            return time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
    return 0
def run():
    i = k = 0
    nxt = time.monotonic()
    while not stop.is_set():
        nxt += 0.1
        n = int(rate / 10) + (1 if (k % 10) < (rate % 10) else 0)
        t = tracer.now()
        for j in range(n):
            m = i % 6
            if m < 3:  # per-step spans: no request id
                tracer.record("decode.step", None, t, t + 40_000, {"step.id": i, "step.num_reqs": 3,
                              "step.tokens": 48})
            elif m == 3:
                tracer.record("kv.transfer", f"req-{i // 57}", t, t + 2_000_000,
                              {"kv.bytes": 1 << 20, "kv.op": "READ", "kv.post_ns": 1200})
            elif m == 4:
                tracer.record("prefill.compute", f"req-{i // 57}", t, t + 30_000_000, {"step.id": i})
            else:
                tracer.event("request.finished", f"req-{i // 57}", attrs={"gen_ai.usage.output_tokens": 9})
            i += 1
        k += 1
        time.sleep(max(0.0, nxt - time.monotonic()))
th = threading.Thread(target=run, daemon=True); th.start()
for line in sys.stdin:
    if line.strip() == "cpu":
        print(json.dumps({"writer_cpu_ns": writer_cpu_ns()}), flush=True)
    else:
        break
stop.set(); th.join()
tracer.shutdown(30)
print(json.dumps(tracer.stats()), flush=True)
"""


def helpers(variant: str, workers: list[subprocess.Popen], trace_dir: Path) -> list[psutil.Process]:
    """The sink processes serving ``workers``: their children (before) or the host's sink of ``trace_dir`` (after)."""
    out = []
    if variant == "after":
        from pdtrace.instrument import hostsink

        pids = hostsink.find(trace_dir)
    else:
        pids = []
        for w in workers:
            try:
                pids += [c.pid for c in psutil.Process(w.pid).children()
                         if "pdtrace.instrument.sink" in " ".join(c.cmdline())]
            except psutil.NoSuchProcess:
                pass
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def writer_cpu(workers) -> float:
    """Sum of the workers' writer-thread CPU, s."""
    tot = 0
    for w in workers:
        w.stdin.write("cpu\n")
        w.stdin.flush()
    for w in workers:
        tot += json.loads(w.stdout.readline())["writer_cpu_ns"]
    return tot / 1e9


def one(variant: str, python: str, n: int, warmup: float, seconds: float) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"collector-{variant}-{n}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    env["PDTRACE_DIR"] = str(d)
    roles = ["prefill", "decode", "router", "api"]
    ws = [subprocess.Popen([python, "-c", textwrap.dedent(WORKER), roles[i % 4], str(RATE)], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(n)]
    for w in ws:
        w.stdout.readline()
    time.sleep(warmup)
    hs = helpers(variant, ws, d)
    c0, w0, t0 = cpu_s(hs), writer_cpu(ws), time.monotonic()
    seen: set[str] = set(p.name for p in d.glob("*.parquet"))
    before = set(seen)
    rss = 0.0
    next_rss = 0.0
    while time.monotonic() - t0 < seconds:
        seen.update(p.name for p in d.glob("*.parquet"))
        if time.monotonic() >= next_rss:
            hs = helpers(variant, ws, d)
            tot = 0
            for p in hs:
                try:
                    tot += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            rss = max(rss, tot / 2**20)
            next_rss = time.monotonic() + 0.5
        time.sleep(0.2)
    hs_end = helpers(variant, ws, d)
    c1, w1, t1 = cpu_s(hs_end), writer_cpu(ws), time.monotonic()
    wall = t1 - t0
    sink_s = sum(c1[p] - c0.get(p, 0.0) for p in c1)
    for w in ws:
        w.stdin.write("stop\n")
        w.stdin.flush()
    stats = [json.loads(w.stdout.readline()) for w in ws]
    for w in ws:
        w.wait(60)
    requests = n * wall  # N/2 pairs x 2 requests/s
    records = RATE * n * wall
    return {"variant": variant, "n": n, "helpers": len(hs_end), "rss_mib": rss,
            "sink_ms_per_req": sink_s * 1e3 / requests, "sink_ms_per_1k": sink_s * 1e3 / (records / 1000),
            "writer_ms_per_req": (w1 - w0) * 1e3 / requests,
            "files_per_min": len(seen - before) / (wall / 60),
            "dropped": sum(s["dropped"] for s in stats), "written": sum(s["written"] for s in stats)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="1,4,8,16")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--before-python", default="/work/main/.venv/bin/python")
    ap.add_argument("--only", choices=("before", "after"), default=None)
    a = ap.parse_args()
    rows = []
    print(f"{'variant':8} {'N':>3} {'helpers':>7} {'RSS MiB':>8} {'sink ms/req':>11} {'sink ms/1k rec':>14} "
          f"{'writer ms/req':>13} {'bg ms/req':>9} {'files/min':>9} {'dropped':>7}", flush=True)
    for n in [int(x) for x in a.n.split(",")]:
        for variant, py in (("before", a.before_python), ("after", sys.executable)):
            if a.only and variant != a.only:
                continue
            r = one(variant, py, n, a.warmup, a.seconds)
            rows.append(r)
            print(f"{variant:8} {n:>3} {r['helpers']:>7} {r['rss_mib']:>8.0f} {r['sink_ms_per_req']:>11.2f} "
                  f"{r['sink_ms_per_1k']:>14.2f} {r['writer_ms_per_req']:>13.3f} "
                  f"{r['sink_ms_per_req'] + r['writer_ms_per_req']:>9.2f} {r['files_per_min']:>9.0f} "
                  f"{r['dropped']:>7}", flush=True)
            time.sleep(6)  # an idle host sink exits (PDTRACE_SINK_IDLE_S, default 5 s) before the next round
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
