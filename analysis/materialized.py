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
                                       (:data:`TIME_COLUMNS`; a row without one under
                                       ``__HIVE_DEFAULT_PARTITION__``); a view without one is one
                                       file ``DEST/<view>/data.parquet``. HUGEINT columns (sums of
                                       ns) are written as BIGINT; ``rkey`` stays UBIGINT (UINT64)

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

from pdtrace.instrument.store import exclusive_lock

from .template import fsync_path

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


def is_started(directory: str | os.PathLike) -> bool:
    """True when ``directory`` is, or was being made, a materialization (its marker or manifest)."""
    d = Path(directory)
    return (d / MARKER).exists() or is_materialized(d)


def open_readonly(directory: str | os.PathLike):
    """The analysis database of the materialization in ``directory``, read-only and locked down
    (:func:`pdtrace.analysis.sandbox.connect_readonly`: only its store files readable); with the
    manifest's skipped files as [(path, reason)]. Returns (ReadOnlyConnection, skipped).

    Raises RuntimeError when the materialization is incomplete (no manifest: a run died or runs
    now), when its database was made by another SQL library (another pdtrace version), or when it
    names store files outside the manifest's source directory (a database pdtrace did not write
    this way is never trusted with file access).
    """
    from . import cache as _cache
    from . import sandbox as _sandbox

    d = Path(directory)
    if not is_materialized(d):
        raise RuntimeError(f"{d} is an incomplete materialization (no {MANIFEST}): run `pdtrace materialize` again")
    doc = manifest(d)
    src = Path(doc.get("source", ""))
    con = duckdb.connect(str(database(d)), read_only=True)
    try:
        row = con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()
        if row is None or row[0] != _cache.library_stamp():
            raise RuntimeError(f"{d} was materialized by another pdtrace version: run `pdtrace materialize` again")
        outside = [p for (p,) in con.execute("SELECT path FROM _files WHERE ok").fetchall()
                   if not src.is_absolute() or src not in Path(p).resolve().parents]
        if outside:
            raise RuntimeError(f"{d}: its database names store files outside its source {src} ({outside[0]})")
        return _sandbox.lock_down(con), [tuple(x) for x in doc.get("skipped", [])]
    except BaseException:
        con.close()
        raise


def _inside(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def write(source: str | os.PathLike, dest: str | os.PathLike, engine: str = "duckdb", *,
          master: str | None = None, threads: int | None = None, memory_limit: str | None = None,
          task_memory_limit: str | None = None, work_dir: str | os.PathLike | None = None, window=None) -> dict:
    """Analyse the store ``source`` with ``engine`` (``duckdb`` or ``spark``) and write the
    materialization ``dest`` (layout in the module docstring); returns the manifest.

    ``master``: the Spark master (default :data:`pdtrace.analysis.spark.DEFAULT_MASTER`);
    ``threads``, ``memory_limit``: the driver's DuckDB settings; ``task_memory_limit``, ``work_dir``:
    see :class:`pdtrace.analysis.spark.SparkTrace`; ``window``: a :class:`pdtrace.analysis.window.Window`,
    the requests that arrived in it only (the manifest's ``window`` names it, ``pruned_files`` counts the
    store files it left out; a fleet materializes each hour of a day this way). Nothing is read from or written into ``source``
    beyond its store files. ``dest`` is written under temporary names, fsynced, and the manifest
    written last; an earlier materialization in ``dest`` keeps its manifest until the new build
    succeeded (a run that cannot start, e.g. without Java, leaves it whole), and a crash after that
    leaves no manifest (:func:`pdtrace.analysis.open` then refuses DEST until a run completes). A
    view dataset of an earlier materialization that no longer exists is removed. One writer per
    ``dest`` at a time: the run holds an exclusive lock (flock) on ``dest``'s marker file while it runs.

    Raises ValueError for an unknown engine, for a ``source`` that is itself a materialization, for
    ``dest`` inside ``source`` (its Parquet files would be read as store files) or ``source`` inside ``dest``, FileExistsError for a ``dest`` that
    holds other files and no manifest, :class:`MaterializeBusy` while another run writes ``dest``;
    FileNotFoundError when ``source`` does not exist.
    """
    from . import db as _db

    src, out = Path(source).resolve(), Path(dest).resolve()  # the database names store files by absolute path
    if engine not in _db.ENGINES:
        raise ValueError(f"unknown engine {engine!r}: duckdb or spark")
    if not src.is_dir():
        raise FileNotFoundError(f"trace directory not found: {src}")
    if (src / MARKER).exists():
        raise ValueError(f"{src} is a materialization, not a trace directory")
    if _inside(out, src) or _inside(src, out):
        raise ValueError(f"the materialization {out} and the store {src} must not contain each other")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} holds files and is not a materialization: choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out / MARKER, MaterializeBusy(f"another pdtrace materialize is writing {out}")):
        return _write_locked(src, out, engine, master=master, threads=threads, memory_limit=memory_limit,
                             task_memory_limit=task_memory_limit, work_dir=work_dir, window=window)


