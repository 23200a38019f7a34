"""The analysis on Apache Spark: the refresh engine's per-request steps run as Spark tasks.

One definition of every rule: a Spark task runs the same DuckDB SQL library
(:mod:`pdtrace.analysis.loader`) over one batch of requests, exactly as a cold build of a large
store does on one machine (:meth:`pdtrace.analysis.materialize.Materializer._materialize_in_batches`).
Why this and not the SQL translated to Spark SQL, with what each costs: ``docs/spark.md``.

How a :class:`SparkTrace` refresh runs (a cold build; the driver is this process):

1. **Listing and checks.** The driver lists the store and reads the footers
   (:func:`pdtrace.analysis.files.scan`); the full decode of every new file -- the costly check --
   runs in Spark tasks, a slice of the files each (:func:`_decode_slice`).
2. **Global parts, on the driver.** The ``file``, ``changed``, ``window`` and ``full``
   materializations (per-file partial aggregates, per-request facts from each request's own rows,
   their window roll-ups, clock offsets and step baselines) are computed by the driver's DuckDB, as
   on one machine.
3. **Per-request parts, in Spark tasks.** The requests are split into time-ordered batches
   (:meth:`~pdtrace.analysis.materialize.Materializer._plan_batches`: at least one per Spark core, at
   most :attr:`~pdtrace.analysis.materialize.Materializer.batch_requests` requests each; a request and
   the ids its router linked to it stay together). The driver writes its database to a snapshot
   file in the work directory; each task opens the snapshot read-only (all tasks share it, the
   tables the batch writes are temporary ones), points ``_records`` at the store files
   holding its batch's requests, computes the ``request`` materializations (critical path, TTFT
   segments, stalls, flags, ...) with DuckDB bounded by ``task_memory_limit`` and ``task_threads``,
   and writes those tables alone to a file of its own in the work directory (:func:`_run_batch`).
4. **Gather.** The driver attaches each task's file read-only and inserts its rows, so the driver
   holds a complete analysis database: ``pdtrace report``, ``pdtrace sql`` and the dashboard read it
   through the same views (:func:`pdtrace.analysis.open` with ``engine="spark"``).

A warm refresh (a few new files of a growing directory) recomputes few requests: it runs on the
driver, through the same steps as :class:`pdtrace.analysis.db.Trace`.

Bad input is the DuckDB path's: the listing and its checks are the same code, so a bad or corrupt
file is skipped and named alike, and a store file removed while the tasks read it (compaction)
fails the Spark job as an access error; the refresh then lists the directory again and starts over,
as :meth:`pdtrace.analysis.db.Trace.refresh` does for DuckDB (never a silently short answer).

The work directory must be readable and writable by the driver and every executor (a shared file
system on a cluster; a temporary directory in local mode). The store files are read by the
executors at the paths the driver listed. pyspark and a Java 17 runtime are needed (the ``spark``
extra; Debian's ``openjdk-17-jre-headless``); this module imports pyspark only when a session is made.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from . import db as _db
from . import files as _files
from .materialize import Materializer, materializations

#: The Spark master of ``pdtrace ... --engine spark`` when none is given: local mode, two cores.
DEFAULT_MASTER = "local[2]"


def session(master: str = DEFAULT_MASTER, conf: dict[str, str] | None = None):
    """A SparkSession for the analysis (``getOrCreate``: an active one is reused, ``master`` and
    ``conf`` then apply only where Spark lets them). Python workers run this interpreter
    (``spark.pyspark.python``); the UI and the console progress bar are off. Raises ImportError
    (naming the ``spark`` extra) without pyspark, ValueError for a Spark Connect URL (``sc://``: the
    engine runs Python tasks through the SparkContext, which Spark Connect does not offer), and what
    Spark raises when Java cannot start."""
    if master.startswith("sc://"):
        raise ValueError(f"the Spark engine cannot run over Spark Connect ({master}): it runs Python tasks "
                         "through the SparkContext, which Spark Connect does not offer; give the cluster's "
                         "master URL (spark://HOST:7077, yarn, k8s://...) or local[N]")
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImportError("the Spark engine needs pyspark: pip install 'pdtrace[spark]'") from exc
    # the workers run this interpreter (its venv holds pdtrace): Spark's own setting is not enough
    # for a local master, whose workers are started from PYSPARK_PYTHON (default: python3 on PATH)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    b = (SparkSession.builder.master(master).appName("pdtrace-analysis")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.pyspark.python", sys.executable)
         .config("spark.pyspark.driver.python", sys.executable)
         .config("spark.log.level", "ERROR"))
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    return b.getOrCreate()


def _decode_slice(paths: list[str], threads: int, memory_limit: str | None) -> list[tuple[str, str, str]]:
    """Spark task: :func:`pdtrace.analysis.files.decode_errors` of ``paths`` (DuckDB bounded by ``threads``
    and ``memory_limit``), as (path, state, reason)."""
    return [(p, state, reason) for p, (state, reason) in
            _files.decode_errors(paths, threads=threads, memory_limit=memory_limit).items()]


class _BatchState(Materializer):
    """A task's read-only view of the driver's snapshot: the refresh steps over one batch (see
    :func:`_run_batch`); what they write lives in the connection's temporary catalog."""

    _records_view = "TEMP VIEW"

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con


