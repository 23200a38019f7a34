"""A trace directory's store files as the analysis sees them: which to read, which to skip and why.

:func:`scan` lists the directory and checks each file's footer (the store's reader rules,
:func:`pdtrace.instrument.store.check_metadata`, on footers read by DuckDB in one statement, or by
:func:`pdtrace.instrument.store.check_file` when that statement fails); :func:`decode_errors` decodes new files in full before
they are absorbed, so a file whose footer is sound but whose data pages are not is skipped and named
(a :class:`SkippedFileWarning`), and a file that cannot be read *just now* (out of descriptors or
memory, vanished) is told apart from one whose bytes are bad.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import duckdb

from pdtrace.instrument import schema as _schema, store as _store


class SkippedFileWarning(UserWarning):
    """A store file could not be read and was skipped (the message names it and why)."""



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


def access_error(exc: BaseException) -> bool:
    """True when ``exc`` is DuckDB failing to open a file (vanished, too many open files, ...)."""
    return isinstance(exc, duckdb.Error) and _ACCESS_WORDS.search(str(exc)) is not None


def decode_error(paths: list[str], threads: int | None = None, memory_limit: str | None = None) -> tuple[str, str]:
    """Whether DuckDB decodes every value of every column of the store files ``paths``.

    The footers were already checked (:func:`pdtrace.instrument.store.check_file`);
    this hashes every value (a streaming aggregate: bounded memory) on a
    separate in-memory connection, over the union of the files' columns.
    Returns ``("sound", "")``; ``("corrupt", "corrupt data: <DuckDB's first
    line>")`` (non-printable characters escaped); or ``("unknown", <error
    class>)`` when the decode failed for a reason that is not the bytes'
    (:data:`_NOT_FILE_ERRORS`, such as out of memory, or :func:`access_error`:
    a file could not be opened). ``threads``, ``memory_limit``: that connection's DuckDB settings
    (default DuckDB's).
    """
    con = None
    try:
        con = duckdb.connect()
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        if memory_limit:
            con.execute("SET memory_limit = ?", [memory_limit])
        # hive_partitioning = false: the files' own columns only, never date/hour/host from a fleet layout's directories
        con.execute("SELECT max(hash(COLUMNS(*))) FROM read_parquet(?, union_by_name = true, hive_partitioning = false)",
                    [paths]).fetchall()
        return "sound", ""
    except _NOT_FILE_ERRORS as exc:
        return "unknown", type(exc).__name__
    except duckdb.Error as exc:  # e.g. 'Corrupted file?', "don't know what type"
        if access_error(exc):
            return "unknown", type(exc).__name__
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return "corrupt", "corrupt data: " + "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in first)
    finally:
        if con is not None:
            con.close()


def decode_errors(paths: list[str], threads: int | None = None,
                  memory_limit: str | None = None) -> dict[str, tuple[str, str]]:
    """{path: (state, reason)} of the files in ``paths`` that do not decode as sound (:func:`decode_error`,
    with ``threads`` and ``memory_limit``).

    All of them are decoded in one statement (3.65 s for the 1M-request benchmark
    store's 180 files, against 14.17 s one by one; BENCHMARKS.md "Analysis cold build"); only when that
    is not sound, each file alone.
    """
    if not paths or decode_error(paths, threads, memory_limit)[0] == "sound":
        return {}
    out = {}
    for p in paths:
        state, reason = decode_error([p], threads, memory_limit)
        if state != "sound":
            out[p] = (state, reason)
    return out


#: A cold build of store files totalling at most this many bytes on disk holds their rows in memory
#: (:func:`hold_rows`). Held rows take 16-18x their size on disk (zstd Parquet; the synthetic
#: 1,000-request store: 0.68 MB on disk, 12.5 MB held; 9.7 MB: 179 MB), and holding pays off only while
#: the store is small: a cold refresh of 9.7 MB took 2.4 s held against 3.7 s in place, one of 30.9 MB
#: 7-11 s against 6-9 s (2026-12-06, 2 cores).
HOLD_BYTES = 4 * 1024 * 1024

#: Held rows per byte on disk assumed when checking a hold against DuckDB's memory_limit (measured
#: 16-18, see HOLD_BYTES), and the share of that limit a hold may take.
HELD_PER_DISK_BYTE, HOLD_SHARE = 20, 0.25

_UNITS = {"bytes": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def memory_limit_bytes(con: duckdb.DuckDBPyConnection) -> int | None:
    """DuckDB's ``memory_limit`` on ``con`` in bytes (its setting reads e.g. ``'18.8 GiB'``,
    ``'100.0 MiB'``); None when it cannot be read or parsed."""
    try:
        text = con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
    except duckdb.Error:
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


#: The table of held rows, in the connection's temporary schema.
HELD_TABLE = "_held_rows"


def hold_rows(con: duckdb.DuckDBPyConnection, sizes: dict[str, int], limit: int = HOLD_BYTES) -> bool:
    """Read the store files ``sizes`` ({path: bytes on disk}) once into a temporary table of ``con``
    and make the SQL library's ``_read_store(files)`` read them from there, when they total at most
    ``limit`` bytes (True); else do nothing (False).

    Why: every statement over ``_read_store`` (``_records``, ``_file_rows``) otherwise opens each
    file again, reads its footer at bind time (``union_by_name``) and decodes its pages: on a small
    store that is most of a statement's time in a cold build (~40 statements). Held, those statements
    read the files once (the duplicate check and the row counts of ``_files`` still read in place).

    How: a ``TEMP`` table :data:`HELD_TABLE` holds ``main._read_store(paths)`` (the library's macro,
    so the rows are exactly the ones read in place), and a ``TEMP`` table macro ``_read_store(files)``
    -- found before the library's (the temporary schema comes first in DuckDB's search path) --
    returns the held rows of ``files``. A ``files`` list naming a file not held returns no rows for
    it: callers pass only files of ``sizes``. Undo with :func:`release_rows`; both live only as long
    as the connection (no trace of them in a cache file). Raises what reading the files raises
    (duckdb.Error: a file vanished, out of memory), holding nothing then.
    """
    if not sizes or sum(sizes.values()) > limit:
        return False
    release_rows(con)
    try:
        con.execute(f"CREATE TEMP TABLE {HELD_TABLE} AS SELECT * FROM main._read_store(?)", [sorted(sizes)])
        con.execute(f"CREATE TEMP MACRO _read_store(files) AS TABLE "
                    f"SELECT * FROM temp.main.{HELD_TABLE} WHERE _file IN (SELECT unnest(files))")
    except BaseException:
        release_rows(con)
        raise
    return True


def release_rows(con: duckdb.DuckDBPyConnection) -> None:
    """Undo :func:`hold_rows` on ``con`` (nothing held: nothing done): ``_read_store`` reads files in
    place again and the held rows are freed."""
    con.execute("DROP MACRO TABLE IF EXISTS temp.main._read_store")
    con.execute(f"DROP TABLE IF EXISTS temp.main.{HELD_TABLE}")


#: Characters DuckDB reads as a glob in a file list: a path holding one is checked by pyarrow.
_GLOB_CHARS = re.compile(r"[*?\[\]{}]")


def by_halves(names: list[str], read, failed) -> None:
    """Run ``read(batch)`` (one DuckDB statement over a list of files) on ``names``; when it raises
    ``duckdb.Error``, on each half again, so k unreadable files of n cost about 2·k·log2(n) statements;
    a single file whose statement fails is passed to ``failed(name)``."""
    try:
        read(names)
    except duckdb.Error:
        if len(names) == 1:
            failed(names[0])
            return
        by_halves(names[:len(names) // 2], read, failed)
        by_halves(names[len(names) // 2:], read, failed)


def footers(con: duckdb.DuckDBPyConnection, paths: list[Path]) -> dict[str, dict[bytes, bytes] | None]:
    """{path: the footer's pdtrace keys (``VERSION_KEY``, ``ARTIFACT_KEY`` of :mod:`pdtrace.instrument.schema`)
    and values, ``{}`` for a file with neither; ``None`` for a file DuckDB could not read as Parquet
    (vanished, empty, truncated or foreign bytes, a path the connection may not read, a glob
    character in its path): the caller checks that one with pyarrow}. Read by DuckDB
    (``parquet_kv_metadata``) in one statement for the whole list, split in halves when it fails
    (:func:`by_halves`).
    Cheaper than pyarrow's ``read_metadata`` per file, and a report then never imports pyarrow
    (BENCHMARKS.md "Small-store cold report")."""
    out: dict[str, dict[bytes, bytes] | None] = {}

    def read(batch: list[str]) -> None:
        rows = con.execute("SELECT file_name, key, value FROM parquet_kv_metadata(?) WHERE key IN (?, ?)",
                           [batch, _schema.VERSION_KEY, _schema.ARTIFACT_KEY]).fetchall()
        got: dict[str, dict[bytes, bytes]] = {n: {} for n in batch}
        for name, key, value in rows:
            if name not in got:  # DuckDB named a file otherwise than asked: trust nothing of this batch
                out.update(dict.fromkeys(batch))
                return
            got[name][bytes(key)] = bytes(value)
        out.update(got)

    names = [str(p) for p in paths]
    for n in names:
        if _GLOB_CHARS.search(n):  # DuckDB would expand it as a pattern
            out[n] = None
    plain = [n for n in names if n not in out]
    if plain:
        by_halves(plain, read, lambda name: out.__setitem__(name, None))
    return out


def scan(directory: str | os.PathLike, corrupt: dict[str, tuple[int, int, str]] | None = None,
         con: duckdb.DuckDBPyConnection | None = None, window=None, pruned: list[str] | None = None
         ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]]]:
    """List ``directory``: ({readable file: (size, mtime_ns)}, [(skipped file, reason)]).

    pdtrace files that are not spans (``FileCheck.artifact``: the lab client's records) are in neither
    list, nor is a file that vanished since the listing. A file that exists but could not be opened
    just now (out of descriptors) has a reason starting ``unreadable now:``; one that cannot be opened
    for good (permission) ``unreadable:``. ``corrupt``: {path: (size, mtime_ns, reason)} of files whose
    data failed to decode earlier; such a file is skipped with that reason until its size or mtime
    changes. ``con``: a DuckDB connection that may read the directory, to read the footers in one
    statement (:func:`footers`); without it, and for a file DuckDB cannot read, the footer is read by
    :func:`pdtrace.instrument.store.check_file`. Both apply one rule (``store.check_metadata``).
    ``window``: a :class:`pdtrace.analysis.window.Window`; only the files it selects are checked and
    listed (:meth:`~pdtrace.analysis.window.Window.select`), the others appended to ``pruned`` (when
    given) and in neither list.
    """
    corrupt = corrupt or {}
    good: dict[str, tuple[int, int]] = {}
    bad: list[tuple[str, str]] = []
    paths = _store.store_files(Path(directory))
    if window is not None:
        kept = window.select(paths, directory, con)
        if pruned is not None:
            chosen = set(kept)
            pruned.extend(str(p) for p in paths if p not in chosen)
        paths = kept
    kvs = footers(con, paths) if con is not None else {}
    for p in paths:
        kv = kvs.get(str(p))
        chk = _store.check_metadata(p, kv) if kv is not None else _store.check_file(p)
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
        known = corrupt.get(str(p))
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            bad.append((str(p), known[2]))  # its data failed to decode (until it changes)
            continue
        good[str(p)] = (st.st_size, st.st_mtime_ns)
    return good, bad
