"""Tracing overhead measured within one lab run: sampled (traced) vs unsampled requests, paired.

Usage (repo root, lab environment installed; each mode's lab run holds ``/tmp/pdtrace-heavy.lock``)::

    .venv/bin/python benchmarks/paired_overhead.py --out /tmp/paired            # pull and push, ~6 min each
    .venv/bin/python benchmarks/paired_overhead.py --reuse /tmp/paired          # re-analyse only

Why: the on/off A/B of two labs (``benchmarks/connector_overhead.py``) compares conditions minutes
apart on a shared 2-core machine whose load moves a round's TTFT by up to 2x; it cannot tell a 2 %
cost from a 20 % one. Here one lab runs the production recipe (``--connector stock``: vLLM's stock
serving command plus ``PDTRACE_DIR``, traced by pdtrace's plugin) with ``PDTRACE_SAMPLE=0.5`` in the
router and both engines (API servers, EngineCore and workers inherit it), so traced and untraced
requests interleave under the same conditions. A request is traced iff
sha256(X) < 0.5 * 2**256 (``pdtrace.instrument.ids.is_sampled``), X = the router's request id,
which the client gets back in the response's ``X-Request-Id`` header; so the client knows which of its
requests were traced, and the store is checked to agree (below).

Per lab run two phases, one after the other in the same lab (after one warm-up request and
``--warm-requests`` untimed requests of each phase's shape):

- ``isolated``: ``--iso-requests`` alike requests (``--prompt-tokens``, ``--output-tokens``) ``--gap-s``
  apart, so none overlaps: a request's TTFT noise then comes from the engines and the machine only,
  not from queueing behind other requests.
- ``trace``: the first ``--requests`` arrivals of the public Azure conversation trace (lengths x0.25)
  at its own rate x ``--rate-scale``: what a serving engine sees, with queueing.

Per phase and metric (client TTFT = first token received - sent; TPOT = (last - first token) /
(tokens - 1)), the cost of tracing a request = the paired-neighbour estimate of
:mod:`pdtrace.connector.lab.paired`: each traced request minus the median of its ``--k`` nearest
untraced neighbours on each side in arrival order whose prompt length is within x2**``--tol-log2``
(isolated: all equal); the median of these differences, with a 95 % moving-block bootstrap interval
(blocks of 2k consecutive pairs, 2000 resamples), printed in ms and as % of the untraced median
(the interval's % uses that median as a fixed base). Goal (issue 18): the upper bound <= 2 %.

Noise floor (the placebo): the untraced requests alone, split by a second hash
(sha256("placebo:X"), independent of the sampling rule), through the same estimator. Its interval
is what the method reports for no effect (about half the pairs of the real estimate, so somewhat
wider).

The placebo null: 200 placebo splits (salts ``placebo0`` ...) of all requests (each half about as
traced as the other, so the effect cancels; as many pairs as the real estimate) and of the untraced
ones, through the same estimator: 95 % of their medians lie in the printed range. Under bursty load
neighbours share bursts and the bootstrap interval is too narrow (a single placebo's interval can
exclude 0); the cost interval by test inversion (estimate minus the null's 97.5 / 2.5 % points, a
constant shift assumed; Imbens & Rubin 2015, ch. 5) does not rely on independent pairs. The goal is
also judged on the wider of the two upper bounds.

What the paired figure measures, and what not: the cost that comes with recording *one request*
(its spans in the router, the API-server middleware, the scheduler and worker hooks, the sink's work
on its records, as far as any of it delays that request). Costs that every request pays alike, traced
or not, cancel: the traced code paths' bookkeeping for every request, the per-step spans
(``PDTRACE_STEP_SAMPLE``, default every step: a step span lists every request of its batch,
untraced ones too), the writer thread and the sink processes. Work for a traced request that slows
its untraced neighbours also cancels partly. So it is a lower bound of the whole cost; the A/B
(``connector_overhead.py``, with ``--noise-floor`` and ``--samples``) covers the rest, at its
resolution.

Checked in the store of each run and printed: every traced process's ``recorder.sample``
(router, both API servers, EngineCore and worker processes), that each traced request has rows from
the router, prefill and decode and each untraced one none, and what is still recorded that names an
untraced request (step spans listing it in ``step.batch``).

Written: ``<out>/paired.json`` (every figure) and per mode ``<out>/<mode>/client-<phase>/requests.parquet``
(what the client saw), ``<out>/<mode>/trace/`` (the span store), ``<out>/<mode>/meta.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (also when loaded by a test)
from inject_attribution import heavy_lock, isolated_workload  # noqa: E402

from pdtrace.connector.lab import paired  # noqa: E402
from pdtrace.instrument import ids  # noqa: E402
from pdtrace.instrument.stages import ROLES  # noqa: E402

PHASES = ("isolated", "trace")
METRICS = ("ttft_ms", "tpot_ms")
GOAL_PCT = 2.0  # issue 18: upper 95 % bound of the paired TTFT and TPOT cost, % of the untraced median


def run_mode(mode: str, out: Path, sample: float, iso_requests: int, gap_s: float, prompt_tokens: int,
             output_tokens: int, requests: int, rate_scale: float, connector: str = "stock",
             lock: bool = True, warm_requests: int = 8) -> Path:
    """One lab (real engines, ``mode`` pull|push) with PDTRACE_SAMPLE=``sample`` everywhere; both phases
    replayed; returns ``out/<mode>``. Holds :data:`inject_attribution.LOCK` while engines run unless
    ``lock`` is False. Raises FileExistsError for a non-empty ``out/<mode>``."""
    from pdtrace.connector.data import AZURE_CONV
    from pdtrace.connector.lab import replay, workload
    from pdtrace.connector.lab.launcher import Lab, LabConfig
    from pdtrace.connector.lab.model import make_model, model_info
    from pdtrace.connector.lab.run import TRACED, _warmup

    d = (out / mode).resolve()
    if d.exists() and any(d.iterdir()):
        raise FileExistsError(f"{d} is not empty")
    d.mkdir(parents=True, exist_ok=True)
    model = make_model("default")
    vocab = model_info(model)["vocab_size"]
    iso = isolated_workload(d / "isolated.jsonl", iso_requests, gap_s, prompt_tokens, output_tokens)
    wls = {"isolated": workload.build("isolated", iso, vocab_size=vocab, length_scale=1.0, rate_scale=1.0,
                                      max_requests=iso_requests, max_model_len=8192),
           "trace": workload.build("azure-conv", AZURE_CONV, vocab_size=vocab, length_scale=0.25,
                                   rate_scale=rate_scale, max_requests=requests, max_model_len=8192)}
    env = {"PDTRACE_SAMPLE": repr(float(sample))}
    cfg = LabConfig(model=model, mode=mode, run_dir=d, trace_dir=d / "trace",
                    role_env={r: dict(env) for r in ROLES})
    if connector == "traced":
        cfg.connector_class, cfg.connector_module = TRACED[mode], "pdtrace.connector.traced"
        cfg.extra_args = ["--middleware", "pdtrace.connector.traced.middleware.FrontendMiddleware"]
    meta = {"mode": mode, "sample": sample, "connector": connector, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg_start": os.getloadavg(), "phases": {}}
    t0 = time.monotonic()
    with (heavy_lock() if lock else contextlib.nullcontext()):
        meta["lock_wait_s"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        with Lab(cfg) as lab:
            meta["lab_start_s"] = round(time.monotonic() - t0, 1)
            print(f"[{mode}] lab up in {meta['lab_start_s']} s (lock wait {meta['lock_wait_s']} s)", flush=True)
            _warmup(lab.router_url, vocab, 1)
            # untimed: the first requests of each shape pay one-off costs (kernel selection, allocations)
            for name in PHASES:
                w = wls[name]
                warm = workload.Workload(f"warm-{name}", "-", "synthetic", 1.0, 1.0, 0, w.requests[:warm_requests],
                                         min(warm_requests, len(w.requests)), False)
                asyncio.run(replay.replay(warm, lab.router_url, timeout_s=300, progress=False))
            for name in PHASES:
                t = time.monotonic()
                recs = asyncio.run(replay.replay(wls[name], lab.router_url, timeout_s=300, progress=False))
                replay.write_records(recs, d / f"client-{name}", f"{d.name}-{name}")
                meta["phases"][name] = {"requests": len(recs), "wall_s": round(time.monotonic() - t, 1),
                                        "ok": sum(r.ok for r in recs)}
                print(f"[{mode}] {name}: {len(recs)} requests in {meta['phases'][name]['wall_s']} s", flush=True)
            meta["rss_mib"] = _lab_rss_mib(lab)
    meta["total_s"] = round(time.monotonic() - t0, 1)
    meta["loadavg_end"] = os.getloadavg()
    (d / "meta.json").write_text(json.dumps(meta, indent=2))
    return d


def _lab_rss_mib(lab) -> float | None:
    """Total RSS (MiB) of the lab's process trees (engines, router, sinks), psutil; None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    tot = 0
    for pid in lab.pids().values():
        try:
            root = psutil.Process(pid)
            for p in [root] + root.children(recursive=True):
                tot += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return round(tot / 2**20, 1)


