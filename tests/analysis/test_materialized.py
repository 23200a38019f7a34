"""``pdtrace materialize``: a trace analysed once into Parquet datasets and a database that
``pdtrace report``/``sql`` open like a trace directory (issue 20)."""
from __future__ import annotations

import json

import duckdb
import pytest
from click.testing import CliRunner

from pdtrace.analysis import materialized
from pdtrace.cli.main import main
from pdtrace_case_builder import Case


def _store(d, n=6):
    """n pull requests one hour apart (so they fall in n hourly partitions), each complete."""
    Case().pull_requests(n, gap_ms=3_600_000.0).write(d)
    return d


def _run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r


def test_materialize_then_report_and_sql_read_it_like_the_trace(tmp_path):
    src = _store(tmp_path / "src")
    dest = tmp_path / "dest"
    r = _run("materialize", src, dest)
    assert r.exit_code == 0, r.output
    assert "6 requests" in r.output
    doc = materialized.manifest(dest)
    assert doc["engine"] == "duckdb" and doc["views"]["requests"]["rows"] == 6
    assert doc["views"]["requests"]["partitioned_by"] == ["date", "hour"]
    want = json.loads(_run("report", "--no-cache", "--format", "json", src).output)
    got = json.loads(_run("report", "--format", "json", dest).output)
    assert got == want
    q = _run("sql", "--format", "csv", dest, "SELECT count(*) AS n, round(sum(ttft_ms), 3) AS s FROM requests")
    assert q.output.splitlines() == ["n,s", "6,240.0"]
    # the dataset: one partition per hour, the same rows as the view
    parts = sorted(p.parent.relative_to(dest / "requests").as_posix()
                   for p in (dest / "requests").rglob("*.parquet"))
    assert len(parts) == 6 and parts[0].startswith("date=2025-06-15/hour=")
    con = duckdb.connect()
    ds = con.execute(f"SELECT request_id, ttft_ms, date, hour FROM read_parquet('{dest}/requests/**/*.parquet', "
                     "hive_partitioning = true) ORDER BY request_id").fetchall()
    assert [(r[0], r[1]) for r in ds] == [(f"r{i}", 40.0) for i in range(6)]
    hours = [r[3] for r in ds]
    assert hours == sorted(hours) and len(set(hours)) == 6
    # the spans views still read the store in place
    n = _run("sql", "--format", "csv", dest, "SELECT count(*) FROM spans").output.splitlines()[1]
    assert int(n) == 6 * 5


def test_materialize_refuses_a_destination_inside_the_store_or_holding_other_files(tmp_path):
    src = _store(tmp_path / "src", n=1)
    r = CliRunner().invoke(main, ["materialize", str(src), str(src / "m")])
    assert r.exit_code == 2 and "must not contain each other" in r.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    r = CliRunner().invoke(main, ["materialize", str(src), str(other)])
    assert r.exit_code == 2 and "not a materialization" in r.output
    assert (other / "notes.txt").read_text() == "x" and not (src / "m").exists()


def test_a_second_materialize_of_the_same_destination_is_refused_while_one_runs(tmp_path):
    import subprocess
    import sys

    src = _store(tmp_path / "src", n=2)
    dest = tmp_path / "dest"
    assert _run("materialize", src, dest).exit_code == 0
    before = materialized.manifest(dest)
    # another process holds DEST's lock (as a running `pdtrace materialize` does) until told to stop
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.read()"), str(dest / materialized.MARKER)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _run("materialize", src, dest)
        assert r.exit_code == 1 and f"another pdtrace materialize is writing {dest}" in r.output
        assert materialized.manifest(dest) == before  # untouched
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert _run("materialize", src, dest).exit_code == 0  # the lock went with its process


def test_materialize_again_replaces_and_an_unfinished_one_has_no_manifest(tmp_path):
    src = _store(tmp_path / "src", n=2)
    dest = tmp_path / "dest"
    assert _run("materialize", src, dest).exit_code == 0
    _store(tmp_path / "src", n=3)  # one more request (the files rewritten)
    assert _run("materialize", src, dest).exit_code == 0
    assert materialized.manifest(dest)["views"]["requests"]["rows"] == 3
    assert not list(dest.glob(".*.tmp"))
    # a run that died before its manifest: not opened as a materialization; a new run completes it
    (dest / materialized.MANIFEST).unlink()
    assert not materialized.is_materialized(dest)
    assert _run("materialize", src, dest).exit_code == 0
    assert materialized.is_materialized(dest)


