"""A materialized analysis: a trace's answers written once, as Parquet datasets and a database.

``pdtrace materialize [--engine duckdb|spark] SRC DEST`` (:func:`write`) analyses the store SRC once
and writes DEST::

    DEST/.pdtrace-materialization      written first: DEST is a materialization (a new run replaces it)
    DEST/pdtrace-materialized.json     the manifest (written last: a DEST without it is incomplete)
    DEST/analysis.duckdb               the analysis database (the same views as a cache file)
    DEST/<view>/date=YYYY-MM-DD/hour=HH/*.parquet
                                       each public view's rows (``requests``, ``ttft_segments``,
                                       ``ttft_breakdown``, ``incomplete_requests``, ``transfers``,
                                       ``block_holds``, ``decode_stalls``, ``request_stalls``,
                                       ``clock_offsets``, the summaries, ...), partitioned like the
                                       store by the UTC date and hour of the row's time column
                                       (:data:`TIME_COLUMNS`); a view without one is one file
                                       ``DEST/<view>/data.parquet``

``pdtrace report DEST``, ``pdtrace sql DEST`` and the dashboard open DEST like a trace directory
(:func:`pdtrace.analysis.open` recognizes the manifest, :func:`is_materialized`): they read the
database, read-only, without refreshing it. The views that read the span rows themselves
(``spans``, ``events``, ``collected_spans``, ``in_flight_spans``) read SRC's files in place, so
they answer while SRC is where it was. Spark, Trino or any Parquet reader reads the datasets
(``DEST/<view>/``, Hive partitioning on ``date`` and ``hour``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import duckdb

#: The manifest's file name; its presence marks a complete materialization.
MANIFEST = "pdtrace-materialized.json"
#: Written first and kept: DEST is (or was being made) a materialization, which a new run may replace.
MARKER = ".pdtrace-materialization"
#: The analysis database's file name in DEST.
DATABASE = "analysis.duckdb"
#: Views not written as datasets: they are the span rows themselves (SRC holds them).
RAW_VIEWS = ("spans", "events", "collected_spans", "in_flight_spans")
#: A view's partition time: the first of these columns it has (ns since the Unix epoch).
TIME_COLUMNS = ("arrival_ns", "start_ns", "window_start_ns", "first_ns", "since_ns", "first_flush_ns")


def is_materialized(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a complete materialization (its manifest)."""
    return (Path(directory) / MANIFEST).is_file()


def manifest(directory: str | os.PathLike) -> dict:
    """The manifest of the materialization in ``directory``. Raises FileNotFoundError without one,
    ValueError when it is not valid JSON."""
    return json.loads((Path(directory) / MANIFEST).read_text())


def database(directory: str | os.PathLike) -> Path:
    """The analysis database of the materialization in ``directory``."""
    return Path(directory) / DATABASE


