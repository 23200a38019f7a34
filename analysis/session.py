"""The one way programs open a trace: :func:`open` returns a :class:`Session`.

The CLI (``pdtrace report``, ``sql``, ``check``), the dashboard, ``pdtrace lab``'s closing report,
the footprint line and the benchmarks that read answers all open a trace here, so the rules live in
one place:

* **The cache.** ``cache=True`` keeps the analysis in the directory's default cache file
  (:func:`pdtrace.analysis.cache.default_cache_path`), a path keeps it there, ``None`` keeps it in
  memory. When the file is locked by another process (a dashboard holds it while ``pdtrace report``
  runs), the session works in memory instead and says so (:attr:`Session.cache_locked`).
* **Read-only.** With ``read_only=True`` (the default) every statement run through the session must
  be a query (:func:`pdtrace.analysis.sandbox.readonly_statements`), and DuckDB reads no file it
  should not. A one-look session (``live=False``: the CLI, the lab's report) is locked down after
  its refresh as ``pdtrace sql`` always was (:meth:`pdtrace.analysis.db.Trace.readonly`: the cache
  reopened read-only, only the absorbed store files readable, the configuration locked). A live
  session (``live=True``: the dashboard) keeps refreshing, so DuckDB may read files under the trace
  directory (and the directories its symlinked store files point into) only
  (:func:`pdtrace.analysis.sandbox.restrict_to_directory`, applied after the first refresh). Only the
  session's own refresh writes, and only into its cache, never into the store.
* **A materialized directory** (``pdtrace materialize``, :mod:`pdtrace.analysis.materialized`) opens
  as its analysis database, read-only and locked down, and is never refreshed: its answers are
  those written when it was made.
* **The engine.** ``engine="spark"`` builds the analysis with :class:`pdtrace.analysis.spark.SparkTrace`
  (the per-request steps as Spark tasks, same answers); queries run on DuckDB either way.
* **A time window** (``window``, :class:`pdtrace.analysis.window.Window`): only the requests that
  arrived in it, read from the files that can hold them (rules in :mod:`pdtrace.analysis.window`).
  With ``cache=True`` a windowed session works in memory, so the directory's default cache keeps
  the whole store's analysis; a cache path given explicitly is rebuilt whenever its window changes.
* **Refresh.** :meth:`Session.refresh` absorbs the files that appeared or changed since the last
  one (:meth:`pdtrace.analysis.db.Trace.refresh`); refreshes are serialized, queries run on their
  own cursors meanwhile. Files the refresh skipped are in :attr:`Session.skipped` (path, reason),
  not raised and not warned about: the caller shows them its own way.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

import duckdb

from . import cache as _cache
from . import db as _db
from . import materialized as _materialized
from . import sandbox as _sandbox


class Session:
    """An opened trace directory: its analysis database, refreshed on demand, queried read-only.

    Build one with :func:`open`; nothing is opened or read until its first :meth:`refresh`. Attributes: ``directory`` (Path), ``cache_path`` (the cache file in
    use, None in memory), ``cache_locked`` (True when the cache asked for was held by another process
    and the session fell back to memory), ``read_only``, ``live`` (keeps refreshing), ``version`` (an int that changes whenever a
    refresh changed the views: a key for cached results), ``last_refresh`` (the
    :class:`pdtrace.analysis.db.RefreshResult` of the last refresh, None before the first).
    """

    def __init__(self, directory: str | os.PathLike, cache: str | os.PathLike | bool | None = True,
                 read_only: bool = True, live: bool = False, threads: int | None = None,
                 memory_limit: str | None = None, engine: str = "duckdb", spark_master: str | None = None,
                 spark_opts: dict | None = None, window=None):
        if engine not in _db.ENGINES:
            raise ValueError(f"unknown engine {engine!r}: duckdb or spark")
        self.directory = Path(directory)
        self.engine = engine
        self._spark_master = spark_master
        self._spark_opts = spark_opts
        #: The :class:`pdtrace.analysis.window.Window` asked for (None: the whole store).
        self.window = window
        self.read_only = read_only
        self.live = live
        self._looked: _sandbox.ReadOnlyConnection | None = None  # a one-look session, locked down
        self._cache_arg = cache
        self._threads = threads
        self._memory_limit = memory_limit
        self._lock = threading.Lock()
        self._trace: _db.Trace | None = None
        self.cache_path: Path | None = None
        self.cache_locked = False
        self.version = 0
        self.last_refresh: _db.RefreshResult | None = None
        self.skipped: list[tuple[str, str]] = []

    # -- lifecycle ----------------------------------------------------------------
    @property
    def exists(self) -> bool:
        """True when the trace directory exists (it may hold no file yet)."""
        return self.directory.is_dir()

    def _connect(self) -> None:
        """Open the engine on the cache asked for, in memory when another process holds that file."""
        cache = self._cache_arg
        if cache is True:  # (a window's analysis is not the directory's: in memory)
            cache = _cache.default_cache_path(self.directory) if self.window is None else None
        kw = {"threads": self._threads, "memory_limit": self._memory_limit, "engine": self.engine,
              "spark_master": self._spark_master, "spark_opts": self._spark_opts, "window": self.window}
        try:
            tr = _db.make_trace(self.directory, cache=cache or None, **kw)
        except duckdb.IOException:  # the cache file is held by another process: work in memory
            tr = _db.make_trace(self.directory, cache=None, **kw)
            self.cache_locked = True
        self._trace = tr
        self.cache_path = tr.cache

    def refresh(self) -> bool:
        """Absorb new, changed and vanished store files; True when the views changed (files absorbed or
        dropped, a rebuild, or a different set of skipped files). False while the directory does not
        exist. Raises what :meth:`pdtrace.analysis.db.Trace.refresh` raises (out of memory, an
        interrupt, a fault in the SQL); a skipped file is not an error (see :attr:`skipped`).
        Raises RuntimeError on a read-only session that is not ``live`` after its first refresh
        (it is locked down: open another to see new files) and after :meth:`close`. A materialization
        is opened by the first refresh (RuntimeError when it is incomplete or not to be trusted:
        :func:`pdtrace.analysis.materialized.open_readonly`); every later refresh returns False."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"session of {self.directory} is closed")
            if self._looked is not None and self._materialized:
                return False  # a materialization never changes
            if self._looked is not None:
                raise RuntimeError(f"session of {self.directory} was opened for one look (live=False): "
                                   "open another to see new files")
            if self._trace is None:
                if not self.exists:
                    return False
                if _materialized.is_started(self.directory):
                    looked, skipped = _materialized.open_readonly(self.directory)  # (refuses an incomplete one)
                    if self.window is not None:
                        looked.close()
                        raise RuntimeError(f"{self.directory} is a materialization: its requests are fixed when it "
                                           "is made (pdtrace materialize --since/--until), not chosen when read")
                    self._looked, self.skipped = looked, skipped
                    self._materialized = True
                    self.version += 1
                    return True
                self._connect()
            res = self._trace.refresh(warn=False)  # skipped files are in self.skipped
            changed = bool(res.new or res.gone or res.rebuilt) or self.skipped != res.skipped
            self.last_refresh, self.skipped = res, res.skipped
            if changed or self.version == 0:
                self.version += 1
            if self.read_only:
                self._sandbox()
            return changed

    def _sandbox(self) -> None:
        """After a refresh of a read-only session: lock a one-look session down, restrict a live one."""
        con = self._trace.con
        if not self.live:
            self._looked = self._trace.readonly()
            return
        dirs = [self.directory] + [Path(p).resolve().parent for (p,) in
                                   con.execute("SELECT path FROM _files WHERE ok").fetchall()]
        _sandbox.restrict_to_directory(con, dirs)

    _closed = False
    #: True when the directory is a materialization (:mod:`pdtrace.analysis.materialized`).
    _materialized = False

    def close(self) -> None:
        """Close the database (safe to call twice); the session cannot be queried or refreshed afterwards."""
        with self._lock:
            self._closed = True
            if self._looked is not None:
                self._looked.close()
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- queries ------------------------------------------------------------------
    def cursor(self) -> Any:
        """A new cursor over the views (close it when done): a
        :class:`pdtrace.analysis.sandbox.ReadOnlyConnection` in a read-only session, else a plain DuckDB
        cursor. Raises FileNotFoundError when the directory has not appeared yet, RuntimeError after
        :meth:`close`."""
        with self._lock:
            if self._looked is not None and not self._closed:
                return self._looked.cursor()
            if self._closed or self._trace is None:
                if not self._closed and not self.exists:
                    raise FileNotFoundError(f"trace directory not found: {self.directory}")
                raise RuntimeError(f"session of {self.directory} is closed or was never refreshed")
            if self._looked is not None:
                return self._looked.cursor()
            cur = self._trace.con.cursor()
        return _sandbox.ReadOnlyConnection(cur) if self.read_only else cur

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        """Run ``sql`` on a new cursor and return it positioned on the result (``fetchall()``,
        ``df()``, ``description``; in a read-only session the cursor is a
        :class:`pdtrace.analysis.sandbox.ReadOnlyConnection`, so what runs on it next is checked too).
        Raises :class:`pdtrace.analysis.sandbox.ReadOnlyError` for a statement that is not a query in a
        read-only session, ``duckdb.Error`` for a failing one."""
        return self.cursor().execute(sql, list(params or []))

    def query(self, sql: str, params: Sequence[Any] | None = None) -> list[dict]:
        """Run one query; its rows as dicts (column -> value), for small results."""
        cur = self.execute(sql, params)
        try:
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, row)) for row in cur.fetchall()]
        finally:
            cur.close()

    def df(self, sql: str, params: Sequence[Any] | None = None):
        """Run one query; its result as a pandas DataFrame (pandas must be installed)."""
        cur = self.execute(sql, params)
        try:
            return cur.df()
        finally:
            cur.close()