class MaterializeBusy(RuntimeError):
    """Another ``pdtrace materialize`` holds the lock of the same DEST."""


def _write_locked(src: Path, out: Path, engine: str, *, master, threads, memory_limit, task_memory_limit,
                  work_dir, window) -> dict:
    """:func:`write`'s build and export, with ``out``'s lock held."""
    from . import db as _db

    old_views = set(manifest(out)["views"]) if is_materialized(out) else set()
    t0 = time.perf_counter()
    tmp_db = out / f".{DATABASE}.tmp"
    for p in (tmp_db, Path(f"{tmp_db}.wal")):
        p.unlink(missing_ok=True)
    tr = _db.make_trace(src, cache=tmp_db, threads=threads, memory_limit=memory_limit, engine=engine,
                        spark_master=master, spark_opts={"work_dir": work_dir, "task_memory_limit": task_memory_limit},
                        window=window)
    with tr:
        res = tr.refresh(warn=False)
        stats = dict(getattr(tr, "spark_stats", {}))
        used_master = tr.spark.sparkContext.master if engine == "spark" else None
        tr.con.execute("CHECKPOINT")
    build_s = time.perf_counter() - t0
    # the build succeeded: from here on DEST is incomplete until its manifest is written again
    (out / MANIFEST).unlink(missing_ok=True)
    views = _export(tmp_db, out)
    for gone in old_views - set(views):  # a view of an earlier materialization that no longer exists
        shutil.rmtree(out / gone, ignore_errors=True)
    os.replace(tmp_db, out / DATABASE)
    _sync_tree(out)
    doc = {
        "source": str(src), "engine": engine, "master": used_master,
        "created_unix_s": round(time.time(), 3), "build_seconds": round(build_s, 3),
        "seconds": round(time.perf_counter() - t0, 3), "files": len(res.new), "skipped": res.skipped,
        "window": window.describe() if window is not None else None, "pruned_files": len(res.pruned),
        "spark": stats, "views": views,
    }
    tmp = out / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MANIFEST)
    fsync_path(out)
    return doc


def _sync_tree(out: Path) -> None:
    """fsync every file and directory under ``out`` (before the manifest says DEST is complete)."""
    for root, _, names in os.walk(out):
        for n in names:
            fsync_path(os.path.join(root, n))
        fsync_path(root)


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
            types = con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ? "
                                "AND database_name = current_database() ORDER BY column_index", [v]).fetchall()
            cols = [c for c, _ in types]
            # HUGEINT (sums of ns) has no Parquet type (DuckDB would write DOUBLE, losing digits): BIGINT
            sel = ", ".join(f'"{c}"::BIGINT AS "{c}"' if t == "HUGEINT" else f'"{c}"' for c, t in types)
            tcol = next((c for c in TIME_COLUMNS if c in cols), None)
            tmp, final = out / f".{v}.tmp", out / v
            shutil.rmtree(tmp, ignore_errors=True)
            if tcol is None:
                tmp.mkdir()
                n = con.execute(f"COPY (SELECT {sel} FROM \"{v}\") TO '{_q(tmp / 'data.parquet')}' (FORMAT parquet)"
                                ).fetchone()[0]
            else:
                # like the store's: date=YYYY-MM-DD/hour=HH (UTC); a row without a time in
                # date=__HIVE_DEFAULT_PARTITION__/hour=__HIVE_DEFAULT_PARTITION__
                n = con.execute(f"""
                    COPY (SELECT {sel}, strftime(make_timestamp("{tcol}" // 1000), '%Y-%m-%d') AS date,
                                 strftime(make_timestamp("{tcol}" // 1000), '%H') AS hour FROM "{v}")
                    TO '{_q(tmp)}' (FORMAT parquet, PARTITION_BY (date, hour))""").fetchone()[0]
                if not tmp.exists():  # no row: an empty directory, still a dataset
                    tmp.mkdir()
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            done[v] = {"rows": n, "partitioned_by": ["date", "hour"] if tcol else [], "time_column": tcol}
    finally:
        con.close()
    return done


def _q(p: Path) -> str:
    return str(p).replace("'", "''")
