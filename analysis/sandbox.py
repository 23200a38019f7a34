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

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self._con = con

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
        """A new read-only cursor on the same database (for another thread, or a second result)."""
        return ReadOnlyConnection(self._con.cursor())

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
