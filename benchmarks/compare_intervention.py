"""Push vs pull explained stage by stage, and the explanation checked by intervention (issue 17 part B).

Usage (from the repo root, lab environment installed)::

    .venv/bin/python benchmarks/compare_intervention.py [--requests 20] [--workload mooncake-conv]
        [--length-scale 0.09] [--budget 512 [--budget 8192 ...]] [--control] [--out DIR]
        [--lock /tmp/pdtrace-heavy.lock]

Runs ``pdtrace lab`` (traced connectors) on one prefill-heavy replay (Mooncake
conversation trace, long prompts) once per configuration, each under ``--lock`` (an
exclusive flock held for that run only; other lab users take it between
runs), and reuses a run directory that already holds a finished run
(``run.json``):

1. ``base-pull``: pull, engines as the lab starts them (vLLM's CPU default
   prefill token budget, ``--max-num-batched-tokens`` 2048);
2. ``base-push``: push, the same;
3. ``budget<N>-push`` for each ``--budget N`` (default 512): push with P's
   prefill token budget set to N (``--max-num-batched-tokens`` on the prefill
   engine only, ``LabOptions.engine_args``): P's engine steps carry fewer
   (N < 2048) or more prompt tokens; D is unchanged.
   ``--control`` adds ``control-push``, a second unchanged push run, to show
   the run-to-run noise of the same figures.
4. ``--serial`` adds ``serial-push``: push with the router dispatching D only
   after P answered (``LabOptions.push_dispatch``), engines unchanged. It
   checks the explanation of push minus pull rather than the step-length
   model: if P's prompt compute is slower per token in push because D runs
   during P's prefill (push dispatches both legs at once, and D steps on its
   waiting request meanwhile; on the lab's 2 cores they share the machine),
   then without that overlap P's ms per prompt token, ``prefill.queue`` and
   ``prefill.compute`` return to pull's (predicted: each stage's push mean
   moves to its pull mean, ``predict_serial``).

Then prints

* the delta decomposition of ``pdtrace report base-pull --compare base-push``
  (mean TTFT, push minus pull, split by critical-path stage per prompt
  bucket; ``analysis/report.py`` ``compare_delta`` over the view
  ``ttft_stage_means``);
* the same for ``base-push --compare budget<N>-push`` (what the intervention
  changed, stage by stage);
* predicted vs observed: P's engine steps before and after (from the
  ``prefill.compute`` chunk spans, grouped by ``step.id``: step length, prompt
  tokens per step, ms per prompt token). The prediction scales each blamed
  P-side stage by what drives it (``PREDICTED``): ``handoff.step_wait`` (push's
  writer waits for P's next engine step, DESIGN.md §2) by P's step length,
  ``prefill.queue`` and ``prefill.compute`` by P's ms per prompt token;
  ``after = before * measure_after / measure_before``. The predicted TTFT
  change is the sum of those stages' predicted changes (the decomposition is
  exact, so if the explanation is complete the other stages do not move).
  Printed beside it: the observed changes, and the stages that moved most
  without being predicted to (what the explanation missed).

One round on a shared 2-core machine with 20 requests: other processes' load
moves every number by tens of percent (BENCHMARKS.md "Pull vs push by prompt bucket"); read the
before/after within one run of this script, and against ``--control``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from pdtrace import analysis
from pdtrace.analysis import report
from pdtrace.connector.lab.run import LabOptions, run_lab

from inject_attribution import heavy_lock  # this folder is sys.path[0] when run as a script

#: Stages whose exposed time the prediction scales, and by what (DESIGN.md §2): a wait for P's next engine step
#: scales with P's step length; P's queue and prompt compute with P's time per prefill token (a fixed number of
#: prompt tokens to get through at that rate; first order, ignoring the nonlinearity of queueing).
PREDICTED = {"handoff.step_wait": "step_ms", "prefill.queue": "ms_per_token", "prefill.compute": "ms_per_token"}

def run(name: str, base: Path, a, mode: str, engine_args: dict | None = None, dispatch: str = "concurrent") -> Path:
    """One lab run into ``base/name`` (skipped when it already finished there); ``dispatch``: the router's
    push dispatch (``LabOptions.push_dispatch``)."""
    out = base / name
    if (out / "run.json").is_file():
        print(f"[{name}] reusing {out}", flush=True)
        return out
    with (heavy_lock(a.lock) if a.lock else contextlib.nullcontext()):
        t = time.time()
        print(f"[{name}] lab --mode {mode} {engine_args or ''} {dispatch} ...", flush=True)
        run_lab(LabOptions(mode=mode, connector="traced", workload=a.workload, max_requests=a.requests,
                           length_scale=a.length_scale, rate_scale=a.rate_scale, out=out, progress=False,
                           report=False, engine_args=engine_args or {}, push_dispatch=dispatch))
        print(f"[{name}] done in {time.time() - t:.0f} s", flush=True)
    return out


def collect(run_dir: Path) -> tuple[dict, dict]:
    """``report.collect`` of a run, and P's engine steps: mean step length (ms: first chunk start to last chunk
    end of the prefill.compute chunks with one step.id on one engine), mean prompt tokens per step, ms per token."""
    with analysis.open(run_dir, cache=run_dir.parent / (run_dir.name + ".duckdb")) as tr:
        step = tr.query("""
            WITH s AS (SELECT engine_id, attr_int['step.id'] AS sid, (max(end_ns) - min(start_ns)) / 1e6 AS ms,
                              sum(attr_int['step.tokens']) AS tokens
                       FROM spans WHERE stage = 'prefill.compute' AND role = 'prefill'
                         AND attr_int['step.chunk_index'] IS NOT NULL GROUP BY ALL)
            SELECT count(*) AS steps, avg(ms) AS step_ms, avg(tokens) AS tokens_per_step,
                   sum(ms) / sum(tokens) AS ms_per_token FROM s""")[0]
        data = report.collect(tr.cursor())
    return data, step


def _all(delta: dict) -> list[dict]:
    return [r for r in delta["by_stage"] if r["scope"] == "all"]


def predict(before: dict, after: dict, step_before: dict, step_after: dict) -> dict:
    """Predicted vs observed change (ms per request, scope 'all') of the stages in PREDICTED and of mean TTFT.

    Prediction: after = before * (P's measure after / before), the measure named in PREDICTED; the TTFT is
    predicted to move by the sum of those stages' predicted changes (the other stages unchanged)."""
    rows = {(r["stage"], r["category"]): r for r in _all(report.compare_delta(before, after))}
    out = {"p_steps_before": step_before, "p_steps_after": step_after, "stages": []}
    pred_total = obs_total = 0.0
    for s, measure in PREDICTED.items():
        ratio = step_after[measure] / step_before[measure]
        for (stage, cat), r in rows.items():
            if stage != s:
                continue
            p = r["mean_a_ms"] * (ratio - 1)
            pred_total += p
            obs_total += r["delta_ms"]
            out["stages"].append({"stage": stage, "category": cat, "scaled_by": f"{measure} x{ratio:.2f}",
                                  "before_ms": r["mean_a_ms"], "after_ms": r["mean_b_ms"],
                                  "predicted_delta_ms": p, "observed_delta_ms": r["delta_ms"]})
    any_row = next(iter(rows.values()))
    out["ttft_before_ms"], out["ttft_after_ms"] = any_row["ttft_mean_a_ms"], any_row["ttft_mean_b_ms"]
    out["predicted_ttft_delta_ms"] = pred_total
    out["observed_predicted_stages_delta_ms"] = obs_total
    out["observed_ttft_delta_ms"] = any_row["ttft_delta_ms"]
    out["unpredicted"] = sorted(({"stage": k[0], "category": k[1], "delta_ms": v["delta_ms"]}
                                 for k, v in rows.items() if k[0] not in PREDICTED),
                                key=lambda x: -abs(x["delta_ms"]))[:5]
    return out


def predict_serial(pull: dict, push: dict, serial: dict, steps: dict) -> dict:
    """``--serial``'s check (module docstring): P's ms per prompt token in the three runs, and per P-side
    stage (``prefill.queue``, ``prefill.compute``; scope 'all') its push mean, its pull mean (the
    prediction for serial push) and its serial-push mean; also the TTFT means. ms per request."""
    a, b = {r["stage"]: r for r in _all(report.compare_delta(pull, push))}, \
        {r["stage"]: r for r in _all(report.compare_delta(push, serial))}
    out = {"ms_per_token": {k: steps[k]["ms_per_token"] for k in ("base-pull", "base-push", "serial-push")},
           "step_ms": {k: steps[k]["step_ms"] for k in ("base-pull", "base-push", "serial-push")}, "stages": []}
    for s in ("prefill.queue", "prefill.compute"):
        pull_ms = a[s]["mean_a_ms"] if s in a else 0.0
        push_ms = a[s]["mean_b_ms"] if s in a else b[s]["mean_a_ms"] if s in b else 0.0
        serial_ms = b[s]["mean_b_ms"] if s in b else 0.0
        out["stages"].append({"stage": s, "pull_ms": pull_ms, "push_ms": push_ms, "serial_ms": serial_ms,
                              "predicted_delta_ms": pull_ms - push_ms, "observed_delta_ms": serial_ms - push_ms})
    any_a, any_b = next(iter(a.values())), next(iter(b.values()))
    out["ttft_ms"] = {"pull": any_a["ttft_mean_a_ms"], "push": any_a["ttft_mean_b_ms"],
                      "serial": any_b["ttft_mean_b_ms"]}
    return out


def print_serial(p: dict) -> None:
    """Print :func:`predict_serial`'s result: P's ms per prompt token and mean step (ms) in the three runs,
    the TTFT means, and a table of the P-side stages (ms per request: pull, push, serial push, predicted
    and observed change)."""
    m, st = p["ms_per_token"], p["step_ms"]
    print("Serial push (D dispatched after P answered) vs push and pull: P's ms per prompt token "
          f"pull {m['base-pull']:.4f}, push {m['base-push']:.4f}, serial push {m['serial-push']:.4f}; P's step "
          f"{st['base-pull']:.1f} / {st['base-push']:.1f} / {st['serial-push']:.1f} ms; TTFT mean "
          f"{p['ttft_ms']['pull']:.1f} / {p['ttft_ms']['push']:.1f} / {p['ttft_ms']['serial']:.1f} ms")
    print(report.table([{k: s[k] for k in ("stage", "pull_ms", "push_ms", "serial_ms", "predicted_delta_ms",
                                           "observed_delta_ms")} for s in p["stages"]]))
    print()


def print_prediction(p: dict, label: str) -> None:
    """Print :func:`predict`'s result ``p`` under ``label``: the prediction against the observation (ms per
    request; P's steps, step length in ms and prompt tokens per step before and after)."""
    b, a = p["p_steps_before"], p["p_steps_after"]
    print(f"Predicted vs observed, {label} (all prompts, ms per request): P's steps {b['steps']} -> {a['steps']}, "
          f"step {b['step_ms']:.1f} -> {a['step_ms']:.1f} ms, prompt tokens per step {b['tokens_per_step']:.0f} -> "
          f"{a['tokens_per_step']:.0f}, ms per prompt token {b['ms_per_token']:.4f} -> {a['ms_per_token']:.4f}")
    print(report.table([{k: s[k] for k in ("stage", "scaled_by", "before_ms", "after_ms", "predicted_delta_ms",
                                           "observed_delta_ms")} for s in p["stages"]]
                       + [{"stage": "sum of these", "predicted_delta_ms": p["predicted_ttft_delta_ms"],
                           "observed_delta_ms": p["observed_predicted_stages_delta_ms"]},
                          {"stage": "TTFT (mean)", "before_ms": p["ttft_before_ms"], "after_ms": p["ttft_after_ms"],
                           "predicted_delta_ms": p["predicted_ttft_delta_ms"],
                           "observed_delta_ms": p["observed_ttft_delta_ms"]}]))
    print("largest changes not predicted: " + ", ".join(f"{u['stage']} {u['delta_ms']:+.1f}" for u in p["unpredicted"]))
    print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--workload", default="mooncake-conv", choices=["azure-conv", "mooncake-conv"])
    ap.add_argument("--length-scale", type=float, default=0.09)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--budget", type=int, action="append", default=None,
                    help="P's --max-num-batched-tokens in an intervention run (repeat for several; default 512)")
    ap.add_argument("--control", action="store_true", help="also a second unchanged push run (noise)")
    ap.add_argument("--serial", action="store_true", help="also a push run with D dispatched after P answered")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--lock", default="/tmp/pdtrace-heavy.lock", help="flock file held during each lab run ('' none)")
    a = ap.parse_args(argv)
    base = a.out or Path("runs") / time.strftime("%Y%m%dT%H%M%SZ-compare", time.gmtime())
    budgets = a.budget or [512]
    dirs = {"base-pull": run("base-pull", base, a, "pull"), "base-push": run("base-push", base, a, "push")}
    for n in budgets:
        dirs[f"budget{n}-push"] = run(f"budget{n}-push", base, a, "push",
                                      {"prefill": ["--max-num-batched-tokens", str(n)]})
    if a.control:
        dirs["control-push"] = run("control-push", base, a, "push")
    if a.serial:
        dirs["serial-push"] = run("serial-push", base, a, "push", dispatch="serial")
    got = {k: collect(d) for k, d in dirs.items()}
    data = {k: v[0] for k, v in got.items()}
    step = {k: v[1] for k, v in got.items()}
    print(f"\n{a.workload}, {a.requests} requests, lengths x{a.length_scale}, rate x{a.rate_scale}; ms per request\n")
    d1 = report.compare_delta(data["base-pull"], data["base-push"])
    print("\n".join(report.render_delta(d1, "pull", "push")))
    res = {"dirs": {k: str(v) for k, v in dirs.items()}, "p_steps": step, "push_minus_pull": d1, "interventions": {}}
    for name in [k for k in dirs if k.startswith("budget")] + (["control-push"] if a.control else []):
        label = "control: push unchanged" if name == "control-push" else \
            f"P's prefill token budget 2048 (vLLM CPU default) -> {name[len('budget'):-len('-push')]}"
        d = report.compare_delta(data["base-push"], data[name])
        print(f"Intervention {name}: {label}")
        print("\n".join(report.render_delta(d, "push", name)))
        res["interventions"][name] = {"label": label, "delta": d,
                                      "prediction": predict(data["base-push"], data[name], step["base-push"],
                                                            step[name])}
    for name, r in res["interventions"].items():
        print_prediction(r["prediction"], f"{name} ({r['label']})")
    if a.serial:
        d = report.compare_delta(data["base-push"], data["serial-push"])
        print("Intervention serial-push: D dispatched after P answered")
        print("\n".join(report.render_delta(d, "push", "serial-push")))
        res["serial"] = {"delta": d, "prediction": predict_serial(data["base-pull"], data["base-push"],
                                                                  data["serial-push"], step)}
        print_serial(res["serial"]["prediction"])
    (base / "compare_intervention.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
