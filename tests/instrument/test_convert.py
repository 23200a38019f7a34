"""The sink's conversion of record tuples to Arrow: each record keeps its own attributes.

The converter groups the records of a large batch by their key tuple and
converts a big group's values a column at a time, the rest a value at a time;
these tests mix call sites, wrong types and records without attributes in one
batch and check every record's maps and the drop count, both ways.
"""
import pytest

from pdtrace.instrument import attributes, convert

RES = {"service_name": "pdtrace-decode", "role": "decode", "engine_id": "d0", "host": "h", "pid": 1}


def _rec(i: int, attrs: dict | None = None) -> tuple:
    """A span record in recorder.py's layout: 15 fixed slots, then the keys, then the values."""
    a = attrs or {}
    return (0, i, i, None, "kv.transfer", 1, 1000 + i, 2000 + i, 0, None, f"X{i}", 0, 0, None, "MainThread",
            *a, *a.values())


def _maps(table):
    return list(zip(table.column("attr_int").to_pylist(), table.column("attr_float").to_pylist(),
                    table.column("attr_str").to_pylist()))


@pytest.mark.parametrize("group_min", [1, 10**9], ids=["by-column", "by-value"])
def test_a_batch_of_call_sites_keeps_each_records_attributes(monkeypatch, group_min):
    monkeypatch.setattr(convert, "GROUP_MIN", group_min)  # 1: every key tuple converted a column at a time
    attributes.register("test.convert_ratio", float, "a float key for this test (ratio)")
    recs = [
        _rec(0, {"kv.bytes": 4096, "kv.op": "READ", "step.id": 1}),
        _rec(1, {"kv.blocks": 3}),  # another call site between record 0 and its next record
        _rec(2, {"kv.bytes": 8192, "kv.op": "WRITE", "step.id": 2}),  # same call site as record 0
        _rec(3, {"kv.bytes": True, "kv.post_ns": 5}),  # bool is an int
        _rec(4, {"kv.bytes": "12", "kv.post_ns": 7}),  # same keys as record 3, a str where an int belongs
        _rec(5, {"prompt": "secret text", "step.id": 9}),  # not allowlisted
        _rec(6, {"kv.op": "x" * 1000}),  # cut to max_len
        _rec(7, {"test.convert_ratio": 3, "kv.op": "READ"}),  # an int where a float belongs is a float
        _rec(8, {"test.convert_ratio": 0.25, "kv.op": "WRITE"}),
        _rec(9, {"kv.op": "READ", "kv.bytes": 4096, "step.id": 3}),  # record 0's keys in another order
    ]
    conv = convert.Converter()
    table = conv.table(recs, RES, offset_ns=10)
    got = _maps(table)
    assert [list(i) for i, _, _ in got] == [
        [("kv.bytes", 4096), ("step.id", 1)], [("kv.blocks", 3)], [("kv.bytes", 8192), ("step.id", 2)],
        [("kv.bytes", 1), ("kv.post_ns", 5)], [("kv.post_ns", 7)], [("step.id", 9)], [], [], [],
        [("kv.bytes", 4096), ("step.id", 3)]]
    assert [list(s) for _, _, s in got] == [
        [("kv.op", "READ")], [], [("kv.op", "WRITE")], [], [], [], [("kv.op", "x" * 256)], [("kv.op", "READ")],
        [("kv.op", "WRITE")], [("kv.op", "READ")]]
    assert [list(f) for _, f, _ in got] == [[]] * 7 + [[("test.convert_ratio", 3.0)], [("test.convert_ratio", 0.25)], []]
    assert conv.dropped_attributes == 2  # record 4's "12" and record 5's prompt
    assert table.column("request_id").to_pylist() == [f"X{i}" for i in range(10)]
    assert table.column("start_ns").to_pylist() == [1010 + i for i in range(10)]


def test_one_bad_value_drops_only_itself_among_thousands():
    recs = [_rec(i, {"kv.bytes": i, "kv.op": "READ"}) for i in range(5000)]
    recs[1234] = _rec(1234, {"kv.bytes": 1.5, "kv.op": "READ"})
    recs[10:4000:7] = [_rec(i, {"kv.op": "WRITE", "kv.blocks": i}) for i in range(10, 4000, 7)]  # a second call site
    conv = convert.Converter()
    ints = conv.table(recs, RES, 0).column("attr_int").to_pylist()
    assert conv.dropped_attributes == 1
    assert ints[1234] == []
    assert all(ints[i] == ([("kv.blocks", i)] if 10 <= i < 4000 and (i - 10) % 7 == 0 else [("kv.bytes", i)])
               for i in range(5000) if i != 1234)


