"""``pdtrace compact SRC [--into DEST]``: rewrite a directory of small store files as large files in
hourly Hive partitions.

Output layout (:mod:`pdtrace.instrument.layout`): ``DEST/date=YYYY-MM-DD/hour=HH/host=<host>/
compact-<batch>-<i>of<n>.parquet``. Rules, all of them:

1. **Partition of a row**: the UTC date and hour of its ``end_ns`` and its own ``host`` column (null:
   ``__HIVE_DEFAULT_PARTITION__``). A source file whose rows all share one host and one hour goes
   whole to one partition; a file with rows of several hosts or hours is split row by row, so every
   row is in the partition of its own host (the ``host`` partition always equals the ``host`` column,
   and every file is at the same depth, as Spark and Trino require). Rows are copied as they are
   (every column, the same values, the source's column types), sorted by ``start_ns`` within a file.
2. **Sizes**: sources are read in *batches* of about ``batch_bytes`` on disk (default: the size
   target; a batch closes with the source that brings it to that size), in order of modification
   time (so rows of one hour tend to share a batch); a batch's rows of one partition are written as
   files of at most about ``target_bytes`` (estimated from the sources' bytes per row), in row
   groups of :data:`pdtrace.instrument.sink.ROW_GROUP` rows (the writer's), zstd. Memory: a batch's
   rows are held in Arrow, plus one output's rows at a time (peak RSS ~20x the batch's bytes on disk:
   26 MiB of sources, 1M rows, 509 MiB, 3.6 s on 2 cores, 2026-12-06; so ~5 GiB at the default
   target: lower ``--target-mb`` on a small machine).
3. **No span lost or duplicated**: within a batch, a record_id present in several sources is written
   once, the copy of the first source by path (the analysis's rule for duplicate copies, so either copy
   is the one it shows). Sources with different Arrow schemas (another schema minor) are never mixed
   in one file; each output keeps its sources' schema and key-value metadata (``pdtrace.schema_version``
   and the rest), so :func:`pdtrace.instrument.store.check_file` accepts it. A row whose record_id an
   output of its partition (this run's or an earlier complete one's) holds already is not written again
   (a record's copies have the same end and host, so the same partition); a batch whose rows are all
   such copies writes nothing and, in place, its sources are deleted (their rows are in place already).
4. **Crash safety** (the writer's rule, :mod:`pdtrace.instrument.store`): every output of a batch is
   written under a hidden temporary name (``.compact-...tmp``), flushed to disk (fsync), then all of
   them are renamed into place, the directories synced, and only then -- in place (no ``--into``) --
   the batch's sources deleted. A crash leaves the old files, or old and new files holding the same
   records (readers that hide duplicate record_ids, as the analysis does, give the same answer), never
   neither. Each output's footer names its batch, the number of outputs of the batch and the batch's
   sources (``pdtrace.compact.batch``, ``pdtrace.compact.files``, ``pdtrace.compact.sources``: JSON
   ``[[path relative to SRC, bytes, mtime ns], ...]``), so the next run finishes a crashed one. A
   batch whose outputs are all present: its sources still there (same path, size and mtime) are
   deleted (in place), or not copied again (``--into``). A batch with outputs missing (a crash between
   two renames): its outputs are deleted, when every one of its sources is still there, and the sources
   compacted again (when a source is gone, the outputs stay: they may hold its only copy). Stale
   temporary outputs are removed. One compaction at a time per DEST (lock file
   ``DEST/.pdtrace-compact.lock``, hidden, never a store file).
5. **Bad files**: a file :func:`~pdtrace.instrument.store.check_file` rejects, or whose data does not
   decode (pyarrow reading every column, and DuckDB hashing every value, the analysis's own check), is
   skipped, named on stderr and left in place, never deleted. Other pdtrace files (``artifact``: the
   lab's client records) are left alone silently.
6. **Files that may still change** are left alone: any file modified within ``min_age_s`` (default
   120 s), and a sink's *part* file (``-p<seq>``, :data:`pdtrace.instrument.store.PART_FILE`) modified
   within ``part_age_s`` (default 172,800 s = 2 days): a running sink holds its parts in memory, merges
   them into a segment (within PDTRACE_ROTATE_S <= 86,400 s) and deletes them, so a part compacted
   before that would be written twice (once here, once in the sink's segment). Older parts are a
   killed sink's and are compacted like any file. (A store file is never rewritten once renamed into
   place -- the writers' rule -- so these two rules cover a live writer's newest file too.)
7. **Idempotent**: in place, this command's own outputs (``compact-*.parquet``) are never sources,
   so a second run with nothing new does nothing. With ``--into``, SRC is never changed; a source
   already named by a complete batch in DEST (same relative path, size and mtime) is not copied again,
   and a DEST inside SRC is not read as sources.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from . import layout, schema, store

#: Default size target of an output file (bytes on disk, estimated).
TARGET_BYTES = 256 << 20

#: Default: files modified within this many seconds are left alone.
MIN_AGE_S = 120.0

#: Default: a sink's part files modified within this many seconds are left alone (rule 6).
PART_AGE_S = 172_800.0

#: Rows per row group of an output: the sink's ROW_GROUP (a test holds them equal; not imported here:
#: importing the sink module registers its attribute keys and imports its converter).
ROW_GROUP = 8192

#: Footer keys of an output (rule 4).
BATCH_KEY, FILES_KEY, SOURCES_KEY = b"pdtrace.compact.batch", b"pdtrace.compact.files", b"pdtrace.compact.sources"

#: Name of an output file.
OUTPUT_FILE = re.compile(r"^compact-([0-9a-f]{12})-(\d{4,})of(\d{4,})\.parquet$")

LOCK_NAME = ".pdtrace-compact.lock"


class CompactBusy(RuntimeError):
    """Another compaction holds DEST's lock file."""


