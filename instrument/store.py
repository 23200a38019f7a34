"""Writing and checking span-store files.

Two users: the recorder's background writer (:mod:`pdtrace.instrument.writer`)
and anyone who builds a store by hand — tests, bug cases, generators — with
:func:`write_rows`, from plain dicts.

Every file is written to a hidden temporary name in the store directory and
renamed into place when complete, so a reader that lists ``*.parquet`` at any
moment sees only whole files.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from . import schema

if TYPE_CHECKING:
    import pyarrow as pa

# pyarrow is imported by the functions that write or read a footer, not here: the analysis imports
# this module for its file rules and checks footers through DuckDB (pdtrace.analysis.files.scan), so a
# report of a small store does not pay pyarrow's import (~0.1-0.2 s, BENCHMARKS.md "Small-store cold report").

#: Parquet compression of every store file but the sink's part files.
COMPRESSION = "zstd"

#: Parquet compression of the sink's *part* files, which live until their merge into a zstd segment
#: (PDTRACE_ROTATE_S): with ~35 columns a small part's zstd encoding cost 3.6 ms against 1.9 ms for lz4
#: (120 rows; sizes 1.4x zstd's), and the sink writes one every flush interval (BENCHMARKS.md "Host sink").
PART_COMPRESSION = "lz4"

_RECORD_DEFAULTS = {
    "kind": schema.KIND_INTERNAL,
    "status_code": schema.STATUS_UNSET,
    "prompt_index": 0,
    "attempt": 0,
}


def split_attrs(attrs: Mapping[str, object] | None) -> tuple[list, list, list]:
    """Split one attribute dict into (int pairs, float pairs, str pairs) by Python type.

    bool counts as int (0/1). Values of other types raise TypeError: the store
    holds only ints, floats and short strings.
    """
    ints, floats, strs = [], [], []
    if attrs:
        for k, v in attrs.items():
            if isinstance(v, bool) or isinstance(v, int):
                ints.append((k, int(v)))
            elif isinstance(v, float):
                floats.append((k, v))
            elif isinstance(v, str):
                strs.append((k, v))
            else:
                raise TypeError(f"attribute {k!r}: {type(v).__name__} is not int, float or str")
    return ints, floats, strs


def rows_to_table(rows: Iterable[Mapping[str, object]], resource: Mapping[str, object] | None = None) -> pa.Table:
    """Build a store table from plain row dicts.

    Each row may hold any column of :data:`schema.COLUMNS` by name, plus
    ``attrs`` (a dict of int/float/str values, split into the typed maps).
    Missing columns are null, except ``kind`` (1), ``status_code`` (0),
    ``prompt_index`` (0), ``attempt`` (0), ``record`` ('span'), ``end_ns``
    (= ``start_ns``) and ``record_id`` (= ``span_id`` for spans, else a fresh
    random id). ``resource`` gives defaults for any column (typically the
    resource columns) that a row leaves out. Times are ns since the Unix epoch.

    Raises KeyError for an unknown column name, TypeError for a bad attribute.
    """
    names = [c[0] for c in schema.COLUMNS]
    known = set(names) | {"attrs"}
    defaults = dict(_RECORD_DEFAULTS)
    defaults["schema_version"] = schema.SCHEMA_VERSION
    if resource:
        for k in resource:
            if k not in known:
                raise KeyError(f"unknown store column {k!r}")
        defaults.update(resource)
    cols: dict[str, list] = {n: [] for n in names}
    for row in rows:
        for k in row:
            if k not in known:
                raise KeyError(f"unknown store column {k!r}")
        rec = row.get("record", "span")
        for n in names:
            if n in row:
                v = row[n]
            else:
                v = defaults.get(n)
            cols[n].append(v)
        i = len(cols["record"]) - 1
        cols["record"][i] = rec
        if cols["end_ns"][i] is None:
            cols["end_ns"][i] = cols["start_ns"][i]
        if cols["record_id"][i] is None:
            cols["record_id"][i] = cols["span_id"][i] if (rec == "span" and cols["span_id"][i] is not None) else uuid.uuid4().int >> 65
        ints, floats, strs = split_attrs(row.get("attrs"))
        for col, extra in (("attr_int", ints), ("attr_float", floats), ("attr_str", strs)):
            given = list(row.get(col) or [])
            if isinstance(row.get(col), Mapping):
                given = list(row[col].items())
            cols[col][i] = given + extra
    import pyarrow as pa

    arrays = [pa.array(cols[n], type=typ) for n, typ, _ in schema.COLUMNS]
    return pa.Table.from_arrays(arrays, schema=schema.SCHEMA)


def write_table(directory: str | os.PathLike, table: pa.Table, name: str | None = None) -> Path:
    """Write ``table`` as one complete store file in ``directory`` and return its path.

    Written to ``.<name>.tmp`` then renamed to ``<name>`` (atomic on POSIX), so
    readers never see a partial file. ``name`` defaults to a unique
    ``manual-<host>-<pid>-<uuid>.parquet``; an existing file of that name is
    replaced. Raises OSError on I/O failure (the temporary file is removed).
    """
    return write_tables(directory, [table], name)


def write_tables(directory: str | os.PathLike, tables: Iterable[pa.Table], name: str | None = None,
                 compression: str = COMPRESSION) -> Path:
    """Write the tables (same schema, in order) as one complete store file; return its path.

    Like :func:`write_table`, through a temporary name and a rename; each
    table becomes one or more row groups (the recorder's writer passes groups
    of ~8,192 rows, so no step has to join a whole flush into one table).
    Encoding runs in pyarrow without the GIL. ``compression``: a Parquet codec name
    (default :data:`COMPRESSION`; the sink writes its short-lived part files with
    :data:`PART_COMPRESSION`). Raises OSError on I/O failure
    and ValueError for an empty ``tables`` (the temporary file is removed).
    """
    import pyarrow.parquet as pq

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if name is None:
        name = f"manual-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.parquet"
    final = d / name
    tmp = d / f".{name}.tmp"
    try:
        w = None
        try:
            for t in tables:
                if w is None:
                    w = pq.ParquetWriter(tmp, t.schema, compression=compression)
                w.write_table(t)
        finally:
            if w is not None:
                w.close()
        if w is None:
            raise ValueError("write_tables: no table to write")
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return final


def merge_parts(directory: str | os.PathLike, parts: list[tuple[str, list[pa.Table]]], name: str) -> Path:
    """Replace a writer's part files by one segment file ``name``; return its path.

    ``parts``: ``[(part file name in directory, [its tables, in order])]``, oldest first. The
    segment is written first (:func:`write_tables`: temporary name, rename), then the parts are
    removed (one already gone is skipped), so every row is in a complete file at every moment.
    Raises OSError when the segment cannot be written: the parts are then kept as they are.
    Used by the recorder's sink and by ``pdtrace collect``.
    """
    path = write_tables(directory, [t for _, ts in parts for t in ts], name)
    for part, _ in parts:
        try:
            os.unlink(os.path.join(directory, part))
        except OSError:
            pass
    return path


def write_rows(directory: str | os.PathLike, rows: Iterable[Mapping[str, object]],
               resource: Mapping[str, object] | None = None, name: str | None = None) -> Path:
    """Build a table from plain rows (see :func:`rows_to_table`) and write it (see :func:`write_table`).

    Example (a 10 ms prefill compute span of request ``r1`` on the prefill engine)::

        write_rows("trace/", [
            {"name": "prefill.compute", "request_id": "r1", "span_id": 7,
             "start_ns": 1_000_000_000, "end_ns": 1_010_000_000},
        ], resource={"role": "prefill", "engine_id": "p0", "host": "h", "pid": 1})
    """
    return write_table(directory, rows_to_table(rows, resource), name)


@dataclass(frozen=True)
class FileCheck:
    """Outcome of :func:`check_file`: ``ok`` or the ``reason`` a reader must skip ``path``.

    ``artifact`` names another pdtrace file kind (``schema.ARTIFACT_KEY``, e.g.
    ``"client-records"``): not spans, skipped without a warning. ``unreadable``:
    the file could not be opened or read just now (vanished, permission, too
    many open files: :data:`TRANSIENT_ERRNOS`): nothing is known about its
    contents. A file that cannot be opened for good (permission) is a bad file
    with reason ``unreadable: ...``.
    """

    path: Path
    ok: bool
    reason: str = ""
    version: str | None = None
    artifact: str | None = None
    unreadable: bool = False


#: OS errors that say the process could not open a file *just now* (out of descriptors, memory):
#: nothing about the file (check_file's ``unreadable``; a permission or type error is the file's).
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM, errno.EINTR})


def check_file(path: str | os.PathLike) -> FileCheck:
    """Check that ``path`` is a readable store file of this schema's major version.

    Reads only the Parquet footer. Never raises for a bad file: returns a
    FileCheck with ``ok=False`` and a reason ('empty file', 'not a Parquet
    file: ...', 'not a pdtrace store file', 'schema 2.0: newer major, skipped',
    with ``artifact`` set 'pdtrace client-records file, not spans',
    'unreadable: <OSError class>' (permission), or with ``unreadable`` set
    'unreadable now: <OSError class>' (vanished, out of descriptors)).
    """
    import pyarrow.parquet as pq

    p = Path(path)
    try:
        if p.stat().st_size == 0:
            return FileCheck(p, False, "empty file")
        meta = pq.read_metadata(p)
    except OSError as exc:  # could not open or read it (vanished, too many open files, permission)
        if not isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)) and p.is_file():
            try:  # pyarrow raises OSError for a truncated or foreign file too: open it to tell them apart
                with open(p, "rb") as f:
                    f.read(1)
            except OSError as exc2:
                exc = exc2
            else:
                return FileCheck(p, False, f"not a Parquet file: {type(exc).__name__}")
        if isinstance(exc, FileNotFoundError) or exc.errno in TRANSIENT_ERRNOS:
            return FileCheck(p, False, f"unreadable now: {type(exc).__name__}", unreadable=True)
        return FileCheck(p, False, f"unreadable: {type(exc).__name__}")
    except Exception as exc:  # pyarrow raises ArrowInvalid for truncated/foreign files
        return FileCheck(p, False, f"not a Parquet file: {type(exc).__name__}")
    return check_metadata(p, meta.metadata or {})


def check_metadata(path: str | os.PathLike, kv: Mapping[bytes, bytes]) -> FileCheck:
    """The verdict of :func:`check_file` on a Parquet file whose footer was read: ``kv`` is the
    footer's key-value metadata ({key bytes: value bytes}, empty when it has none). The one rule
    for both ways of reading a footer (pyarrow here, DuckDB in :func:`pdtrace.analysis.files.scan`)."""
    p = Path(path)
    raw = kv.get(schema.VERSION_KEY)
    if raw is None:
        kind = kv.get(schema.ARTIFACT_KEY)
        if kind is not None:
            name = kind.decode(errors="replace")
            return FileCheck(p, False, f"pdtrace {name} file, not spans", artifact=name)
        return FileCheck(p, False, "not a pdtrace store file (no schema version)")
    version = raw.decode(errors="replace")
    try:
        major = schema.major_of(version)
    except ValueError:
        return FileCheck(p, False, f"bad schema version {version!r}", version)
    if major != schema.SCHEMA_MAJOR:
        return FileCheck(p, False, f"schema {version}: major {major} is not {schema.SCHEMA_MAJOR}, skipped", version)
    return FileCheck(p, True, "", version)


#: Name of a *part* file, as the host's sink writes it (``sink-<host>-<sink pid>-<start>-p<seq>.parquet``,
#: sink.py) or ``pdtrace collect`` (``collect-<host>-<pid>-<start>-p<seq>.parquet``): pid, start time
#: ``%Y%m%dT%H%M%S`` (optionally ``r<n>``), a sequence of 6 or more digits. The writer deletes its parts
#: once they are merged into a segment (``-s<seq>``), so a reader may see one vanish. Other names are
#: never parts.
PART_FILE = re.compile(r"-\d+-\d{8}T\d{6}(?:r\d+)?-p\d{6,}\.parquet$")


def is_part_file(path: str | os.PathLike) -> bool:
    """True when ``path`` names a part file (deleted by the sink after its merge); segments stay."""
    return PART_FILE.search(Path(path).name) is not None


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, busy: Exception):
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block: one writer
    at a time over a directory (``pdtrace compact``'s DEST, ``pdtrace materialize``'s DEST). The lock
    goes with the process (a killed holder leaves none behind). Raises ``busy`` when another open
    file holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        yield
    finally:
        os.close(fd)  # (releases the lock)


def store_files(directory: str | os.PathLike) -> list[Path]:
    """List the complete store files of ``directory`` (``*.parquet``, recursively, sorted).

    Temporary files (``.*.tmp``) and directories are never listed. Raises FileNotFoundError when
    ``directory`` does not exist.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory not found: {d}")
    return sorted(p for p in d.rglob("*.parquet") if not p.name.startswith(".") and p.is_file())