def client_rows(path: Path, sample: float) -> list[dict]:
    """The client records of one phase in send order, each with ``x`` (the router's request id),
    ``traced`` (the sampling rule applied to x; None when the router sent no id), ``ok``,
    ``prompt_tokens``, ``ttft_ms``, ``tpot_ms`` (None when not ok / fewer than 2 tokens)."""
    import pyarrow.parquet as pq

    t = pq.read_table(path).to_pylist()
    rows = []
    for r in sorted(t, key=lambda r: r["send_ns"]):
        ok = r["status"] == "ok" and r["first_token_ns"] is not None
        tt = r["token_times_ns"] or []
        x = r["router_request_id"] or None
        rows.append({"x": x, "traced": ids.is_sampled(x, sample) if x else None, "ok": ok,
                     "prompt_tokens": r["prompt_tokens"],
                     "ttft_ms": (r["first_token_ns"] - r["send_ns"]) / 1e6 if ok else None,
                     "tpot_ms": (tt[-1] - tt[0]) / 1e6 / (len(tt) - 1) if ok and len(tt) > 1 else None})
    return rows


def estimate(rows: list[dict], metric: str, k: int = 2, tol_log2: float | None = 0.5, n_boot: int = 2000,
             placebo: bool = False, seed: int = 0) -> paired.PairedEstimate:
    """Paired cost of tracing on ``metric`` over ``rows`` (:func:`client_rows`, send order).

    ``placebo``: the untraced rows only, "treated" = :func:`paired.placebo_flags` of their ids (the
    method's noise floor). Rows without an id are left out.
    """
    rows = [r for r in rows if r["traced"] is not None]
    if placebo:
        rows = [r for r in rows if not r["traced"]]
        flags = paired.placebo_flags([r["x"] for r in rows])
    else:
        flags = [r["traced"] for r in rows]
    match = paired.length_match([r["prompt_tokens"] for r in rows], tol_log2)
    return paired.paired_estimate(flags, [r[metric] for r in rows], k=k, match=match, block=2 * k,
                                  n_boot=n_boot, seed=seed)


