"""The refresh engine: one trace directory's analysis database, brought up to date on demand.

A :class:`Trace` keeps a DuckDB database -- in memory, or a cache file that survives between runs
(:mod:`pdtrace.analysis.cache`) -- holding the SQL library's views (:mod:`pdtrace.analysis.loader`)
over the directory's store files (read in place: ``_records`` is redefined over the current file
list on each refresh; a cold build of a small store reads them once into memory for its own steps) and the materialized ``_mat_*`` tables behind the heavy views
(:mod:`pdtrace.analysis.materialize`). :meth:`Trace.refresh` absorbs what changed since the last
refresh: new or rewritten files are read, vanished files (the recorder compacts its per-flush parts
into a segment) are dropped, duplicates of a record (same ``record_id`` in two files) are hidden,
and only the requests those rows touch -- plus those whose clock correction moved -- are recomputed.

Bad files (empty, truncated, foreign, another schema major, data that does not decode) are skipped
and named in a :class:`pdtrace.analysis.files.SkippedFileWarning` (:mod:`pdtrace.analysis.files`). A
file that vanishes while a refresh reads it (compaction) makes the refresh start again; an
incremental refresh that fails otherwise is rolled back, and a rebuild that fails is redone by the
next refresh (:meth:`Trace.refresh`).

Programs open a trace with :func:`pdtrace.analysis.open` (a :class:`pdtrace.analysis.session.Session`
over a Trace, queries read-only); this module is the engine under it, used directly by the tests and
benchmarks of the engine itself.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from pdtrace.instrument import store as _store

from . import cache as _cache
from . import files as _files
from . import sandbox as _sandbox
from . import template as _template
from .materialize import Materializer, materializations


@dataclass
class RefreshResult:
    """What one :meth:`Trace.refresh` did.

    ``new``/``gone``: files absorbed / dropped; ``skipped``: [(path, reason)];
    ``dirty_requests``: requests recomputed; ``seconds``: wall time;
    ``rebuilt``: True when the cache was (re)built from scratch; ``pruned``: the store files a
    :class:`pdtrace.analysis.window.Window` left out (not read, not checked).
    """

    new: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    dirty_requests: int = 0
    seconds: float = 0.0
    rebuilt: bool = False
    pruned: list[str] = field(default_factory=list)



class Trace(Materializer):
    """The analysis database of one trace directory.

    ``cache``: path of a DuckDB file to keep between runs (created if
    missing, rebuilt if made by another SQL library version), or None for an
    in-memory database. Either starts as a copy of the SQL library template in
    :func:`pdtrace.analysis.cache.cache_root` (built there when missing; BENCHMARKS.md
    "Small-store cold report"). ``threads``: DuckDB threads (default: all cores); ``memory_limit``: DuckDB's
    ``memory_limit`` setting, e.g. ``'2GB'`` (default: DuckDB's, 80 % of RAM). ``window``: a
    :class:`pdtrace.analysis.window.Window`: only the requests that arrived in it, from the files that
    can hold them (rules there); a cache file built for another window (or none) is rebuilt.
    Raises FileNotFoundError when ``directory`` does not exist.
    """

    def __init__(self, directory: str | os.PathLike, cache: str | os.PathLike | None = None,
                 threads: int | None = None, memory_limit: str | None = None, window=None):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"trace directory not found: {self.directory}")
        self.window = window
        self.cache = Path(cache) if cache is not None else None
        self._threads = threads
        self._memory_limit = memory_limit
        self.con = self._open()
        # files whose data failed to decode: path -> (size, mtime_ns, reason), skipped until they
        # change; a cache file remembers those an earlier run found
        self._corrupt: dict[str, tuple[int, int, str]] = {
            p: (size, mtime, reason) for p, size, mtime, reason in self.con.execute(
                "SELECT path, size, mtime_ns, reason FROM _files "
                "WHERE NOT ok AND starts_with(reason, 'corrupt data:') AND size IS NOT NULL").fetchall()}

    # -- database lifecycle ---------------------------------------------------
    def _open(self, template: bool = True) -> duckdb.DuckDBPyConnection:
        stamp = _cache.library_stamp()
        # a new database starts as a copy of the installed library (library_template). A cache
        # file's copy is checked before it appears: an error opening it is another process's lock,
        # raised as such. A memory database whose copy failed is dropped for a new, empty one.
        if self.cache is not None:
            copied = template and _cache.new_from_template(self.cache, stamp)
            con = duckdb.connect(str(self.cache))
        else:
            con = duckdb.connect(":memory:")
            copied = template and _cache.memory_from_template(con, stamp)
            if template and not copied:
                con.close()
                con = duckdb.connect(":memory:")
        if self._threads:
            con.execute(f"SET threads = {int(self._threads)}")
        if self._memory_limit:
            con.execute("SET memory_limit = ?", [str(self._memory_limit)])
        con.execute("SET preserve_insertion_order = false")
        con.execute("CREATE TABLE IF NOT EXISTS _meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
        row = con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()
        state = con.execute("SELECT value FROM _meta WHERE key = 'state'").fetchone()
        # a template copy holds the library and nothing absorbed: its first refresh is a rebuild
        self._fresh = row is None or row[0] != stamp or (state is not None and state[0] != "clean") or copied
        if row is not None and (row[0] != stamp or (state is not None and state[0] != "clean")):
            con.close()
            if self.cache is None:  # pragma: no cover - a memory database is always new
                raise RuntimeError("in-memory analysis database in an unexpected state")
            _template.unlink_db(self.cache)
            return self._open(template=template and not copied)
        # a template copy or a database just installed holds no absorbed rows: its first wipe is a no-op
        self._empty = copied or row is None
        if row is None:
            _cache.install(con, stamp)
        built_for = con.execute("SELECT value FROM _meta WHERE key = 'window'").fetchone()
        if (built_for[0] if built_for else "") != self._window_key:
            self._fresh = True  # built for another window (or for none): rebuild
        # scratch steps live in memory (temp tables shadow the empty main ones)
        for m in materializations("scratch"):
            con.execute(f"CREATE OR REPLACE TEMP TABLE {m.table} AS SELECT * FROM main.{m.table} LIMIT 0")
        return con

    def close(self) -> None:
        """Close the connection (safe to call twice)."""
        try:
            self.con.close()
        except Exception:
            pass

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- refresh ----------------------------------------------------------------
    def scan(self) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]]]:
        """List the directory (:func:`pdtrace.analysis.files.scan`), skipping the files whose data
        failed to decode until they change. :meth:`refresh` keeps the rows of a file it absorbed
        before that is ``unreadable now:``. Footers are read through this trace's connection. With a
        :attr:`window`, only the files it selects; the others are in :attr:`pruned` afterwards."""
        pruned: list[str] = []
        out = _files.scan(self.directory, self._corrupt, self.con, window=self.window, pruned=pruned)
        self.pruned = pruned
        return out

    #: The store files the last :meth:`scan` left out for the :attr:`window` (paths).
    pruned: tuple[str, ...] | list[str] = ()

    @property
    def _window_key(self) -> str:
        """What ``_meta`` key ``window`` holds for this trace's :attr:`window` ('' for none)."""
        return self.window.key() if self.window is not None else ""

    def _decode_errors(self, paths: list[str]) -> dict[str, tuple[str, str]]:
        """The full decode check of the new files ``paths`` (:func:`pdtrace.analysis.files.decode_errors`;
        :class:`pdtrace.analysis.spark.SparkTrace` spreads it over Spark tasks)."""
        return _files.decode_errors(paths)

    #: A refresh whose store files total at most this many bytes on disk reads them once into
    #: memory instead of once per step (:func:`pdtrace.analysis.files.hold_rows`); 0: never.
    hold_bytes = _files.HOLD_BYTES

    #: Failed attempts one :meth:`refresh` makes when store files vanish under it before it raises.
    refresh_attempts = 3

    def refresh(self, warn: bool = True) -> RefreshResult:
        """Absorb new/changed files, drop vanished ones, recompute what they touch.

        Warns (SkippedFileWarning) once per bad file unless ``warn`` is False (the files are in the
        result's ``skipped`` either way). Returns a RefreshResult.

        New files are decoded in full before they are absorbed (every value of
        every column; all new files in one statement, each alone only when
        that fails: :func:`pdtrace.analysis.files.decode_errors`). A cold build of a
        store of at most :attr:`hold_bytes` then reads its files once into memory
        (:meth:`_hold`). A file whose footer is sound but
        whose data pages are not is skipped and named (reason ``corrupt data:
        ...``) until its size or mtime changes, remembered in a cache file too.
        A file that cannot be opened or decoded just now (too many open files,
        out of memory) is not blamed: it is left out of this refresh (reason
        ``unreadable now: ...``) and tried again by the next one; one absorbed
        before keeps its rows. One that cannot be opened for good (permission)
        is skipped like a bad file (``unreadable: ...``).

        Part files (``-p<seq>``, which the recorder deletes once it merged them
        into a segment) are absorbed in a pass of their own after the other
        new files, so a long refresh (a first build, a backlog) reads only
        segments, which stay, while compaction runs; the short pass that
        follows takes whatever is new then, parts and segments alike.

        A refresh either completes or leaves the cache as the last complete
        one left it: an incremental refresh runs in one transaction and is
        rolled back when it fails. (The views that read store files in place,
        ``spans`` and ``events``, then fail on a file deleted since, such as a
        compacted part, until a refresh succeeds: they are never silently
        short.) A rebuild (a
        new database, or one whose last rebuild died half-way) empties the
        tables on the same connection -- its settings, such as the dashboard's
        file sandbox, are kept -- and is not in a transaction (large inserts
        into transaction-local storage are ~3x slower), so one that fails
        leaves state 'dirty' and the next refresh rebuilds again.

        When reading fails because a listed file vanished or changed (an
        error opening a file, and a different listing), the directory is
        listed again and the refresh retried, up to :attr:`refresh_attempts`
        failures. Any other error -- out of memory, an interrupt, a fault in
        the SQL -- is raised as it is.
        """
        t0 = time.perf_counter()
        out = RefreshResult()
        failures = 0
        may_defer = True  # parts get a pass of their own at most once per refresh
        self.con.execute("CREATE OR REPLACE TEMP TABLE _refreshed_keys (rkey UBIGINT)")
        while True:
            rebuild = self._fresh or self._state() != "clean"
            if rebuild:
                self._wipe()
                out.rebuilt = True
            good, bad = self.scan()
            known = {p: (s, m) for p, s, m in
                     self.con.execute("SELECT path, size, mtime_ns FROM _files WHERE ok").fetchall()}
            for p, reason in list(bad):  # absorbed before, unreadable just now: keep its rows
                if reason.startswith("unreadable now:") and p in known:
                    bad.remove((p, reason))
                    good[p] = known[p]
            new = sorted(p for p, sm in good.items() if known.get(p) != sm)
            deferred = [p for p in new if _store.is_part_file(p)]
            if deferred and len(deferred) < len(new) and may_defer:  # parts: a pass of their own (once)
                may_defer = False
                for p in deferred:
                    del good[p]
                new = [p for p in new if p not in deferred]
            else:
                deferred = []
            for p, (state, reason) in self._decode_errors(new).items():
                sm = good.pop(p)
                new.remove(p)
                if state == "corrupt":
                    self._corrupt[p] = sm + (reason,)
                    bad.append((p, reason))
                elif os.path.exists(p):
                    bad.append((p, f"unreadable now: {reason}"))
                    if p in known:  # changed, not decodable just now: its old rows stay until then
                        good[p] = known[p]
            gone = sorted(p for p in known if p not in good or p in new)
            # a cold build of a small store reads its files once, not once per step (files.hold_rows)
            held = rebuild and bool(new) and self._hold(good)
            try:
                res = self._refresh_files(good, bad, new, gone, cold=rebuild, transaction=not rebuild, held=held)
            except duckdb.Error as exc:
                failures += 1
                if failures >= self.refresh_attempts or not self._vanished(exc, good):
                    raise
                continue
            out.new += [p for p in res.new if p not in out.new]
            out.gone += [p for p in res.gone if p not in out.gone]
            out.skipped = res.skipped
            out.pruned = list(self.pruned)
            if not deferred:
                break
        out.dirty_requests = self.con.execute("SELECT count(DISTINCT rkey) FROM _refreshed_keys").fetchone()[0]
        self.con.execute("DROP TABLE IF EXISTS _refreshed_keys")
        for path, reason in out.skipped if warn else ():
            warnings.warn(f"skipped store file {path}: {reason}", _files.SkippedFileWarning, stacklevel=2)
        out.seconds = time.perf_counter() - t0
        return out

    def _state(self) -> str | None:
        """The cache's ``state`` in ``_meta``: 'clean', 'dirty' (a refresh is running or died),
        'wiped' (emptied for a rebuild), None (new)."""
        row = self.con.execute("SELECT value FROM _meta WHERE key = 'state'").fetchone()
        return row[0] if row else None

    def _wipe(self) -> None:
        """Empty every table a refresh fills, keeping the connection, its settings and the
        files known to be corrupt; the next refresh attempt rebuilds from scratch."""
        con = self.con
        if not self._empty:  # (a new database's tables are empty: ~60 statements saved on a cold open)
            for table in ("_dup_copies", "_dup_drop", "_file_keys", "_scope_keys", "_changed_keys",
                          "_changed_windows", "_read_files", "_window_out"):
                con.execute(f"DELETE FROM {table}")
            con.execute("DELETE FROM _files WHERE ok OR NOT starts_with(coalesce(reason, ''), 'corrupt data:')")
            for m in materializations():
                con.execute(f"DELETE FROM {m.table}")
        self._empty = False  # the refresh attempt that follows fills them
        con.execute("INSERT OR REPLACE INTO _meta VALUES ('state', 'wiped')")
        con.execute("INSERT OR REPLACE INTO _meta VALUES ('window', ?)", [self._window_key])
        self._fresh = True

    def _vanished(self, exc: duckdb.Error, good: dict[str, tuple[int, int]]) -> bool:
        """After a refresh attempt failed with ``exc``: True when it is an error opening a file
        (:func:`pdtrace.analysis.files.access_error`) and a file of the listing ``good`` has vanished or changed since."""
        if not _files.access_error(exc):
            return False
        now, _ = self.scan()
        return any(now.get(p) != sm for p, sm in good.items())

    def _hold(self, good: dict[str, tuple[int, int]]) -> bool:
        """Hold the rows of the files ``good`` in memory (:func:`pdtrace.analysis.files.hold_rows`)
        when they total at most :attr:`hold_bytes` on disk and their estimated held size
        (``files.HELD_PER_DISK_BYTE`` per byte) is at most ``files.HOLD_SHARE`` of DuckDB's
        ``memory_limit``; False when not, or when reading them failed (vanished just now, out of
        memory, interrupted: the refresh then reads the files in place, as without a hold)."""
        sizes = {p: sm[0] for p, sm in good.items()}
        on_disk = sum(sizes.values())
        if not sizes or on_disk > self.hold_bytes:
            return False
        limit = _files.memory_limit_bytes(self.con)
        if limit is None or on_disk * _files.HELD_PER_DISK_BYTE > _files.HOLD_SHARE * limit:
            return False
        try:
            return _files.hold_rows(self.con, sizes, self.hold_bytes)
        except duckdb.Error:
            return False

    def _refresh_files(self, good: dict[str, tuple[int, int]], bad: list[tuple[str, str]],
                       new: list[str], gone: list[str], cold: bool, transaction: bool,
                       held: bool = False) -> RefreshResult:
        """One refresh attempt over a listing (``good``, ``bad``) and its ``new``/``gone`` files;
        ``cold``: recompute from every file; ``transaction``: all of it in one, rolled back on failure;
        ``held``: the rows of ``good`` are held in memory already (:meth:`_hold`; released here)."""
        res = RefreshResult(new=new, gone=gone, skipped=bad)
        con = self.con
        began = False
        try:
            if transaction:
                con.execute("BEGIN TRANSACTION")
                began = True
            con.execute("INSERT OR REPLACE INTO _meta VALUES ('state', 'dirty')")
            con.execute("DELETE FROM _files WHERE NOT ok")
            if bad:
                # a corrupt file keeps its size and mtime: skipped, without decoding it again, until it changes
                con.executemany("INSERT OR REPLACE INTO _files VALUES (?, ?, ?, NULL, false, ?, now())",
                                [(p, *self._corrupt.get(p, (None, None))[:2], r) for p, r in bad])
            if new or gone or cold:
                res.dirty_requests = self._absorb(new, gone, good, cold)
                con.execute("INSERT INTO _refreshed_keys SELECT rkey FROM _scope_keys")
            con.execute("INSERT OR REPLACE INTO _meta VALUES ('state', 'clean')")
            if transaction:
                con.execute("COMMIT")
        except BaseException:
            if began:
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:  # pragma: no cover - the transaction is already gone
                    pass
            raise
        finally:
            if held:
                try:
                    _files.release_rows(con)
                except duckdb.Error:  # (a connection gone bad: the error that follows says why)
                    pass
        self._fresh = False
        return res

    # -- queries ----------------------------------------------------------------
    def readonly(self) -> _sandbox.ReadOnlyConnection:
        """A locked-down connection for queries (see :func:`pdtrace.analysis.sandbox.lock_down`).

        With a cache file: this Trace's connection is closed and the file
        reopened read-only (the Trace cannot refresh afterwards). In memory:
        this connection itself is locked down (no file access; writes only
        touch the in-memory database).
        """
        if self.cache is None:
            return _sandbox.lock_down(self.con)
        self.close()
        return _sandbox.connect_readonly(self.cache)

    def query(self, sql: str, params: list | None = None) -> list[dict]:
        """Run one query on this Trace's connection; rows as dicts (for tests and small results)."""
        cur = self.con.execute(sql, params or [])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]




