"""Tracing overhead of the traced pull connector in the lab: tracing on vs off, interleaved rounds.

Usage (repo root, lab environment installed)::

    .venv/bin/python benchmarks/connector_overhead.py [--rounds 4] [--requests 20] [--out runs/overhead]
        [--no-self-cpu] [--on-env PDTRACE_SAMPLE=0 --on-env PDTRACE_STEP_SAMPLE=0]

Two labs run side by side for the whole benchmark, both with pdtrace's traced
pull connector and frontend middleware: "on" has ``PDTRACE_DIR`` set (every
request and step recorded), "off" has not (the traced classes then build the
stock vLLM objects). Each round replays the same real trace (Azure
conversations, lengths x0.25) through one lab, then the other; the order
alternates every round, so slow drifts of the shared machine hit both. The idle
lab's engines sleep (NIXL progress thread with ``pthrDelay``).

Printed: per round and pooled, client-side TTFT and TPOT p50/p99 for each
condition, and the on/off ratios of the pooled p50s (and p99s) with 95 %
bootstrap confidence intervals (2000 resamples) three ways: *paired* (each
trace request is replayed in both labs every round; pairs are resampled, so
both conditions get the same requests), *by round* (whole rounds of pairs
resampled: also carries a round's shared slowdown; the goal is judged on this
one) and *unpaired* (the conditions resampled apart, as printed before session
7: it counts the spread between requests' prompt lengths as uncertainty about
the overhead). Goal (issue 4): the upper bound of the p50 ratios ≤ 1.05.
``overhead.json`` keeps every request's TTFT and TPOT per round and condition.
TPOT is the client's (last token − first token) / (tokens − 1); it is 0 when
D's API server, lagging, sends all tokens of a request in one chunk.

Also printed: vLLM's own per-request means inside each engine (TTFT as the
engine sees it, queue, prefill, decode, end to end; from its Prometheus
histograms) for both labs, to say on which engine and in which phase the
difference lands.

Also printed: the CPU time (user + system, psutil) each lab's processes used
during its replays, per request, with pdtrace's sink processes apart: on a
2-core machine running 6 lab processes, CPU that tracing adds is latency.

Also printed (unless ``--no-self-cpu``): pdtrace's own CPU time per engine
step, which the "on" lab measures itself with ``PDTRACE_SELF_CPU=1`` (thread
CPU clock around every connector hook, written on each step span as
``step.pdtrace_cpu_ns``), as a share of the step (goal: ≤ 1 % of a decode
step), and the CPU of the pdtrace-writer thread and of its sink process as
a share of each engine process's wall time. The self-measurement's own clock reads are part of the
"on" condition, so the on/off ratios slightly overstate the overhead.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from pdtrace.connector.lab import metrics, replay, workload
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model, model_info

MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio_ci(on, off, q, n=2000, seed=0):
    """Ratio pct(on, q) / pct(off, q) and its 95 % bootstrap interval, the two samples resampled apart.

    Ignores that the same requests were replayed in both conditions (see :func:`paired_ratio_ci`);
    kept for comparison with the runs before session 7, which printed only this one.
    """
    rng = random.Random(seed)
    point = pct(on, q) / pct(off, q) if pct(off, q) > 0 else float("inf")
    rs = []
    for _ in range(n):
        a = [rng.choice(on) for _ in on]
        b = [rng.choice(off) for _ in off]
        d = pct(b, q)
        rs.append(pct(a, q) / d if d > 0 else float("inf"))
    rs.sort()
    return point, rs[int(0.025 * n)], rs[int(0.975 * n) - 1]


def paired_ratio_ci(pairs: dict[tuple[int, int], tuple[float, float]], q: float, by_round: bool,
                    n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of the q-quantiles of "on" and "off" over paired requests, with a 95 % bootstrap interval.

    ``pairs``: {(round, request_index): (on value, off value)}, the same trace request replayed in
    both labs in the same round (ms). The bootstrap resamples pairs, so both conditions get the
    same requests in each resample (a long prompt is drawn for both or neither) — the design of
    this benchmark is paired, and resampling the conditions apart counts the spread between
    requests' lengths as uncertainty about the overhead. ``by_round``: resample whole rounds (all
    pairs of a drawn round; a cluster bootstrap, which also carries a round's shared slowdown)
    instead of single pairs. Returns (point, lower, upper); the point is the ratio over all pairs.
    Raises ValueError without pairs.
    """
    if not pairs:
        raise ValueError("no request succeeded in both conditions")
    rng = random.Random(seed)
    keys = sorted(pairs)

    def ratio(ks):
        d = pct([pairs[k][1] for k in ks], q)
        return pct([pairs[k][0] for k in ks], q) / d if d > 0 else float("inf")

    clusters = {}
    for k in keys:
        clusters.setdefault(k[0] if by_round else k, []).append(k)
    groups = list(clusters.values())
    rs = sorted(ratio([k for _ in groups for k in rng.choice(groups)]) for _ in range(n))
    return ratio(keys), rs[int(0.025 * n)], rs[int(0.975 * n) - 1]


