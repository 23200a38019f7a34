"""Lab start time with and without vLLM's model-inspection cache seeded (``connector/lab/vllmcache.py``).

Usage (from the repo root, lab environment installed)::

    .venv/bin/python benchmarks/lab_start.py [--rounds 3] [--out runs/lab-start]

Each round starts one P/D pull lab twice, tracing off, in alternating order: once
with the seed directory removed (every engine's API server inspects the model in
a fresh ``import torch, vllm`` child, as every lab start did before the seed) and
once seeded. It prints, per start, the wall time until both engines answered
``/health`` and each engine's own start time (``Lab.start_s``), then the medians
and the paired difference (cold - seeded) per round. Paired and alternated: the
load of this shared 2-core machine moves a single start by several seconds.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pdtrace.connector.lab import vllmcache
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model


def start_once(model: Path, run_dir: Path, seeded: bool) -> dict:
    """Start and stop one pull lab (no router); {'wall_s', 'engines': {name: s}, 'seeded'}."""
    if not seeded:
        shutil.rmtree(vllmcache.seed_dir(model), ignore_errors=True)
    cfg = LabConfig(model=model, mode="pull", run_dir=run_dir, router=False)
    t0 = time.monotonic()
    with Lab(cfg) as lab:
        wall = time.monotonic() - t0
        engines = dict(lab.start_s)
    return {"wall_s": wall, "engines": engines, "seeded": seeded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary one)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="lab-start-"))
    # a model of its own beside its own seed directory: removing the seed touches nothing else
    model = make_model("default", out / "models")
    start_once(model, out / "warm-up", seeded=True)  # pays the first-ever imports (page cache), fills the seed
    diffs, cold, warm = [], [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {}
        for seeded in order:
            res = start_once(model, out / f"r{r}-{'seeded' if seeded else 'cold'}", seeded)
            got[seeded] = res
            print(f"round {r} {'seeded' if seeded else 'cold  '}: lab {res['wall_s']:.1f} s, engines "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(res['engines'].items())), flush=True)
        cold.append(got[False]["wall_s"])
        warm.append(got[True]["wall_s"])
        diffs.append(got[False]["wall_s"] - got[True]["wall_s"])
    print(f"lab start, median of {args.rounds}: cold {statistics.median(cold):.1f} s, "
          f"seeded {statistics.median(warm):.1f} s; paired cold - seeded: "
          + ", ".join(f"{d:+.1f}" for d in diffs) + f" s (median {statistics.median(diffs):+.1f} s)")


if __name__ == "__main__":
    main()
