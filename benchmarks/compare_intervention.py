"""Push vs pull explained stage by stage, and the explanation checked by intervention (issue 17 part B).

Usage (from the repo root, lab environment installed)::

    .venv/bin/python benchmarks/compare_intervention.py [--requests 20] [--workload mooncake-conv]
        [--length-scale 0.09] [--budget 512] [--out DIR] [--lock /tmp/pdtrace-heavy.lock]

Runs ``pdtrace lab`` (traced connectors) on one prefill-heavy replay (Mooncake
conversation trace, long prompts) three times, each under ``--lock`` (an
exclusive flock held for that run only; other lab users take it between
runs), and reuses a run directory that already holds a finished run
(``run.json``):

1. ``base-pull``: pull, engines as the lab starts them (vLLM's CPU default
   prefill token budget, ``--max-num-batched-tokens`` 2048);
2. ``base-push``: push, the same;
3. ``budget-push``: push with P's prefill token budget lowered to
   ``--budget`` (``--max-num-batched-tokens`` on the prefill engine only,
   ``LabOptions.engine_args``): P's engine steps get shorter, D is unchanged.
   ``--control`` adds ``control-push``, a second unchanged push run, to show
   the run-to-run noise of the same figures.

Then prints

* the delta decomposition of ``pdtrace report base-pull --compare base-push``
  (mean TTFT, push minus pull, split by critical-path stage per prompt
  bucket; ``analysis/report.py`` ``compare_delta`` over the view
  ``ttft_stage_means``);
* the same for ``base-push --compare budget-push`` (what the intervention
  changed, stage by stage);
* predicted vs observed: P's step length (mean ``prefill.compute`` chunk span:
  one chunk per P engine step) before and after; for each stage that waits for
  P's next engine step (``handoff.step_wait``, DESIGN.md §2: push's writer
  posts the WRITE at P's next step), the prediction scales its mean exposed
  time with P's step length, ``after = before * step_after / step_before``;
  the predicted TTFT change is the sum of those stages' predicted changes (the
  decomposition is exact, so if the explanation is right the other stages do
  not move and the observed TTFT change is about that sum). Printed beside it:
  the observed change of each of those stages and of the TTFT, and the stages
  that moved most without being predicted to (what the explanation missed).

One round on a shared 2-core machine with 20 requests: other processes' load
moves every number by tens of percent (BENCHMARKS.md, pull vs push); read the
before/after within one run of this script, and against ``--control``.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import time
from pathlib import Path

from pdtrace.analysis import db, report
from pdtrace.connector.lab.run import LabOptions, run_lab

#: Stages that are, by definition (DESIGN.md §2), a wait for P's next engine step in push.
P_STEP_BOUND = ("handoff.step_wait",)


@contextlib.contextmanager
def _locked(path: str | None):
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(name: str, base: Path, a, mode: str, engine_args: dict | None = None) -> Path:
    """One lab run into ``base/name`` (skipped when it already finished there)."""
    out = base / name
    if (out / "run.json").is_file():
        print(f"[{name}] reusing {out}", flush=True)
        return out
    with _locked(a.lock):
        t = time.time()
        print(f"[{name}] lab --mode {mode} {engine_args or ''} ...", flush=True)
        run_lab(LabOptions(mode=mode, connector="traced", workload=a.workload, max_requests=a.requests,
                           length_scale=a.length_scale, rate_scale=a.rate_scale, out=out, progress=False,
                           report=False, engine_args=engine_args or {}))
        print(f"[{name}] done in {time.time() - t:.0f} s", flush=True)
    return out


def collect(run_dir: Path) -> tuple[dict, float | None]:
    """``report.collect`` of a run, and P's mean step length (ms; mean prefill.compute chunk span)."""
    with db.open_trace(run_dir, cache=run_dir.parent / (run_dir.name + ".duckdb")) as tr:
        data = report.collect(tr.readonly())
        step = tr.query("SELECT avg((end_ns - start_ns) / 1e6) AS m FROM spans WHERE stage = 'prefill.compute' "
                        "AND role = 'prefill'")[0]["m"]
    return data, step


def _all(delta: dict) -> list[dict]:
    return [r for r in delta["by_stage"] if r["scope"] == "all"]