def metrics_of(recs):
    """Client-side TTFT and TPOT (ms) of one replay: lists over the successful requests, and per request index."""
    per_request = {}
    for r in recs:
        if r.ok:
            n = len(r.token_times_ns)
            per_request[r.request_index] = {
                "ttft": (r.first_token_ns - r.send_ns) / 1e6,
                "tpot": (r.token_times_ns[-1] - r.token_times_ns[0]) / 1e6 / (n - 1) if n > 1 else None}
    return {"ttft": [v["ttft"] for v in per_request.values()],
            "tpot": [v["tpot"] for v in per_request.values() if v["tpot"] is not None],
            "failed": len(recs) - len(per_request), "per_request": per_request}


def self_cpu_share(trace_dir: Path) -> dict:
    """pdtrace's own CPU per engine step, from the "on" lab's trace (``PDTRACE_SELF_CPU=1``).

    Per role (prefill / decode): over every recorded step span, the sum of
    ``step.pdtrace_cpu_ns`` (pdtrace's CPU on the engine's threads since the
    previous step span, thread CPU clock) divided by the sum of the steps'
    durations, plus the median and p99 of the per-step ratio; and the
    pdtrace-writer thread's CPU (``recorder.writer_cpu_ns``, last stats row of
    each engine process) and its sink process's CPU (``recorder.sink_cpu_ns``),
    each divided by that process's traced wall time. Shares in %. Reads the
    Parquet files directly (raw rows, no analysis views).
    """
    import duckdb

    from pdtrace.instrument import store

    files = [str(f) for f in store.store_files(trace_dir)]
    con = duckdb.connect()
    con.read_parquet(files, union_by_name=True).create_view("r")  # (a CREATE VIEW cannot take parameters)
    out = {}
    for role, step in (("prefill", "prefill.step"), ("decode", "decode.step")):
        row = con.execute(
            "WITH s AS (SELECT DISTINCT record_id, end_ns - start_ns AS dur, "
            "attr_int['step.pdtrace_cpu_ns'] AS cpu FROM r WHERE record = 'span' AND name = ? AND role = ?) "
            "SELECT count(*), sum(cpu) / sum(dur) * 100, median(cpu / dur) * 100, "
            "quantile_cont(cpu / dur, 0.99) * 100, median(dur) / 1e6, median(cpu) / 1e3 "
            "FROM s WHERE cpu IS NOT NULL AND dur > 0", [step, role]).fetchall()[0]
        w, sink = con.execute(
            "SELECT sum(cpu) / sum(wall) * 100, sum(sink) / sum(wall) * 100 FROM (SELECT pid, "
            "max(attr_int['recorder.writer_cpu_ns']) AS cpu, max(attr_int['recorder.sink_cpu_ns']) AS sink, "
            "max(end_ns) - min(start_ns) AS wall FROM r WHERE role = ? GROUP BY pid HAVING cpu IS NOT NULL)",
            [role]).fetchall()[0][0]
        out[role] = {"steps": row[0], "share_pct": row[1], "median_step_pct": row[2], "p99_step_pct": row[3],
                     "median_step_ms": row[4], "median_cpu_us": row[5], "writer_pct_of_wall": w,
                     "sink_pct_of_wall": sink}
    return out


#: vLLM's own per-request histograms (seconds), read from each engine's /metrics: where the time went
#: inside an engine, measured by vLLM itself, so on vs off can be compared per engine.
VLLM_HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "e2e_request_latency_seconds")


def engine_means(lab) -> dict:
    """{'prefill'|'decode': {histogram: mean ms, 'requests': count}} from vLLM's Prometheus histograms.

    Means over every request the engine served (warm-up included, the same in
    both labs). A histogram the installed vLLM does not export is left out.
    """
    out = {}
    for role, engines in (("prefill", lab.prefills), ("decode", lab.decodes)):
        m = metrics.scrape(engines[0].url)
        row = {}
        for h in VLLM_HISTOGRAMS:
            n = metrics.total(m, f"vllm:{h}_count")
            if n:
                row[h] = metrics.total(m, f"vllm:{h}_sum") / n * 1e3
                row.setdefault("requests", n)
        out[role] = row
    return out


