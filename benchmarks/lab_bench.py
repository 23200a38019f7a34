"""Lab benchmark: engine start time, router overhead, client TTFT/TPOT, pull vs push, router at 64 streams.

Usage (from the repo root, lab environment installed)::

    .venv/bin/python benchmarks/lab_bench.py [--requests 40] [--workload azure-conv] [--out runs/bench]

For each mode it runs ``pdtrace lab`` (stock connectors, tracing off so the
numbers are the lab's own) on the same replayed trace and scale factors, then
starts one more pull lab and sends 64 concurrent streaming requests through the
router, printing the router's own added latency (TTFT on the router's clock
minus the time it waited on engines on the TTFT path) p50/p99.

One round on a shared 2-core machine: other processes' load moves every number;
compare modes only within one run of this script.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from pdtrace.connector.lab import metrics, replay
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model
from pdtrace.connector.lab.run import LabOptions, router_overhead, run_lab
from pdtrace.connector.lab.workload import ReplayRequest, Workload


def fmt(v):
    return "-" if v is None else f"{v:.2f}"


def stress_router(out: Path, streams: int = 64) -> dict:
    """64 concurrent short streams through one pull lab's router; the router's own added latency."""
    model = make_model("default")
    cfg = LabConfig(model=model, mode="pull", run_dir=out)
    reqs = [ReplayRequest(i, i, 0.0, [16 + (i * 31 + k) % 2000 for k in range(64)], 16) for i in range(streams)]
    wl = Workload("stress", "-", "synthetic", 1.0, 1.0, 0, reqs, streams, False)
    with Lab(cfg) as lab:
        asyncio.run(replay.replay(Workload("warm", "-", "synthetic", 1.0, 1.0, 0, reqs[:2], 2, False),
                                  lab.router_url, progress=False))
        t = time.monotonic()
        recs = asyncio.run(replay.replay(wl, lab.router_url, progress=False))
        wall = time.monotonic() - t
        rows = metrics.router_stats(lab.router_url)
    ids = {r.router_request_id for r in recs}
    ro = router_overhead(rows, ids)
    return {"streams": streams, "ok": sum(r.ok for r in recs), "wall_s": wall, "router_overhead_ms": ro,
            "client": replay.latency_summary(recs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--workload", default="azure-conv")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("runs") / f"bench-{time.strftime('%Y%m%dT%H%M%S')}")
    ap.add_argument("--skip-stress", action="store_true")
    a = ap.parse_args()
    res = {}
    for mode in ("pull", "push"):
        o = LabOptions(mode=mode, workload=a.workload, max_requests=a.requests, rate_scale=a.rate_scale,
                       out=a.out / mode, trace=False, progress=False)
        res[mode] = run_lab(o, echo=lambda *_: None)
    print(f"\n== lab benchmark: {a.workload}, {a.requests} requests, "
          f"length x{res['pull']['workload']['length_scale']}, rate x{a.rate_scale} ==")
    print(f"{'':<28}{'pull':>12}{'push':>12}")
    print(f"{'engine start P (s)':<28}" + "".join(f"{r['engine_start_s'].get('prefill-0', 0):>12.1f}" for r in res.values()))
    print(f"{'engine start D (s)':<28}" + "".join(f"{r['engine_start_s'].get('decode-0', 0):>12.1f}" for r in res.values()))
    print(f"{'warm-up / first contact (s)':<28}" + "".join(f"{r.get('warmup_s', 0):>12.2f}" for r in res.values()))
    print(f"{'ok / requests':<28}" + "".join(f"{str(r['client']['ok']) + '/' + str(r['client']['requests']):>12}" for r in res.values()))
    for k, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        for p in ("p50", "p90", "p99"):
            print(f"{label + ' ' + p + ' (ms)':<28}" + "".join(f"{fmt(r['client'][k][p]):>12}" for r in res.values()))
    for p in ("p50", "p99"):
        print(f"{'router overhead ' + p + ' (ms)':<28}" + "".join(f"{fmt(r['router_overhead_ms'][p]):>12}" for r in res.values()))
    print(f"{'D prompt tokens computed':<28}" + "".join(f"{r['decode_prompt_tokens_by_source']['local_compute']:>12.0f}" for r in res.values()))
    if not a.skip_stress:
        s = stress_router(a.out / "stress")
        res["stress"] = s
        ro = s["router_overhead_ms"]
        print(f"\nrouter under {s['streams']} concurrent streams (pull, 64-token prompts, 16 tokens): "
              f"{s['ok']}/{s['streams']} ok in {s['wall_s']:.1f} s; router's own added latency "
              f"p50 {fmt(ro['p50'])} ms, p99 {fmt(ro['p99'])} ms; client TTFT p50 "
              f"{fmt(s['client']['ttft_ms']['p50'])} ms, p99 {fmt(s['client']['ttft_ms']['p99'])} ms")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench.json").write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
