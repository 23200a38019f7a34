"""Bad input on the Spark engine (issue 20): the same files skipped with the same reasons as the DuckDB
path, the same answers from what is left, and a store file removed while the Spark tasks read it
makes the refresh start again, never a short answer."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from answers import differences
from pdtrace.analysis import db
from pdtrace.instrument import schema, store
from pdtrace_case_builder import Case


def _requests(d: Path, n=24, prefix="", t0=0.0):
    return Case().pull_requests(n, t0_ms=t0, prefix=prefix).write(d, prefix=prefix)


def _corrupt_first_page(path: Path) -> None:
    off = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    b = bytearray(path.read_bytes())
    b[off:off + 64] = b"\xff" * 64
    path.write_bytes(bytes(b))


def test_bad_files_skipped_alike_and_the_rest_answered_alike(tmp_path, spark):
    from pdtrace.analysis.spark import SparkTrace

    d = tmp_path / "s"
    _requests(d)
    part = d / "date=2025-06-15" / "hour=15" / "host=h"  # a fleet partition beside the flat files
    later = _requests(part, n=6, prefix="b-", t0=1000.0)
    # a newer schema minor (one column more) in the partition: read
    t = pq.read_table(later[0])
    t = t.append_column("new_col", pa.array([1] * t.num_rows, pa.int64()))
    pq.write_table(t.replace_schema_metadata(dict(t.schema.metadata or {})), part / "newer-minor.parquet")
    later[0].unlink()
    # bad files: skipped and named
    (d / "empty.parquet").write_bytes(b"")
    good = store.store_files(d)[0]
    (part / "truncated.parquet").write_bytes(good.read_bytes()[:200])
    pq.write_table(pa.table({"x": [1]}), d / "foreign.parquet")
    nt = store.rows_to_table([{"name": "router.request", "span_id": 1, "start_ns": 1}])
    pq.write_table(nt.replace_schema_metadata({schema.VERSION_KEY: b"2.0"}), d / "newer-major.parquet")
    bad = store.write_rows(d, [{"name": "prefill.compute", "request_id": f"z{i}", "span_id": 90_000 + i,
                                "start_ns": 10**9 + i, "end_ns": 10**9 + i + 5} for i in range(500)],
                           resource={"role": "prefill", "engine_id": "p9", "host": "h", "pid": 9}, name="corrupt.parquet")
    _corrupt_first_page(bad)

    with db.Trace(d) as a, SparkTrace(d, spark=spark) as b:
        b.spark_decode_bytes = 0  # the full decode in Spark tasks too
        ra, rb = a.refresh(warn=False), b.refresh(warn=False)
        assert b.spark_stats["decode_tasks"] >= 2 and b.spark_stats["batches"] >= 2
        assert sorted(rb.skipped) == sorted(ra.skipped)
        names = {Path(p).name: why for p, why in rb.skipped}
        assert set(names) == {"empty.parquet", "truncated.parquet", "foreign.parquet", "newer-major.parquet",
                              "corrupt.parquet"}
        assert names["corrupt.parquet"].startswith("corrupt data:")
        assert a.query("SELECT count(*) AS n FROM requests")[0]["n"] == 30
        assert differences(a.con, b.con) == []


def test_a_file_removed_while_spark_tasks_read_restarts_the_refresh(tmp_path, spark):
    """The removal is real (compaction replacing two files by one), forced at the moment the driver
    hands the batches to Spark (a subclass runs it there) instead of waiting for the race."""
    from pdtrace.analysis.spark import SparkTrace

    d = tmp_path / "s"
    files = _requests(d)
    victims = [f for f in files if "decode" in f.name]
    seen = []

    class CompactedDuringTasks(SparkTrace):
        def _materialize_requests(self, listed, n_scope, cold):
            if not seen:
                seen.append(n_scope)
                t = pa.concat_tables([pq.read_table(v) for v in victims])
                merged = store.write_table(d, t, name="merged-decode.parquet")  # (renamed into place)
                assert merged.exists()
                for v in victims:
                    v.unlink()
            return super()._materialize_requests(listed, n_scope, cold)

    with CompactedDuringTasks(d, spark=spark) as b:
        r = b.refresh(warn=False)
        assert len(seen) == 1 and r.skipped == []
        assert sorted(Path(p).name for p in r.new) == sorted(
            [f.name for f in files if f not in victims] + ["merged-decode.parquet"])
    with db.Trace(d) as a, SparkTrace(d, spark=spark) as b2:
        a.refresh()
        b2.refresh()
        assert a.query("SELECT count(*) AS n FROM ttft_breakdown")[0]["n"] == 24
        assert differences(a.con, b2.con) == []


def test_report_and_sql_with_engine_spark_print_duckdbs_and_a_warm_refresh_follows(tmp_path, spark):
    """The Session path (`pdtrace report --engine spark`, the default cache file), then a new file: the warm
    refresh after a Spark cold build gives DuckDB's answers too."""
    import json

    from click.testing import CliRunner

    from pdtrace import analysis
    from pdtrace.cli.main import main

    d = tmp_path / "s"
    _requests(d, n=10)
    run = CliRunner().invoke
    want = run(main, ["report", "--no-cache", "--format", "json", str(d)], catch_exceptions=False)
    got = run(main, ["report", "--no-cache", "--engine", "spark", "--format", "json", str(d)], catch_exceptions=False)
    assert got.exit_code == 0 and json.loads(got.output) == json.loads(want.output)
    q = run(main, ["sql", "--no-cache", "--engine", "spark", "--format", "csv", str(d), "SELECT count(*) FROM requests"])
    assert q.output.splitlines()[1] == "10"
    cache = tmp_path / "c.duckdb"
    s = analysis.open(d, cache=cache, read_only=False, engine="spark")
    try:
        assert s._trace.spark_stats["batches"] >= 2
        _requests(d, n=4, prefix="late-", t0=5000.0)
        assert s.refresh() is True
        with db.Trace(d) as a:
            a.refresh()
            assert differences(a.con, s._trace.con) == []
            assert a.query("SELECT count(*) AS n FROM requests")[0]["n"] == 14
    finally:
        s.close()


def test_a_spark_connect_url_is_refused_with_what_to_give_instead(tmp_path):
    from click.testing import CliRunner

    from pdtrace.cli.main import main

    d = tmp_path / "s"
    _requests(d, n=2)
    r = CliRunner().invoke(main, ["report", "--engine", "spark", "--spark-master", "sc://localhost:15002", str(d)])
    assert r.exit_code == 1
    assert "cannot run over Spark Connect (sc://localhost:15002)" in r.output and "spark://HOST:7077" in r.output
