"""Client TTFT vs pdtrace's TTFT per request, behind vLLM's ``vllm-router`` and behind pdtrace's router (issue 16).

Usage (from the repo root, lab environment installed; starts real engines, so
under the shared lock on a shared machine)::

    flock /tmp/pdtrace-heavy.lock .venv/bin/python benchmarks/router_ttft_agreement.py \
        [--routers vllm-router pdtrace] [--mode pull] [--requests 20] [--out DIR] [--json FILE]

For each router it runs one ``pdtrace lab`` (the production recipe: engines
with vLLM's stock serving command plus ``PDTRACE_DIR`` = the run directory,
traced by pdtrace's vLLM plugin; the Azure 2023 conversation
trace, lengths x0.25, rate x1, the first N arrivals, one warm-up request), then
joins the lab client's record of every replayed request
(``client/requests.parquet``) with pdtrace's ``requests`` row.

Join. The client sends ``X-Request-Id: replay-<i>``; ``vllm-router`` drops it
and gives both legs its own id G, so G is pdtrace's ``request_id``. vLLM answers
every completion with ``"id": "cmpl-<the id its API server got>"`` and both
routers relay D's stream, so the client's ``response_id`` with ``cmpl-``
stripped (:func:`pdtrace.connector.lab.replay.engine_request_id`) is pdtrace's
``request_id`` behind either router. The warm-up request is not in the client
file (it is in ``requests``), so it is not joined.

TTFT. Client: send -> first SSE chunk carrying a generated token, on the
client's clock. pdtrace: ``requests.ttft_ms``, on the clock ``ttft_source``
names: ``router`` (pdtrace's router received the request -> wrote the first
token chunk) or ``engine`` (P's API server received it -> D's API server wrote
the first token chunk; DESIGN.md §3). The client's interval contains either
window (same host, so one clock; the difference is the client's connection,
upload, the router hop(s) that the window leaves out and the trip back), so
every difference client - pdtrace must be >= 0.

Prints one row per request and, per router, the median / p99 / min / max of
the difference (ms), the number of requests whose breakdown
(``ttft_breakdown``: queue + compute + transfer + coordination) does not equal
``ttft_ns`` to the nanosecond, and the ``ttft_source`` values seen.
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


def lab_run(out: Path, router: str, mode: str = "pull", n: int = 20, echo=print) -> dict:
    """One lab behind ``router`` into ``out`` (must be new), engines traced by the plugin; returns run_lab's summary."""
    o = LabOptions(mode=mode, max_requests=n, out=out, connector="stock", router=router, progress=False,
                   report=False)
    return run_lab(o, echo=echo)


def client_rows(out: Path) -> list[dict]:
    """The lab client's records of ``out`` (``client/requests.parquet``) as dicts, with ``join_id`` and ``client_ttft_ms``."""
    import pyarrow.parquet as pq

    rows = pq.read_table(Path(out) / "client" / "requests.parquet").to_pylist()
    for r in rows:
        r["join_id"] = replay.engine_request_id(r["response_id"] or "")
        r["client_ttft_ms"] = ((r["first_token_ns"] - r["send_ns"]) / 1e6
                               if r["status"] == "ok" and r["first_token_ns"] is not None else None)
    return rows


def traced_rows(out: Path) -> dict[str, dict]:
    """pdtrace's ``requests`` of ``out`` joined with ``ttft_breakdown``: request_id -> row.

    Columns: request_id, status, cause, ttft_ms, ttft_source (NULL where the
    analysis has no such column), ttft_ns, parts_ns (queue + compute + transfer +
    coordination of ``ttft_breakdown``; NULL without a breakdown row).
    """
    from pdtrace import analysis

    with analysis.open(out, cache=Path(out).parent / (Path(out).name + ".duckdb")) as tr:
        has_source = bool(tr.query("SELECT 1 FROM duckdb_columns() WHERE table_name = 'requests' "
                                   "AND column_name = 'ttft_source'"))
        rows = tr.query(f"""
            SELECT q.request_id, q.status, q.cause, q.ttft_ms,
                   {'q.ttft_source' if has_source else 'NULL'} AS ttft_source,
                   b.ttft_ns, b.queue_ns + b.compute_ns + b.transfer_ns + b.coordination_ns AS parts_ns
            FROM requests q LEFT JOIN ttft_breakdown b USING (rkey)""")
    return {r["request_id"]: r for r in rows}