def null_spread(rows: list[dict], metric: str, k: int = 2, tol_log2: float | None = 0.5, n_splits: int = 200,
                untraced_only: bool = False) -> dict:
    """The estimator under ``n_splits`` placebo splits (salts ``placebo0``, ``placebo1``, ...): over all
    requests with an id (each half then holds about as many traced requests as the other, so the
    effect cancels; the same number of pairs as the real estimate), or over the untraced ones only.
    Returns {"n", "q025", "q975", "medians"} (ms)."""
    rows = [r for r in rows if r["traced"] is not None and (not untraced_only or not r["traced"])]
    xs = [r["x"] for r in rows]
    match = paired.length_match([r["prompt_tokens"] for r in rows], tol_log2)
    meds = paired.null_medians([r[metric] for r in rows], [paired.placebo_flags(xs, f"placebo{i}")
                                                          for i in range(n_splits)], k=k, match=match)
    return {"n": len(meds), "q025": paired.quantile(meds, 0.025), "q975": paired.quantile(meds, 0.975),
            "medians": meds}


def sampling_check(trace_dir: Path, rows: list[dict]) -> dict:
    """What the store of a run says about sampling, against the rule the client applied.

    Returns ``processes``: [{role, pid, sample}] (``recorder.sample`` of every process that wrote);
    ``traced_missing``: traced requests lacking rows from one of router / prefill / decode
    ({role: count}); ``untraced_with_rows``: untraced requests with any row carrying their id, and
    ``untraced_row_names``: {name: rows}; ``untraced_in_step_batch``: untraced requests listed in at
    least one step span's ``step.batch``, and ``step_spans_listing_untraced``: such step spans.
    """
    import duckdb

    from pdtrace.instrument import store

    files = [str(f) for f in store.store_files(trace_dir)]
    con = duckdb.connect()
    con.read_parquet(files, union_by_name=True).create_view("r")
    procs = [{"role": r, "pid": p, "sample": s} for r, p, s in con.execute(
        "SELECT role, pid, max(attr_float['recorder.sample']) FROM r WHERE record = 'stats' "
        "GROUP BY ALL ORDER BY role, pid").fetchall()]
    by_req: dict[str, dict[str, int]] = {}
    names: dict[str, dict[str, int]] = {}
    for rid, role, name, n in con.execute(
            "SELECT request_id, role, name, count(*) FROM r WHERE request_id IS NOT NULL AND record IN "
            "('span', 'event') GROUP BY ALL").fetchall():
        by_req.setdefault(rid, {})[role] = by_req.get(rid, {}).get(role, 0) + n
        names.setdefault(rid, {})[name] = names.get(rid, {}).get(name, 0) + n
    listed: dict[str, int] = {}
    for (batch,) in con.execute("SELECT attr_str['step.batch'] FROM r WHERE record = 'span' AND "
                                "name IN ('prefill.step', 'decode.step') AND attr_str['step.batch'] IS NOT NULL"
                                ).fetchall():
        for part in batch.split(";"):
            x = part.rsplit(":", 1)[0]
            listed[x] = listed.get(x, 0) + 1
    con.close()
    known = [r for r in rows if r["traced"] is not None]
    missing = {role: sum(1 for r in known if r["traced"] and role not in by_req.get(r["x"], {}))
               for role in ROLES}
    untr = [r["x"] for r in known if not r["traced"]]
    row_names: dict[str, int] = {}
    for x in untr:
        for nm, n in names.get(x, {}).items():
            row_names[nm] = row_names.get(nm, 0) + n
    return {"processes": procs, "traced": sum(1 for r in known if r["traced"]), "untraced": len(untr),
            "traced_missing": missing, "untraced_with_rows": sum(1 for x in untr if x in by_req),
            "untraced_row_names": row_names, "untraced_in_step_batch": sum(1 for x in untr if x in listed),
            "step_spans_listing_untraced": sum(listed.get(x, 0) for x in untr)}


