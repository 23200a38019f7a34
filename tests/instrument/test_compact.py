"""``pdtrace compact``: small store files rewritten as hourly partitions, the analysis answering exactly as before.

Real files, real DuckDB: a fleet store (fleetkit: 9 requests over 3 UTC hours, 3 hosts, 18 small files,
one file of two hosts, one duplicate copy) compacted, and ``pdtrace report --format json`` and the
``requests`` view compared with an untouched copy.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import fleetkit
from pdtrace.cli.main import main as cli_main
from pdtrace.instrument import compact, layout, store

REQUESTS = "SELECT * FROM requests ORDER BY request_id"


@pytest.fixture
def fleet(tmp_path):
    """(flat original, copy to compact): the same files, the same mtimes."""
    a = tmp_path / "flat"
    fleetkit.build(a)
    b = tmp_path / "work"
    shutil.copytree(a, b)
    return a, b


def _files(d: Path) -> list[Path]:
    return store.store_files(d)


def _assert_compacted(d: Path, n_records: int) -> None:
    """Every file of ``d`` is an output in its partition, whole, accepted by check_file; the partition
    values equal each row's own end hour and host; every record once."""
    files = _files(d)
    assert files and all(compact.OUTPUT_FILE.match(p.name) for p in files)
    seen = []
    for p in files:
        assert store.check_file(p).ok
        rel = p.parent.relative_to(d).as_posix()
        rows = duckdb.sql(f"SELECT record_id, end_ns, host FROM read_parquet('{p}', hive_partitioning = false)"
                          ).fetchall()
        assert rows
        for rid, end_ns, host in rows:
            assert layout.partition(end_ns, host) == rel
            seen.append(rid)
    assert len(seen) == len(set(seen)) == n_records


def _distinct_records(d: Path) -> int:
    return duckdb.sql(f"SELECT count(DISTINCT record_id) FROM read_parquet('{d}/**/*.parquet', "
                      "union_by_name = true, hive_partitioning = false)").fetchall()[0][0]


def test_compaction_in_place_keeps_the_report_and_requests(fleet):
    a, b = fleet
    n = _distinct_records(a)
    r = CliRunner().invoke(cli_main, ["compact", str(b)])
    assert r.exit_code == 0, r.output
    assert "7 duplicate copies dropped" in r.output  # the orphan part's copies of a segment's records
    _assert_compacted(b, n)
    # 3 hours x 3 hosts; the file of two hosts split by row
    assert {p.parent.relative_to(b).as_posix() for p in _files(b)} == {
        f"date=2025-06-15/hour={h}/host={host}" for h in ("15", "16", "17") for host in ("rtr-1", "gpu-a", "gpu-b")}
    assert fleetkit.report_json(b) == fleetkit.report_json(a)
    assert fleetkit.table(b, REQUESTS) == fleetkit.table(a, REQUESTS)
    assert len(fleetkit.table(a, REQUESTS)) == fleetkit.N_REQUESTS
    # footer: the source's schema version and key-value metadata are kept
    src_kv = pq.read_metadata(next(a.glob("*.parquet"))).metadata
    out_kv = pq.read_metadata(_files(b)[0]).metadata
    for k in (b"pdtrace.schema_version", b"pdtrace.schema_url"):
        assert out_kv[k] == src_kv[k]
    # idempotent: a second run finds nothing to do and changes nothing
    before = {p: p.read_bytes() for p in _files(b)}
    again = compact.compact(b)
    assert (again.written, again.deleted, again.finished, again.undone) == ([], [], [], [])
    assert {p: p.read_bytes() for p in _files(b)} == before


def test_small_target_splits_a_partition_into_several_files(fleet):
    a, b = fleet
    # 64 KiB target, 10 bytes per row estimated at most: an hour of one host's rows fits one file;
    # the batch size (sources read at once) is what splits here: one source per batch
    res = compact.compact(b, batch_bytes=1)
    assert len(res.written) > 9
    _assert_compacted(b, _distinct_records(a))
    assert fleetkit.report_json(b) == fleetkit.report_json(a)


def test_crash_between_rename_and_delete_gives_the_same_answer_and_is_finished_next_run(fleet, child):
    """A compaction process that dies after its outputs are renamed into place and before any source is
    deleted (a fault we cannot cause for real at that instant: the process calls os._exit there, through
    compact()'s ``after_rename`` hook) leaves old and new files: the analysis answers as before (duplicate
    copies hidden: the same records); the next run deletes the sources and writes nothing again."""
    a, b = fleet
    r = child(f"import os\nfrom pdtrace.instrument import compact\n"
              f"compact.compact({str(b)!r}, after_rename=lambda: os._exit(9))")
    assert r.returncode == 9, r.stderr
    files = _files(b)
    outs = [p for p in files if compact.OUTPUT_FILE.match(p.name)]
    assert outs and len(files) == len(outs) + len(_files(a))  # old + new
    assert fleetkit.report_json(b) == fleetkit.report_json(a)
    assert fleetkit.table(b, REQUESTS) == fleetkit.table(a, REQUESTS)
    res = compact.compact(b)
    assert res.written == [] and len(res.finished) == len(_files(a))
    assert _files(b) == sorted(outs)
    _assert_compacted(b, _distinct_records(a))
    assert fleetkit.report_json(b) == fleetkit.report_json(a)