def _inside(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def write(source: str | os.PathLike, dest: str | os.PathLike, engine: str = "duckdb", *,
          master: str | None = None, threads: int | None = None, memory_limit: str | None = None,
          task_memory_limit: str | None = None, work_dir: str | os.PathLike | None = None) -> dict:
    """Analyse the store ``source`` with ``engine`` (``duckdb`` or ``spark``) and write the
    materialization ``dest`` (layout in the module docstring); returns the manifest.

    ``master``: the Spark master (default :data:`pdtrace.analysis.spark.DEFAULT_MASTER`);
    ``threads``, ``memory_limit``: the driver's DuckDB settings; ``task_memory_limit``, ``work_dir``:
    see :class:`pdtrace.analysis.spark.SparkTrace`. Nothing is read from or written into ``source``
    beyond its store files. ``dest`` is written under temporary names and the manifest last: a crash
    leaves no manifest, and a later run replaces what it left. An earlier materialization in
    ``dest`` is replaced.

    Raises ValueError for an unknown engine, for ``dest`` inside ``source`` (its Parquet files would
    be read as store files) or ``source`` inside ``dest``, and FileExistsError for a ``dest`` that
    holds other files and no manifest; FileNotFoundError when ``source`` does not exist.
    """
    from . import db as _db

    src, out = Path(source), Path(dest)
    if engine not in ("duckdb", "spark"):
        raise ValueError(f"unknown engine {engine!r}: duckdb or spark")
    if not src.is_dir():
        raise FileNotFoundError(f"trace directory not found: {src}")
    if _inside(out, src) or _inside(src, out):
        raise ValueError(f"the materialization {out} and the store {src} must not contain each other")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} holds files and is not a materialization: choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()
    (out / MANIFEST).unlink(missing_ok=True)  # from here on, incomplete until written again
    t0 = time.perf_counter()
    tmp_db = out / f".{DATABASE}.tmp"
    for p in (tmp_db, Path(f"{tmp_db}.wal")):
        p.unlink(missing_ok=True)
    if engine == "spark":
        from . import spark as _spark

        tr = _spark.SparkTrace(src, cache=tmp_db, threads=threads, memory_limit=memory_limit,
                               master=master or _spark.DEFAULT_MASTER, work_dir=work_dir,
                               task_memory_limit=task_memory_limit)
    else:
        tr = _db.Trace(src, cache=tmp_db, threads=threads, memory_limit=memory_limit)
    with tr:
        res = tr.refresh(warn=False)
        stats = dict(getattr(tr, "spark_stats", {}))
        tr.con.execute("CHECKPOINT")
    build_s = time.perf_counter() - t0
    views = _export(tmp_db, out)
    os.replace(tmp_db, out / DATABASE)
    doc = {
        "source": str(src.resolve()), "engine": engine, "master": master if engine == "spark" else None,
        "created_unix_s": round(time.time(), 3), "build_seconds": round(build_s, 3),
        "seconds": round(time.perf_counter() - t0, 3), "files": len(res.new), "skipped": res.skipped,
        "spark": stats, "views": views,
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, out / MANIFEST)
    return doc


def _export(db_path: Path, out: Path) -> dict[str, dict]:
    """Write every public view of the database ``db_path`` except :data:`RAW_VIEWS` as a Parquet
    dataset ``out/<view>/`` (each under a temporary name, then renamed); {view: {"rows", "partitioned_by"}}."""
    con = duckdb.connect(str(db_path), read_only=True)
    done: dict[str, dict] = {}
    try:
        con.execute("SET preserve_insertion_order = false")
        views = [r[0] for r in con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal AND NOT starts_with(view_name, '_') "
            "AND database_name = current_database() ORDER BY 1").fetchall() if r[0] not in RAW_VIEWS]
        for v in views:
            cols = [r[0] for r in con.execute(f'SELECT * FROM "{v}" LIMIT 0').description]
            tcol = next((c for c in TIME_COLUMNS if c in cols), None)
            tmp, final = out / f".{v}.tmp", out / v
            shutil.rmtree(tmp, ignore_errors=True)
            if tcol is None:
                tmp.mkdir()
                con.execute(f"COPY (SELECT * FROM \"{v}\") TO '{_q(tmp / 'data.parquet')}' (FORMAT parquet)")
            else:
                # the partition of a row whose time is unknown: date=unknown/hour=-1
                con.execute(f"""
                    COPY (SELECT *, coalesce(strftime(make_timestamp("{tcol}" // 1000), '%Y-%m-%d'), 'unknown') AS date,
                                 coalesce(hour(make_timestamp("{tcol}" // 1000)), -1) AS hour FROM "{v}")
                    TO '{_q(tmp)}' (FORMAT parquet, PARTITION_BY (date, hour))""")
                if not tmp.exists():  # no row: an empty directory, still a dataset
                    tmp.mkdir()
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            n = con.execute(f'SELECT count(*) FROM "{v}"').fetchone()[0]
            done[v] = {"rows": n, "partitioned_by": ["date", "hour"] if tcol else [], "time_column": tcol}
    finally:
        con.close()
    return done


def _q(p: Path) -> str:
    return str(p).replace("'", "''")