@pytest.mark.parametrize("group_min", [1, 10**9], ids=["by-column", "by-value"])
def test_ints_that_do_not_fit_are_wrong_typed(monkeypatch, group_min):
    """int64 columns: an int key's value outside [-2**63, 2**63) is dropped and counted; a float
    key's int too large for a float too. The record and its other values stay."""
    monkeypatch.setattr(convert, "GROUP_MIN", group_min)
    attributes.register("test.convert_ratio", float, "a float key for this test (ratio)")
    recs = [_rec(0, {"kv.handle": 2**63 - 1, "test.convert_ratio": 2}),
            _rec(1, {"kv.handle": 2**63, "test.convert_ratio": 10**400}),
            _rec(2, {"kv.handle": -(2**63) - 1, "test.convert_ratio": 0.5}),
            _rec(3, {"kv.handle": -(2**63), "test.convert_ratio": -3})]
    conv = convert.Converter()
    got = _maps(conv.table(recs, RES, 0))
    assert [list(i) for i, _, _ in got] == [[("kv.handle", 2**63 - 1)], [], [], [("kv.handle", -(2**63))]]
    assert [list(f) for _, f, _ in got] == [[("test.convert_ratio", 2.0)], [], [("test.convert_ratio", 0.5)],
                                            [("test.convert_ratio", -3.0)]]
    assert conv.dropped_attributes == 3


@pytest.mark.parametrize("group_min", [1, 10**9], ids=["by-column", "by-value"])
def test_a_call_site_of_unknown_keys_counts_each_value_once(monkeypatch, group_min):
    """A busy call site whose keys were never allowlisted (a plug-in that did not register
    them): every value is dropped and counted once, whichever way the batch is converted."""
    monkeypatch.setattr(convert, "GROUP_MIN", group_min)
    recs = [_rec(i, {"plugin.unregistered": i}) for i in range(300)]
    conv = convert.Converter()
    got = _maps(conv.table(recs, RES, 0))
    assert conv.dropped_attributes == 300
    assert all(m == ([], [], []) for m in got)


@pytest.mark.parametrize("group_min", [1, 10**9], ids=["by-column", "by-value"])
def test_an_int_that_rounds_to_the_largest_float_is_kept_both_ways(monkeypatch, group_min):
    monkeypatch.setattr(convert, "GROUP_MIN", group_min)
    attributes.register("test.convert_ratio", float, "a float key for this test (ratio)")
    big = int(1.7976931348623157e308) + 1  # float() rounds it down; only ints from ~2**1024 overflow
    recs = [_rec(i, {"test.convert_ratio": big if i == 0 else i}) for i in range(300)]
    conv = convert.Converter()
    floats = conv.table(recs, RES, 0).column("attr_float").to_pylist()
    assert floats[0] == [("test.convert_ratio", 1.7976931348623157e308)] and conv.dropped_attributes == 0
    assert floats[299] == [("test.convert_ratio", 299.0)]


def test_joint_conversion_of_several_processes_equals_converting_each(monkeypatch):
    """The host's sink converts every client's records of a part file in one call: each row keeps its
    own process's resource columns, clock offset and default tp_rank, its attributes pass its own
    process's allowlist, and the attributes dropped are counted per process."""
    a_allowed = dict(attributes.ALLOWED)
    b_allowed = {k: v for k, v in attributes.ALLOWED.items() if k != "kv.op"}  # B's allowlist lacks kv.op
    res = [dict(RES, pid=1, role="prefill"), dict(RES, pid=2, role="decode", engine_id=None, tp_rank=3),
           dict(RES, pid=3)]
    segs = [([_rec(i, {"kv.bytes": i, "kv.op": "READ"}) for i in range(5)], res[0], 10, a_allowed),
            ([_rec(i, {"kv.bytes": i, "kv.op": "READ", "prompt": "x"}) for i in range(5, 9)], res[1], 20, b_allowed),
            ([], res[2], 30, a_allowed),  # a client with nothing to convert
            ([_rec(9, {"kv.bytes": 9})], res[2], 40, a_allowed)]
    joint, dropped = convert.Converter().table_joint(segs)
    assert dropped == [0, 8, 0, 0]  # kv.op and prompt, four records of B
    each = [convert.Converter(s[3]).table(s[0], s[1], s[2]) for s in segs if s[0]]
    import pyarrow as pa
    assert joint.to_pylist() == pa.concat_tables(each).to_pylist()
    rows = joint.to_pylist()
    assert [r["pid"] for r in rows] == [1] * 5 + [2] * 4 + [3]
    assert [r["start_ns"] - 1000 - i for i, r in enumerate(rows)] == [10] * 5 + [20] * 4 + [40]
    assert [r["tp_rank"] for r in rows] == [None] * 5 + [3] * 4 + [None]
    assert rows[5]["attr_str"] == [] and rows[0]["attr_str"] == [("kv.op", "READ")]
    with pytest.raises(ValueError):
        convert.Converter().table_joint([([], res[0], 0, None)])