@dataclass
class CompactResult:
    """What one run did. Paths are strings; ``skipped``: [(path, reason)] of bad files left in place."""

    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    young: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # sources of an earlier run's complete batch, deleted now
    undone: list[str] = field(default_factory=list)  # outputs of an earlier run's incomplete batch, deleted
    rows: int = 0
    duplicates: int = 0


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _footer(path: Path) -> dict[bytes, bytes] | None:
    import pyarrow.parquet as pq

    try:
        return dict(pq.read_metadata(path).metadata or {})
    except Exception:  # noqa: BLE001 - unreadable: not one of ours to trust
        return None


def _outputs(dest: Path) -> dict[str, list[tuple[Path, int, dict]]]:
    """{batch: [(output path, n of the batch, footer)]} of the complete output files under ``dest``."""
    out: dict[str, list[tuple[Path, int, dict]]] = {}
    for p in dest.rglob("compact-*.parquet"):
        m = OUTPUT_FILE.match(p.name)
        if not m or not p.is_file():
            continue
        kv = _footer(p)
        if kv is None or kv.get(BATCH_KEY, b"").decode() != m.group(1):
            continue
        out.setdefault(m.group(1), []).append((p, int(kv[FILES_KEY]), kv))
    return out


def _decodes(paths: list[str]) -> dict[str, str]:
    """{path: reason} of the files DuckDB cannot decode in full (every value hashed), as the analysis checks."""
    import duckdb

    def one(ps):
        con = duckdb.connect()
        try:
            con.execute("SELECT max(hash(COLUMNS(*))) FROM read_parquet(?, union_by_name = true, "
                        "hive_partitioning = false)", [ps]).fetchall()
            return ""
        except duckdb.Error as exc:
            return "corrupt data: " + ((str(exc).strip().splitlines() or [type(exc).__name__])[0][:200])
        finally:
            con.close()

    if not paths or not one(paths):
        return {}
    return {p: r for p in paths if (r := one([p]))}