def predict(before: dict, after: dict, step_before: float, step_after: float) -> dict:
    """Predicted vs observed change (ms per request, scope 'all') of the P-step-bound stages and of TTFT."""
    rows = {r["stage"]: r for r in _all(report.compare_delta(before, after))}
    ratio = step_after / step_before
    out = {"p_step_before_ms": step_before, "p_step_after_ms": step_after, "ratio": ratio, "stages": []}
    pred_total = 0.0
    for s in P_STEP_BOUND:
        r = rows.get(s, {"mean_a_ms": 0.0, "mean_b_ms": 0.0, "delta_ms": 0.0})
        p = r["mean_a_ms"] * (ratio - 1)
        pred_total += p
        out["stages"].append({"stage": s, "before_ms": r["mean_a_ms"], "after_ms": r["mean_b_ms"],
                              "predicted_delta_ms": p, "observed_delta_ms": r["delta_ms"]})
    any_row = next(iter(rows.values()))
    out["ttft_before_ms"], out["ttft_after_ms"] = any_row["ttft_mean_a_ms"], any_row["ttft_mean_b_ms"]
    out["predicted_ttft_delta_ms"] = pred_total
    out["observed_ttft_delta_ms"] = any_row["ttft_delta_ms"]
    out["unpredicted"] = sorted(({"stage": k, "category": v["category"], "delta_ms": v["delta_ms"]}
                                 for k, v in rows.items() if k not in P_STEP_BOUND),
                                key=lambda x: -abs(x["delta_ms"]))[:5]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--workload", default="mooncake-conv", choices=["azure-conv", "mooncake-conv"])
    ap.add_argument("--length-scale", type=float, default=0.09)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=512, help="P's --max-num-batched-tokens in the intervention run")
    ap.add_argument("--control", action="store_true", help="also a second unchanged push run (noise)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--lock", default="/tmp/pdtrace-heavy.lock", help="flock file held during each lab run ('' none)")
    a = ap.parse_args(argv)
    base = a.out or Path("runs") / time.strftime("%Y%m%dT%H%M%SZ-compare", time.gmtime())
    budget_args = {"prefill": ["--max-num-batched-tokens", str(a.budget)]}
    dirs = {"base-pull": run("base-pull", base, a, "pull"), "base-push": run("base-push", base, a, "push"),
            "budget-push": run("budget-push", base, a, "push", budget_args)}
    if a.control:
        dirs["control-push"] = run("control-push", base, a, "push")
    got = {k: collect(d) for k, d in dirs.items()}
    data = {k: v[0] for k, v in got.items()}
    step = {k: v[1] for k, v in got.items()}
    print(f"\n{a.workload}, {a.requests} requests, lengths x{a.length_scale}, rate x{a.rate_scale}; ms per request\n")
    d1 = report.compare_delta(data["base-pull"], data["base-push"])
    print("\n".join(report.render_delta(d1, "pull", "push")))
    d2 = report.compare_delta(data["base-push"], data["budget-push"])
    print(f"Intervention: P's prefill token budget 2048 (vLLM CPU default) -> {a.budget}")
    print("\n".join(report.render_delta(d2, "push", f"push, P budget {a.budget}")))
    res = {"dirs": {k: str(v) for k, v in dirs.items()}, "p_step_ms": step,
           "push_minus_pull": d1, "budget_minus_base": d2,
           "prediction": predict(data["base-push"], data["budget-push"], step["base-push"], step["budget-push"])}
    if a.control:
        res["control_minus_base"] = report.compare_delta(data["base-push"], data["control-push"])
        res["control_prediction"] = predict(data["base-push"], data["control-push"], step["base-push"],
                                            step["control-push"])
    for key, label in (("prediction", f"P budget {a.budget}"), ("control_prediction", "control (no change)")):
        if key not in res:
            continue
        p = res[key]
        print(f"Predicted vs observed, {label} (scope all): P step {p['p_step_before_ms']:.1f} -> "
              f"{p['p_step_after_ms']:.1f} ms (x{p['ratio']:.2f})")
        print(report.table([{"stage": s["stage"], "before_ms": s["before_ms"], "after_ms": s["after_ms"],
                             "predicted_delta_ms": s["predicted_delta_ms"], "observed_delta_ms": s["observed_delta_ms"]}
                            for s in p["stages"]]
                           + [{"stage": "TTFT (mean)", "before_ms": p["ttft_before_ms"], "after_ms": p["ttft_after_ms"],
                               "predicted_delta_ms": p["predicted_ttft_delta_ms"],
                               "observed_delta_ms": p["observed_ttft_delta_ms"]}]))
        print("largest unpredicted changes: " + ", ".join(f"{u['stage']} {u['delta_ms']:+.1f}" for u in p["unpredicted"]))
        print()
    (base / "compare_intervention.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
