"""Cold analysis of a large store: DuckDB on one machine against the Spark engine, in the same run.

``python benchmarks/spark_scale.py STORE [--masters local[1],local[2]] [--task-memory-limit 1GB]
[--memory-limit 6GB] [--tmp DIR] [--batch-requests 100000] [--no-duckdb]``

For each engine (DuckDB, then the Spark engine on each master) a fresh child process builds the
analysis of STORE cold into a new cache file, as ``pdtrace report --engine ...`` would, the driver's
DuckDB bounded by ``--memory-limit`` (default 6GB; the Spark work directory beside the cache file,
under ``--tmp`` or the temp dir). The
parent samples the child's process tree every 0.2 s (psutil): peak RSS of the whole tree, of the
driver, of the JVM, and of the largest Python worker (a Spark task's DuckDB, bounded by
``--task-memory-limit``). Printed per engine: wall seconds, speed-up of each master over the first,
the peaks, and a digest of the ``requests`` view (count and an order-free hash of every request's
id, TTFT, TPOT and breakdown) that must be equal across engines. The bare scan (DuckDB reading
every column of every file once) is printed beside them: the floor of any cold build.

The store comes from ``benchmarks/analysis_gen.py``. Figures: BENCHMARKS.md "Analysis on Spark".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: The digest of the requests view: equal answers give equal digests (hash of rounded values).
DIGEST_SQL = """
SELECT count(*) AS requests,
       bit_xor(hash(r.rkey, round(r.ttft_ms, 6), round(r.tpot_ms, 6), round(b.queue_ms, 6), round(b.compute_ms, 6),
                    round(b.transfer_ms, 6), round(b.coordination_ms, 6), round(b.unattributed_ms, 6))) AS digest
FROM requests r LEFT JOIN ttft_breakdown b USING (rkey)
"""


def _child(engine: str, store: str, master: str, task_memory_limit: str | None, batch: int,
           memory_limit: str | None, tmp: str | None) -> None:
    """Build the analysis of ``store`` cold with ``engine`` into a new cache file (as ``pdtrace report``
    does) in a temporary directory, the driver's DuckDB bounded by ``memory_limit``; print one JSON
    line of timings and the digest."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="pdtrace-scale-", dir=tmp)
    cache = os.path.join(work, "analysis.duckdb")
    t0 = time.perf_counter()
    if engine == "duckdb":
        from pdtrace.analysis import db

        tr = db.Trace(store, cache=cache, memory_limit=memory_limit)
    else:
        from pdtrace.analysis import spark

        s = spark.session(master)
        t_session = time.perf_counter() - t0
        tr = spark.SparkTrace(store, cache=cache, memory_limit=memory_limit, spark=s,
                              task_memory_limit=task_memory_limit, work_dir=work)
    tr.batch_requests = batch
    t1 = time.perf_counter()
    res = tr.refresh(warn=False)
    t2 = time.perf_counter()
    n, digest = tr.con.execute(DIGEST_SQL).fetchone()
    out = {"engine": engine, "master": master if engine == "spark" else None, "open_s": t1 - t0,
           "refresh_s": t2 - t1, "wall_s": t2 - t0, "requests": n, "digest": str(digest),
           "files": len(res.new), "skipped": len(res.skipped), "spark": getattr(tr, "spark_stats", {})}
    if engine == "spark":
        out["session_s"] = t_session
    print("RESULT " + json.dumps(out), flush=True)
    tr.close()
    shutil.rmtree(work, ignore_errors=True)


def _measure(cmd: list[str]) -> tuple[dict, dict]:
    """Run ``cmd``; return (its RESULT json, peaks in MiB: tree, driver, jvm, python_worker)."""
    import psutil

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    root = psutil.Process(p.pid)
    peak = {"tree": 0, "driver": 0, "jvm": 0, "python_worker": 0}
    while p.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            rss = {}
            for q in procs:
                try:
                    rss[q.pid] = (q.memory_info().rss, " ".join(q.cmdline()))
                except psutil.Error:
                    pass
            peak["tree"] = max(peak["tree"], sum(r for r, _ in rss.values()))
            peak["driver"] = max(peak["driver"], rss.get(p.pid, (0, ""))[0])
            peak["jvm"] = max([peak["jvm"]] + [r for r, c in rss.values() if "java" in c.split(" ")[0]])
            peak["python_worker"] = max([peak["python_worker"]] + [r for pid, (r, c) in rss.items()
                                                                   if pid != p.pid and "pyspark" in c])
        except psutil.Error:
            pass
        time.sleep(0.2)
    out = p.stdout.read()
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{cmd} printed no result (exit {p.returncode})")
    return json.loads(line[len("RESULT "):]), {k: v / 2**20 for k, v in peak.items()}


def _bare_scan(store: str) -> float:
    """Seconds for DuckDB to read every column of every store file once (the floor of a cold build)."""
    import duckdb

    from pdtrace.instrument import store as _store

    files = [str(p) for p in _store.store_files(store)]
    t0 = time.perf_counter()
    duckdb.connect().execute("SELECT max(hash(COLUMNS(*))) FROM read_parquet(?, union_by_name = true)",
                             [files]).fetchall()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--masters", default="local[1],local[2]")
    ap.add_argument("--task-memory-limit", default="1GB")
    ap.add_argument("--memory-limit", default="6GB", help="the driver's DuckDB memory_limit (both engines)")
    ap.add_argument("--tmp", default=None, help="directory for the cache files and Spark work (default the temp dir)")
    ap.add_argument("--batch-requests", type=int, default=100_000)
    ap.add_argument("--no-duckdb", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "MASTER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], a.store, a.child[1], a.task_memory_limit, a.batch_requests, a.memory_limit, a.tmp)
        return
    print(f"store {a.store}: bare scan {_bare_scan(a.store):.1f} s (every column of every file, DuckDB, 2 threads)")
    runs = [("duckdb", "-")] if not a.no_duckdb else []
    runs += [("spark", m) for m in a.masters.split(",")]
    first_spark = None
    digests = set()
    for engine, master in runs:
        cmd = [sys.executable, __file__, a.store, "--task-memory-limit", a.task_memory_limit,
               "--memory-limit", a.memory_limit, *(["--tmp", a.tmp] if a.tmp else []),
               "--batch-requests", str(a.batch_requests), "--child", engine, master]
        res, peak = _measure(cmd)
        digests.add((res["requests"], res["digest"]))
        speed = ""
        if engine == "spark":
            first_spark = first_spark or res["wall_s"]
            speed = f" speed-up {first_spark / res['wall_s']:.2f}x over {runs[1 if not a.no_duckdb else 0][1]}"
        sp = res["spark"]
        extra = (f" (session {res['session_s']:.1f} s; driver before the tasks {sp.get('driver_global_seconds', 0):.1f} s;"
                 f" {sp.get('batches', 0)} tasks: wall {sp.get('wall_seconds', 0):.1f} s, summed {sp.get('task_seconds', 0):.1f} s;"
                 f" gather {sp.get('gather_seconds', 0):.1f} s)") if engine == "spark" else ""
        print(f"{engine:6s} {master:9s} cold {res['wall_s']:7.1f} s{speed}{extra}; peak RSS tree {peak['tree']:.0f} MiB,"
              f" driver {peak['driver']:.0f}, JVM {peak['jvm']:.0f}, largest Python worker {peak['python_worker']:.0f};"
              f" {res['requests']} requests, {res['files']} files", flush=True)
    print("same answers (requests digest) across engines:", "yes" if len(digests) == 1 else f"NO {digests}")


if __name__ == "__main__":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    main()
