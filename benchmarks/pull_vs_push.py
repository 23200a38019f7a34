"""Pull vs push on the same replayed real trace, by prompt-length bucket (issue 5).

Usage (from the repo root, lab environment installed)::

    .venv/bin/python benchmarks/pull_vs_push.py [--requests 40] [--workload azure-conv] [--out DIR]

Runs ``pdtrace lab`` (traced connectors, tracing on, default profile) once per
mode on the same replay (same trace, scale factors and seed), one after the
other, then prints:

1. ``pdtrace report PULL_DIR --compare PUSH_DIR`` (the analysis' summary views
   over each whole trace: the replay plus the lab's one warm-up request);
2. the table in the shape of the published pull-vs-push comparison: per
   prompt-length bucket ``[lo, 2·lo)`` tokens, TTFT and TPOT mean and p99 (ms,
   pdtrace's definitions: TTFT on the router's clock, TPOT = (last − first
   token) / (output tokens − 1)) for both modes side by side, over the
   replayed requests only (the warm-up's first-contact handshake left out),
   plus each mode's category shares of TTFT; ``--markdown`` prints it as a
   Markdown table.

One round on a shared 2-core machine: other processes' load moves every
number; compare the modes only within one run of this script.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pdtrace.connector.lab import replay
from pdtrace.connector.lab.run import LabOptions, run_lab
from pdtrace.instrument.stages import CATEGORIES


def client_tpot(run_dir: Path) -> dict[str, float | None]:
    """Router request id -> the client's TPOT (ms: (last − first token) / (tokens − 1)) of the replayed requests
    (the client's records; the warm-up is not among them)."""
    import pyarrow.parquet as pq
    out = {}
    for r in pq.read_table(run_dir / "client").to_pylist():
        if r["router_request_id"] and r["status"] == "ok":
            t = r["token_times_ns"] or []
            out[r["router_request_id"]] = (t[-1] - t[0]) / 1e6 / (len(t) - 1) if len(t) > 1 else None
    return out


def per_request(run_dir: Path) -> list[dict]:
    """pdtrace's per-request figures of the replayed requests: prompt tokens, TTFT/TPOT (ms), categories (ms).

    ``tpot_src``: 'pdtrace' (``requests.tpot_ms``) or 'client' (the client's TPOT, used when pdtrace has
    none: on 2026-11-30 ``requests.output_tokens`` is NULL in lab runs, no process records the count).
    """
    from pdtrace import analysis
    ctpot = client_tpot(run_dir)
    ids = set(ctpot)
    with analysis.open(run_dir, cache=run_dir.parent / (run_dir.name + ".duckdb")) as tr:
        rows = tr.query("""
            SELECT q.request_id, q.prompt_tokens, prompt_bucket_lo(q.prompt_tokens) AS prompt_bucket_lo,
                   q.output_tokens, q.ttft_ms, q.tpot_ms, q.status,
                   b.queue_ns, b.compute_ns, b.transfer_ns, b.coordination_ns, b.ttft_ns
            FROM requests q LEFT JOIN ttft_breakdown b ON b.request_id = q.request_id""")
    rows = [r for r in rows if r["request_id"] in ids]
    for r in rows:
        r["tpot_src"] = "pdtrace" if r["tpot_ms"] is not None else "client"
        if r["tpot_ms"] is None:
            r["tpot_ms"] = ctpot[r["request_id"]]
    return rows


def by_bucket(rows: list[dict]) -> dict[int, dict]:
    """bucket lo -> n, TTFT mean/p99, TPOT mean/p99 (ms) over complete requests; the buckets are the
    analysis's (the public macro ``prompt_bucket_lo`` of analysis/sql/summary.sql, as in ``pdtrace report``)."""
    out: dict[int, dict] = {}
    for lo in sorted({r["prompt_bucket_lo"] for r in rows if r["prompt_bucket_lo"] is not None}):
        rs = [r for r in rows if r["prompt_bucket_lo"] == lo and r["status"] == "complete"]
        ttft = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
        tpot = [r["tpot_ms"] for r in rs if r["tpot_ms"] is not None]
        out[lo] = {"n": len(rs),
                   "ttft_mean": statistics.fmean(ttft) if ttft else None, "ttft_p99": replay._pct(ttft, 0.99),
                   "tpot_mean": statistics.fmean(tpot) if tpot else None, "tpot_p99": replay._pct(tpot, 0.99)}
    return out


def shares(rows: list[dict]) -> dict[str, float]:
    """Each category's share of the summed TTFT over the replayed requests."""
    tot = sum(r["ttft_ns"] or 0 for r in rows) or 1
    return {c: sum(r[f"{c}_ns"] or 0 for r in rows) / tot for c in CATEGORIES}


def _f(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(a: dict[int, dict], b: dict[int, dict], markdown: bool) -> str:
    """Both modes side by side per bucket (ms)."""
    head = ["prompt tokens", "n pull", "n push", "TTFT mean pull", "TTFT mean push", "TTFT p99 pull",
            "TTFT p99 push", "TPOT mean pull", "TPOT mean push", "TPOT p99 pull", "TPOT p99 push"]
    body = []
    for lo in sorted(set(a) | set(b)):
        x, y = a.get(lo, {}), b.get(lo, {})
        body.append([f"{lo}–{2 * lo - 1}", str(x.get("n", 0)), str(y.get("n", 0)),
                     _f(x.get("ttft_mean")), _f(y.get("ttft_mean")), _f(x.get("ttft_p99")), _f(y.get("ttft_p99")),
                     _f(x.get("tpot_mean")), _f(y.get("tpot_mean")), _f(x.get("tpot_p99")), _f(y.get("tpot_p99"))])
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(r) + " |" for r in body])
    w = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in [head] + body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--workload", default="azure-conv", choices=["azure-conv", "mooncake-conv"])
    ap.add_argument("--length-scale", type=float, default=None)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true", help="print the bucket table as Markdown")
    a = ap.parse_args(argv)
    base = a.out or Path("runs") / time.strftime("%Y%m%dT%H%M%SZ-pull-vs-push", time.gmtime())
    dirs, summaries = {}, {}
    for mode in ("pull", "push"):
        dirs[mode] = base / mode
        summaries[mode] = run_lab(LabOptions(mode=mode, connector="traced", workload=a.workload,
                                             max_requests=a.requests, length_scale=a.length_scale,
                                             rate_scale=a.rate_scale, out=dirs[mode], progress=False, report=False))
    from click.testing import CliRunner

    from pdtrace.cli.main import main as pdtrace_main
    print(f"\n$ pdtrace report {dirs['pull']} --compare {dirs['push']}")
    print(CliRunner().invoke(pdtrace_main, ["report", str(dirs["pull"]), "--compare", str(dirs["push"])]).output)
    rows = {m: per_request(d) for m, d in dirs.items()}
    buckets = {m: by_bucket(r) for m, r in rows.items()}
    wl = summaries["pull"]["workload"]
    print(f"Replayed requests only ({a.workload}, {a.requests} requests, scale factors: "
          f"length x{wl.get('length_scale')}, rate x{wl.get('rate_scale')}); ms")
    print(table(buckets["pull"], buckets["push"], a.markdown))
    src = {r["tpot_src"] for rs in rows.values() for r in rs}
    print(f"TPOT from: {', '.join(sorted(src))} (client: the replay client's token times; pdtrace had none)")
    for m in ("pull", "push"):
        c = summaries[m]["client"]
        print(f"{m}: {c['ok']}/{c['requests']} ok; TTFT shares " +
              ", ".join(f"{k} {v * 100:.1f} %" for k, v in shares(rows[m]).items()))
    (base / "pull_vs_push.json").write_text(json.dumps({"buckets": buckets, "dirs": {k: str(v) for k, v in dirs.items()},
                                                        "shares": {m: shares(r) for m, r in rows.items()}},
                                                       indent=2, default=str))
    return 0 if all(s["client"]["failed"] == 0 for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