def _run_batch(snapshot: str, work: str, batch: int, paths: list[str], threads: int,
               memory_limit: str | None) -> tuple[int, str, int, float]:
    """Spark task: compute the ``request`` materializations of batch ``batch``.

    Opens the driver's ``snapshot`` (a DuckDB file) read-only -- every task shares it, nothing is
    copied -- and shadows the tables a batch writes (the ``request`` and ``scratch`` materializations,
    empty on a cold build, and ``_scope_keys``) with temporary tables of the same columns, which the
    views then read instead (DuckDB resolves the temporary catalog first). It sets ``_scope_keys`` to
    the keys of the batch (table ``_spark_batch``), points ``_records`` (a temporary view) at the store
    files ``paths`` holding them, and runs the same step as a batched cold build
    (:meth:`~pdtrace.analysis.materialize.Materializer._materialize_scope`); then writes the batch's
    ``request`` tables alone to ``work/batch-<batch>-<attempt>.duckdb``. Every file of the task is
    named by its Spark task attempt, so a retried or speculative attempt never shares one. Returns
    (batch, path of the output, requests, seconds). Raises what DuckDB raises (the Spark job then
    fails with it).
    """
    from pyspark import TaskContext

    t0 = time.perf_counter()
    ctx = TaskContext.get()
    tag = f"{batch:06d}-{ctx.taskAttemptId() if ctx is not None else os.getpid()}"
    out = os.path.join(work, f"batch-{tag}.duckdb")
    spill = os.path.join(work, f"spill-{tag}")
    try:
        con = duckdb.connect(snapshot, read_only=True)
        try:
            con.execute(f"SET threads = {int(threads)}")
            if memory_limit:
                con.execute("SET memory_limit = ?", [memory_limit])
            con.execute("SET preserve_insertion_order = false")
            con.execute("SET temp_directory = ?", [spill])
            for table in [m.table for m in materializations("request", "scratch")] + ["_scope_keys"]:
                con.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT * FROM main.{table} LIMIT 0")
            st = _BatchState(con)
            con.execute("INSERT INTO temp._scope_keys SELECT rkey FROM _spark_batch WHERE b = ?", [batch])
            n = con.execute("SELECT count(*) FROM temp._scope_keys").fetchone()[0]
            st._set_records(sorted(paths))
            st._materialize_scope()
            con.execute("ATTACH ? AS _out (READ_WRITE)", [out])
            for m in materializations("request"):
                con.execute(f"CREATE TABLE _out.{m.table} AS SELECT * FROM temp.{m.table}")
            con.execute("DETACH _out")
        finally:
            con.close()
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    return batch, out, n, time.perf_counter() - t0