def open(directory: str | os.PathLike, cache: str | os.PathLike | bool | None = True, read_only: bool = True,
         *, live: bool = False, refresh: bool = True, missing_ok: bool = False, threads: int | None = None,
         memory_limit: str | None = None, engine: str = "duckdb", spark_master: str | None = None,
         spark_opts: dict | None = None, window=None) -> Session:
    """Open the trace in ``directory`` and absorb its files (with ``refresh=False``, at the first
    :meth:`Session.refresh`): the one way in.

    ``cache``: True for the directory's default cache file, a path for that file, None or False for
    an in-memory database (kept nowhere); a locked cache file falls back to memory. ``read_only``:
    queries only, DuckDB reading files under ``directory`` only (False: any statement, any file; for
    tests and tools that build on the views). ``live``: the session keeps refreshing (the dashboard
    following a growing directory); a read-only session that is not live is locked down after its
    first refresh (see the module docstring). ``missing_ok``: a directory that does not exist yet is
    not an error; the session opens when it appears (:meth:`Session.refresh`). ``threads``,
    ``memory_limit``: DuckDB settings (see :class:`pdtrace.analysis.db.Trace`). ``engine``: ``duckdb``
    or ``spark`` (:class:`pdtrace.analysis.spark.SparkTrace`, on ``spark_master``, default
    ``local[2]``; ``spark_opts``: its ``work_dir``, ``task_memory_limit``, ``task_threads``). ``window``: a
    :class:`pdtrace.analysis.window.Window` (module docstring). A materialization (``pdtrace materialize``) opens read-only whatever the options (RuntimeError with a window).

    Raises ValueError for an unknown ``engine``, FileNotFoundError when ``directory`` does not exist (unless ``missing_ok``), and what a
    refresh raises.
    """
    s = Session(directory, cache=cache, read_only=read_only, live=live, threads=threads, memory_limit=memory_limit,
                engine=engine, spark_master=spark_master, spark_opts=spark_opts, window=window)
    if not missing_ok and not s.exists:
        raise FileNotFoundError(f"trace directory not found: {s.directory}")
    if refresh:
        s.refresh()
    return s
