"""Library templates: a DuckDB file built once and copied to start every new analysis database.

Loading the SQL library (every module's views, macros and comments) costs 0.9-1.7 s on this machine
kind, much of a small trace's cold report (BENCHMARKS.md "Small-store cold report"). A template
holds the loaded library and nothing else; :func:`copy_into` makes a new cache file a copy of it,
and :func:`copy_to_memory` fills a new in-memory database from it (DuckDB's ``COPY FROM
DATABASE``), each building it first when it is missing. What the template holds and when two are alike is the
caller's (:mod:`pdtrace.analysis.cache`: ``build`` installs the library, ``check`` reads its stamp,
the file name carries a key of everything the contents depend on).

Files, all in the template's directory unless named otherwise:

``<name>.duckdb``   the template, renamed into place only once built and flushed to disk
``<name>.sha256``   sha256 (hex) of the template's bytes, written before the template is renamed
                    into place; a template whose bytes do not match (damaged since, or renamed by
                    a concurrent builder after another wrote the sum) is dropped and built again
``*.tmp``           a build or copy in progress; one older than :data:`STALE_S` was left by a
                    killed process and is removed by the next build
                    (copies sit beside the cache file they become; a copy for a memory
                    database sits beside the template, private to its process)

Guarantees: a reader never sees a half-built template, a half-copied cache or a half-copied
memory database (its connection is dropped); a cache file that exists is never replaced or
removed (another process may have it open); a copy is opened and checked before it appears
under the cache's name, or before a memory database is used; a template is used only when the
current user owns it, and only the bytes checked against its sum are copied. Every failure
returns False and the caller installs the library itself.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Callable

import duckdb

#: Seconds after which a ``*.tmp`` file of a build or copy is taken for one a killed process left.
STALE_S = 600.0


def fsync_path(path: str | os.PathLike) -> None:
    """fsync the file or directory ``path`` (its data, or its entries); raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_db(path: Path) -> None:
    """Remove a DuckDB file and its write-ahead log, if present."""
    for p in (path, Path(str(path) + ".wal")):
        p.unlink(missing_ok=True)


def _sweep(directory: Path, prefix: str) -> None:
    """Remove ``prefix*.tmp`` (and ``.tmp.wal``) files in ``directory`` older than :data:`STALE_S`."""
    now = time.time()
    for p in directory.glob(prefix + "*.tmp*"):
        try:
            if now - p.stat().st_mtime > STALE_S:
                p.unlink()
        except OSError:
            pass


def _sum_path(tpl: Path) -> Path:
    return tpl.with_suffix(".sha256")


def drop(tpl: Path) -> None:
    """Remove the template ``tpl`` and its checksum (missing files are fine)."""
    unlink_db(tpl)
    _sum_path(tpl).unlink(missing_ok=True)


def _build(tpl: Path, build: Callable[[duckdb.DuckDBPyConnection], None], tag: str) -> None:
    """Build ``tpl``: ``build`` fills a new database in a temporary file, which is flushed to disk,
    summed, and renamed into place. Raises what ``build``, DuckDB or the file system raise."""
    tpl.parent.mkdir(parents=True, exist_ok=True)
    _sweep(tpl.parent, tpl.stem)
    tmp = tpl.with_name(tpl.name + tag)
    sums = _sum_path(tpl).with_name(_sum_path(tpl).name + tag)
    try:
        con = duckdb.connect(str(tmp))
        try:
            build(con)
            con.execute("CHECKPOINT")
        finally:
            con.close()
        fsync_path(tmp)
        sums.write_text(hashlib.sha256(tmp.read_bytes()).hexdigest())
        os.replace(sums, _sum_path(tpl))
        os.replace(tmp, tpl)
        fsync_path(tpl.parent)
    finally:
        unlink_db(tmp)
        sums.unlink(missing_ok=True)


def _sound(tpl: Path) -> bytes | None:
    """The template's bytes when it exists, belongs to this user and matches its checksum; else None."""
    try:
        if tpl.stat().st_uid != os.getuid():
            return None
        data = tpl.read_bytes()
        want = _sum_path(tpl).read_text().strip()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == want else None


def _sound_or_built(tpl: Path, build: Callable[[duckdb.DuckDBPyConnection], None], tag: str) -> bytes | None:
    """The template's checked bytes (:func:`_sound`), building it with ``build`` (temporary files
    tagged ``tag``) when it is missing, damaged or foreign; None when no sound one could be built.
    Raises what :func:`_build` raises."""
    data = _sound(tpl)
    if data is None:
        drop(tpl)
        _build(tpl, build, tag)
        data = _sound(tpl)
    return data


def copy_into(cache: Path, tpl: Path, build: Callable[[duckdb.DuckDBPyConnection], None],
              check: Callable[[duckdb.DuckDBPyConnection], bool]) -> bool:
    """Create the absent file ``cache`` as a copy of the template ``tpl`` (built with ``build`` when
    missing, damaged or foreign). The copy is written beside ``cache``, opened read-only and passed
    to ``check`` (False: the template is dropped, nothing is created) before it is hard-linked to
    ``cache``, which fails when ``cache`` exists. True when ``cache`` is such a copy; False when it
    is not (no template could be built or copied, the directory is not writable, or ``cache``
    appeared meanwhile: another process made it, and it is left alone)."""
    if cache.exists() or not os.access(cache.parent, os.W_OK):
        return False
    tag = f".{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        data = _sound_or_built(tpl, build, tag)
        if data is None:
            return False
        _sweep(cache.parent, cache.name)
        tmp = cache.with_name(cache.name + tag)
        try:
            tmp.write_bytes(data)
            con = duckdb.connect(str(tmp), read_only=True)
            try:
                ok = check(con)
            finally:
                con.close()
            if not ok:
                drop(tpl)
                return False
            os.link(tmp, cache)  # fails if cache exists: never replaces another process's file
        finally:
            unlink_db(tmp)
        return True
    except (OSError, duckdb.Error, RuntimeError):
        return False


def copy_to_memory(con: duckdb.DuckDBPyConnection, tpl: Path,
                   build: Callable[[duckdb.DuckDBPyConnection], None],
                   check: Callable[[duckdb.DuckDBPyConnection], bool]) -> bool:
    """Fill the empty in-memory database ``con`` with the template ``tpl`` (built with ``build`` when
    missing, damaged or foreign): the bytes checked against its sum are written to a private file
    beside it (mode 0600), which is attached read-only, copied with ``COPY FROM DATABASE`` (views,
    macros, tables, comments), detached and removed; ``check`` then reads ``con``. True when
    ``con`` holds the copy. False when it does not: no template could be built or copied, or
    ``check`` refused the copy (the template is dropped). After a False ``con`` may hold part of a
    copy: the caller opens a new connection and installs the library into it."""
    tag = f".{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        data = _sound_or_built(tpl, build, tag)
        if data is None:
            return False
        tmp = tpl.with_name(tpl.name + tag)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            db = con.execute("SELECT current_database()").fetchone()[0]
            con.execute("ATTACH ? AS _pdtrace_template (READ_ONLY)", [str(tmp)])
            try:
                con.execute(f'COPY FROM DATABASE _pdtrace_template TO "{db}"')
            finally:
                con.execute("DETACH _pdtrace_template")
        finally:
            unlink_db(tmp)
        if not check(con):
            drop(tpl)
            return False
        return True
    except (OSError, duckdb.Error, RuntimeError):
        return False
