"""Connections to a trace directory's analysis database (the one module that owns them).

A :class:`Trace` keeps a DuckDB database -- in memory, or a cache file that
survives between runs -- holding every record of the directory's store files
(table ``_raw``), the SQL library's views (:mod:`pdtrace.analysis.loader`) and
the materialized ``_mat_*`` tables behind the heavy views. :meth:`Trace.refresh`
absorbs what changed since the last refresh: new or rewritten files are read,
vanished files (the recorder compacts its per-flush parts into a segment)
are dropped, duplicates of a record (same ``record_id`` in two files) are
hidden, and only the requests those rows touch -- plus those whose clock
correction moved -- are recomputed.

Bad files (empty, truncated, foreign, another schema major) are skipped and
named in a :class:`SkippedFileWarning`; the store's reader rules are
:func:`pdtrace.instrument.store.check_file`'s.

Queries go through :func:`connect_readonly` (or :meth:`Trace.readonly`): the
database opened read-only with file system access disabled and the
configuration locked, so a query cannot write files, attach databases or
load extensions.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from pdtrace.instrument import stages as _stages
from pdtrace.instrument import store as _store

from . import loader

#: Version of the cache layout beyond the SQL text (bump to force rebuilds).
CACHE_FORMAT = "1"


class SkippedFileWarning(UserWarning):
    """A store file could not be read and was skipped (the message names it and why)."""


@dataclass
class RefreshResult:
    """What one :meth:`Trace.refresh` did.

    ``new``/``gone``: files absorbed / dropped; ``skipped``: [(path, reason)];
    ``dirty_requests``: requests recomputed; ``seconds``: wall time;
    ``rebuilt``: True when the cache was (re)built from scratch.
    """

    new: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    dirty_requests: int = 0
    seconds: float = 0.0
    rebuilt: bool = False


def lock_down(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """Forbid file system access, extension loading and configuration changes on ``con``; return it.

    After this, COPY TO, EXPORT, ATTACH, read_*() of files and INSTALL/LOAD
    raise PermissionException, and SET of any option raises.
    """
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def connect_readonly(cache: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """Open a cache database built by :class:`Trace` read-only and locked down (see :func:`lock_down`).

    Raises duckdb.IOException when the file is missing or locked by a writer.
    """
    return lock_down(duckdb.connect(str(cache), read_only=True))


class Trace:
    """The analysis database of one trace directory.

    ``cache``: path of a DuckDB file to keep between runs (created if
    missing, rebuilt if made by another SQL library version), or None for an
    in-memory database. ``threads``: DuckDB threads (default: all cores).
    Raises FileNotFoundError when ``directory`` does not exist.
    """

    def __init__(self, directory: str | os.PathLike, cache: str | os.PathLike | None = None,
                 threads: int | None = None):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"trace directory not found: {self.directory}")
        self.cache = Path(cache) if cache is not None else None
        self._threads = threads
        self.con = self._open()

    # -- database lifecycle ---------------------------------------------------
    def _open(self) -> duckdb.DuckDBPyConnection:
        con = duckdb.connect(str(self.cache) if self.cache else ":memory:")
        if self._threads:
            con.execute(f"SET threads = {int(self._threads)}")
        con.execute("SET preserve_insertion_order = false")
        stamp = f"{CACHE_FORMAT}:{loader.library_hash()}"
        con.execute("CREATE TABLE IF NOT EXISTS _meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
        row = con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()
        self._fresh = row is None or row[0] != stamp
        if self._fresh and row is not None:
            con.close()
            self.cache.unlink()
            wal = Path(str(self.cache) + ".wal")
            if wal.exists():
                wal.unlink()
            return self._open()
        if self._fresh:
            self._install(con)
            con.execute("INSERT OR REPLACE INTO _meta VALUES ('library', ?)", [stamp])
        return con

    def _install(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute(loader.base_tables_sql())
        con.execute("DELETE FROM _stage_vocab")
        con.executemany("INSERT INTO _stage_vocab VALUES (?, ?, ?, ?)",
                        [(k, v.role, v.category, v.doc) for k, v in _stages.STAGES.items()])
        con.execute("DELETE FROM _event_vocab")
        con.executemany("INSERT INTO _event_vocab VALUES (?, ?)", list(_stages.EVENTS.items()))
        for mod in loader.load_order():
            try:
                con.execute(mod.text)
            except duckdb.Error as exc:
                raise RuntimeError(f"SQL module {mod.name} failed to load: {exc}") from exc

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
        """List the directory: ({readable file: (size, mtime_ns)}, [(skipped file, reason)])."""
        good: dict[str, tuple[int, int]] = {}
        bad: list[tuple[str, str]] = []
        for p in _store.store_files(self.directory):
            chk = _store.check_file(p)
            if not chk.ok:
                bad.append((str(p), chk.reason))
                continue
            try:
                st = p.stat()
            except OSError as exc:  # vanished between listing and stat
                bad.append((str(p), f"unreadable: {type(exc).__name__}"))
                continue
            good[str(p)] = (st.st_size, st.st_mtime_ns)
        return good, bad

    def refresh(self) -> RefreshResult:
        """Absorb new/changed files, drop vanished ones, recompute what they touch.

        Warns (SkippedFileWarning) once per bad file. Returns a RefreshResult.
        """
        t0 = time.perf_counter()
        res = RefreshResult(rebuilt=self._fresh)
        good, bad = self.scan()
        con = self.con
        known = {p: (s, m) for p, s, m in con.execute("SELECT path, size, mtime_ns FROM _files WHERE ok").fetchall()}
        res.new = sorted(p for p, sm in good.items() if known.get(p) != sm)
        res.gone = sorted(p for p in known if p not in good or p in res.new)
        res.skipped = bad
        for path, reason in bad:
            warnings.warn(f"skipped store file {path}: {reason}", SkippedFileWarning, stacklevel=2)
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute("DELETE FROM _files WHERE NOT ok")
            if bad:
                con.executemany("INSERT OR REPLACE INTO _files VALUES (?, NULL, NULL, NULL, false, ?, now())",
                                [(p, r) for p, r in bad])
            if res.new or res.gone or self._fresh:
                res.dirty_requests = self._absorb(res.new, res.gone, good)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        self._fresh = False
        res.seconds = time.perf_counter() - t0
        return res

    def _absorb(self, new: list[str], gone: list[str], good: dict[str, tuple[int, int]]) -> int:
        con = self.con
        cold = self._fresh or con.execute("SELECT count(*) FROM _raw").fetchone()[0] == 0
        con.execute("CREATE OR REPLACE TEMP TABLE _chg (record_id UBIGINT, rkey UBIGINT, linked VARCHAR, run_id VARCHAR, prompt_index INTEGER)")
        if gone:
            con.execute("CREATE OR REPLACE TEMP TABLE _gone AS SELECT unnest(?::VARCHAR[]) AS path", [gone])
            if not cold:
                con.execute("""INSERT INTO _chg SELECT record_id, rkey, attr_str['router.linked_request_id'], run_id, prompt_index
                               FROM _raw WHERE _file IN (SELECT path FROM _gone)""")
            con.execute("DELETE FROM _raw WHERE _file IN (SELECT path FROM _gone)")
            con.execute("DELETE FROM _files WHERE path IN (SELECT path FROM _gone)")
        if new:
            con.execute("INSERT INTO _raw SELECT *, true FROM _read_store(?)", [new])
            if not cold:
                con.execute("""INSERT INTO _chg SELECT record_id, rkey, attr_str['router.linked_request_id'], run_id, prompt_index
                               FROM _raw WHERE _file IN (SELECT unnest(?::VARCHAR[]))""", [new])
            con.execute("""INSERT OR REPLACE INTO _files
                           SELECT f.path, f.size, f.mtime_ns, coalesce(c.n, 0), true, '', now()
                           FROM (SELECT unnest(?::VARCHAR[]) AS path, unnest(?::BIGINT[]) AS size,
                                        unnest(?::BIGINT[]) AS mtime_ns) f
                           LEFT JOIN (SELECT _file, count(*) AS n FROM _raw GROUP BY _file) c ON c._file = f.path""",
                        [new, [good[p][0] for p in new], [good[p][1] for p in new]])
        # one visible copy per record_id: the copy in the first file by name
        dup_src = "_raw" if cold else "_raw WHERE record_id IN (SELECT record_id FROM _chg)"
        con.execute(f"""
            UPDATE _raw SET _keep = d.keep
            FROM (SELECT rowid AS rid, row_number() OVER (PARTITION BY record_id ORDER BY _file) = 1 AS keep
                  FROM _raw WHERE record_id IN (
                      SELECT record_id FROM {dup_src} GROUP BY record_id HAVING count(*) > 1 OR bool_or(NOT _keep))) d
            WHERE _raw.rowid = d.rid AND _raw._keep <> d.keep""")
        # clock offsets: recompute; requests on clocks whose offset moved are dirty too
        old_offsets = "_old_offsets"
        con.execute(f"CREATE OR REPLACE TEMP TABLE {old_offsets} AS SELECT * FROM _mat_domain_offsets")
        for name, kind in loader.materializations():
            if kind == "full":
                con.execute(f"DELETE FROM _mat_{name.lstrip('_')}")
                con.execute(f"INSERT INTO _mat_{name.lstrip('_')} SELECT * FROM _calc_{name.lstrip('_')}")
        con.execute("DELETE FROM _scope_keys")
        if cold:
            con.execute("INSERT INTO _scope_keys SELECT DISTINCT rkey FROM _raw WHERE rkey IS NOT NULL")
        else:
            con.execute(f"""
                CREATE OR REPLACE TEMP TABLE _moved AS
                SELECT coalesce(n.domain, o.domain) AS domain, coalesce(n.window_idx, o.window_idx) AS window_idx
                FROM _mat_domain_offsets n FULL OUTER JOIN {old_offsets} o
                  ON n.domain = o.domain AND n.window_idx IS NOT DISTINCT FROM o.window_idx
                WHERE n.offset_ns IS DISTINCT FROM o.offset_ns""")
            con.execute("""
                INSERT INTO _scope_keys
                SELECT rkey FROM _chg WHERE rkey IS NOT NULL
                UNION SELECT _request_key(run_id, linked, prompt_index) FROM _chg WHERE linked IS NOT NULL
                UNION SELECT by_rkey FROM _req_links WHERE rkey IN (SELECT rkey FROM _chg)
                UNION SELECT r.rkey FROM _raw r JOIN _moved m ON r.domain = m.domain
                      AND (m.window_idx IS NULL OR r.start_ns // _clock_window_ns() = m.window_idx)
                      WHERE r.rkey IS NOT NULL""")
        for name, kind in loader.materializations():
            mat, calc = f"_mat_{name.lstrip('_')}", f"_calc_{name.lstrip('_')}"
            if kind == "request":
                con.execute(f"DELETE FROM {mat} WHERE rkey IN (SELECT rkey FROM _scope_keys)")
                con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
            elif kind == "scratch":
                con.execute(f"DELETE FROM {mat}")
                con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
        for name, kind in loader.materializations():
            if kind == "scratch":
                con.execute(f"DELETE FROM _mat_{name.lstrip('_')}")
        return con.execute("SELECT count(*) FROM _scope_keys").fetchone()[0]

    # -- queries ----------------------------------------------------------------
    def readonly(self) -> duckdb.DuckDBPyConnection:
        """A locked-down connection for queries (see :func:`lock_down`).

        With a cache file: this Trace's connection is closed and the file
        reopened read-only (the Trace cannot refresh afterwards). In memory:
        this connection itself is locked down (no file access; writes only
        touch the in-memory database).
        """
        if self.cache is None:
            return lock_down(self.con)
        self.close()
        return connect_readonly(self.cache)

    def query(self, sql: str, params: list | None = None) -> list[dict]:
        """Run one query on this Trace's connection; rows as dicts (for tests and small results)."""
        cur = self.con.execute(sql, params or [])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]


def open_trace(directory: str | os.PathLike, cache: str | os.PathLike | None = None,
               threads: int | None = None) -> Trace:
    """Open ``directory``'s analysis database and refresh it (see :class:`Trace`)."""
    tr = Trace(directory, cache=cache, threads=threads)
    tr.refresh()
    return tr


def default_cache_path(directory: str | os.PathLike) -> Path:
    """Cache file for ``directory``: ``$PDTRACE_CACHE_DIR`` (default: the user's temp dir)/pdtrace-<hash>.duckdb."""
    import hashlib
    root = Path(os.environ.get("PDTRACE_CACHE_DIR") or Path(tempfile.gettempdir()) / "pdtrace-cache")
    root.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]
    return root / f"pdtrace-{key}.duckdb"
