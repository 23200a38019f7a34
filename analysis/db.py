"""Connections to a trace directory's analysis database (the one module that owns them).

A :class:`Trace` keeps a DuckDB database -- in memory, or a cache file that
survives between runs -- holding the SQL library's views
(:mod:`pdtrace.analysis.loader`) over the directory's store files (read in
place: ``_records`` is redefined over the current file list on each refresh)
and the materialized ``_mat_*`` tables behind the heavy views. :meth:`Trace.refresh`
absorbs what changed since the last refresh: new or rewritten files are read,
vanished files (the recorder compacts its per-flush parts into a segment)
are dropped, duplicates of a record (same ``record_id`` in two files) are
hidden, and only the requests those rows touch -- plus those whose clock
correction moved -- are recomputed.

Bad files (empty, truncated, foreign, another schema major) are skipped and
named in a :class:`SkippedFileWarning`; the store's reader rules are
:func:`pdtrace.instrument.store.check_file`'s. A file whose footer is sound but
whose data pages do not decode is skipped and named the same way: every new
file is decoded in full before it is absorbed. A file that vanishes while a
refresh reads it (compaction) makes the refresh start again; an incremental
refresh that fails otherwise is rolled back, and a rebuild that fails is
redone by the next refresh (:meth:`Trace.refresh`).

Queries go through :func:`connect_readonly` (or :meth:`Trace.readonly`): the
database opened read-only with file system access disabled and the
configuration locked, so a query cannot write files, attach databases or
load extensions.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from pdtrace.instrument import config
from pdtrace.instrument import stages as _stages
from pdtrace.instrument import store as _store

from . import loader
from . import template as _template

#: Version of the cache layout beyond the SQL text (bump to force rebuilds).
CACHE_FORMAT = "1"


def _sql_list(paths: list[str]) -> str:
    """A SQL list literal of file paths (quotes doubled), for views over a fixed file list."""
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _vocab_text(docs: bool = False) -> str:
    """The stage and event vocabulary as text (stage, role, category; event names), with each
    stage's and event's documentation when ``docs``."""
    return (repr(sorted((k, v.role, v.category) + ((v.doc,) if docs else ()) for k, v in _stages.STAGES.items()))
            + repr(sorted(_stages.EVENTS.items() if docs else _stages.EVENTS)))


def _vocab_hash() -> str:
    """sha256 (16 hex) of the stage and event vocabulary a cache was built with.

    The vocabulary is loaded into the cache (``_stage_vocab``) and fixes the
    ``_stage_name`` ENUM; a cache built with another vocabulary is rebuilt.
    """
    return hashlib.sha256(_vocab_text().encode()).hexdigest()[:16]


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


class ReadOnlyError(duckdb.PermissionException):
    """A statement other than a query was refused by a read-only connection."""


_QUERY_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def _explained(sql: str) -> str | None:
    """The text of the statement an ``EXPLAIN [ANALYZE] [(options)]`` statement explains (None if unclear)."""
    toks = duckdb.tokenize(sql)
    ends = [p for p, _ in toks[1:]] + [len(sql)]
    seen, depth = False, 0
    for (pos, kind), end in zip(toks, ends):
        if kind == duckdb.token_type.comment:
            continue
        word = sql[pos:end].strip()
        if not seen:
            if word.upper() != "EXPLAIN":
                return None
            seen = True
        elif word == "(":
            depth += 1
        elif word == ")":
            depth -= 1
        elif depth == 0 and word.upper() not in ("ANALYZE", "ANALYSE"):
            return sql[pos:]
    return None


def readonly_statements(con: duckdb.DuckDBPyConnection, sql: str) -> list:
    """Parse ``sql`` on ``con`` and return its statements when every one only reads; else raise ReadOnlyError.

    The one read-only rule of pdtrace (queries, the SQL shell, the dashboard's
    console): SELECT (incl. WITH, FROM-first, SUMMARIZE, DESCRIBE, SHOW) and
    EXPLAIN of such a statement. ``EXPLAIN ANALYZE`` runs the statement it
    explains, so an EXPLAIN passes only when what follows it is itself a query.
    Raises duckdb.ParserException for text that does not parse.
    """
    stmts = con.extract_statements(sql)
    bad = []
    for s in stmts:
        ok = s.type == duckdb.StatementType.SELECT
        if s.type == duckdb.StatementType.EXPLAIN:
            inner = _explained(s.query)
            try:
                inner_stmts = con.extract_statements(inner) if inner else []
            except duckdb.ParserException:
                inner_stmts = []
            ok = len(inner_stmts) == 1 and inner_stmts[0].type == duckdb.StatementType.SELECT
            if not ok:
                bad.append("EXPLAIN of " + (inner_stmts[0].type.name if len(inner_stmts) == 1 else "a non-query"))
                continue
        if not ok:
            bad.append(s.type.name)
    if bad:
        raise ReadOnlyError(f"read-only: only queries are allowed, not {', '.join(bad)}")
    return stmts


class ReadOnlyConnection:
    """A DuckDB connection that runs only queries (SELECT, EXPLAIN), on locked-down settings.

    Two fences: every statement is parsed first and anything but a query
    raises :class:`ReadOnlyError` (COPY, ATTACH, EXPORT, CREATE, SET, PRAGMA,
    INSTALL...); and the connection itself has file system access disabled
    except for reading the store's own files, extension autoloading off and
    its configuration locked (see :func:`lock_down`).
    """

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self._con = con

    def execute(self, sql: str, params: list | None = None) -> duckdb.DuckDBPyConnection:
        """Run one or more queries; return the connection positioned on the last result.

        Raises ReadOnlyError for a non-query statement, duckdb.Error for a bad query.
        """
        readonly_statements(self._con, sql)
        if params:
            return self._con.execute(sql, params)
        return self._con.execute(sql)

    @property
    def description(self):
        return self._con.description

    def fetchall(self):
        return self._con.fetchall()

    def close(self) -> None:
        """Close the underlying connection (safe to call twice)."""
        try:
            self._con.close()
        except Exception:
            pass


def lock_down(con: duckdb.DuckDBPyConnection) -> ReadOnlyConnection:
    """Forbid writes and file access beyond the store's files on ``con``; return a ReadOnlyConnection.

    The store files absorbed in ``_files`` stay readable (``allowed_paths``);
    COPY TO, EXPORT, ATTACH, reading other files and INSTALL/LOAD raise, and
    SET of any option raises.
    """
    files = [r[0] for r in con.execute("SELECT path FROM _files WHERE ok").fetchall()]
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    if files:
        con.execute("SET allowed_paths = ?", [files])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return ReadOnlyConnection(con)


def connect_readonly(cache: str | os.PathLike) -> ReadOnlyConnection:
    """Open a cache database built by :class:`Trace` read-only and locked down (see :func:`lock_down`).

    Raises duckdb.IOException when the file is missing or locked by a writer.
    """
    return lock_down(duckdb.connect(str(cache), read_only=True))


def _stamp() -> str:
    """What a cache was built with: cache format, SQL library hash, stage vocabulary hash."""
    return f"{CACHE_FORMAT}:{loader.library_hash()}:{_vocab_hash()}"


def _install(con: duckdb.DuckDBPyConnection, stamp: str) -> None:
    """Load the vocabulary and every SQL module into the empty database ``con``; record ``stamp``.

    Raises RuntimeError naming the module whose SQL fails to load.
    """
    con.execute("CREATE TABLE IF NOT EXISTS _meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
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
    con.execute("INSERT OR REPLACE INTO _meta VALUES ('library', ?)", [stamp])


def cache_root() -> Path:
    """Where default caches and library templates live: ``$PDTRACE_CACHE_DIR``, else ``<tmp>/pdtrace-cache``
    (created if missing; raises OSError when it cannot be)."""
    root = Path(config.raw("PDTRACE_CACHE_DIR") or Path(tempfile.gettempdir()) / "pdtrace-cache")
    root.mkdir(parents=True, exist_ok=True)
    return root


def library_template(stamp: str | None = None) -> Path:
    """The library template (:mod:`pdtrace.analysis.template`) for ``stamp`` (default: this library's):
    ``<cache_root()>/pdtrace-library-<16 hex>.duckdb``, keyed by everything its contents depend on: the
    stamp, the stage and event vocabulary with its documentation, the DuckDB version (a file is
    readable by the storage version that wrote it) and the user (a template is never shared). Other
    versions' templates stay (about 2 MB each) until the directory is cleaned. Raises OSError when
    the cache root cannot be created.
    """
    key = hashlib.sha256(f"{stamp or _stamp()}:{duckdb.__version__}:{os.getuid()}:{_vocab_text(docs=True)}".encode())
    key = key.hexdigest()[:16]
    return cache_root() / f"pdtrace-library-{key}.duckdb"


def _new_from_template(cache: Path, stamp: str) -> bool:
    """Create the absent ``cache`` as a copy of the library template (True), or leave it to the caller
    to install the library (False: see :func:`pdtrace.analysis.template.copy_into`)."""
    def check(con: duckdb.DuckDBPyConnection) -> bool:
        row = con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()
        return row is not None and row[0] == stamp

    try:
        tpl = library_template(stamp)
    except OSError:
        return False
    return _template.copy_into(cache, tpl, lambda con: _install(con, stamp), check)


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
        # files whose data failed to decode: path -> (size, mtime_ns, reason), skipped until they
        # change; a cache file remembers those an earlier run found
        self._corrupt: dict[str, tuple[int, int, str]] = {
            p: (size, mtime, reason) for p, size, mtime, reason in self.con.execute(
                "SELECT path, size, mtime_ns, reason FROM _files "
                "WHERE NOT ok AND starts_with(reason, 'corrupt data:') AND size IS NOT NULL").fetchall()}

    # -- database lifecycle ---------------------------------------------------
    def _open(self, template: bool = True) -> duckdb.DuckDBPyConnection:
        stamp = _stamp()
        # a new cache file starts as a copy of the installed library (library_template), checked
        # before it appears: an error opening it is another process's lock, raised as such
        copied = template and self.cache is not None and _new_from_template(self.cache, stamp)
        con = duckdb.connect(str(self.cache) if self.cache else ":memory:")
        if self._threads:
            con.execute(f"SET threads = {int(self._threads)}")
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
        if row is None:
            _install(con, stamp)
        # scratch steps live in memory (temp tables shadow the empty main ones)
        for name, kind in loader.materializations():
            if kind == "scratch":
                mat = f"_mat_{name.lstrip('_')}"
                con.execute(f"CREATE OR REPLACE TEMP TABLE {mat} AS SELECT * FROM main.{mat} LIMIT 0")
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
        """List the directory: ({readable file: (size, mtime_ns)}, [(skipped file, reason)]).

        pdtrace files that are not spans (``FileCheck.artifact``: the lab client's
        records) are in neither list, nor is a file that vanished since the
        listing. A file that exists but could not be opened just now (out of
        descriptors) has a reason starting ``unreadable now:`` (:meth:`refresh`
        keeps such a file's rows when it absorbed the file before); one that
        cannot be opened for good (permission) ``unreadable:``.
        """
        good: dict[str, tuple[int, int]] = {}
        bad: list[tuple[str, str]] = []
        for p in _store.store_files(self.directory):
            chk = _store.check_file(p)
            if chk.artifact:  # another pdtrace file (the lab's client records): not spans, not bad
                continue
            if not chk.ok:
                if not (chk.unreadable and not p.exists()):  # a file gone since the listing: nothing to say
                    bad.append((str(p), chk.reason))
                continue
            try:
                st = p.stat()
            except OSError as exc:
                if p.exists():
                    kind = "unreadable now" if exc.errno in _store.TRANSIENT_ERRNOS else "unreadable"
                    bad.append((str(p), f"{kind}: {type(exc).__name__}"))
                continue
            known = self._corrupt.get(str(p))
            if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
                bad.append((str(p), known[2]))  # its data failed to decode (until it changes)
                continue
            good[str(p)] = (st.st_size, st.st_mtime_ns)
        return good, bad

    #: Failed attempts one :meth:`refresh` makes when store files vanish under it before it raises.
    refresh_attempts = 3

    def refresh(self) -> RefreshResult:
        """Absorb new/changed files, drop vanished ones, recompute what they touch.

        Warns (SkippedFileWarning) once per bad file. Returns a RefreshResult.

        New files are decoded in full before they are absorbed (every value of
        every column; all new files in one statement, each alone only when
        that fails: :func:`_decode_errors`). A file whose footer is sound but
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
            for p, (state, reason) in _decode_errors(new).items():
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
            try:
                res = self._refresh_files(good, bad, new, gone, cold=rebuild, transaction=not rebuild)
            except duckdb.Error as exc:
                failures += 1
                if failures >= self.refresh_attempts or not self._vanished(exc, good):
                    raise
                continue
            out.new += [p for p in res.new if p not in out.new]
            out.gone += [p for p in res.gone if p not in out.gone]
            out.skipped = res.skipped
            if not deferred:
                break
        out.dirty_requests = self.con.execute("SELECT count(DISTINCT rkey) FROM _refreshed_keys").fetchone()[0]
        self.con.execute("DROP TABLE IF EXISTS _refreshed_keys")
        for path, reason in out.skipped:
            warnings.warn(f"skipped store file {path}: {reason}", SkippedFileWarning, stacklevel=2)
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
        for table in ("_dup_copies", "_dup_drop", "_file_keys", "_scope_keys", "_changed_keys",
                      "_changed_windows", "_read_files"):
            con.execute(f"DELETE FROM {table}")
        con.execute("DELETE FROM _files WHERE ok OR NOT starts_with(coalesce(reason, ''), 'corrupt data:')")
        for name, _ in loader.materializations():
            con.execute(f"DELETE FROM _mat_{name.lstrip('_')}")
        con.execute("INSERT OR REPLACE INTO _meta VALUES ('state', 'wiped')")
        self._fresh = True

    def _vanished(self, exc: duckdb.Error, good: dict[str, tuple[int, int]]) -> bool:
        """After a refresh attempt failed with ``exc``: True when it is an error opening a file
        (:func:`_access_error`) and a file of the listing ``good`` has vanished or changed since."""
        if not _access_error(exc):
            return False
        now, _ = self.scan()
        return any(now.get(p) != sm for p, sm in good.items())

    def _refresh_files(self, good: dict[str, tuple[int, int]], bad: list[tuple[str, str]],
                       new: list[str], gone: list[str], cold: bool, transaction: bool) -> RefreshResult:
        """One refresh attempt over a listing (``good``, ``bad``) and its ``new``/``gone`` files;
        ``cold``: recompute from every file; ``transaction``: all of it in one, rolled back on failure."""
        res = RefreshResult(new=new, gone=gone, skipped=bad)
        con = self.con
        if transaction:
            con.execute("BEGIN TRANSACTION")
        try:
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
            if transaction:
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:  # pragma: no cover - the transaction is already gone
                    pass
            raise
        self._fresh = False
        return res

    def _set_records(self, files: list[str]) -> None:
        """Point ``_records`` at ``files`` (read in place), hiding the copies listed in ``_dup_drop``."""
        con = self.con
        if not files:
            con.execute("CREATE OR REPLACE VIEW _records AS SELECT * FROM _records_empty")
            return
        lit = _sql_list(files)
        has_dups = con.execute("SELECT count(*) FROM _dup_drop").fetchone()[0] > 0
        anti = " WHERE NOT _hidden_copy(r.record_id, r._file)" if has_dups else ""
        con.execute(f"CREATE OR REPLACE VIEW _records AS SELECT * FROM _read_store({lit}) r{anti}")

    def _absorb(self, new: list[str], gone: list[str], good: dict[str, tuple[int, int]], cold: bool) -> int:
        con = self.con
        files = sorted(good)
        con.execute("DELETE FROM _changed_keys")
        if gone:
            con.execute("CREATE OR REPLACE TEMP TABLE _gone AS SELECT unnest(?::VARCHAR[]) AS path", [gone])
            con.execute("INSERT INTO _changed_keys SELECT rkey FROM _file_keys WHERE _file IN (SELECT path FROM _gone)")
            con.execute("DELETE FROM _file_keys WHERE _file IN (SELECT path FROM _gone)")
            con.execute("DELETE FROM _files WHERE path IN (SELECT path FROM _gone)")
        if new:
            # what each new file touches: its request keys and the keys its router rows link to
            con.execute("""
                CREATE OR REPLACE TEMP TABLE _new_keys AS
                SELECT DISTINCT _file, k AS rkey FROM (
                    SELECT _file, rkey AS k FROM _read_store(?) WHERE rkey IS NOT NULL
                    UNION ALL
                    SELECT _file, _request_key(run_id, attr_str['router.linked_request_id'], prompt_index)
                    FROM _read_store(?) WHERE role = 'router' AND attr_str['router.linked_request_id'] IS NOT NULL)""",
                        [new, new])
            con.execute("INSERT INTO _file_keys SELECT * FROM _new_keys")
            if not cold:
                con.execute("INSERT INTO _changed_keys SELECT rkey FROM _new_keys")
            con.execute("""INSERT OR REPLACE INTO _files
                           SELECT f.path, f.size, f.mtime_ns, c.n, true, '', now()
                           FROM (SELECT unnest(?::VARCHAR[]) AS path, unnest(?::BIGINT[]) AS size,
                                        unnest(?::BIGINT[]) AS mtime_ns) f
                           LEFT JOIN (SELECT file_name, sum(num_rows) AS n FROM parquet_file_metadata(?)
                                      GROUP BY file_name) c ON c.file_name = f.path""",
                        [new, [good[p][0] for p in new], [good[p][1] for p in new], new])
        self._refresh_duplicates(files, new, gone, cold)
        self._set_records(files)
        self._refresh_file_parts(files if cold else new, gone, cold)
        self._refresh_changed(cold)
        # clock offsets: recompute; requests on clocks whose offset moved are dirty too
        con.execute("CREATE OR REPLACE TEMP TABLE _old_offsets AS SELECT * FROM _mat_domain_offsets")
        for name, kind in loader.materializations():
            if kind == "full":
                con.execute(f"DELETE FROM _mat_{name.lstrip('_')}")
                con.execute(f"INSERT INTO _mat_{name.lstrip('_')} SELECT * FROM _calc_{name.lstrip('_')}")
        con.execute("DELETE FROM _scope_keys")
        if cold:
            con.execute("INSERT INTO _scope_keys SELECT DISTINCT rkey FROM _file_keys")
        else:
            con.execute("""
                CREATE OR REPLACE TEMP TABLE _moved AS
                SELECT coalesce(n.domain, o.domain) AS domain, coalesce(n.window_idx, o.window_idx) AS window_idx
                FROM _mat_domain_offsets n FULL OUTER JOIN _old_offsets o
                  ON n.domain = o.domain AND n.window_idx IS NOT DISTINCT FROM o.window_idx
                WHERE n.offset_ns IS DISTINCT FROM o.offset_ns""")
            moved = con.execute("SELECT count(*) FROM _moved").fetchone()[0] > 0
            con.execute("""
                INSERT INTO _scope_keys
                SELECT rkey FROM _changed_keys WHERE rkey IS NOT NULL
                UNION SELECT by_rkey FROM _req_links WHERE rkey IN (SELECT rkey FROM _changed_keys)""")
            if moved:
                con.execute("""
                    INSERT INTO _scope_keys
                    SELECT DISTINCT r.rkey FROM _records r JOIN _moved m ON r.domain = m.domain
                      AND (m.window_idx IS NULL OR r.start_ns // _clock_window_ns() = m.window_idx)
                    WHERE r.rkey IS NOT NULL AND r.rkey NOT IN (SELECT rkey FROM _scope_keys)""")
        n_scope = con.execute("SELECT count(*) FROM _scope_keys").fetchone()[0]
        try:
            if n_scope <= self.batch_requests:
                if not cold:
                    self._restrict_records(files)
                self._materialize_scope()
            else:
                self._materialize_in_batches(files, n_scope)
        finally:
            self._tidy(lambda: self._set_records(files))
        return n_scope

    def _tidy(self, step) -> None:
        """Run the clean-up ``step()`` of a refresh step (from a ``finally``). After a failure inside
        a warm refresh's transaction DuckDB refuses every statement ('transaction is aborted') and
        the rollback undoes the step anyway: the clean-up is skipped there, so that the step's own
        error is the one raised."""
        try:
            step()
        except duckdb.TransactionException as exc:
            if "aborted" not in str(exc):
                raise

    def _refresh_duplicates(self, files: list[str], new: list[str], gone: list[str], cold: bool) -> None:
        """Bring ``_dup_copies`` and ``_dup_drop`` up to date: one visible copy per record_id, the copy in the
        first file by name (the recorder's compaction briefly leaves a record in a part and a segment).

        Cold: every file's record ids are grouped once. Warm: the copies in vanished (or rewritten) files
        are forgotten, and only the new files' record ids are looked up in the other files (their
        ``record_id`` column, restricted to the new ids' min..max so that Parquet row-group statistics can
        skip the rest) instead of grouping every record id of the store on each absorb.
        """
        con = self.con
        if cold:
            con.execute("DELETE FROM _dup_copies")
            if files:
                con.execute("""
                    INSERT INTO _dup_copies
                    SELECT DISTINCT record_id, filename FROM read_parquet(?, filename = true)
                    WHERE record_id IN (SELECT record_id FROM read_parquet(?) GROUP BY record_id HAVING count(*) > 1)""",
                            [files, files])
        else:
            if gone:
                con.execute("DELETE FROM _dup_copies WHERE _file IN (SELECT unnest(?::VARCHAR[]))", [gone])
            if new:
                con.execute("CREATE OR REPLACE TEMP TABLE _new_ids AS "
                            "SELECT DISTINCT record_id, filename AS _file FROM read_parquet(?, filename = true)", [new])
                lo, hi = con.execute("SELECT min(record_id), max(record_id) FROM _new_ids").fetchone()
                fresh = set(new)
                old = [f for f in files if f not in fresh]
                con.execute("CREATE OR REPLACE TEMP TABLE _id_copies AS SELECT record_id, _file FROM _new_ids")
                if old and lo is not None:
                    con.execute("""
                        INSERT INTO _id_copies
                        SELECT DISTINCT record_id, filename FROM read_parquet(?, filename = true)
                        WHERE record_id BETWEEN ? AND ? AND record_id IN (SELECT record_id FROM _new_ids)""",
                                [old, lo, hi])
                con.execute("DELETE FROM _dup_copies WHERE record_id IN (SELECT record_id FROM _new_ids)")
                con.execute("""
                    INSERT INTO _dup_copies SELECT record_id, _file FROM _id_copies
                    WHERE record_id IN (SELECT record_id FROM _id_copies GROUP BY record_id HAVING count(*) > 1)""")
        # a record left in one file (its other copies vanished) is no longer a duplicate
        con.execute("""DELETE FROM _dup_copies WHERE record_id IN (
                           SELECT record_id FROM _dup_copies GROUP BY record_id HAVING count(DISTINCT _file) < 2)""")
        con.execute("DELETE FROM _dup_drop")
        con.execute("""
            INSERT INTO _dup_drop
            SELECT record_id, _file FROM (
                SELECT record_id, _file, row_number() OVER (PARTITION BY record_id ORDER BY _file) AS rn FROM _dup_copies)
            WHERE rn > 1""")

    def _refresh_changed(self, cold: bool) -> None:
        """Refresh the ``changed`` materializations, then the ``window`` ones (see
        :mod:`pdtrace.analysis.loader`): recompute the request keys in ``_changed_keys``, or every key on a
        cold build (``_changed_keys`` is then set to every key of ``_file_keys``); the windows a ``changed``
        table with a ``window_idx`` column held rows of those keys in, before or after, go to
        ``_changed_windows`` and their roll-ups are recomputed."""
        con = self.con
        if cold:
            con.execute("DELETE FROM _changed_keys")
            con.execute("INSERT INTO _changed_keys SELECT DISTINCT rkey FROM _file_keys WHERE rkey IS NOT NULL")
        con.execute("DELETE FROM _changed_windows")
        for name, kind in loader.materializations():
            mat, calc = f"_mat_{name.lstrip('_')}", f"_calc_{name.lstrip('_')}"
            if kind == "changed":
                windowed = "window_idx" in [d[0] for d in con.execute(f"SELECT * FROM {mat} LIMIT 0").description]
                touched = (f"INSERT INTO _changed_windows SELECT DISTINCT window_idx FROM {mat} "
                           "WHERE rkey IN (SELECT rkey FROM _changed_keys)")
                if cold:
                    con.execute(f"DELETE FROM {mat}")
                else:
                    if windowed:
                        con.execute(touched)
                    con.execute(f"DELETE FROM {mat} WHERE rkey IN (SELECT rkey FROM _changed_keys)")
                con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
                if windowed:
                    con.execute(f"INSERT INTO _changed_windows SELECT DISTINCT window_idx FROM {mat}" if cold
                                else touched)
            elif kind == "window":
                if cold:
                    con.execute(f"DELETE FROM {mat}")
                else:
                    con.execute(f"DELETE FROM {mat} WHERE window_idx IN (SELECT window_idx FROM _changed_windows)")
                con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")

    def _refresh_file_parts(self, read: list[str], gone: list[str], cold: bool) -> None:
        """Refresh the ``file`` materializations (see :mod:`pdtrace.analysis.loader`): delete the rows of
        vanished (or rewritten) files and add those of the files in ``read`` -- the new files, or every
        file on a cold build -- reading only those files through ``_file_rows`` (and listing them in
        ``_read_files``)."""
        con = self.con
        parts = [name for name, kind in loader.materializations() if kind == "file"]
        if read:
            con.execute(f"CREATE OR REPLACE VIEW _file_rows AS SELECT * FROM _read_store({_sql_list(read)})")
            con.execute("INSERT INTO _read_files SELECT unnest(?::VARCHAR[])", [read])
        try:
            for name in parts:
                mat, calc = f"_mat_{name.lstrip('_')}", f"_calc_{name.lstrip('_')}"
                if cold:
                    con.execute(f"DELETE FROM {mat}")
                elif gone:
                    con.execute(f"DELETE FROM {mat} WHERE _file IN (SELECT unnest(?::VARCHAR[]))", [gone])
                if read:
                    con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
        finally:
            self._tidy(lambda: (con.execute("CREATE OR REPLACE VIEW _file_rows AS SELECT * FROM _records_empty"),
                                con.execute("DELETE FROM _read_files")))

    #: Requests recomputed per batch: a refresh touching more is done in batches
    #: of consecutive requests (see :meth:`_materialize_in_batches`).
    batch_requests = 100_000

    def _restrict_records(self, files: list[str]) -> None:
        """Point ``_records`` at the files holding rows of the requests in ``_scope_keys``
        (``_file_keys`` maps each file to the request keys, and linked ids, it touches)."""
        keep = set(files)
        self._set_records(sorted(keep.intersection(r[0] for r in self.con.execute(
            "SELECT DISTINCT _file FROM _file_keys WHERE rkey IN (SELECT rkey FROM _scope_keys)").fetchall())))

    def _materialize_scope(self) -> None:
        """Recompute the per-request materializations for the keys in ``_scope_keys``."""
        con = self.con
        try:
            for name, kind in loader.materializations():
                mat, calc = f"_mat_{name.lstrip('_')}", f"_calc_{name.lstrip('_')}"
                if kind == "request":
                    con.execute(f"DELETE FROM {mat} WHERE rkey IN (SELECT rkey FROM _scope_keys)")
                    con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
                elif kind == "scratch":
                    con.execute(f"DELETE FROM {mat}")
                    con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
        finally:
            self._tidy(lambda: [con.execute(f"DELETE FROM _mat_{name.lstrip('_')}")
                                for name, kind in loader.materializations() if kind == "scratch"])

    def _materialize_in_batches(self, files: list[str], n_scope: int) -> None:
        """Recompute ``n_scope`` requests in time-ordered batches of :attr:`batch_requests`.

        One pass over a million requests at once outgrows memory (DuckDB spills:
        56.7 s with a 6 GB limit vs 43.5 s with 14 GB on the 1M benchmark store;
        in batches of 100,000: 40 s at a 2.2 GiB peak RSS instead of 45 s at
        10.4 GiB; BENCHMARKS.md "Analysis"). Requests are ordered by the
        earliest modification time of the files holding their rows (files rotate
        in time, so a batch's requests share files), and each batch reads only the
        files holding its requests, exactly like a warm refresh: per-request
        results are the same whatever the batching. A request and the ids the
        router linked to it (``router.linked_request_id``) go to the same batch.
        """
        con = self.con
        n_batches = -(-n_scope // self.batch_requests)
        con.execute("CREATE OR REPLACE TEMP TABLE _scope_all AS SELECT DISTINCT rkey FROM _scope_keys")
        # each key's batch: its linking request's (a linked id follows the request that names it)
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _scope_batch AS
            WITH t AS (
                SELECT k.rkey, min(f.mtime_ns) AS t0 FROM _scope_all k
                LEFT JOIN _file_keys fk ON fk.rkey = k.rkey LEFT JOIN _files f ON f.path = fk._file
                GROUP BY k.rkey
            ), lead AS (
                SELECT t.rkey, coalesce(min(tl.t0), t.t0) AS t0, coalesce(min(l.by_rkey), t.rkey) AS owner
                FROM t LEFT JOIN _req_links l ON l.rkey = t.rkey LEFT JOIN t tl ON tl.rkey = l.by_rkey
                GROUP BY t.rkey, t.t0
            )
            SELECT rkey, (dense_rank() OVER (ORDER BY t0, owner) - 1) * ? // ? AS b FROM lead""",
                    [n_batches, n_scope])
        batches = [r[0] for r in con.execute("SELECT DISTINCT b FROM _scope_batch ORDER BY b").fetchall()]
        for b in batches:
            con.execute("DELETE FROM _scope_keys")
            con.execute("INSERT INTO _scope_keys SELECT rkey FROM _scope_batch WHERE b = ?", [b])
            self._restrict_records(files)
            self._materialize_scope()
        con.execute("DELETE FROM _scope_keys")
        con.execute("INSERT INTO _scope_keys SELECT rkey FROM _scope_all")

    # -- queries ----------------------------------------------------------------
    def readonly(self) -> ReadOnlyConnection:
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


#: DuckDB errors that say nothing about a file's bytes: a fault of the SQL, the memory limit, an
#: interrupt, the sandbox (a corrupt page raises a plain duckdb.Error, IOException or
#: InvalidInputException, depending on where the decoder stumbles).
_NOT_FILE_ERRORS = (duckdb.OutOfMemoryException, duckdb.InterruptException, duckdb.BinderException,
                    duckdb.ParserException, duckdb.CatalogException, duckdb.PermissionException,
                    duckdb.TransactionException)

#: How DuckDB says it could not open or list a file (its own words and the OS's strerror): the
#: file's access, not its bytes.
_ACCESS_WORDS = re.compile(r"Cannot open file|No files found|No such file|Too many open files|Permission denied|"
                           r"Resource temporarily unavailable|Is a directory")


def _access_error(exc: BaseException) -> bool:
    """True when ``exc`` is DuckDB failing to open a file (vanished, too many open files, ...)."""
    return isinstance(exc, duckdb.Error) and _ACCESS_WORDS.search(str(exc)) is not None


def _decode_error(paths: list[str]) -> tuple[str, str]:
    """Whether DuckDB decodes every value of every column of the store files ``paths``.

    The footers were already checked (:func:`pdtrace.instrument.store.check_file`);
    this hashes every value (a streaming aggregate: bounded memory) on a
    separate in-memory connection, over the union of the files' columns.
    Returns ``("sound", "")``; ``("corrupt", "corrupt data: <DuckDB's first
    line>")`` (non-printable characters escaped); or ``("unknown", <error
    class>)`` when the decode failed for a reason that is not the bytes'
    (:data:`_NOT_FILE_ERRORS`, such as out of memory, or :func:`_access_error`:
    a file could not be opened).
    """
    con = None
    try:
        con = duckdb.connect()
        con.execute("SELECT max(hash(COLUMNS(*))) FROM read_parquet(?, union_by_name = true)", [paths]).fetchall()
        return "sound", ""
    except _NOT_FILE_ERRORS as exc:
        return "unknown", type(exc).__name__
    except duckdb.Error as exc:  # e.g. 'Corrupted file?', "don't know what type"
        if _access_error(exc):
            return "unknown", type(exc).__name__
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return "corrupt", "corrupt data: " + "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in first)
    finally:
        if con is not None:
            con.close()


def _decode_errors(paths: list[str]) -> dict[str, tuple[str, str]]:
    """{path: (state, reason)} of the files in ``paths`` that do not decode as sound (:func:`_decode_error`).

    All of them are decoded in one statement (3.7 s for the 1M-request benchmark
    store's 180 files, against 14 s one by one; BENCHMARKS.md); only when that
    is not sound, each file alone.
    """
    if not paths or _decode_error(paths)[0] == "sound":
        return {}
    out = {}
    for p in paths:
        state, reason = _decode_error([p])
        if state != "sound":
            out[p] = (state, reason)
    return out


def open_trace(directory: str | os.PathLike, cache: str | os.PathLike | None = None,
               threads: int | None = None) -> Trace:
    """Open ``directory``'s analysis database and refresh it (see :class:`Trace`)."""
    tr = Trace(directory, cache=cache, threads=threads)
    tr.refresh()
    return tr


def default_cache_path(directory: str | os.PathLike) -> Path:
    """Cache file for ``directory``: :func:`cache_root`/pdtrace-<16 hex of sha256(resolved path)>.duckdb."""
    key = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]
    return cache_root() / f"pdtrace-{key}.duckdb"