def _f(v, nd=2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def analyse(d: Path, sample: float, k: int, tol_log2: float | None) -> dict:
    """Every figure of one mode's run directory (see the module docstring); printed as it goes."""
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    res = {"mode": d.name, "meta": meta, "phases": {}}
    all_rows = []
    for ph in PHASES:
        p = d / f"client-{ph}" / "requests.parquet"
        if not p.exists():
            continue
        rows = client_rows(p, sample)
        all_rows += rows
        traced = [r for r in rows if r["traced"]]
        untr = [r for r in rows if r["traced"] is False]
        out = {"requests": len(rows), "traced": len(traced), "untraced": len(untr),
               "failed_traced": sum(1 for r in traced if not r["ok"]),
               "failed_untraced": sum(1 for r in untr if not r["ok"]), "no_id": sum(r["traced"] is None for r in rows),
               "wall_s": meta.get("phases", {}).get(ph, {}).get("wall_s")}
        print(f"\n[{d.name}] phase {ph}: {len(rows)} requests ({out['wall_s']} s), traced {len(traced)} / untraced "
              f"{len(untr)}; failed traced {out['failed_traced']} untraced {out['failed_untraced']}")
        print(f"  {'metric':<6}{'untraced p50':>13}{'traced p50':>11}   {'cost ms [95% CI]':<26}"
              f"{'cost % [95% CI]':<26}{'upper %':>8}  goal<=2%  {'mean ms':>8}  pairs/unmatched   "
              f"placebo ms [95% CI] (% ; pairs)")
        for m in METRICS:
            e = estimate(rows, m, k, tol_log2)
            pl = estimate(rows, m, k, tol_log2, placebo=True)
            tp = [r[m] for r in traced if r[m] is not None]
            hi_pct = e.pct(e.hi)
            goal = None if hi_pct is None else hi_pct <= GOAL_PCT
            nul = null_spread(rows, m, k, tol_log2)
            nul_u = null_spread(rows, m, k, tol_log2, untraced_only=True)
            # interval by test inversion under a constant shift: estimate minus the null's 97.5 / 2.5 % points
            inv = ((e.median - nul["q975"], e.median - nul["q025"]) if e.median is not None and nul["n"]
                   else (None, None))
            inv_hi_pct = e.pct(inv[1])
            goal_both = None if hi_pct is None or inv_hi_pct is None else max(hi_pct, inv_hi_pct) <= GOAL_PCT
            out[m] = {"cost": e.__dict__, "cost_pct": [e.pct(e.median), e.pct(e.lo), e.pct(e.hi)],
                      "traced_median": statistics.median(tp) if tp else None, "goal_met": goal,
                      "placebo": pl.__dict__, "placebo_pct": [pl.pct(pl.median), pl.pct(pl.lo), pl.pct(pl.hi)],
                      "null_all": {k2: v for k2, v in nul.items() if k2 != "medians"},
                      "null_untraced": {k2: v for k2, v in nul_u.items() if k2 != "medians"},
                      "inverted_ci": list(inv), "inverted_ci_pct": [e.pct(inv[0]), inv_hi_pct],
                      "goal_met_both": goal_both}
            print(f"  {m[:4].upper():<6}{_f(e.control_median):>13}{_f(out[m]['traced_median']):>11}   "
                  f"{_f(e.median)} [{_f(e.lo)}, {_f(e.hi)}]".ljust(26 + 33)
                  + f"{_f(e.pct(e.median), 1)} [{_f(e.pct(e.lo), 1)}, {_f(e.pct(e.hi), 1)}]".ljust(26)
                  + f"{_f(hi_pct, 1):>8}  {'-' if goal is None else ('met' if goal else 'MISSED'):<8}  "
                    f"{_f(e.mean):>8}  {e.n}/{e.unmatched}".ljust(20)
                  + f"   {_f(pl.median)} [{_f(pl.lo)}, {_f(pl.hi)}] ({_f(pl.pct(pl.lo), 1)}..{_f(pl.pct(pl.hi), 1)} %; {pl.n})")
        print(f"  placebo null, {nul['n']} splits by other hashes (the estimator when no split carries an effect):")
        for m in METRICS:
            o = out[m]
            print(f"  {m[:4].upper():<6}all requests: 95 % of placebo medians in [{_f(o['null_all']['q025'])}, "
                  f"{_f(o['null_all']['q975'])}] ms; untraced only: [{_f(o['null_untraced']['q025'])}, "
                  f"{_f(o['null_untraced']['q975'])}] ms; cost interval by inversion [{_f(o['inverted_ci'][0])}, "
                  f"{_f(o['inverted_ci'][1])}] ms = [{_f(o['inverted_ci_pct'][0], 1)}, {_f(o['inverted_ci_pct'][1], 1)}] %"
                  f"; goal on the wider of both upper bounds: "
                  f"{'-' if o['goal_met_both'] is None else ('met' if o['goal_met_both'] else 'MISSED')}")
        res["phases"][ph] = out
    tr = d / "trace"
    if tr.exists():
        c = sampling_check(tr, all_rows)
        res["sampling_check"] = c
        samples = sorted({p["sample"] for p in c["processes"]}, key=lambda v: (v is None, v))
        print(f"\n[{d.name}] store check: {len(c['processes'])} processes wrote, recorder.sample values {samples} "
              f"({', '.join(sorted({str(p['role']) for p in c['processes']}))}); traced requests lacking rows of "
              f"router/prefill/decode: {c['traced_missing']}; untraced requests with rows of their own: "
              f"{c['untraced_with_rows']} of {c['untraced']} {c['untraced_row_names'] or ''}; untraced requests "
              f"listed in step spans' step.batch: {c['untraced_in_step_batch']} ({c['step_spans_listing_untraced']} "
              "step spans)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="new directory for the runs (<out>/pull, <out>/push)")
    ap.add_argument("--reuse", type=Path, help="analyse the runs already in this directory; start nothing")
    ap.add_argument("--modes", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    ap.add_argument("--sample", type=float, default=0.5, help="PDTRACE_SAMPLE of the run (0 < p < 1)")
    ap.add_argument("--connector", default="stock", choices=["stock", "traced"])
    ap.add_argument("--iso-requests", type=int, default=150)
    ap.add_argument("--gap-s", type=float, default=0.8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200, help="arrivals of the public trace (phase 'trace')")
    ap.add_argument("--rate-scale", type=float, default=0.5)
    ap.add_argument("--warm-requests", type=int, default=8,
                    help="untimed requests of each phase's shape replayed first (not counted)")
    ap.add_argument("--k", type=int, default=2, help="untraced neighbours per side")
    ap.add_argument("--tol-log2", type=float, default=0.5,
                    help="prompt-length match: |log2(len_i/len_j)| <= this; negative: no length matching")
    ap.add_argument("--no-lock", action="store_true", help="do not take the heavy lock (already under flock)")
    ap.add_argument("--json", type=Path, help="where to write the figures (default <out>/paired.json)")
    a = ap.parse_args(argv)
    if not a.reuse and not a.out:
        ap.error("give --out (run the lab) or --reuse (analyse existing runs)")
    if not 0.0 < a.sample < 1.0:
        ap.error("--sample must be strictly between 0 and 1: at 0 every request is untraced, at 1 every request "
                 "traced, and the paired cost is undefined")
    base = a.reuse or a.out
    tol = a.tol_log2 if a.tol_log2 >= 0 else None
    results = []
    for mode in a.modes:
        if not a.reuse:
            run_mode(mode, base, a.sample, a.iso_requests, a.gap_s, a.prompt_tokens, a.output_tokens, a.requests,
                     a.rate_scale, a.connector, lock=not a.no_lock, warm_requests=a.warm_requests)
        results.append(analyse((base / mode).resolve(), a.sample, a.k, tol))
    print(f"\ncost = median over traced requests of (request - median of its {a.k} nearest untraced neighbours "
          f"per side in arrival order, prompt length within x{2 ** tol if tol is not None else float('inf'):.2f}); "
          f"95 % moving-block bootstrap (blocks of {2 * a.k} pairs); % of the untraced median; placebo = untraced "
          "requests split by a second hash (the method's noise floor). Per-step spans, writer and sinks are paid "
          "by traced and untraced requests alike and cancel here: see connector_overhead.py for the A/B.")
    path = a.json or base / "paired.json"
    path.write_text(json.dumps({"sample": a.sample, "k": a.k, "tol_log2": tol, "results": results}, indent=2,
                               default=str))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