def test_crash_between_two_renames_is_undone_and_redone(fleet, child):
    """A batch with an output missing (the process died between two renames: simulated by deleting one
    renamed output after a crash like the test above, since the instant cannot be hit for real) is not
    trusted: its outputs are deleted (every source is still there) and the sources compacted again."""
    a, b = fleet
    r = child(f"import os\nfrom pdtrace.instrument import compact\n"
              f"compact.compact({str(b)!r}, after_rename=lambda: os._exit(9))")
    assert r.returncode == 9, r.stderr
    outs = [p for p in _files(b) if compact.OUTPUT_FILE.match(p.name)]
    outs[-1].unlink()
    assert fleetkit.report_json(b) == fleetkit.report_json(a)  # old files hold every record
    res = compact.compact(b)
    assert sorted(res.undone) == sorted(str(p) for p in outs[:-1])
    assert len(res.deleted) == len(_files(a)) and res.finished == []
    _assert_compacted(b, _distinct_records(a))
    assert fleetkit.report_json(b) == fleetkit.report_json(a)


def test_a_stale_temporary_output_is_removed(fleet):
    a, b = fleet
    d = b / "date=2025-06-15" / "hour=15" / "host=rtr-1"
    d.mkdir(parents=True)
    (d / ".compact-0123456789ab-0000of0001.parquet.tmp").write_bytes(b"half a file")
    compact.compact(b)
    assert not list(b.rglob("*.tmp"))
    _assert_compacted(b, _distinct_records(a))


def _corrupt_first_page(path: Path) -> None:
    """Overwrite the first data page header of the first column: the footer stays sound."""
    off = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    raw = bytearray(path.read_bytes())
    raw[off:off + 64] = b"\xff" * 64
    path.write_bytes(bytes(raw))


@pytest.mark.filterwarnings("ignore:skipped store file")  # the analysis names them too (expected)
def test_bad_files_are_skipped_named_and_kept(fleet, capsys):
    a, b = fleet
    bad = {}
    for d in (a, b):  # the same damage in both copies: the analysis skips them in both
        files = sorted(p for p in d.glob("sink-gpu_a-*.parquet"))
        trunc, corrupt_ = files[0], files[1]
        trunc.write_bytes(trunc.read_bytes()[:100])
        _corrupt_first_page(corrupt_)
        (d / "foreign.parquet").write_bytes(b"PAR1 not really")
        t = time.time() - 86400
        for p in (trunc, corrupt_, d / "foreign.parquet"):
            os.utime(p, (t, t))
        bad[d] = {trunc.name, corrupt_.name, "foreign.parquet"}
    kept = {p: b.joinpath(p).read_bytes() for p in bad[b]}
    res = compact.compact(b)
    err = capsys.readouterr().err
    assert {Path(p).name for p, _ in res.skipped} == bad[b]
    for name in bad[b]:
        assert f"{b / name}" in err and "left in place" in err
        assert (b / name).read_bytes() == kept[name]  # never deleted, never touched
    assert any(reason.startswith("corrupt data") for _, reason in res.skipped)
    assert fleetkit.report_json(b) == fleetkit.report_json(a)
    assert fleetkit.table(b, REQUESTS) == fleetkit.table(a, REQUESTS)
    again = compact.compact(b)  # still skipped, still there, nothing rewritten
    assert again.written == [] and {Path(p).name for p, _ in again.skipped} == bad[b]


def test_recent_files_and_young_parts_are_left_alone(fleet):
    a, b = fleet
    fresh = store.write_rows(b, [{"name": "prefill.compute", "request_id": "late", "span_id": 5,
                                  "start_ns": 10**18, "end_ns": 10**18 + 5}],
                             resource={"role": "prefill", "host": "gpu-a", "pid": 1}, name="manual-fresh.parquet")
    part = b / "sink-gpu_a-55-20250615T150000-p000009.parquet"
    store.write_rows(b, [{"name": "prefill.compute", "request_id": "late2", "span_id": 6,
                          "start_ns": 10**18, "end_ns": 10**18 + 5}],
                     resource={"role": "prefill", "host": "gpu-a", "pid": 55}, name=part.name)
    t = time.time() - 3600  # an hour old: past --min-age, within --part-age (a running sink's part)
    os.utime(part, (t, t))
    res = compact.compact(b)
    assert sorted(res.young) == sorted([str(fresh), str(part)])
    assert fresh.exists() and part.exists()
    res = compact.compact(b, min_age_s=0, part_age_s=60)  # now both are old enough
    assert not fresh.exists() and not part.exists() and len(res.deleted) == 2


def test_into_leaves_the_source_unchanged_and_copies_once(fleet, tmp_path):
    a, b = fleet
    dest = tmp_path / "partitioned"
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in _files(b)}
    res = compact.compact(b, dest)
    assert res.deleted == [] and res.written
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in _files(b)} == before
    _assert_compacted(dest, _distinct_records(a))
    assert fleetkit.report_json(dest) == fleetkit.report_json(a)
    again = compact.compact(b, dest)  # every source is in a complete batch of DEST already
    assert again.written == []
    _assert_compacted(dest, _distinct_records(a))


def test_one_compaction_at_a_time(fleet):
    import fcntl

    a, b = fleet
    fd = os.open(b / compact.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(compact.CompactBusy):
            compact.compact(b)
    finally:
        os.close(fd)
    assert _files(b) == _files(b) and not any(compact.OUTPUT_FILE.match(p.name) for p in _files(b))


def test_into_a_directory_inside_the_source(fleet):
    a, b = fleet
    dest = b / "compacted"
    compact.compact(b, dest)
    again = compact.compact(b, dest)  # neither SRC's files (copied) nor DEST's own outputs are sources
    assert again.written == [] and again.deleted == []
    _assert_compacted(dest, _distinct_records(a))


def test_row_groups_are_the_writers():
    from pdtrace.instrument import sink

    assert compact.ROW_GROUP == sink.ROW_GROUP
