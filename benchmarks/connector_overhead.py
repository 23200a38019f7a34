"""Tracing overhead of the traced pull connector in the lab: tracing on vs off, interleaved rounds.

Usage (repo root, lab environment installed)::

    .venv/bin/python benchmarks/connector_overhead.py [--rounds 4] [--requests 20] [--out runs/overhead]
        [--no-self-cpu] [--on-env PDTRACE_SAMPLE=0 --on-env PDTRACE_STEP_SAMPLE=0]
        [--noise-floor [--off-only]] [--samples 0,0.01,0.1,1]

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
one) and *unpaired* (the conditions resampled apart, as the script first
printed: it counts the spread between requests' prompt lengths as uncertainty about
the overhead). Goal (issue 4): the upper bound of the p50 ratios ≤ 1.05.
``overhead.json`` keeps every request's TTFT and TPOT per round and condition.
TPOT is the client's (last token − first token) / (tokens − 1); it is 0 when
D's API server, lagging, sends all tokens of a request in one chunk.

``--noise-floor`` adds a second untraced lab, "off2", replayed by the same procedure: its off2/off
ratios and intervals, printed beside the on/off ones, are what this A/B reports when nothing
differs (its noise floor); ``--off-only`` runs off and off2 alone. ``--samples P,P,...`` replaces the
one traced lab by one per ``PDTRACE_SAMPLE`` value (router and engines; the sampling curve), each
compared with the same "off" lab. The untraced labs stay up for the whole run and the traced labs run
one at a time, ``--rounds`` rounds each (a lab holds 3-6 GiB), so a traced lab's ratio uses the
untraced labs' rounds that ran beside it; with more than two labs up the order rotates every round. For
0 < P < 1 the traced lab's own requests also give the *paired* cost (traced minus untraced requests of
that lab, matched by arrival order and prompt length: :func:`paired_in_lab`,
``benchmarks/paired_overhead.py`` for the method); at 0 and 1 it is undefined (all untraced / all
traced) and printed as such. ``--on-env`` and ``PDTRACE_SAMPLE`` reach the traced labs' router as
well as their engines. Each traced lab's ``pdtrace footprint:`` line (CPU accounting, issue 18 item 2;
:func:`footprint_of`) is printed beside its figures.

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
import contextlib
import json
import random
import tempfile
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
    kept for comparison with earlier runs, which printed only this one.
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
                "x": r.router_request_id, "prompt": r.prompt_tokens, "send_ns": r.send_ns,
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


def paired_in_lab(per_request: dict, sample: float) -> dict | None:
    """Paired cost of tracing inside one "on" lab whose PDTRACE_SAMPLE is strictly between 0 and 1.

    ``per_request``: {(round, request_index): {"x", "prompt", "send_ns", "ttft", "tpot"}} (:func:`metrics_of`).
    The requests in send order, traced iff the sampling rule keeps the router's id ``x``; per metric the
    estimate of :func:`pdtrace.connector.lab.paired.paired_estimate` (2 untraced neighbours per side with a
    prompt length within x1.41, moving blocks of 4 pairs) as {"median", "lo", "hi", "n", "pct_hi", ...}.
    None at ``sample`` 0 or 1 (every request untraced / traced: no pairs), or when no request has an id.
    """
    from pdtrace.connector.lab import paired
    from pdtrace.instrument import ids

    if not 0.0 < sample < 1.0:
        return None
    rows = sorted((v for v in per_request.values() if v.get("x")), key=lambda v: v["send_ns"])
    if not rows:
        return None
    flags = [ids.is_sampled(v["x"], sample) for v in rows]
    match = paired.length_match([v["prompt"] for v in rows], 0.5)
    out = {"traced": sum(flags), "untraced": len(flags) - sum(flags)}
    for k in ("ttft", "tpot"):
        e = paired.paired_estimate(flags, [v[k] for v in rows], k=2, match=match, block=4)
        out[k] = {**e.__dict__, "pct": e.pct(e.median), "pct_lo": e.pct(e.lo), "pct_hi": e.pct(e.hi)}
    return out


def footprint_of(lab) -> str | None:
    """The ``pdtrace footprint:`` line of one traced lab (issue 18 item 2; :mod:`pdtrace.analysis.footprint`),
    read while its processes still run: the host's sink of its directory (psutil), the store's thread CPU
    and writer rows, over the lab's life so far (since its first process started). None for an untraced lab;
    a failure is returned as the line's text, never raised.
    """
    import psutil

    from pdtrace.analysis import footprint

    if not lab.cfg.trace_dir:
        return None
    try:
        helpers = footprint.sample_helpers(lab.cfg.trace_dir)
        started = min(psutil.Process(p.pid).create_time() for p in lab.procs.values())
        return footprint.line(footprint.of_run(lab.cfg.trace_dir, helpers, time.time() - started,
                                               cache=Path(tempfile.mkdtemp(prefix="pdtrace-fp-")) / "c.duckdb"))
    except Exception as exc:  # noqa: BLE001 - a benchmark's side figure; say what failed
        return f"pdtrace footprint: failed ({type(exc).__name__}: {exc})"


def _fmt_sample(f: float) -> str:
    return f"{f:g}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--no-self-cpu", dest="self_cpu", action="store_false",
                    help="do not set PDTRACE_SELF_CPU=1 in the traced lab (its two clock reads per hook "
                         "are then not part of the measured overhead, and no per-step CPU share is printed)")
    ap.add_argument("--on-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the traced lab(s) (repeatable), e.g. PDTRACE_SAMPLE=0 "
                         "PDTRACE_STEP_SAMPLE=0 to split the cost of recording from the cost of the "
                         "traced code paths themselves")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also run a second untraced lab (off2), the same procedure as off: its off2/off ratio "
                         "and intervals are the A/B's noise floor, printed beside each on/off ratio")
    ap.add_argument("--samples", default=None, metavar="P,P,...",
                    help="the sampling curve: one traced lab per PDTRACE_SAMPLE value (e.g. 0,0.01,0.1,1), "
                         "each against the same off lab; for 0 < P < 1 also the paired cost inside that lab")
    ap.add_argument("--off-only", action="store_true",
                    help="with --noise-floor: no traced lab at all (off vs off2 only; the shortest noise-floor run)")
    ap.add_argument("--out", type=Path, default=Path("runs") / f"overhead-{time.strftime('%Y%m%dT%H%M%S')}")
    a = ap.parse_args()
    from pdtrace.connector.data import AZURE_CONV

    try:
        on_env = dict(kv.split("=", 1) for kv in a.on_env)
    except ValueError:
        ap.error("--on-env takes KEY=VALUE")
    if a.off_only and not a.noise_floor:
        ap.error("--off-only needs --noise-floor")
    try:
        samples = [float(v) for v in a.samples.split(",")] if a.samples else None
    except ValueError:
        ap.error("--samples takes comma-separated fractions, e.g. 0,0.01,0.1,1")
    if samples and any(not 0.0 <= f <= 1.0 for f in samples):
        ap.error("--samples: each fraction within [0, 1]")
    if samples and "PDTRACE_SAMPLE" in on_env:
        ap.error("give the sampling either by --samples or by --on-env PDTRACE_SAMPLE, not both")
    # condition -> PDTRACE_SAMPLE of its lab (None: untraced)
    conds: dict[str, float | None] = {"off": None}
    if not a.off_only:
        if samples:
            conds.update({f"on@{_fmt_sample(f)}": f for f in samples})
        else:
            conds["on"] = float(on_env.get("PDTRACE_SAMPLE", 1.0))
    if a.noise_floor:
        conds["off2"] = None
    traced = [c for c, f in conds.items() if f is not None]
    versus = [c for c in conds if c != "off"]  # each compared with "off"

    model = make_model("default")
    wl = workload.build("azure-conv", AZURE_CONV, vocab_size=model_info(model)["vocab_size"], length_scale=0.25,
                        rate_scale=a.rate_scale, max_requests=a.requests, max_model_len=8192)
    cfgs = {}
    for cond, f in conds.items():
        d = (a.out / cond).resolve()
        d.mkdir(parents=True, exist_ok=True)
        env = {}
        if f is not None:
            env = {**({"PDTRACE_SELF_CPU": "1"} if a.self_cpu else {}), **on_env, "PDTRACE_SAMPLE": repr(f)}
        cfgs[cond] = LabConfig(model=model, mode="pull", run_dir=d, trace_dir=(d if f is not None else None),
                               connector_class="TracedNixlPullConnector",
                               connector_module="pdtrace.connector.traced", extra_args=["--middleware", MIDDLEWARE],
                               extra_env=env, role_env={"router": dict(env)} if env else {})
    res = {c: {"ttft": [], "tpot": [], "failed": 0, "per_request": {}} for c in conds}
    cpu: dict[str, dict[str, float]] = {c: {} for c in conds}  # CPU s per lab process during the replays
    rounds = []
    footprints = {}
    t0 = time.monotonic()
    engines: dict[str, dict] = {}
    warm = workload.Workload("warm", "-", "synthetic", 1.0, 1.0, 0, wl.requests[:2], 2, False)
    untraced = [c for c in conds if c not in traced]
    # The untraced labs stay up for the whole run; the traced labs run one at a time (a lab is ~3-6 GiB of
    # RSS), each for --rounds rounds against the untraced ones, rounds numbered across the whole run.
    blocks = [[c] for c in traced] or [[]]
    r = 0
    with contextlib.ExitStack() as stack:
        labs = {c: stack.enter_context(Lab(cfgs[c])) for c in untraced}
        for lab in labs.values():
            asyncio.run(replay.replay(warm, lab.router_url, progress=False))
        for block in blocks:
            with contextlib.ExitStack() as inner:
                for c in block:
                    t1 = time.monotonic()
                    labs[c] = inner.enter_context(Lab(cfgs[c]))
                    asyncio.run(replay.replay(warm, labs[c].router_url, progress=False))
                    print(f"{c} up in {time.monotonic() - t1:.0f} s", flush=True)
                names = untraced + block
                for _ in range(a.rounds):
                    order = tuple(names[(r + i) % len(names)] for i in range(len(names))) if len(names) > 2 else \
                        (tuple(names) if r % 2 == 0 else tuple(reversed(names)))
                    row = {"round": r, "order": order}
                    for cond in order:
                        c0 = lab_cpu_s(labs[cond])
                        m = metrics_of(asyncio.run(replay.replay(wl, labs[cond].router_url, timeout_s=300,
                                                                 progress=False)))
                        c1 = lab_cpu_s(labs[cond])
                        for k, v in c1.items():  # CPU used during this replay, s
                            cpu[cond][k] = cpu[cond].get(k, 0.0) + v - c0.get(k, 0.0)
                        for k in ("ttft", "tpot"):
                            res[cond][k] += m[k]
                        res[cond]["failed"] += m["failed"]
                        res[cond]["per_request"].update({(r, i): v for i, v in m["per_request"].items()})
                        row[cond] = {"ttft_p50": pct(m["ttft"], 0.5), "tpot_p50": pct(m["tpot"], 0.5),
                                     "failed": m["failed"]}
                    rounds.append(row)
                    print(f"round {r} ({'/'.join(order)}): TTFT p50 "
                          + " ".join(f"{c} {row[c]['ttft_p50']:.1f}" for c in names) + " ms; TPOT p50 "
                          + " ".join(f"{c} {row[c]['tpot_p50']:.2f}" for c in names) + " ms", flush=True)
                    r += 1
                for c in block:
                    engines[c] = engine_means(labs[c])
                    footprints[c] = footprint_of(labs[c])
                    del labs[c]
        for c in untraced:
            engines[c] = engine_means(labs[c])
    print(f"total {time.monotonic() - t0:.0f} s", flush=True)
    out = {"conditions": {c: f for c, f in conds.items()}, "rounds": rounds, "requests_per_round": a.requests,
           "failed": {c: res[c]["failed"] for c in res}, "vllm_engine_means_ms": engines}
    print(f"\n{a.rounds} rounds x {a.requests} requests per traced lab (the untraced labs ran in every round); failed: "
          + ", ".join(f"{c} {res[c]['failed']}" for c in conds))
    print("ratios of the pooled quantiles against off; 95 % bootstrap intervals: paired (the same requests in both "
          "labs resampled together), by round (whole rounds resampled), unpaired (the conditions apart)"
          + ("; off2 is a second untraced lab: its row is the A/B's noise floor" if a.noise_floor else ""))
    print(f"{'metric':<10}{'cond':<10}{'value':>10}{'off':>10}{'ratio':>9}  {'paired':<16}  {'by round':<16}  unpaired")
    for k in ("ttft", "tpot"):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            for c in versus:
                both = set(res[c]["per_request"]) & set(res["off"]["per_request"])
                pairs = {key: (res[c]["per_request"][key][k], res["off"]["per_request"][key][k]) for key in both
                         if res[c]["per_request"][key][k] is not None and res["off"]["per_request"][key][k] is not None}
                # unpaired: each condition's values over the rounds both ran (the traced labs run in turn)
                cv = [res[c]["per_request"][key][k] for key in both if res[c]["per_request"][key][k] is not None]
                ov = [res["off"]["per_request"][key][k] for key in both
                      if res["off"]["per_request"][key][k] is not None]
                p, lo, hi = ratio_ci(cv, ov, q)
                pp, plo, phi = paired_ratio_ci(pairs, q, by_round=False)
                _, rlo, rhi = paired_ratio_ci(pairs, q, by_round=True)
                key = f"{k}_{name}" if c == "on" else f"{k}_{name}_{c}"
                out[key] = {"value": pct(cv, q), "off": pct(ov, q), "ratio": p,
                            "ci95": [lo, hi], "pairs": len(pairs), "paired_ratio": pp,
                            "paired_ci95": [plo, phi], "by_round_ci95": [rlo, rhi]}
                print(f"{k.upper() + ' ' + name:<10}{c:<10}{pct(cv, q):>10.2f}{pct(ov, q):>10.2f}"
                      f"{p:>9.3f}  [{plo:.3f}, {phi:.3f}]  [{rlo:.3f}, {rhi:.3f}]  [{lo:.3f}, {hi:.3f}]"
                      f"  (paired point {pp:.3f}, {len(pairs)} pairs)")
    out["per_request_ms"] = {c: [{"round": key[0], "request_index": key[1], **v}
                                 for key, v in sorted(res[c]["per_request"].items())] for c in res}
    if traced:
        print("\npaired cost inside each traced lab (traced minus untraced requests of the same lab, matched by "
              "arrival order and prompt length; median ms [95 % CI], % of the untraced median):")
        out["paired_in_lab"] = {}
        for c in traced:
            pr = paired_in_lab(res[c]["per_request"], conds[c])
            out["paired_in_lab"][c] = pr
            if pr is None:
                why = "every request untraced" if conds[c] == 0.0 else "every request traced"
                print(f"  {c}: undefined (PDTRACE_SAMPLE={_fmt_sample(conds[c])}: {why}, no pairs)")
                continue
            print(f"  {c}: traced {pr['traced']} / untraced {pr['untraced']}; " + "; ".join(
                f"{k.upper()} {pr[k]['median'] if pr[k]['median'] is None else round(pr[k]['median'], 2)} "
                f"[{_r(pr[k]['lo'])}, {_r(pr[k]['hi'])}] ms, upper {_r(pr[k]['pct_hi'], 1)} % (n={pr[k]['n']})"
                for k in ("ttft", "tpot")))
        print("\npdtrace's footprint per traced lab (CPU accounting, issue 18 item 2):")
        for c in traced:
            print(f"  {c}: {footprints[c] or 'untraced: no footprint'}")
        out["footprint"] = footprints
    print("\nvLLM's own per-request means inside each engine (ms; from its Prometheus histograms, all requests):")
    print(f"{'engine':<9}{'histogram':<32}" + "".join(f"{c:>10}" for c in conds))
    for role in ("prefill", "decode"):
        for h in VLLM_HISTOGRAMS:
            vals = [engines[c][role].get(h) for c in conds]
            if all(v is not None for v in vals):
                print(f"{role:<9}{h:<32}" + "".join(f"{v:>10.2f}" for v in vals))
    n_rounds = {c: sum(1 for row in rounds if c in row) for c in conds}
    out["cpu_ms_per_request"] = {c: {k: v / max(1, n_rounds[c] * a.requests) * 1e3 for k, v in cpu[c].items()}
                                 for c in cpu}
    print("\nCPU used during the replays, ms per request (user + system, each lab process with its "
          "descendants; pdtrace's sinks apart):")
    print(f"{'process':<12}" + "".join(f"{c:>10}" for c in conds))
    for k in sorted(set().union(*(cpu[c] for c in conds))):
        print(f"{k:<12}" + "".join(f"{out['cpu_ms_per_request'][c].get(k, 0.0):>10.2f}" for c in conds))
    print(f"{'total':<12}" + "".join(f"{sum(out['cpu_ms_per_request'][c].values()):>10.2f}" for c in conds))
    if a.self_cpu and traced:
        out["self_cpu"] = {}
        for c in traced:
            out["self_cpu"][c] = sc = self_cpu_share((a.out / c).resolve())
            print(f"\npdtrace's own CPU per engine step, {c} (thread CPU clock; goal <= 1 % of a decode step):")
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
    verdicts = []
    for c in versus:
        sfx = "" if c == "on" else f"_{c}"
        if n_rounds[c] < 4:  # a cluster bootstrap over 2-3 rounds cannot give an interval
            verdicts.append(f"{c}: not judged ({n_rounds[c]} rounds; at least 4 needed)")
            continue
        v = {k: "met" if out[f"{k}_p50{sfx}"]["by_round_ci95"][1] <= 1.05 else "missed" for k in ("ttft", "tpot")}
        verdicts.append(f"{c}: TTFT {v['ttft']}, TPOT {v['tpot']}")
    print(f"written {a.out / 'overhead.json'} (with every request's TTFT/TPOT); p50 goal: upper bound <= 1.05, "
          f"judged on the by-round interval: " + "; ".join(verdicts)
          + (" (off2 is untraced: a miss there is the noise floor itself)" if a.noise_floor else ""))


def _r(v, nd=2):
    return "-" if v is None else round(v, nd)


if __name__ == "__main__":
    main()