def test_spark_engine_materializes_and_spark_reads_the_datasets(tmp_path, spark):
    src = _store(tmp_path / "src")
    dest = tmp_path / "dest"
    doc = materialized.write(src, dest, engine="spark")
    assert doc["engine"] == "spark" and doc["spark"]["batches"] >= 2
    want = json.loads(_run("report", "--no-cache", "--format", "json", src).output)
    assert json.loads(_run("report", "--format", "json", dest).output) == want
    df = spark.read.parquet(str(dest / "requests"))  # Spark's own Hive partition discovery
    rows = sorted((r["request_id"], r["ttft_ms"], r["hour"]) for r in df.select("request_id", "ttft_ms", "hour").collect())
    assert [r[:2] for r in rows] == [(f"r{i}", 40.0) for i in range(6)]
    assert len({r[2] for r in rows}) == 6


def test_the_dashboard_reads_a_materialization_like_its_trace(tmp_path, cache_dir):
    from answers import same_within
    from pdtrace.dashboard import data

    src = _store(tmp_path / "src")
    dest = tmp_path / "dest"
    materialized.write(src, dest)
    a, b = data.session(src), data.session(dest)
    assert data.store_health(b) == data.store_health(a)
    assert data.store_health(b)["requests"] == 6
    assert same_within(data.headline(b), data.headline(a))
    assert b.refresh() is False  # a materialization never changes


def test_an_unfinished_or_foreign_materialization_is_refused_and_its_sql_stays_read_only(tmp_path):
    src = _store(tmp_path / "src", n=2)
    dest = tmp_path / "dest"
    assert _run("materialize", src, dest).exit_code == 0
    # read-only: no COPY, no other file
    r = CliRunner().invoke(main, ["sql", str(dest), f"COPY requests TO '{tmp_path / 'x.csv'}'"])
    assert r.exit_code != 0 and not (tmp_path / "x.csv").exists()
    (tmp_path / "secret.txt").write_text("s")
    r = CliRunner().invoke(main, ["sql", str(dest), f"SELECT * FROM read_text('{tmp_path / 'secret.txt'}')"])
    assert r.exit_code != 0 and "s\n" not in r.output
    # a materialization is not a source
    r = CliRunner().invoke(main, ["materialize", str(dest), str(tmp_path / "again")])
    assert r.exit_code == 2 and "is a materialization" in r.output
    # a database naming a file outside its source is never opened
    doc = materialized.manifest(dest)
    doc["source"] = str(tmp_path / "elsewhere")
    (dest / materialized.MANIFEST).write_text(json.dumps(doc))
    r = CliRunner().invoke(main, ["report", str(dest)])
    assert r.exit_code == 1 and "outside its source" in r.output
    # a run that died after its build: no manifest; refused, not read as a trace directory
    (dest / materialized.MANIFEST).unlink()
    r = CliRunner().invoke(main, ["report", str(dest)])
    assert r.exit_code == 1 and "incomplete materialization" in r.output


def test_datasets_keep_the_stores_partition_names_and_exact_integers(tmp_path):
    src = _store(tmp_path / "src", n=2)
    (src / "empty.parquet").write_bytes(b"")
    dest = tmp_path / "dest"
    r = _run("materialize", src, dest)
    assert "skipped store file" in r.output and "empty.parquet" in r.output
    hours = sorted(p.name for p in (dest / "requests").glob("date=*/hour=*"))
    assert hours == ["hour=15", "hour=16"]  # two digits, as the store's partitions
    import pyarrow.parquet as pq

    f = next((dest / "ttft_breakdown").rglob("*.parquet"))
    t = pq.read_schema(f)
    assert str(t.field("queue_ns").type) == "int64"  # HUGEINT in the database: exact as BIGINT
    # the skipped file is named when the materialization is read, as for the trace
    rep = CliRunner().invoke(main, ["report", str(dest)])
    assert "skipped store file" in rep.output and "empty.parquet" in rep.output
