"""The read-only rule of every query pdtrace runs for a user (``pdtrace sql``, ``pdtrace report``, the
dashboard, :func:`pdtrace.analysis.open`).

Two fences: :func:`readonly_statements` parses a text first and refuses anything but a query (SELECT,
EXPLAIN of a query); and the connection itself reads no file it should not -- :func:`lock_down` (the
store's absorbed files only, configuration locked: a finished look such as ``pdtrace sql``) or
:func:`restrict_to_directory` (files under the trace directory: a session that keeps refreshing,
the dashboard) -- with extension autoloading off, so a query cannot write files, attach databases or
load extensions.
"""
from __future__ import annotations

import os
from pathlib import Path

import duckdb

from . import files as _files


class ReadOnlyError(duckdb.PermissionException):
    """A statement other than a query was refused by a read-only connection."""


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
    """A DuckDB connection (or cursor) that runs only queries (SELECT, EXPLAIN).

    Two fences: every statement is parsed first and anything but a query raises
    :class:`ReadOnlyError` (COPY, ATTACH, EXPORT, CREATE, SET, PRAGMA, INSTALL...); and the
    connection under it reads no file it should not: the store's absorbed files only, its
    configuration locked (:func:`lock_down`, a finished look at a trace), or files under the trace
    directory only (:func:`restrict_to_directory`, a session that keeps refreshing). Results are
    read from this object itself (``execute`` returns it), so nothing runs on the connection
    under it unchecked.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, hold: dict[str, int] | None = None):
        self._con = con
        self._hold = hold  # {store file: bytes} a new cursor holds in memory (lock_down)

    def statements(self, sql: str) -> list:
        """The statements of ``sql`` when every one is a query (:func:`readonly_statements`); raises
        ReadOnlyError otherwise, duckdb.ParserException for text that does not parse."""
        return readonly_statements(self._con, sql)

    def execute(self, sql: str, params: list | None = None) -> "ReadOnlyConnection":
        """Run one or more queries; return this connection, positioned on the last result.

        Raises ReadOnlyError for a non-query statement, duckdb.Error for a bad query.
        """
        readonly_statements(self._con, sql)
        if params:
            self._con.execute(sql, params)
        else:
            self._con.execute(sql)
        return self

    def cursor(self) -> "ReadOnlyConnection":
        """A new read-only cursor on the same database (for another thread, or a second result).

        On a connection from :func:`lock_down` over a small store, the cursor first reads the
        store's rows into memory (:func:`pdtrace.analysis.files.hold_rows`: 0.1 s for the
        20-request synthetic store, 0.3 s CPU for the 1,000-request one), so that the views reading
        store files in place (``spans``, ``events``, ``transfers``, ``coarse_breakdown``...) read
        each file once per cursor instead of once per query; the rows are those the files hold
        when it is made (the connection is a finished look). Temporary objects belong to one DuckDB
        connection, hence one read per cursor, none on the connection itself. When reading them
        fails (a file vanished since the refresh, out of memory) the cursor reads files in place,
        as it would without a hold, and fails on such a file only when a query reads it.
        """
        cur = self._con.cursor()
        if self._hold:
            try:
                _files.hold_rows(cur, self._hold, limit=sum(self._hold.values()))
            except duckdb.Error:
                pass
        return ReadOnlyConnection(cur, self._hold)

    @property
    def description(self):
        """The last result's columns (DB-API ``description``), None when it has none."""
        return self._con.description

    def fetchone(self):
        return self._con.fetchone()

    def fetchmany(self, size: int = 1):
        return self._con.fetchmany(size)

    def fetchall(self):
        return self._con.fetchall()

    def df(self):
        """The last result as a pandas DataFrame (pandas must be installed)."""
        return self._con.df()

    def close(self) -> None:
        """Close the underlying connection (safe to call twice)."""
        try:
            self._con.close()
        except Exception:
            pass


def lock_down(con: duckdb.DuckDBPyConnection, hold: bool | int = True) -> ReadOnlyConnection:
    """Forbid writes and file access beyond the store's files on ``con``; return a ReadOnlyConnection.

    The store files absorbed in ``_files`` stay readable (``allowed_paths``);
    COPY TO, EXPORT, ATTACH, reading other files and INSTALL/LOAD raise, and
    SET of any option raises. ``hold``: each cursor of the returned connection
    (:meth:`ReadOnlyConnection.cursor`) reads the store's rows into memory first when its files
    total at most :data:`pdtrace.analysis.files.HOLD_BYTES` (True), at most ``hold`` bytes (an
    int), or never (False); see :meth:`ReadOnlyConnection.cursor`.
    """
    sizes = dict(con.execute("SELECT path, coalesce(size, 0) FROM _files WHERE ok").fetchall())
    files = sorted(sizes)
    limit = 0 if hold is False else _files.HOLD_BYTES if hold is True else int(hold)
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    if files:
        con.execute("SET allowed_paths = ?", [files])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return ReadOnlyConnection(con, sizes if sizes and sum(sizes.values()) <= limit else None)


def connect_readonly(cache: str | os.PathLike, hold: bool | int = True) -> ReadOnlyConnection:
    """Open a cache database built by :class:`Trace` read-only and locked down (see :func:`lock_down`,
    which ``hold`` is passed to).

    Raises duckdb.IOException when the file is missing or locked by a writer.
    """
    return lock_down(duckdb.connect(str(cache), read_only=True), hold)


def restrict_to_directory(con: duckdb.DuckDBPyConnection, directories: list[str | os.PathLike]) -> None:
    """Let ``con`` read files under ``directories`` only (DuckDB ``allowed_directories`` with external
    access off) and never install or autoload an extension; its own database file stays writable, so
    the connection can still refresh (read the store's files, write its tables). Pass the trace
    directory and the resolved directories of store files that are symlinks (DuckDB checks the file
    a link points to). Idempotent: a connection already restricted is left as it is (DuckDB refuses
    to re-enable external access).
    """
    if not con.execute("SELECT current_setting('enable_external_access')").fetchone()[0]:
        return
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    dirs = sorted({str(Path(d).resolve()) + os.sep for d in directories})
    con.execute("SET allowed_directories = ?", [dirs])
    con.execute("SET enable_external_access = false")
