"""Bad input: bad files skipped and named, duplicates counted once, views documented, read-only queries."""
import shutil

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdtrace.analysis import db, loader
from pdtrace.instrument import schema, store
from test_ttft_cases import _case_h


def test_every_public_view_and_column_is_documented(analyse):
    tr = analyse(_case_h())
    views = tr.query("SELECT view_name, comment FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' "
                     "AND NOT starts_with(view_name, '_')")
    names = {v["view_name"] for v in views}
    assert {"spans", "events", "requests", "ttft_segments", "ttft_breakdown", "incomplete_requests",
            "clock_offsets", "stages"} <= names
    assert [v["view_name"] for v in views if not v["comment"]] == []
    cols = tr.query("SELECT table_name, column_name, comment FROM duckdb_columns() WHERE schema_name = 'main' "
                    "AND NOT internal AND NOT starts_with(table_name, '_') "
                    "AND table_name IN (SELECT view_name FROM duckdb_views() WHERE NOT internal)")
    missing = [(c["table_name"], c["column_name"]) for c in cols if not c["comment"]]
    assert missing == []


def test_column_check_catches_an_undocumented_column():
    con = duckdb.connect()
    con.execute("CREATE VIEW v AS SELECT 1 AS a, 2 AS b; COMMENT ON VIEW v IS 'x'; COMMENT ON COLUMN v.a IS 'a (ns)'")
    rows = con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = 'v' AND comment IS NULL").fetchall()
    assert rows == [("b",)]


def test_modules_declare_known_dependencies():
    order = [m.name for m in loader.load_order()]
    for m in loader.load_order():
        for dep in m.requires:
            assert order.index(dep) < order.index(m.name)
    with pytest.raises(ValueError):
        loader.load_order({"a": loader.Module("a", ("b",), (), ""), "b": loader.Module("b", ("a",), (), "")})


def test_bad_files_skipped_and_named(tmp_path):
    d = tmp_path / "s"
    _case_h().write(d)
    (d / "empty.parquet").write_bytes(b"")
    good = store.store_files(d)[0]
    (d / "truncated.parquet").write_bytes(good.read_bytes()[:200])
    pq.write_table(pa.table({"x": [1]}), d / "foreign.parquet")
    t = store.rows_to_table([{"name": "router.request", "span_id": 1, "start_ns": 1}])
    t = t.replace_schema_metadata({schema.VERSION_KEY: b"2.0"})
    pq.write_table(t, d / "newer.parquet")
    with pytest.warns(db.SkippedFileWarning) as rec:
        tr = db.open_trace(d)
    msgs = " ".join(str(w.message) for w in rec)
    for n in ("empty.parquet", "truncated.parquet", "foreign.parquet", "newer.parquet"):
        assert n in msgs
    assert "major 2" in msgs
    skipped = tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"]
    assert skipped == 4
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    tr.close()


def test_lab_client_records_are_not_a_bad_store_file(tmp_path):
    """The lab writes its client's view (client/requests.parquet) inside the trace dir: no warning, not skipped."""
    import warnings

    from pdtrace.connector.lab.replay import ClientRecord, write_records

    d = tmp_path / "s"
    _case_h().write(d)
    rec = ClientRecord(0, 0, 12, 4, 0, send_ns=1, first_token_ns=2, end_ns=3, token_times_ns=[2, 3], status="ok")
    path = write_records([rec], d / "client", "run-1")
    assert store.check_file(path).artifact == "client-records"
    assert pq.read_table(path).column("status").to_pylist() == ["ok"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", db.SkippedFileWarning)
        tr = db.open_trace(d)
    assert tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"] == 0
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    tr.close()


def test_duplicated_spans_counted_once_and_compaction_is_safe(tmp_path):
    d = tmp_path / "s"
    paths = _case_h().write(d)
    # the recorder's compaction briefly leaves the decode file's rows in a segment too
    dec = [p for p in paths if "decode" in p.name][0]
    shutil.copy(dec, d / "segment-decode.parquet")
    with db.Trace(d) as tr:
        tr.refresh()
        assert tr.query("SELECT count(*) AS n FROM spans WHERE stage = 'dest.register'")[0]["n"] == 1
        b = tr.query("SELECT * FROM ttft_breakdown")[0]
        assert b["ttft_ms"] == 4070 and b["coordination_ms"] == 4000
        # compaction finishes: the part disappears, the segment stays
        dec.unlink()
        r = tr.refresh()
        assert r.gone == [str(dec)] and r.new == []
        assert tr.query("SELECT count(*) AS n FROM spans WHERE stage = 'dest.register'")[0]["n"] == 1
        assert tr.query("SELECT coordination_ms FROM ttft_breakdown")[0]["coordination_ms"] == 4000



def test_a_copy_arriving_later_is_found_incrementally(tmp_path):
    # Warm refreshes look up only the new files' record ids in the other files:
    # a copy that arrives later, sorting before the original, becomes the
    # visible one; when it vanishes again the original is visible; every state
    # equals a cold build of the same directory.
    d = tmp_path / "s"
    paths = _case_h().write(d)
    dec = [p for p in paths if "decode" in p.name][0]
    n_dec = len(pq.read_table(dec))
    cache = tmp_path / "c.duckdb"
    q = "SELECT * EXCLUDE (rkey) FROM ttft_breakdown"
    with db.Trace(d, cache=cache) as tr:
        assert tr.refresh().rebuilt
        assert tr.query("SELECT count(*) AS n FROM _dup_drop")[0]["n"] == 0
        first = tr.query(q)
        copy = d / ("0-" + dec.name)                         # sorts before the original
        shutil.copy(dec, copy)
        r = tr.refresh()
        assert not r.rebuilt and r.new == [str(copy)]
        drop = tr.query("SELECT _file, count(*) AS n FROM _dup_drop GROUP BY _file")
        assert drop == [{"_file": str(dec), "n": n_dec}]     # the original's rows are now the hidden copies
        assert tr.query("SELECT count(*) AS n FROM spans WHERE stage = 'dest.register'")[0]["n"] == 1
        assert tr.query(q) == first
        with db.open_trace(d) as cold:
            assert cold.query("SELECT _file, count(*) AS n FROM _dup_drop GROUP BY _file") == drop
        copy.unlink()
        r = tr.refresh()
        assert r.gone == [str(copy)]
        assert tr.query("SELECT count(*) AS n FROM _dup_drop")[0]["n"] == 0
        assert tr.query("SELECT count(*) AS n FROM _dup_copies")[0]["n"] == 0
        assert tr.query("SELECT count(*) AS n FROM spans WHERE stage = 'dest.register'")[0]["n"] == 1
        assert tr.query(q) == first


def test_sql_is_read_only(tmp_path):
    d = tmp_path / "s"
    _case_h().write(d)
    cache = tmp_path / "c.duckdb"
    db.open_trace(d, cache=cache).close()
    con = db.connect_readonly(cache)
    assert con.execute("SELECT ttft_ms FROM ttft_breakdown").fetchone()[0] == 4070
    out = tmp_path / "out.csv"
    for q in (f"COPY (SELECT 1) TO '{out}'", f"ATTACH '{tmp_path / 'x.duckdb'}' AS x",
              "CREATE TABLE t AS SELECT 1", "DROP VIEW spans", "SET enable_external_access = true",
              f"SELECT * FROM read_csv('{out}')", "INSTALL httpfs", f"EXPORT DATABASE '{tmp_path / 'exp'}'"):
        with pytest.raises(duckdb.Error):
            con.execute(q)
    assert not out.exists() and not (tmp_path / "x.duckdb").exists() and not (tmp_path / "exp").exists()
    con.close()