def agreement(client: list[dict], traced: dict[str, dict]) -> dict:
    """Join client records with pdtrace's rows by ``join_id``; differences client - pdtrace (ms) and counts."""
    rows, missing = [], []
    for c in client:
        t = traced.get(c["join_id"])
        if t is None:
            missing.append(c["request_index"])
            continue
        d = (c["client_ttft_ms"] - t["ttft_ms"]) if c["client_ttft_ms"] is not None and t["ttft_ms"] is not None else None
        rows.append({"request_index": c["request_index"], "request_id": t["request_id"],
                     "prompt_tokens": c["prompt_tokens"], "client_status": c["status"], "status": t["status"],
                     "cause": t["cause"], "ttft_source": t["ttft_source"], "client_ttft_ms": c["client_ttft_ms"],
                     "pdtrace_ttft_ms": t["ttft_ms"], "diff_ms": d, "ttft_ns": t["ttft_ns"], "parts_ns": t["parts_ns"]})
    diffs = sorted(r["diff_ms"] for r in rows if r["diff_ms"] is not None)
    s = {"n_client": len(client), "n_joined": len(rows), "missing": missing, "rows": rows,
         "n_traced": len(traced), "client_failed": sum(1 for c in client if c["status"] != "ok"),
         "incomplete": [r["request_index"] for r in rows if r["status"] != "complete"],
         "sources": sorted({str(r["ttft_source"]) for r in rows}),
         "not_tiled": [r["request_index"] for r in rows if r["ttft_ns"] is None or r["parts_ns"] != r["ttft_ns"]],
         "n_diff": len(diffs)}
    if diffs:
        s.update({"diff_median_ms": statistics.median(diffs), "diff_p99_ms": replay._pct(diffs, 0.99),
                  "diff_min_ms": diffs[0], "diff_max_ms": diffs[-1],
                  "negative": sum(1 for d in diffs if d < 0),
                  "pdtrace_ttft_median_ms": statistics.median(r["pdtrace_ttft_ms"] for r in rows
                                                              if r["diff_ms"] is not None)})
    return s


def measure(out: Path, router: str, mode: str = "pull", n: int = 20, echo=print) -> dict:
    """:func:`lab_run` + :func:`agreement` for one router.

    Adds ``router``, ``router_build``, ``mode``, ``run_dir``, the lab's client
    summary (``client``) and D's prompt tokens by source during the replay
    (``decode_prompt_tokens_by_source``: local_compute 0 means every prompt's KV
    came from P).
    """
    summary = lab_run(out, router, mode, n, echo)
    s = agreement(client_rows(out), traced_rows(out))
    s.update({"router": router, "mode": mode, "run_dir": str(out), "client": summary["client"],
              "router_build": summary.get("router_build", "pdtrace"),
              "decode_prompt_tokens_by_source": summary["decode_prompt_tokens_by_source"]})
    return s


def _f(v, spec="9.3f"):
    return f"{v:{spec}}" if v is not None else f"{'-':>{spec.split('.')[0].lstrip('+')}}"


def render(s: dict) -> str:
    """Per-request rows and the summary lines of one router (ms)."""
    lines = [f"== {s['router']} ({s['router_build']}, {s['mode']}) run {s['run_dir']}",
             f"{'i':>3} {'prompt':>6} {'source':>7} {'client':>9} {'pdtrace':>9} {'diff':>8}  request_id"]
    for r in s["rows"]:
        lines.append(f"{r['request_index']:>3} {r['prompt_tokens']:>6} {str(r['ttft_source']):>7} "
                     f"{_f(r['client_ttft_ms'])} {_f(r['pdtrace_ttft_ms'])} {_f(r['diff_ms'], '+8.3f')}  "
                     f"{r['request_id'][-40:]}")
    lines.append(f"joined {s['n_joined']} of {s['n_client']} client requests (missing {s['missing'] or 'none'}; "
                 f"client failures {s['client_failed']}; pdtrace requests {s['n_traced']} incl. warm-up); "
                 f"incomplete {s['incomplete'] or 'none'}; ttft_source {s['sources']}; "
                 f"breakdown != TTFT {s['not_tiled'] or 'none'}")
    if s["n_diff"]:
        lines.append(f"client - pdtrace TTFT (ms): median {s['diff_median_ms']:+.3f}  p99 {s['diff_p99_ms']:+.3f}  "
                     f"min {s['diff_min_ms']:+.3f}  max {s['diff_max_ms']:+.3f}  negative {s['negative']}  "
                     f"(n={s['n_diff']}, pdtrace TTFT median {s['pdtrace_ttft_median_ms']:.1f} ms)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", nargs="+", choices=["vllm-router", "pdtrace"], default=["vllm-router", "pdtrace"])
    ap.add_argument("--mode", choices=["pull", "push"], default="pull")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="parent directory of the runs (one per router)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    a = ap.parse_args(argv)
    parent = a.out or Path("runs") / time.strftime("%Y%m%dT%H%M%SZ-router-agreement", time.gmtime())
    results = []
    for router in a.routers:
        s = measure(parent / f"{router}-{a.mode}", router, a.mode, a.requests, echo=lambda *_: None)
        results.append(s)
        print(render(s), flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
