"""Hand-built stores and the file check readers rely on."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdtrace.instrument import schema, store


def test_write_rows_defaults_and_attrs(tmp_path):
    p = store.write_rows(tmp_path, [
        {"name": "kv.transfer", "request_id": "r1", "span_id": 5, "start_ns": 10, "end_ns": 20,
         "attrs": {"kv.bytes": 100, "kv.op": "READ", "share": 0.5, "flag": True}},
        {"record": "event", "name": "router.first_token", "request_id": "r1", "span_id": 5, "start_ns": 15},
    ], resource={"role": "decode", "engine_id": "d0", "pid": 1})
    t = pq.read_table(p).to_pylist()
    s, e = t
    assert s["record_id"] == 5 and s["record"] == "span" and s["kind"] == 1 and s["attempt"] == 0
    assert dict(s["attr_int"]) == {"kv.bytes": 100, "flag": 1} and dict(s["attr_str"]) == {"kv.op": "READ"}
    assert dict(s["attr_float"]) == {"share": 0.5}
    assert s["role"] == "decode" and s["engine_id"] == "d0" and s["schema_version"] == schema.SCHEMA_VERSION
    assert e["end_ns"] == 15 and e["record_id"] not in (None, 5)


def test_write_rows_rejects_unknown_column_and_bad_attr(tmp_path):
    with pytest.raises(KeyError):
        store.write_rows(tmp_path, [{"nmae": "x"}])
    with pytest.raises(TypeError):
        store.write_rows(tmp_path, [{"name": "x", "start_ns": 1, "attrs": {"a": [1]}}])
    assert store.store_files(tmp_path) == []


def test_check_file_names_every_bad_kind(tmp_path):
    good = store.write_rows(tmp_path, [{"name": "x", "start_ns": 1}], name="good.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    data = good.read_bytes()
    (tmp_path / "trunc.parquet").write_bytes(data[: len(data) // 2])
    pq.write_table(pa.table({"a": [1]}), tmp_path / "foreign.parquet")
    newer = pa.table({"a": [1]}).replace_schema_metadata({schema.VERSION_KEY: b"2.0"})
    pq.write_table(newer, tmp_path / "newer.parquet")
    minor = store.rows_to_table([{"name": "x", "start_ns": 1}])
    minor = minor.replace_schema_metadata({schema.VERSION_KEY: b"1.7"})
    pq.write_table(minor, tmp_path / "minor.parquet")
    (tmp_path / ".half.parquet.tmp").write_bytes(b"PAR1")
    res = {p.name: store.check_file(p) for p in store.store_files(tmp_path)}
    assert set(res) == {"good.parquet", "empty.parquet", "trunc.parquet", "foreign.parquet", "newer.parquet",
                        "minor.parquet"}
    assert res["good.parquet"].ok and res["minor.parquet"].ok
    assert res["empty.parquet"].reason == "empty file"
    assert res["trunc.parquet"].reason.startswith("not a Parquet file")
    assert res["foreign.parquet"].reason.startswith("not a pdtrace store file")
    assert not res["newer.parquet"].ok and "major 2" in res["newer.parquet"].reason


def test_store_files_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        store.store_files(tmp_path / "nope")


def test_every_column_documented():
    for name, typ, doc in schema.COLUMNS:
        assert doc and len(doc) > 10, name
    assert schema.SCHEMA.names == [c[0] for c in schema.COLUMNS]
