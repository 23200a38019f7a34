"""``pdtrace report``, ``pdtrace sql`` and ``pdtrace check``: the analysis from the command line (no vLLM needed).

All keep an incremental cache per trace directory (``--cache``, default
under ``$PDTRACE_CACHE_DIR`` or the temp dir), so a growing directory is not
re-analysed from scratch. Queries run read-only, DuckDB reading nothing outside the trace
directory (:func:`pdtrace.analysis.open`).
"""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import click
import duckdb

from pdtrace import analysis

from . import check as _check, report as _report


def _open(directory: str, cache: str | None, no_cache: bool, engine: str = "duckdb", spark_master: str | None = None,
          spark_opts: dict | None = None, window=None):
    """Open DIRECTORY through :func:`pdtrace.analysis.open` (cache as the options say; a locked cache file
    falls back to memory; ``engine``, ``spark_master``, ``spark_opts`` and ``window`` as
    :func:`pdtrace.analysis.open` takes them) and print each skipped store file as a warning on stderr; returns the Session. An
    incomplete materialization, or a Spark engine that cannot start (no Java, no pyspark, a bad master),
    is a ClickException."""
    try:
        s = analysis.open(directory, cache=None if no_cache else (Path(cache) if cache else True),
                          engine=engine, spark_master=spark_master, spark_opts=spark_opts, window=window)
    except (RuntimeError, ImportError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    except Exception as exc:  # Spark's own errors (Py4J, Java gateway) name no pdtrace type
        if engine != "spark":
            raise
        raise click.ClickException(f"the Spark engine failed: {type(exc).__name__}: "
                                   f"{(str(exc).strip().splitlines() or [''])[0][:300]}") from exc
    for path, reason in s.skipped:
        click.echo(f"warning: skipped store file {path}: {reason}", err=True)
    return s


_window_opts = [
    click.option("--since", default=None, metavar="WHEN",
                 help="Only the requests that arrived at or after WHEN: ISO 8601 (UTC without a zone, e.g. "
                      "2026-12-06T10:00) or a duration before now (30m, 2h, 1d). Reads only the store files "
                      "(Hive partitions, then footer statistics) that can hold them."),
    click.option("--until", default=None, metavar="WHEN", help="Only the requests that arrived before WHEN (as --since)."),
    click.option("--lookahead", default=None, metavar="DURATION",
                 help="With --until: how long after it the rows of a request that arrived before it are read "
                      "(default 10m; rules: pdtrace.analysis.window)."),
]


def _with_window(f):
    for opt in reversed(_window_opts):
        f = opt(f)
    return f


def _window(since, until, lookahead):
    """The :class:`pdtrace.analysis.window.Window` of the options (None without --since/--until);
    a text that does not parse is a UsageError."""
    from . import window as _window_mod

    try:
        return _window_mod.Window.from_options(since, until, lookahead)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _window_info(s) -> tuple[dict, str]:
    """For a windowed session: the report's ``window`` entry (the window and ``pruned_files``) and its
    first line."""
    w = {**s.window.describe(), "pruned_files": len(s.last_refresh.pruned) if s.last_refresh is not None else 0}
    return w, (f"Window: requests arriving in [{w['since']}, {w['until']}) (lookahead {w['lookahead_s']:g} s); "
               f"{w['pruned_files']} store file(s) outside it not read")


def _result(con, query: str):
    cur = con.execute(query)
    if cur.description is None:
        return [], []
    cols = [d[0] for d in cur.description]
    return cols, cur.fetchall()


def _print(cols, rows, fmt: str) -> None:
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        w.writerows(rows)
        click.echo(buf.getvalue(), nl=False)
    elif fmt == "json":
        click.echo(json.dumps([dict(zip(cols, r)) for r in rows], default=str, indent=1))
    else:
        click.echo(_report.table([dict(zip(cols, r)) for r in rows], cols))


_cache_opts = [
    click.option("--cache", type=click.Path(dir_okay=False), default=None,
                 help="Cache database file (default: one per directory under $PDTRACE_CACHE_DIR or the temp dir)."),
    click.option("--no-cache", is_flag=True, help="Analyse in memory; keep nothing of the trace (the SQL library template is shared)."),
]


def _with_cache(f):
    for opt in reversed(_cache_opts):
        f = opt(f)
    return f


_engine_opts = [
    click.option("--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True,
                 help="Build the analysis on this machine's DuckDB, or with its per-request steps as Apache Spark "
                      "tasks (needs the 'spark' extra and Java 17; same answers)."),
    click.option("--spark-master", default=None, metavar="URL",
                 help="Spark master for --engine spark (default local[2]; e.g. spark://host:7077)."),
    click.option("--task-memory-limit", default=None, metavar="SIZE",
                 help="--engine spark: DuckDB memory_limit of each Spark task (e.g. 1GB; bound it by the executors' memory)."),
    click.option("--work-dir", type=click.Path(file_okay=False), default=None,
                 help="--engine spark: directory for the tasks' snapshot and outputs, readable and writable by the "
                      "driver and every executor (required with a master that is not local; default the temp dir)."),
]


def _spark_opts(task_memory_limit, work_dir) -> dict:
    return {"task_memory_limit": task_memory_limit, "work_dir": work_dir}


def _with_engine(f):
    for opt in reversed(_engine_opts):
        f = opt(f)
    return f


@click.command("report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--compare", "compare_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="A second trace directory (e.g. push vs pull on the same workload), shown side by side, with the "
                   "difference in mean TTFT (second minus first) split by critical-path stage per prompt bucket.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@_with_cache
@_with_engine
@_with_window
def report(directory, compare_dir, fmt, cache, no_cache, engine, spark_master, task_memory_limit, work_dir,
           since, until, lookahead):
    """Print the TTFT breakdown summary of a trace directory or a materialization (DIRECTORY)."""
    opts = _spark_opts(task_memory_limit, work_dir)
    window = _window(since, until, lookahead)
    with _open(directory, cache, no_cache, engine, spark_master, opts, window) as s:
        data = _report.collect(s.cursor())
        if window is not None:
            data["window"], head = _window_info(s)
    if compare_dir is None:
        if fmt == "json":
            click.echo(json.dumps(data, default=str, indent=1))
        else:
            click.echo((head + "\n\n" if window is not None else "") + _report.render(data, directory))
        return
    with _open(compare_dir, None, no_cache, engine, spark_master, opts, window) as s2:
        data2 = _report.collect(s2.cursor())
        if window is not None:
            data2["window"], head2 = _window_info(s2)
    delta = _report.compare_delta(data, data2)
    if fmt == "json":
        click.echo(json.dumps({directory: data, compare_dir: data2,
                               "ttft_delta": {"a": directory, "b": compare_dir, **delta}}, default=str, indent=1))
    else:
        heads = f"{directory}: {head}\n{compare_dir}: {head2}\n\n" if window is not None else ""
        click.echo(heads + _report.render_compare(data, data2, directory, compare_dir, delta))


_HELP = """Enter SQL ending with ';'. Commands: .views (public views), .schema VIEW (its columns and units), .quit"""


def _shell(con, fmt: str) -> None:
    click.echo(_HELP)
    buf = ""
    while True:
        try:
            line = input("pdtrace> " if not buf else "     ...> ")
        except EOFError:
            break
        s = line.strip()
        if not buf and s in (".quit", ".exit"):
            break
        if not buf and s == ".views":
            _print(*_result(con, "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal "
                                 "AND NOT starts_with(view_name, '_') ORDER BY view_name"), fmt)
            continue
        if not buf and s.startswith(".schema"):
            name = s.split(maxsplit=1)[1] if len(s.split()) > 1 else ""
            cur = con.execute("SELECT column_name, data_type, comment FROM duckdb_columns() "
                              "WHERE table_name = ? ORDER BY column_index", [name])
            _print(["column_name", "data_type", "comment"], cur.fetchall(), fmt)
            continue
        buf += line + "\n"
        if s.endswith(";"):
            try:
                _print(*_result(con, buf), fmt)
            except duckdb.Error as exc:
                click.echo(f"error: {exc}", err=True)
            buf = ""


@click.command("sql")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("query", required=False)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@_with_cache
@_with_engine
@_with_window
def sql(directory, query, fmt, cache, no_cache, engine, spark_master, task_memory_limit, work_dir,
        since, until, lookahead):
    """Run read-only SQL over DIRECTORY's views (interactive shell without QUERY).

    DIRECTORY is a trace directory or a materialization (``pdtrace materialize``). Queries cannot
    write files, attach databases or change settings.
    """
    window = _window(since, until, lookahead)
    with _open(directory, cache, no_cache, engine, spark_master, _spark_opts(task_memory_limit, work_dir),
               window) as s:
        con = s.cursor()
        if query is None:
            _shell(con, fmt)
            return
        try:
            cols, rows = _result(con, query)
        except duckdb.Error as exc:
            raise click.ClickException(str(exc)) from exc
        _print(cols, rows, fmt)


@click.command("check")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--recent", "recent_s", type=click.FloatRange(min=0), default=_check.RECENT_S, show_default=True,
              metavar="SECONDS", help="A process is live when its last flush is at most SECONDS old; "
                                      "a problem when none is.")
@click.option("--at-end", is_flag=True,
              help="Measure ages from the trace's newest flush instead of now (a finished run, e.g. a lab run).")
@click.option("--max-clock-bound-ms", type=click.FloatRange(min=0), default=_check.MAX_CLOCK_BOUND_MS,
              show_default=True, help="A clock offset bound above this is a problem.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@_with_cache
def check(directory, recent_s, at_end, max_clock_bound_ms, fmt, cache, no_cache):
    """Check that tracing works in DIRECTORY (default: $PDTRACE_DIR): which processes write, drops, errors.

    Lists every process that wrote (role, engine, host, pid, pdtrace/vLLM
    version, connector, how tracing was switched on, sampling, age of its
    last flush, its recorder's counters), the clock offsets and skipped
    files, then each problem on its own line. Exit status: 0 no problem,
    1 a problem (the kinds: pdtrace.analysis.check), 2 bad usage. Reads
    only: nothing is written into DIRECTORY.
    """
    if directory is None:
        from pdtrace.instrument import config

        directory = config.from_env().trace_dir
        if directory is None:
            raise click.UsageError("no DIRECTORY given and PDTRACE_DIR is not set")
    if not Path(directory).is_dir():
        data = _check.missing(directory, recent_s=recent_s, max_clock_bound_ms=max_clock_bound_ms)
    else:
        with _open(directory, cache, no_cache) as s:
            data = _check.collect(s.cursor(), directory, recent_s=recent_s, at_end=at_end,
                                  max_clock_bound_ms=max_clock_bound_ms)
    click.echo(json.dumps(data, default=str, indent=1) if fmt == "json" else _check.render(data))
    sys.exit(0 if data["ok"] else 1)


@click.command("materialize")
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@_with_engine
@_with_window
def materialize(source, dest, engine, spark_master, task_memory_limit, work_dir, since, until, lookahead):
    """Analyse the trace directory SOURCE once and write DEST: the views as Parquet datasets
    partitioned by date and hour, and the analysis database that `pdtrace report DEST`, `pdtrace sql DEST`
    and the dashboard read (layout: pdtrace.analysis.materialized). With --since/--until, only the
    requests that arrived in that window (e.g. one materialization per hour of a fleet's day)."""
    from . import materialized as _materialized

    window = _window(since, until, lookahead)
    try:
        doc = _materialized.write(source, dest, engine, master=spark_master, task_memory_limit=task_memory_limit,
                                  work_dir=work_dir, window=window)
    except (ValueError, FileExistsError) as exc:
        raise click.UsageError(str(exc)) from exc
    except (ImportError, _materialized.MaterializeBusy) as exc:
        raise click.ClickException(str(exc)) from exc
    for path, reason in doc["skipped"]:
        click.echo(f"warning: skipped store file {path}: {reason}", err=True)
    rows = sum(v["rows"] for v in doc["views"].values())
    click.echo(f"materialized {source} into {dest} with {engine}: {doc['files']} store files, "
               f"{doc['views'].get('requests', {}).get('rows', 0)} requests, {len(doc['views'])} views "
               f"({rows} rows) in {doc['seconds']:.1f} s"
               + (f"; requests arriving in [{doc['window']['since']}, {doc['window']['until']}), "
                  f"{doc['pruned_files']} store file(s) outside the window not read" if window is not None else ""))
