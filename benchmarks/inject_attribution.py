"""Proof by intervention: inject known delays into DESIGN.md §2 stages and check pdtrace's attribution.

Runs the lab (pdtrace's traced connectors and router, real vLLM CPU engines, NIXL on loopback)
once per mode with ``PDTRACE_LAB_INJECT`` (see :mod:`pdtrace.connector.lab.inject`): every listed
stage is injected into about half of the requests, chosen independently per stage by a hash of
the request id (a factorial design), so injected and uninjected requests are interleaved under
the same load in the same run. Which request got which delay is read back from the store (event
``lab.inject``) and checked against the hash rule.

Per stage and mode, over the complete replayed requests (the warm-up excluded):

- ``attributed``: increase of the stage's exposed time (``ttft_segments``, summed per request by
  ``stage_group``) in injected requests; ``ttft``: increase of TTFT (``requests.ttft_ms``);
  ``hidden``: increase of the stage's hidden time (``ttft_hidden``). For ``ttft`` the controls are
  also matched on the other stages' injections (:func:`same_other_injections`): a TTFT carries every
  injected delay, an exposed or hidden stage time only its own. Matched controls are the nearest with
  that pattern, further away in arrival order than the two before and after (with 4-5 stages, one
  request in 8-16 has a given pattern): drifts over that span are not cancelled, which the isolated
  mode (no queueing, a quiet replay) keeps small.
- Each increase is a paired-neighbour estimate: every injected request is compared with the median
  of its nearest uninjected neighbours in arrival order (two before, two after), so slow drifts
  of the noisy 2-core machine cancel; the median of the pairs, 95 % CI by bootstrap over the
  pairs (2000 resamples). A neighbour whose spans of the stage overlap another request's injected
  interval of that stage is no control for it: the delays sleep in serial threads (D's forward
  thread, the push writer threads), so such a neighbour waited behind the delay too. An injected
  request in that position stays treated: its increase may include a neighbour's delay (upward bias
  under overlap).
- ``--isolated``: instead of the public trace, alike requests (``--prompt-tokens``, 16 output
  tokens) ``--gap-s`` apart, so no two overlap; the TTFT of neighbours then differs by a few ms,
  not by the hundreds of ms the public trace's queueing adds, and the TTFT increase is measurable.
- ``interval→stage``: median over injected requests of the share of the injected interval
  itself ([the ``lab.inject`` event, + the delay], same host clock) that ``ttft_segments`` charges
  to the stage; when below 90 %, the stage that got most of the rest. Unlike the Δ columns this
  needs no control group, so load noise does not enter it (the sleep may outlast the interval by
  a poll or a scheduler tick; kv.ready's release waits for the next poll).
- ``path``: ``on`` when the attributed increase is at least half the injected delay, else
  ``off``. ``attributed ok``: on the path |attributed - injected| within the tolerance; off the
  path |attributed| within it and hidden grew by at least half the delay. ``TTFT ok``: |TTFT
  increase - injected| (on) or |TTFT increase| (off) within the tolerance.
  Tolerance: max(``--tol-ms``, ``--tol-frac`` x injected) (default 8 ms or 25 %).

Usage (about 3-4 min per mode; each lab run holds ``/tmp/pdtrace-heavy.lock``)::

    .venv/bin/python benchmarks/inject_attribution.py --out /tmp/inject-bench
    .venv/bin/python benchmarks/inject_attribution.py --out /tmp/inject-iso --isolated --max-requests 40
    .venv/bin/python benchmarks/inject_attribution.py --reuse /tmp/inject-bench   # re-analyse only

Other stages (``prefill.queue``, ``prefill.compute``, ``kv.transfer``, ``decode.queue``,
``decode.first_step``, ...) have no hook that lengthens them alone; see the module docstring of
:mod:`pdtrace.connector.lab.inject`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import statistics
import sys
from pathlib import Path

LOCK = "/tmp/pdtrace-heavy.lock"
DEFAULT_SPECS = {
    "pull": "router.dispatch=30ms,prefill.frontend=30ms,handoff.prep=40ms,kv.ready=25ms",
    "push": "router.dispatch=30ms,prefill.frontend=30ms,handoff.prep=40ms,kv.ready=25ms,dest.register=15ms",
}


@contextlib.contextmanager
def heavy_lock(path: str = LOCK):
    """Hold the machine-wide lock for engine runs (the same file ``flock`` uses)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def isolated_workload(path: Path, n: int, gap_s: float, prompt_tokens: int, output_tokens: int) -> Path:
    """Write a Mooncake-format trace of ``n`` alike requests ``gap_s`` apart (no hash_ids: every
    prompt its own random tokens, no prefix hit). With a gap longer than a request's TTFT + decode,
    no two requests overlap: TTFT varies little between neighbours, so a paired TTFT increase is
    measurable (the replayed public trace's queueing spreads TTFT by hundreds of ms)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"timestamp": round(i * gap_s * 1000), "input_length": prompt_tokens,
                                "output_length": output_tokens}) + "\n")
    return path


def run_mode(mode: str, spec: str, out: Path, max_requests: int, length_scale: float | None,
             rate_scale: float, lock: bool = True, workload_file: Path | None = None) -> Path:
    """One lab run with ``spec`` injected; returns its directory. ``lock``: hold :data:`LOCK` while the
    engines run (False when the caller already runs under ``flock``, e.g. the lab test);
    ``workload_file``: replay this trace instead of the Azure conversation trace."""
    from pdtrace.connector.lab.run import LabOptions, run_lab

    d = out / mode
    o = LabOptions(mode=mode, max_requests=max_requests, out=d, connector="traced", progress=False,
                   inject=spec, length_scale=length_scale, rate_scale=rate_scale, report=False,
                   workload_file=workload_file)
    with (heavy_lock() if lock else contextlib.nullcontext()):
        run_lab(o, echo=lambda *a, **k: print(*a, file=sys.stderr, **k))
    return d


def _group(stage: str) -> str:
    return "handoff.prep" if stage.startswith("handoff.") else stage


def per_request(run_dir: Path) -> tuple[list[dict], dict[str, float]]:
    """Complete replayed requests in arrival order: ttft_ms, exposed/hidden ms per stage group,
    injected stages (from ``lab.inject`` events); and the run's spec (ms per stage)."""
    from pdtrace import analysis
    from pdtrace.connector.lab import inject

    spec = inject.parse(json.loads((run_dir / "run.json").read_text()).get("inject") or "")
    with analysis.open(run_dir, cache=run_dir.parent / (run_dir.name + ".duckdb")) as tr:
        reqs = tr.query("""
            SELECT q.request_id, q.ttft_ms, q.arrival_ns
            FROM requests q
            LEFT JOIN spans r ON r.request_id = q.request_id AND r.stage = 'router.request'
            WHERE q.ttft_ms IS NOT NULL AND q.status = 'complete' AND NOT coalesce(q.first_contact, false)
              AND coalesce(r.attr_str['request.client_id'], '') NOT LIKE 'pdtrace-lab-warmup%'
            ORDER BY q.arrival_ns""")
        segs = tr.query("""SELECT request_id, stage, stage_group, sum(dur_ns) / 1e6 AS ms
                           FROM ttft_segments GROUP BY ALL""")
        hid = tr.query("SELECT request_id, stage, sum(hidden_ms) AS ms FROM ttft_hidden GROUP BY ALL")
        evs = tr.query("""SELECT request_id, attr_str['lab.stage'] AS stage,
                                 max(attr_float['lab.injected_ms']) AS ms, count(*) AS n
                          FROM events WHERE event = 'lab.inject' GROUP BY ALL""")
        # which exposed segments cover each injected interval [event, event + delay] (same host clock)
        cover = tr.query("""
            WITH e AS (SELECT request_id, attr_str['lab.stage'] AS stage, time_ns AS t0,
                              time_ns + CAST(attr_float['lab.injected_ms'] * 1e6 AS BIGINT) AS t1
                       FROM events WHERE event = 'lab.inject')
            SELECT e.request_id, e.stage, coalesce(s.stage_group, s.stage) AS seg_stage,
                   sum(greatest(0, least(e.t1, s.end_ns) - greatest(e.t0, s.start_ns))) / 1e6 AS ms
            FROM e JOIN ttft_segments s ON s.request_id = e.request_id
            WHERE s.end_ns > e.t0 AND s.start_ns < e.t1
            GROUP BY ALL""")
        # each request's extent per stage group (its spans' first start .. last end), for contamination
        extent = tr.query("""
            SELECT request_id, stage, min(start_ns) AS t0, max(end_ns) AS t1
            FROM spans WHERE request_id IS NOT NULL GROUP BY ALL""")
        intervals = tr.query("""
            SELECT request_id, attr_str['lab.stage'] AS stage, time_ns AS t0,
                   time_ns + CAST(attr_float['lab.injected_ms'] * 1e6 AS BIGINT) AS t1
            FROM events WHERE event = 'lab.inject'""")
    rows = {r["request_id"]: {**r, "exposed": {}, "hidden": {}, "injected": {}, "cover": {}, "contaminated": set()}
            for r in reqs}
    # an uninjected request whose stage ran while another request's injected delay of that stage ran
    # waited behind it (the delay sits in a serial thread: D's forward thread, a writer thread), so it
    # is no control for that stage
    by_stage: dict[str, list[tuple[str, int, int]]] = {}
    for iv in intervals:
        by_stage.setdefault(iv["stage"], []).append((iv["request_id"], iv["t0"], iv["t1"]))
    for x in extent:
        r = rows.get(x["request_id"])
        if r is None:
            continue
        g = _group(x["stage"])
        for other, t0, t1 in by_stage.get(g, ()):
            if other != x["request_id"] and x["t0"] < t1 and t0 < x["t1"]:
                r["contaminated"].add(g)
    for s in segs:
        if s["request_id"] in rows:
            g = s["stage_group"] or _group(s["stage"])
            e = rows[s["request_id"]]["exposed"]
            e[g] = e.get(g, 0.0) + s["ms"]
    for h in hid:
        if h["request_id"] in rows:
            e = rows[h["request_id"]]["hidden"]
            g = _group(h["stage"])
            e[g] = e.get(g, 0.0) + h["ms"]
    for ev in evs:
        if ev["request_id"] in rows:
            rows[ev["request_id"]]["injected"][ev["stage"]] = ev["ms"]
    for c in cover:
        if c["request_id"] in rows:
            d = rows[c["request_id"]]["cover"].setdefault(c["stage"], {})
            d[_group(c["seg_stage"])] = d.get(_group(c["seg_stage"]), 0.0) + c["ms"]
    out = list(rows.values())
    for r in out:
        # the record must agree with the rule (a hook that never fired shows here)
        r["rule"] = {s for s in spec if inject.selected(s, r["request_id"])}
    return out, spec