#: The engines a trace's analysis can be built with (:func:`make_trace`).
ENGINES = ("duckdb", "spark")


def make_trace(directory: str | os.PathLike, cache: str | os.PathLike | None = None, threads: int | None = None,
               memory_limit: str | None = None, engine: str = "duckdb", spark_master: str | None = None,
               spark_opts: dict | None = None, window=None) -> Trace:
    """A new, not yet refreshed analysis of ``directory`` on ``engine``: a :class:`Trace` (``duckdb``), or a
    :class:`pdtrace.analysis.spark.SparkTrace` on ``spark_master`` (default ``local[2]``) with
    ``spark_opts`` (its ``work_dir``, ``task_memory_limit``, ``task_threads``; None values ignored);
    ``window``: a :class:`pdtrace.analysis.window.Window` or None (either engine).
    Raises ValueError for an engine not in :data:`ENGINES`, and what the engine's constructor raises."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: duckdb or spark")
    if engine == "duckdb":
        return Trace(directory, cache=cache, threads=threads, memory_limit=memory_limit, window=window)
    from . import spark as _spark

    opts = {k: v for k, v in (spark_opts or {}).items() if v is not None}
    return _spark.SparkTrace(directory, cache=cache, threads=threads, memory_limit=memory_limit,
                             master=spark_master or _spark.DEFAULT_MASTER, window=window, **opts)


def open_trace(directory: str | os.PathLike, cache: str | os.PathLike | None = None,
               threads: int | None = None) -> Trace:
    """Open ``directory``'s analysis database and refresh it (see :class:`Trace`)."""
    tr = Trace(directory, cache=cache, threads=threads)
    tr.refresh()
    return tr