class SparkTrace(_db.Trace):
    """A :class:`pdtrace.analysis.db.Trace` whose cold build runs its per-request steps, and the full
    decode of new files, as Spark tasks (see the module docstring).

    ``spark``: a SparkSession (default: :func:`session` with ``master``). ``work_dir``: where each
    refresh makes its own directory for the snapshot and the tasks' outputs, removed whole afterwards
    (it must be readable and writable by every executor; default the temp dir, for a local master
    only). ``directory`` is resolved to an absolute path (executors read the files at the listed paths). ``task_threads``, ``task_memory_limit``: each
    task's DuckDB ``threads`` and ``memory_limit`` (e.g. ``'1GB'``; bound them with the executors'
    cores and memory; the full decode tasks are bound alike). Other arguments as
    :class:`pdtrace.analysis.db.Trace`. Raises ValueError for a work directory inside the store, or
    none with a master that is not local.
    """

    #: Rows are never held in the driver's memory: the tasks read the store files themselves.
    hold_bytes = 0

    def __init__(self, directory: str | os.PathLike, cache: str | os.PathLike | None = None,
                 threads: int | None = None, memory_limit: str | None = None, *, spark=None,
                 master: str = DEFAULT_MASTER, work_dir: str | os.PathLike | None = None,
                 task_threads: int = 1, task_memory_limit: str | None = None, window=None):
        directory = Path(directory).resolve()  # executors read the store at the listed paths
        self.spark = spark if spark is not None else session(master)
        self.work_dir = Path(work_dir).resolve() if work_dir is not None else None
        if self.work_dir is not None and directory.is_dir() and (
                self.work_dir == directory or directory in self.work_dir.parents):
            raise ValueError(f"the Spark work directory {self.work_dir} must not be inside the store {directory}")
        if self.work_dir is None and not self.spark.sparkContext.master.startswith("local"):
            raise ValueError(f"a Spark master that is not local ({self.spark.sparkContext.master}) needs a work "
                             "directory every executor can read and write (work_dir / --work-dir)")
        self.task_threads = task_threads
        self.task_memory_limit = task_memory_limit
        #: What the last cold build did: {"batches", "requests", "task_seconds" (summed over tasks),
        #: "wall_seconds" (of the tasks' job), "decode_tasks", "driver_global_seconds", "gather_seconds"}.
        self.spark_stats: dict[str, float] = {}
        super().__init__(directory, cache=cache, threads=threads, memory_limit=memory_limit, window=window)

    def refresh(self, warn: bool = True) -> _db.RefreshResult:
        """:meth:`pdtrace.analysis.db.Trace.refresh`; :attr:`spark_stats` then also holds the driver's
        seconds before the per-request tasks (``driver_global_seconds``: listing, checks, global parts)
        and gathering their rows (``gather_seconds``)."""
        self._t_refresh = time.perf_counter()
        self.spark_stats = {}
        return super().refresh(warn)

    @property
    def _cores(self) -> int:
        return max(1, int(self.spark.sparkContext.defaultParallelism))

    #: New files totalling fewer bytes than this are decoded on the driver (a Spark job costs ~0.4 s
    #: in local mode; decoding 64 MiB of store files about as much on one core).
    spark_decode_bytes = 64 << 20

    def _decode_errors(self, paths: list[str]) -> dict[str, tuple[str, str]]:
        """:func:`pdtrace.analysis.files.decode_errors` of ``paths`` in Spark tasks (a slice of the files
        per core), or on the driver below :attr:`spark_decode_bytes`; same answer."""
        if not paths:
            return {}
        if sum(os.path.getsize(p) for p in paths if os.path.exists(p)) < self.spark_decode_bytes:
            return super()._decode_errors(paths)
        n = min(len(paths), self._cores * 2)
        slices = [paths[i::n] for i in range(n)]
        threads, limit = self.task_threads, self.task_memory_limit
        rows = self.spark.sparkContext.parallelize(slices, n).flatMap(
            lambda sl: _decode_slice(sl, threads, limit)).collect()
        self.spark_stats["decode_tasks"] = n
        return {p: (state, reason) for p, state, reason in rows}

    def _materialize_requests(self, files: list[str], n_scope: int, cold: bool) -> None:
        """Run the request batches as Spark tasks on a cold build (a warm refresh: on the driver)."""
        if not cold or n_scope == 0:
            return super()._materialize_requests(files, n_scope, cold)
        con = self.con
        self.spark_stats["driver_global_seconds"] = time.perf_counter() - getattr(self, "_t_refresh", time.perf_counter())
        batches = self._plan_batches(max(-(-n_scope // self.batch_requests), self._cores))
        holding = self._batch_files(files)
        if self.work_dir is not None:
            self.work_dir.mkdir(parents=True, exist_ok=True)
        # one directory per refresh (removed whole): runs sharing a work directory never meet
        work = tempfile.mkdtemp(prefix="pdtrace-spark-", dir=self.work_dir)
        snapshot = os.path.join(work, "snapshot.duckdb")
        try:
            con.execute("CREATE OR REPLACE TABLE main._spark_batch AS SELECT rkey, b FROM _scope_batch")
            db = con.execute("SELECT current_database()").fetchone()[0]
            con.execute("ATTACH ? AS _spark_snapshot", [snapshot])
            try:
                con.execute(f'COPY FROM DATABASE "{db}" TO _spark_snapshot')
            finally:
                con.execute("DETACH _spark_snapshot")
            threads, limit = self.task_threads, self.task_memory_limit
            jobs = [(b, holding.get(b, [])) for b in batches]
            t0 = time.perf_counter()
            try:
                done = self.spark.sparkContext.parallelize(jobs, len(jobs)).map(
                    lambda j: _run_batch(snapshot, work, j[0], j[1], threads, limit)).collect()
            except Exception as exc:  # the job failed: a task's error, wrapped by Spark (Py4JJavaError)
                moved = [p for p in files if not os.path.exists(p)]
                if moved and _files._ACCESS_WORDS.search(str(exc)):
                    # a task could not open a listed file that compaction removed: DuckDB's access error
                    raise duckdb.IOException(f"Cannot open file {moved[0]}: removed while Spark tasks read the "
                                             f"store ({len(moved)} listed file(s) gone)") from exc
                raise
            self.spark_stats.update(batches=len(done), requests=sum(d[2] for d in done),
                                    task_seconds=sum(d[3] for d in done), wall_seconds=time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _, path, _, _ in sorted(done):
                con.execute("ATTACH ? AS _spark_batch_db (READ_ONLY)", [path])
                try:
                    for m in materializations("request"):
                        con.execute(f"INSERT INTO {m.table} SELECT * FROM _spark_batch_db.main.{m.table}")
                finally:
                    con.execute("DETACH _spark_batch_db")
            self.spark_stats["gather_seconds"] = time.perf_counter() - t0
        finally:
            con.execute("DROP TABLE IF EXISTS main._spark_batch")
            shutil.rmtree(work, ignore_errors=True)
        self._end_batches()