def same_other_injections(rows: list[dict], stage: str):
    """``match(i, j)`` for :func:`paired_delta`: true iff rows i and j got the same injections of every
    stage other than ``stage``. The stages are injected independently (a factorial design), so an
    unmatched control differs from its treated request by the other stages' delays too: unbiased on
    average, but each other stage of d ms injected into half the requests adds d/2 ms of standard
    deviation to a TTFT difference (4 stages of 25-40 ms: ~30 ms, as much as the delay measured)."""
    others = [frozenset(r["injected"]) - {stage} for r in rows]
    return lambda i, j: others[i] == others[j]


def paired_delta(rows: list[dict], stage: str, value, seed: int = 0, n_boot: int = 2000, k: int = 2,
                 match=None):
    """Paired-neighbour increase of ``value(row)`` in rows injected with ``stage``: (median, lo, hi, n).

    Each injected request's control is the median of its ``k`` nearest uninjected neighbours on
    each side in arrival order, leaving out those contaminated by the injection (their own spans of
    the stage overlap another request's injected interval of it: they queued behind the delay in the
    same serial thread); the median of the paired differences and its bootstrap CI
    (:func:`pdtrace.connector.lab.paired.paired_estimate`, single pairs resampled): on the shared
    2-core machine a few requests meet load spikes of hundreds of ms, which would swamp a mean of
    ten pairs."""
    from pdtrace.connector.lab import paired

    # an uninjected request contaminated by a neighbour's injection of this stage is neither treated
    # nor control (value None)
    e = paired.paired_estimate([stage in r["injected"] for r in rows],
                               [None if stage not in r["injected"] and stage in r.get("contaminated", ())
                                else value(r) for r in rows], k=k, match=match, n_boot=n_boot, seed=seed)
    return e.median, e.lo, e.hi, e.n


