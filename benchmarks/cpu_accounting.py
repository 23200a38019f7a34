"""pdtrace's own CPU, thread by thread: hot path per engine thread, background per request and per span.

    flock /tmp/pdtrace-heavy.lock .venv/bin/python benchmarks/cpu_accounting.py [--sample 1] [--mode pull]
    .venv/bin/python benchmarks/cpu_accounting.py --run-dir DIR     # figures of a finished traced lab run

Runs one traced lab (pdtrace's class names and middleware, ``--connector
traced``; 20 Azure-conversation requests ×0.25 lengths; default settings,
``PDTRACE_SELF_CPU=1``, ``PDTRACE_SAMPLE`` = ``--sample``), then reads its store:

*Hot path* (CPU pdtrace takes from a thread vLLM needs; thread CPU clock around
every pdtrace hook, :mod:`pdtrace.instrument.selfcpu`), per engine thread:

- EngineCore thread (scheduler; ``MainThread`` of the EngineCore process): per
  recorded step span, ``step.pdtrace_cpu_ns / step.thread_cpu_ns`` (pdtrace's CPU
  over the thread's CPU since the previous recorded step);
- forward thread (``MainThread`` of the worker process, TP rank 0): the same
  ratio per ``connector.load`` span (once per step);
- API-server event loop (``MainThread`` of the API server): per flush window
  (view ``thread_cpu_windows``; no engine steps there).

Each: median and p99 of the per-step (per-window) share, the total share
(sum of pdtrace CPU / sum of thread CPU, view ``thread_cpu`` for every thread),
median µs per step and pdtrace µs per traced request (the thread's pdtrace CPU
over its busy windows / traced requests). Goal (issue 18): total share ≤ 1 %
on every engine thread.

*Background*: each traced process's ``pdtrace-writer`` thread (view
``processes.writer_cpu_ns``) and pdtrace's helper processes (psutil at the end
of the replay, as in the footprint line; :mod:`pdtrace.analysis.footprint`), in
ms per traced request and µs per record written. Goal: ≤ 2 ms per request at
``PDTRACE_SAMPLE=1``.

The last line is the run's footprint line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))
    return xs[k]


def per_step(con, role: str, name: str) -> dict:
    """Per recorded span ``name`` of ``role`` that carries the self-CPU stamps: the share list and µs."""
    rows = con.execute(
        "SELECT attr_int['step.pdtrace_cpu_ns'], attr_int['step.thread_cpu_ns'], pid, thread FROM spans "
        "WHERE role = ? AND stage = ? AND attr_int['step.thread_cpu_ns'] > 0", [role, name]).fetchall()
    shares = [pd / th for pd, th, _, _ in rows]
    return {"n": len(rows), "median_pct": (statistics.median(shares) * 100) if shares else None,
            "p99_pct": (_q(shares, 0.99) * 100) if shares else None,
            "total_pct": (sum(r[0] for r in rows) / sum(r[1] for r in rows) * 100) if rows else None,
            "median_pdtrace_us": (statistics.median(r[0] for r in rows) / 1e3) if rows else None,
            "thread": sorted({(r[2], r[3]) for r in rows})}


def per_window(con, role: str, service: str) -> dict:
    rows = con.execute("SELECT pdtrace_ns, thread_ns FROM thread_cpu_windows WHERE role = ? AND service_name = ? "
                       "AND thread = 'MainThread' AND hooks > 0 AND thread_ns > 0", [role, service]).fetchall()
    shares = [pd / th for pd, th in rows]
    return {"n": len(rows), "median_pct": (statistics.median(shares) * 100) if shares else None,
            "p99_pct": (_q(shares, 0.99) * 100) if shares else None}


def figures(run_dir: Path, helpers=None, run_s: float | None = None) -> dict:
    """Every figure of the module docstring for the traced lab run in ``run_dir``."""
    from pdtrace import analysis
    from pdtrace.analysis import footprint as fpm

    with analysis.open(run_dir) as tr:
        con = tr.cursor()
        fig = fpm.store_figures(con)
        threads = [dict(zip(["role", "service_name", "pid", "thread", "busy_windows", "hooks", "pdtrace_ns",
                             "thread_ns", "hot_path_share"], r)) for r in con.execute(
            "SELECT role, service_name, pid, thread, busy_windows, hooks, pdtrace_ns, thread_ns, hot_path_share "
            "FROM thread_cpu ORDER BY role, service_name, pid, thread").fetchall()]
        steps = {}
        for role in ("prefill", "decode"):
            steps[(role, "EngineCore thread")] = per_step(con, role, f"{role}.step")
            steps[(role, "forward thread")] = per_step(con, role, "connector.load")
            steps[(role, "API event loop")] = per_window(con, role, f"pdtrace-{role}-api")
        procs = con.execute("SELECT role, service_name, pid, writer_cpu_ns, sink_cpu_ns, written FROM processes "
                            "ORDER BY role, pid").fetchall()
        con.close()
    fp = fpm.compute(fig, helpers, fpm.files_created(run_dir), run_s or 60.0)
    return {"store": fig, "threads": threads, "steps": steps, "processes": procs, "footprint": fp}


def show(f: dict) -> None:
    req = f["store"]["requests"]
    print(f"traced requests {req}, records written {f['store']['records']}")
    print("\nhot path, per engine thread (share = pdtrace CPU / the thread's CPU; per step or per flush window)")
    print(f"{'engine':<8}{'thread':<20}{'n':>6}{'median %':>10}{'p99 %':>9}{'total %':>9}{'us/step':>9}"
          f"{'us/request':>12}   (total %: view thread_cpu, the busy flush windows)")
    tot = {(t["role"], t["service_name"], t["thread"], t["pid"]): t for t in f["threads"]}
    for (role, kind), v in f["steps"].items():
        api = f"pdtrace-{role}-api"
        if kind == "API event loop":
            cands = [t for (r, s, th, _), t in tot.items() if r == role and s == api and th == "MainThread"]
        else:  # EngineCore and worker processes: told apart by the pid on their stamped spans
            pids = {p for p, _ in v.get("thread") or ()}
            cands = [t for t in f["threads"] if t["role"] == role and t["pid"] in pids and t["thread"] == "MainThread"]
        t = cands[0] if cands else None
        share = (t["hot_path_share"] * 100) if t and t["hot_path_share"] is not None else v.get("total_pct")
        us_req = (t["pdtrace_ns"] / 1e3 / req) if t and req else None

        def fmt(x, w, d=3):
            return f"{x:>{w}.{d}f}" if x is not None else f"{'-':>{w}}"
        print(f"{role:<8}{kind:<20}{v['n']:>6}{fmt(v['median_pct'], 10)}{fmt(v['p99_pct'], 9)}{fmt(share, 9)}"
              f"{fmt(v.get('median_pdtrace_us'), 9, 1)}{fmt(us_req, 12, 1)}")
    print("\nevery thread that ran a pdtrace hook (view thread_cpu):")
    for t in f["threads"]:
        s = t["hot_path_share"]
        print(f"  {t['role']:<8}{t['service_name'] or '':<22}{t['pid']:>8} {t['thread']:<34} hooks {t['hooks'] or 0:>7}"
              f"  pdtrace {(t['pdtrace_ns'] or 0) / 1e6:8.2f} ms  share {'-' if s is None else f'{s * 100:.3f} %'}")
    fp = f["footprint"]
    recs = f["store"]["records"]
    print("\nbackground (off the engine threads):")
    for role, svc, pid, w, s, n in f["processes"]:
        print(f"  {role or '-':<8}{svc or '-':<22}{pid:>8}  writer {(w or 0) / 1e6:8.1f} ms  sink (stats) "
              f"{(s or 0) / 1e6:8.1f} ms  records {n or 0}")
    if req:
        print(f"  writer threads {fp.writer_cpu_s * 1e3:.1f} ms + helper processes {fp.helper_cpu_s * 1e3:.1f} ms "
              f"= {fp.background_ms_per_request:.2f} ms per request, "
              f"{(fp.writer_cpu_s + fp.helper_cpu_s) * 1e6 / max(1, recs):.1f} us per record")
    from pdtrace.analysis import footprint as fpm
    print("\n" + fpm.line(fp))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, help="only read this finished traced lab run (no lab started)")
    ap.add_argument("--sample", default="1", help="PDTRACE_SAMPLE of the lab (default 1)")
    ap.add_argument("--mode", default="pull", choices=("pull", "push"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    if a.run_dir is not None:
        f = figures(a.run_dir)
    else:
        from pdtrace.analysis import footprint as fpm
        from pdtrace.connector.lab import run as lab_run

        out = a.out or Path("runs") / f"cpu-accounting-{time.strftime('%Y%m%dT%H%M%S')}-s{a.sample}"
        env = {"PDTRACE_SAMPLE": a.sample, "PDTRACE_SELF_CPU": "1"}
        o = lab_run.LabOptions(mode=a.mode, connector="traced", max_requests=a.requests, out=out, progress=False,
                               report=False, role_env={r: dict(env) for r in ("prefill", "decode", "router")})
        s = lab_run.run_lab(o)
        fp = s.get("footprint") or {}
        helpers = fpm.Helpers(fp.get("helper_pids", []), int(fp.get("rss_mib", 0) * 2**20),
                              fp.get("helper_cpu_s", 0.0), fp.get("helper_reading_time_s", 0.0)) if fp else None
        f = figures(out, helpers, fp.get("run_s"))
        print(f"\nrun directory {out}; PDTRACE_SAMPLE={a.sample}")
    show(f)
    if a.json:
        f2 = {**f, "steps": {f"{k[0]} {k[1]}": v for k, v in f["steps"].items()},
              "footprint": f["footprint"].__dict__}
        a.json.write_text(json.dumps(f2, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