def lab_cpu_s(lab) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the lab's processes, from psutil.

    Keys: each lab process (router, engines: their API servers and engine
    cores, i.e. every descendant), and ``"sinks"`` (the host's
    ``pdtrace.instrument.sink`` process of the lab's trace directory, detached
    from the lab's trees: ``hostsink.find``). A process that exits between two
    readings takes its CPU with it (none does during a round).
    """
    import psutil

    from pdtrace.instrument import hostsink

    out = {"sinks": 0.0}
    for pid in (hostsink.find(lab.cfg.trace_dir) if lab.cfg.trace_dir else []):
        try:
            t = psutil.Process(pid).cpu_times()
            out["sinks"] += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    for name, pid in lab.pids().items():
        try:
            root = psutil.Process(pid)
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        out[name] = 0.0
        for p in tree:
            try:
                t = p.cpu_times()
                if "pdtrace.instrument.sink" in " ".join(p.cmdline()):
                    continue
            except psutil.NoSuchProcess:
                continue
            out[name] += t.user + t.system
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--no-self-cpu", dest="self_cpu", action="store_false",
                    help="do not set PDTRACE_SELF_CPU=1 in the traced lab (its two clock reads per hook "
                         "are then not part of the measured overhead, and no per-step CPU share is printed)")
    ap.add_argument("--on-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the traced lab (repeatable), e.g. PDTRACE_SAMPLE=0 "
                         "PDTRACE_STEP_SAMPLE=0 to split the cost of recording from the cost of the "
                         "traced code paths themselves")
    ap.add_argument("--out", type=Path, default=Path("runs") / f"overhead-{time.strftime('%Y%m%dT%H%M%S')}")
    a = ap.parse_args()
    from pdtrace.connector.data import AZURE_CONV

    try:
        on_env = dict(kv.split("=", 1) for kv in a.on_env)
    except ValueError:
        ap.error("--on-env takes KEY=VALUE")

    model = make_model("default")
    wl = workload.build("azure-conv", AZURE_CONV, vocab_size=model_info(model)["vocab_size"], length_scale=0.25,
                        rate_scale=a.rate_scale, max_requests=a.requests, max_model_len=8192)
    cfgs = {}
    for cond in ("on", "off"):
        d = (a.out / cond).resolve()
        d.mkdir(parents=True, exist_ok=True)
        cfgs[cond] = LabConfig(model=model, mode="pull", run_dir=d, trace_dir=(d if cond == "on" else None),
                               connector_class="TracedNixlPullConnector",
                               connector_module="pdtrace.connector.traced", extra_args=["--middleware", MIDDLEWARE],
                               extra_env=({**({"PDTRACE_SELF_CPU": "1"} if a.self_cpu else {}), **on_env}
                                          if cond == "on" else {}))
    res = {c: {"ttft": [], "tpot": [], "failed": 0, "per_request": {}} for c in ("on", "off")}
    cpu: dict[str, dict[str, float]] = {"on": {}, "off": {}}  # CPU s per lab process during the replays
    rounds = []
    t0 = time.monotonic()
    with Lab(cfgs["on"]) as lab_on, Lab(cfgs["off"]) as lab_off:
        labs = {"on": lab_on, "off": lab_off}
        print(f"labs up in {time.monotonic() - t0:.0f} s", flush=True)
        warm = workload.Workload("warm", "-", "synthetic", 1.0, 1.0, 0, wl.requests[:2], 2, False)
        for lab in labs.values():
            asyncio.run(replay.replay(warm, lab.router_url, progress=False))
        for r in range(a.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            row = {"round": r, "order": order}
            for cond in order:
                c0 = lab_cpu_s(labs[cond])
                m = metrics_of(asyncio.run(replay.replay(wl, labs[cond].router_url, timeout_s=300, progress=False)))
                c1 = lab_cpu_s(labs[cond])
                for k, v in c1.items():  # CPU used during this replay, s
                    cpu[cond][k] = cpu[cond].get(k, 0.0) + v - c0.get(k, 0.0)
                for k in ("ttft", "tpot"):
                    res[cond][k] += m[k]
                res[cond]["failed"] += m["failed"]
                res[cond]["per_request"].update({(r, i): v for i, v in m["per_request"].items()})
                row[cond] = {"ttft_p50": pct(m["ttft"], 0.5), "tpot_p50": pct(m["tpot"], 0.5), "failed": m["failed"]}
            rounds.append(row)
            print(f"round {r} ({'/'.join(order)}): TTFT p50 on {row['on']['ttft_p50']:.1f} off "
                  f"{row['off']['ttft_p50']:.1f} ms; TPOT p50 on {row['on']['tpot_p50']:.2f} off "
                  f"{row['off']['tpot_p50']:.2f} ms", flush=True)
        engines = {cond: engine_means(labs[cond]) for cond in ("on", "off")}
    out = {"rounds": rounds, "requests_per_round": a.requests, "failed": {c: res[c]["failed"] for c in res},
           "vllm_engine_means_ms": engines}
    print(f"\n{a.rounds} rounds x {a.requests} requests per condition; failed: on {res['on']['failed']}, "
          f"off {res['off']['failed']}")
    print("ratios of the pooled quantiles; 95 % bootstrap intervals: paired (the same requests in both labs "
          "resampled together), by round (whole rounds resampled), unpaired (the conditions apart)")
    print(f"{'metric':<10}{'on':>10}{'off':>10}{'ratio':>9}  {'paired':<16}  {'by round':<16}  unpaired")
    both = set(res["on"]["per_request"]) & set(res["off"]["per_request"])
    for k in ("ttft", "tpot"):
        pairs = {key: (res["on"]["per_request"][key][k], res["off"]["per_request"][key][k]) for key in both
                 if res["on"]["per_request"][key][k] is not None and res["off"]["per_request"][key][k] is not None}
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            p, lo, hi = ratio_ci(res["on"][k], res["off"][k], q)
            pp, plo, phi = paired_ratio_ci(pairs, q, by_round=False)
            _, rlo, rhi = paired_ratio_ci(pairs, q, by_round=True)
            out[f"{k}_{name}"] = {"on": pct(res["on"][k], q), "off": pct(res["off"][k], q), "ratio": p,
                                  "ci95": [lo, hi], "pairs": len(pairs), "paired_ratio": pp,
                                  "paired_ci95": [plo, phi], "by_round_ci95": [rlo, rhi]}
            print(f"{k.upper() + ' ' + name:<10}{pct(res['on'][k], q):>10.2f}{pct(res['off'][k], q):>10.2f}"
                  f"{p:>9.3f}  [{plo:.3f}, {phi:.3f}]  [{rlo:.3f}, {rhi:.3f}]  [{lo:.3f}, {hi:.3f}]"
                  f"  (paired point {pp:.3f}, {len(pairs)} pairs)")
    out["per_request_ms"] = {c: [{"round": key[0], "request_index": key[1], **v}
                                 for key, v in sorted(res[c]["per_request"].items())] for c in res}
    print("\nvLLM's own per-request means inside each engine (ms; from its Prometheus histograms, all requests):")
    print(f"{'engine':<9}{'histogram':<32}{'on':>10}{'off':>10}{'on-off':>9}")
    for role in ("prefill", "decode"):
        for h in VLLM_HISTOGRAMS:
            on, off = engines["on"][role].get(h), engines["off"][role].get(h)
            if on is not None and off is not None:
                print(f"{role:<9}{h:<32}{on:>10.2f}{off:>10.2f}{on - off:>9.2f}")
    n_req = a.rounds * a.requests
    out["cpu_ms_per_request"] = {c: {k: v / n_req * 1e3 for k, v in cpu[c].items()} for c in cpu}
    print("\nCPU used during the replays, ms per request (user + system, each lab process with its "
          "descendants; pdtrace's sinks apart):")
    print(f"{'process':<12}{'on':>10}{'off':>10}{'on-off':>9}")
    for k in sorted(set(cpu["on"]) | set(cpu["off"])):
        on, off = (out["cpu_ms_per_request"][c].get(k, 0.0) for c in ("on", "off"))
        print(f"{k:<12}{on:>10.2f}{off:>10.2f}{on - off:>9.2f}")
    tot = {c: sum(out["cpu_ms_per_request"][c].values()) for c in cpu}
    print(f"{'total':<12}{tot['on']:>10.2f}{tot['off']:>10.2f}{tot['on'] - tot['off']:>9.2f}")
    if a.self_cpu:
        out["self_cpu"] = sc = self_cpu_share((a.out / "on").resolve())
        print("\npdtrace's own CPU per engine step (thread CPU clock; goal <= 1 % of a decode step):")
        for role, v in sc.items():
            if not v["steps"]:
                print(f"  {role}: no step spans with step.pdtrace_cpu_ns")
                continue
            print(f"  {role}: {v['steps']} steps, median step {v['median_step_ms']:.2f} ms, median pdtrace CPU "
                  f"{v['median_cpu_us']:.1f} us; share {v['share_pct']:.3f} % (per step: median "
                  f"{v['median_step_pct']:.3f} %, p99 {v['p99_step_pct']:.3f} %); writer thread "
                  f"{(v['writer_pct_of_wall'] or 0):.3f} % and its sink process {(v['sink_pct_of_wall'] or 0):.3f} % "
                  "of the engine process's wall time")
    (a.out / "overhead.json").write_text(json.dumps(out, indent=2))
    verdict = {k: "met" if out[f"{k}_p50"]["by_round_ci95"][1] <= 1.05 else "missed" for k in ("ttft", "tpot")}
    print(f"written {a.out / 'overhead.json'} (with every request's TTFT/TPOT); p50 goal: upper bound <= 1.05, "
          f"judged on the by-round interval: TTFT {verdict['ttft']}, TPOT {verdict['tpot']}")


if __name__ == "__main__":
    main()