def evaluate(rows: list[dict], spec: dict[str, float], mode: str, tol_ms: float = 8.0,
             tol_frac: float = 0.25) -> list[dict]:
    """One result row per injected stage (see the module docstring for the columns and the verdict)."""
    res = []
    for stage, inj in spec.items():
        a = paired_delta(rows, stage, lambda r: r["exposed"].get(stage, 0.0))
        # TTFT carries every stage's delay: controls with the same other injections (same_other_injections)
        t = paired_delta(rows, stage, lambda r: r["ttft_ms"], match=same_other_injections(rows, stage))
        h = paired_delta(rows, stage, lambda r: r["hidden"].get(stage, 0.0))
        # exposed + hidden: the stage's whole length, whichever path each request took
        w = paired_delta(rows, stage, lambda r: r["exposed"].get(stage, 0.0) + r["hidden"].get(stage, 0.0))
        tol = max(tol_ms, tol_frac * inj)
        # the injected interval itself: share charged to the stage, and the stage most charged otherwise
        cov = [r.get("cover", {}).get(stage, {}) for r in rows if stage in r["injected"]]
        shares = [c.get(stage, 0.0) / inj for c in cov] if inj else []
        others: dict[str, float] = {}
        for c in cov:
            for g, ms in c.items():
                if g != stage:
                    others[g] = others.get(g, 0.0) + ms
        row = {"mode": mode, "stage": stage, "injected_ms": inj, "n_injected": a[3],
               "n_requests": len(rows), "attributed_ms": a[0], "attributed_ci": (a[1], a[2]),
               "ttft_ms": t[0], "ttft_ci": (t[1], t[2]), "hidden_ms": h[0], "tol_ms": tol,
               "total_ms": w[0], "total_ci": (w[1], w[2]),
               "interval_share": statistics.median(shares) if shares else None,
               "interval_else": max(others, key=others.get) if others else None,
               "record_mismatch": sum(1 for r in rows if (stage in r["injected"]) != (stage in r["rule"]))}
        if a[0] is None:
            row.update(path="?", error_ms=None, error_pct=None, ok=False, attributed_ok=False, ttft_ok=False)
        else:
            on = a[0] >= inj / 2
            row["path"] = "on" if on else "off"
            # (no TTFT estimate -- no control with the same other injections -- is not ok)
            if on:
                row["error_ms"] = a[0] - inj
                row["attributed_ok"] = abs(a[0] - inj) <= tol
                row["ttft_ok"] = t[0] is not None and abs(t[0] - inj) <= tol
            else:
                row["error_ms"] = a[0]  # off the path the stage's exposed time should not move
                row["attributed_ok"] = abs(a[0]) <= tol and (h[0] or 0.0) >= inj / 2
                row["ttft_ok"] = t[0] is not None and abs(t[0]) <= tol
            row["ok"] = row["attributed_ok"] and row["ttft_ok"]
            row["error_pct"] = 100.0 * row["error_ms"] / inj if inj else None
        res.append(row)
    return res


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def table(results: list[dict], markdown: bool = False) -> str:
    head = ["stage", "mode", "injected ms", "n inj/all", "attributed Δ ms [95% CI]", "TTFT Δ ms [95% CI]",
            "hidden Δ ms", "interval→stage %", "error ms", "error %", "path", "attributed ok", "TTFT ok"]
    lines = []
    for r in results:
        lines.append([r["stage"], r["mode"], _f(r["injected_ms"], 0), f"{r['n_injected']}/{r['n_requests']}",
                      f"{_f(r['attributed_ms'])} [{_f(r['attributed_ci'][0])}, {_f(r['attributed_ci'][1])}]",
                      f"{_f(r['ttft_ms'])} [{_f(r['ttft_ci'][0])}, {_f(r['ttft_ci'][1])}]",
                      _f(r["hidden_ms"]),
                      (_f(None if r["interval_share"] is None else 100 * r["interval_share"], 0)
                       + (f" (else {r['interval_else']})" if r["interval_else"] and (r["interval_share"] or 0) < 0.9
                          else "")),
                      _f(r["error_ms"]), _f(r["error_pct"], 0), r["path"],
                      ("yes" if r["attributed_ok"] else "NO") + (f" (record≠rule {r['record_mismatch']})"
                                                                 if r["record_mismatch"] else ""),
                      "yes" if r["ttft_ok"] else "NO"])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    w = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % n for n in w)
    return "\n".join([fmt.format(*head)] + [fmt.format(*x) for x in lines])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="new directory for the runs (<out>/pull, <out>/push)")
    ap.add_argument("--reuse", type=Path, help="analyse the runs already in this directory; start nothing")
    ap.add_argument("--modes", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    ap.add_argument("--inject-pull", default=DEFAULT_SPECS["pull"])
    ap.add_argument("--inject-push", default=DEFAULT_SPECS["push"])
    ap.add_argument("--max-requests", type=int, default=40)
    ap.add_argument("--length-scale", type=float, default=None)
    ap.add_argument("--rate-scale", type=float, default=0.5, help="lower = fewer overlapping requests")
    ap.add_argument("--isolated", action="store_true",
                    help="replay --max-requests alike requests --gap-s apart (no overlap) instead of the "
                         "Azure trace: the TTFT increase becomes measurable")
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tol-ms", type=float, default=8.0)
    ap.add_argument("--tol-frac", type=float, default=0.25)
    ap.add_argument("--no-lock", action="store_true", help=f"do not take {LOCK} (already run under flock)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the result rows here")
    a = ap.parse_args(argv)
    if not a.reuse and not a.out:
        ap.error("give --out (run the lab) or --reuse (analyse existing runs)")
    base = a.reuse or a.out
    wl = None
    if a.isolated and not a.reuse:
        wl = isolated_workload(base / "isolated.jsonl", a.max_requests, a.gap_s, a.prompt_tokens, 16)
    results = []
    for mode in a.modes:
        d = base / mode
        if not a.reuse:
            run_mode(mode, a.inject_pull if mode == "pull" else a.inject_push, base, a.max_requests,
                     1.0 if wl else a.length_scale, 1.0 if wl else a.rate_scale, lock=not a.no_lock,
                     workload_file=wl)
        rows, spec = per_request(d)
        results += evaluate(rows, spec, mode, a.tol_ms, a.tol_frac)
    print(table(results, a.markdown))
    print(f"\ntolerance: max({a.tol_ms:g} ms, {a.tol_frac:.0%} of the injected delay); Δ = paired-neighbour "
          "increase in injected requests (median of pairs, 95 % bootstrap CI); error = attributed - injected "
          "(on path) or attributed (off path)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(r["attributed_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