def compact(src: str | os.PathLike, dest: str | os.PathLike | None = None, *, target_bytes: int = TARGET_BYTES,
            batch_bytes: int | None = None, min_age_s: float = MIN_AGE_S, part_age_s: float = PART_AGE_S,
            err: TextIO | None = None, after_rename: Callable[[], None] | None = None) -> CompactResult:
    """Compact the store files of ``src`` into hourly partitions of ``dest`` (default: ``src``, in place).

    ``target_bytes``: size target of an output file (bytes on disk, estimated); ``batch_bytes``: bytes
    of sources read at once (default ``target_bytes``); ``min_age_s``, ``part_age_s``: seconds (rule 6
    of the module doc, which states every rule). Bad files are named on ``err`` (default stderr) as
    ``warning: skipped store file PATH: REASON (left in place)``. ``after_rename``: called after a
    batch's outputs are renamed into place and before its sources are deleted (a test's crash point).

    Raises FileNotFoundError when ``src`` does not exist, ValueError for a size or age out of range,
    :class:`CompactBusy` when another compaction holds ``dest``'s lock, OSError when an output cannot be
    written (that batch's temporary files are removed, its sources kept; earlier batches stay done).
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    err = sys.stderr if err is None else err
    if target_bytes < 1 << 16:
        raise ValueError(f"target_bytes {target_bytes} is below 64 KiB")
    if min_age_s < 0 or part_age_s < 0:
        raise ValueError("min_age_s and part_age_s must be >= 0")
    batch_bytes = target_bytes if batch_bytes is None else batch_bytes
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"trace directory not found: {src}")
    dest = src if dest is None else Path(dest)
    dest_res = dest.resolve()
    in_place = dest_res == src.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    res = CompactResult()
    with store.exclusive_lock(dest / LOCK_NAME, CompactBusy(f"another pdtrace compact is running on {dest}")):
        for tmp in dest.rglob(".compact-*.tmp"):  # a crashed run's temporary outputs (we hold the lock)
            try:
                tmp.unlink()
            except OSError:
                pass
        done = _recover(src, dest, in_place, res)
        seen: dict[str, list] = {}  # partition -> record_id arrays of its outputs (read when first touched)
        now = time.time()
        batch: list[tuple[Path, int, int]] = []  # (source, bytes, mtime ns)
        total = 0
        cands = []
        for p in store.store_files(src):
            if in_place and OUTPUT_FILE.match(p.name):
                continue
            try:
                st = p.stat()
            except OSError:
                continue  # vanished (a merged part)
            if not in_place and dest_res in p.resolve().parents:
                continue  # DEST inside SRC: its outputs are not sources
            rel = p.relative_to(src).as_posix()
            if (rel, st.st_size, st.st_mtime_ns) in done:
                continue
            age = now - st.st_mtime
            if age < min_age_s or (store.is_part_file(p) and age < part_age_s):
                res.young.append(str(p))
                continue
            chk = store.check_file(p)
            if chk.artifact:
                continue
            if not chk.ok:
                if not (chk.unreadable and not p.exists()):
                    _skip(res, err, p, chk.reason)
                continue
            cands.append((st.st_mtime_ns, str(p), st.st_size))
        cands.sort()
        for mtime_ns, p, size in cands:
            batch.append((Path(p), size, mtime_ns))
            total += size
            if total >= batch_bytes:
                _batch(src, dest, in_place, batch, target_bytes, res, err, after_rename, seen, pa, pc, pq)
                batch, total = [], 0
        if batch:
            _batch(src, dest, in_place, batch, target_bytes, res, err, after_rename, seen, pa, pc, pq)
    return res


def _skip(res: CompactResult, err: TextIO, path: Path, reason: str) -> None:
    res.skipped.append((str(path), reason))
    print(f"warning: skipped store file {path}: {reason} (left in place)", file=err)


def _same(p: Path, size: int, mtime_ns: int) -> bool:
    """True when ``p`` exists with this size (bytes) and modification time (ns): the source a footer names."""
    try:
        st = p.stat()
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) == (size, mtime_ns)


def _recover(src: Path, dest: Path, in_place: bool, res: CompactResult) -> set[tuple[str, int, int]]:
    """Finish what an earlier run left (rule 4); return the (relative path, bytes, mtime ns) of the
    sources complete batches hold."""
    done: set[tuple[str, int, int]] = set()
    for b, outs in _outputs(dest).items():
        n = outs[0][1]
        sources = [(s, int(z), int(m)) for s, z, m in json.loads(outs[0][2].get(SOURCES_KEY, b"[]"))]
        present = {int(OUTPUT_FILE.match(p.name).group(2)) for p, _, _ in outs}
        if present == set(range(n)):
            done.update(sources)
            if in_place:
                for rel, size, mtime_ns in sources:
                    p = src / rel
                    if _same(p, size, mtime_ns):
                        try:
                            p.unlink()
                            res.finished.append(str(p))
                        except OSError:
                            pass
            continue
        # incomplete: its outputs go, when every source is still there to hold their rows
        if all(_same(src / rel, size, mtime_ns) for rel, size, mtime_ns in sources):
            for p, _, _ in outs:
                try:
                    p.unlink()
                    res.undone.append(str(p))
                except OSError:
                    pass
    return done


def _seen_ids(dest: Path, part: str, seen: dict, pa, pq) -> list:
    """The record_id arrays of the outputs in partition ``part`` of ``dest``: read once per run from the
    complete outputs there (after :func:`_recover`, every output present is of a complete batch), then
    extended by :func:`_batch` with what this run writes."""
    if part not in seen:
        arrs = []
        d = dest / part
        if d.is_dir():
            for p in sorted(d.iterdir()):
                if OUTPUT_FILE.match(p.name):
                    arrs.append(pq.ParquetFile(p).read(columns=["record_id"]).column("record_id").combine_chunks())
        seen[part] = arrs
    return seen[part]


def _batch(src, dest, in_place, batch, target_bytes, res, err, after_rename, seen, pa, pc, pq) -> None:
    """Compact one batch of sources ``[(path, bytes, mtime ns)]`` (rules 1-5)."""
    tables: dict[str, list] = {}  # schema text -> [(path, table)]
    schemas: dict[str, object] = {}
    kept: list[tuple[Path, int, int]] = []
    bad = _decodes([str(p) for p, _, _ in batch])
    for p, size, mtime_ns in sorted(batch, key=lambda x: str(x[0])):
        if str(p) in bad:
            _skip(res, err, p, bad[str(p)])
            continue
        try:
            t = pq.ParquetFile(p).read()  # a plain file read: no partition columns from the path
        except FileNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001 - a page that does not decode
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            _skip(res, err, p, f"corrupt data: {type(exc).__name__}: {first}")
            continue
        key = t.schema.to_string(show_field_metadata=False, show_schema_metadata=False) + "\n" + \
            (t.schema.metadata or {}).get(schema.VERSION_KEY, b"").decode()
        schemas.setdefault(key, t.schema)
        tables.setdefault(key, []).append(t)
        kept.append((p, size, mtime_ns))
    if not kept:
        return
    bid = uuid.uuid4().hex[:12]
    src_bytes = sum(s for _, s, _ in kept)
    plan = []  # (partition dir, schema, table of the group, row indices of one output: in start_ns order)
    n_rows = sum(x.num_rows for xs in tables.values() for x in xs)
    per_row = max(1.0, src_bytes / max(1, n_rows))
    max_rows = max(ROW_GROUP, int(target_bytes / per_row) // ROW_GROUP * ROW_GROUP)
    for key in list(tables):
        sch = schemas[key]
        t = pa.concat_tables([x.replace_schema_metadata(sch.metadata) for x in tables.pop(key)])
        n_in = t.num_rows
        if n_in == 0:
            continue
        t = _first_copies(t, pa, pc)
        res.duplicates += n_in - t.num_rows
        res.rows += t.num_rows
        ids = t.column("record_id")
        for part, idx in _partitions(t, pa, pc):
            old = _seen_ids(dest, part, seen, pa, pq)
            if old:  # copies of records an output of this partition holds already (rule 3)
                dup = pc.fill_null(pc.is_in(ids.take(idx), value_set=pa.concat_arrays(old)), False)
                kept_idx = idx.filter(pc.invert(dup))
                res.duplicates += len(idx) - len(kept_idx)
                res.rows -= len(idx) - len(kept_idx)
                idx = kept_idx
            if len(idx) == 0:
                continue
            idx = idx.take(pc.sort_indices(t.column("start_ns").take(idx)))  # stable: ties keep their order
            for off in range(0, len(idx), max_rows):
                plan.append((part, sch, t, idx.slice(off, max_rows)))
    n = len(plan)
    sources = json.dumps([[p.relative_to(src).as_posix(), s, m] for p, s, m in kept])
    finals: list[Path] = []
    tmps: list[Path] = []
    try:
        for i, (part, sch, whole, idx) in enumerate(plan):
            t = whole.take(idx)  # one output's rows at a time: memory is the batch plus one output
            d = dest / part
            d.mkdir(parents=True, exist_ok=True)
            name = f"compact-{bid}-{i:04d}of{n:04d}.parquet"
            tmp = d / f".{name}.tmp"
            tmps.append(tmp)
            meta = dict(sch.metadata or {})
            meta.update({BATCH_KEY: bid.encode(), FILES_KEY: str(n).encode(), SOURCES_KEY: sources.encode()})
            sch2 = sch.with_metadata(meta)
            with pq.ParquetWriter(tmp, sch2, compression=store.COMPRESSION) as w:
                for off in range(0, t.num_rows, ROW_GROUP):
                    w.write_table(t.slice(off, ROW_GROUP).replace_schema_metadata(meta), row_group_size=ROW_GROUP)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            finals.append(d / name)
            _seen_ids(dest, part, seen, pa, pq).append(t.column("record_id").combine_chunks())
            del t
        for tmp, final in zip(tmps, finals):
            os.replace(tmp, final)
    except BaseException:
        for tmp in tmps:
            try:
                tmp.unlink()
            except OSError:
                pass
        raise
    for d in {f.parent for f in finals}:
        _fsync_dir(d)
    res.written += [str(f) for f in finals]
    if after_rename is not None:
        after_rename()
    if in_place:
        for p, _, _ in kept:
            try:
                p.unlink()
                res.deleted.append(str(p))
            except FileNotFoundError:
                pass
        for d in {p.parent for p, _, _ in kept}:
            _fsync_dir(d)


def _first_copies(t, pa, pc):
    """``t`` without the later copies of a record_id (rows in order: the first copy stays); null ids all stay."""
    ids = t.column("record_id").combine_chunks()
    if ids.null_count == 0 and pc.count_distinct(ids).as_py() == t.num_rows:
        return t
    idx = pa.array(range(t.num_rows), pa.int64())
    valid = pc.is_valid(ids)
    first = pa.table({"record_id": ids, "i": idx}).filter(valid).group_by("record_id", use_threads=False) \
        .aggregate([("i", "min")]).column("i_min").combine_chunks()
    rows = pa.concat_arrays([first, pc.filter(idx, pc.invert(valid))])
    return t.take(pc.take(rows, pc.sort_indices(rows)))


def _partitions(t, pa, pc):
    """[(relative partition directory, int64 indices of its rows in ``t``, in order)] by the UTC hour of
    ``end_ns`` and ``host`` (rule 1), sorted by directory."""
    hour = pc.divide(t.column("end_ns"), pa.scalar(3_600_000_000_000, pa.int64())).combine_chunks()
    host = t.column("host").cast(pa.string()).combine_chunks() if "host" in t.column_names \
        else pa.nulls(t.num_rows, pa.string())
    idx = pa.array(range(t.num_rows), pa.int64())
    keys = pa.table({"h": hour, "host": host}).group_by(["h", "host"], use_threads=False).aggregate([])
    out = []
    for h, hs in zip(keys.column("h").to_pylist(), keys.column("host").to_pylist()):
        m_h = pc.is_null(hour) if h is None else pc.equal(hour, h)
        m_s = pc.is_null(host) if hs is None else pc.equal(host, hs)
        mask = pc.fill_null(pc.and_(m_h, m_s), False)
        rel = layout.partition(None if h is None else h * 3_600_000_000_000, hs)
        out.append((rel, idx.filter(mask)))
    out.sort(key=lambda x: x[0])
    return out


def _command():
    import click

    @click.command("compact")
    @click.argument("src", type=click.Path(exists=True, file_okay=False))
    @click.option("--into", "dest", type=click.Path(file_okay=False), default=None,
                  help="Write the partitions here and leave SRC unchanged (default: compact SRC in place, "
                       "deleting each source once its rows are in place).")
    @click.option("--target-mb", type=click.FloatRange(0.0625, 65536), default=TARGET_BYTES / (1 << 20),
                  show_default=True, help="Size target of an output file (MiB on disk, estimated).")
    @click.option("--min-age", type=click.FloatRange(0), default=MIN_AGE_S, show_default=True,
                  help="Leave alone files modified within this many seconds.")
    @click.option("--part-age", type=click.FloatRange(0), default=PART_AGE_S, show_default=True,
                  help="Leave alone a sink's part files modified within this many seconds (a running sink "
                       "still merges them).")
    def compact_cmd(src, dest, target_mb, min_age, part_age):
        """Rewrite SRC's small store files as large files in DEST/date=YYYY-MM-DD/hour=HH/host=H/ (UTC hour
        of each row's end). Crash-safe: new files are renamed into place before any source is deleted;
        bad files are named on stderr and left in place. See pdtrace.instrument.compact for every rule."""
        try:
            r = compact(src, dest, target_bytes=int(target_mb * (1 << 20)), min_age_s=min_age, part_age_s=part_age)
        except (CompactBusy, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"compacted {r.rows} records ({r.duplicates} duplicate copies dropped) into {len(r.written)} "
                   f"file(s); {len(r.deleted) + len(r.finished)} source(s) deleted, {len(r.skipped)} bad file(s) "
                   f"skipped, {len(r.young)} too recent left alone")

    return compact_cmd


def __getattr__(name: str):
    """``compact_command``: the click command (built on first use: click is imported only by the CLI).
    Raises AttributeError for other names."""
    if name == "compact_command":
        cmd = globals()["compact_command"] = _command()
        return cmd
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
