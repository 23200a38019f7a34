"""A small store's rows held in memory (:func:`pdtrace.analysis.files.hold_rows`): read once by a
cold build, the same answers as reading the files in place; and the SQL library parsed once per
process (:func:`pdtrace.analysis.loader.modules`)."""
import os
import shutil
from pathlib import Path

from pdtrace.analysis import db, files, loader
from test_handoff_cases import _case_j
from test_incomplete import _case_e, _case_k
from test_ttft_cases import _case_a, _case_c, _case_d, _case_h, _case_i, _case_l

_HELD = "SELECT count(*) FROM duckdb_tables() WHERE temporary AND table_name = '_held_rows'"


def _public_views(con) -> dict[str, list]:
    """{view: its rows, sorted} for every public view (not starting with ``_``) on ``con``."""
    names = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal "
                                       "AND NOT starts_with(view_name, '_') ORDER BY 1").fetchall()]
    return {v: sorted(map(repr, con.execute(f"SELECT * FROM {v}").fetchall())) for v in names}


def _write(d: Path, cases) -> None:
    for prefix, make in cases:
        make().write(d, prefix=f"{prefix}-")


def test_held_refresh_equals_reading_in_place(tmp_path):
    """Every public view after a cold refresh, then after a warm one absorbing more files, is the
    same whether the refresh holds the store's rows in memory or reads each file per statement
    (``hold_bytes = 0``); one DuckDB thread each, so float sums add in the same order."""
    d = tmp_path / "s"
    _write(d, [("a", _case_a), ("c", _case_c), ("d", _case_d), ("e", _case_e), ("j", _case_j)])
    held, in_place = db.Trace(d, threads=1), db.Trace(d, threads=1)
    in_place.hold_bytes = 0
    with held, in_place:
        assert held._hold(files.scan(d)[0]) and held.con.execute(_HELD).fetchone()[0] == 1  # it can hold
        files.release_rows(held.con)
        held.refresh()
        in_place.refresh()
        first = _public_views(held.con)
        assert first == _public_views(in_place.con)
        assert len(first["ttft_breakdown"]) >= 5 and first["incomplete_requests"] and first["spans"]
        # nothing stays held after a refresh: the views read the files in place again
        assert held.con.execute(_HELD).fetchone()[0] == 0
        _write(d, [("h", _case_h), ("i", _case_i), ("k", _case_k), ("l", _case_l)])
        r1, r2 = held.refresh(), in_place.refresh()
        assert not r1.rebuilt and r1.new == r2.new and len(r1.new) > 0
        second = _public_views(held.con)
        assert second == _public_views(in_place.con)
        assert len(second["ttft_breakdown"]) > len(first["ttft_breakdown"])


def test_hold_rows_reads_the_files_once_and_release_undoes_it(tmp_path):
    d = tmp_path / "s"
    _write(d, [("a", _case_a), ("h", _case_h)])
    good, _ = files.scan(d)
    sizes = {p: s for p, (s, _m) in good.items()}
    one = sorted(sizes)[0]
    q = f"SELECT * FROM _read_store(['{one}']) ORDER BY record_id"
    with db.Trace(d) as tr:
        con = tr.con
        want = con.execute(q).fetchall()
        assert want and {r[-1] for r in want} == {one}                  # _file: one file's rows
        assert not files.hold_rows(con, sizes, limit=sum(sizes.values()) - 1)   # too big: nothing held
        assert con.execute(_HELD).fetchone()[0] == 0
        assert files.hold_rows(con, sizes, limit=sum(sizes.values()))
        assert con.execute(_HELD).fetchone()[0] == 1
        plan = "\n".join(r[1] for r in con.execute("EXPLAIN " + q).fetchall())
        assert "READ_PARQUET" not in plan.upper()                       # served from memory
        assert con.execute(q).fetchall() == want
        n_all = con.execute("SELECT count(*) FROM temp.main._held_rows").fetchone()[0]
        assert n_all == sum(r[0] for r in con.execute(
            "SELECT count(*) FROM main._read_store(?) GROUP BY _file", [sorted(sizes)]).fetchall())
        files.release_rows(con)
        files.release_rows(con)                                          # nothing held: no error
        assert con.execute(_HELD).fetchone()[0] == 0
        assert "READ_PARQUET" in "\n".join(r[1] for r in con.execute("EXPLAIN " + q).fetchall()).upper()
        assert con.execute(q).fetchall() == want


def test_only_a_cold_build_within_the_memory_limit_holds(tmp_path, monkeypatch):
    """The hold is for the cold build of a small store: a warm refresh (the dashboard following a
    growing store) reads its new files in place, and so does a cold build whose estimated held size
    exceeds a quarter of DuckDB's memory_limit; every new file is decoded in full either way (a
    hold reads only the store schema's columns, the decode check every column)."""
    calls, decoded = [], []
    real_hold, real_decode = files.hold_rows, files.decode_errors

    def hold(con, sizes, limit=files.HOLD_BYTES):
        ok = real_hold(con, sizes, limit)
        calls.append(ok)
        return ok

    def decode(paths):
        decoded.append(list(paths))
        return real_decode(paths)

    monkeypatch.setattr(files, "hold_rows", hold)
    monkeypatch.setattr(files, "decode_errors", decode)
    d = tmp_path / "s"
    _write(d, [("a", _case_a), ("e", _case_e)])
    with db.Trace(d) as tr:
        tr.refresh()
        assert calls == [True] and len(decoded) == 1 and len(decoded[0]) == len(files.scan(d)[0])
        _write(d, [("h", _case_h)])
        assert tr.refresh().new and calls == [True] and len(decoded) == 2  # warm: decoded, not held
    calls.clear()
    # a memory_limit of 512 MiB and a store whose rows would take more than a quarter of it (the
    # held-per-disk-byte factor raised so that this small store counts as that big)
    on_disk = sum(s for s, _m in files.scan(d)[0].values())
    monkeypatch.setattr(files, "HELD_PER_DISK_BYTE", (files.HOLD_SHARE * 512 * 2 ** 20) // on_disk + 1)
    with db.Trace(d, memory_limit="512MiB") as tr:
        tr.refresh()
        assert calls == [] and tr.query("SELECT count(*) AS n FROM ttft_breakdown")[0]["n"] >= 2
    monkeypatch.setattr(files, "HELD_PER_DISK_BYTE", (files.HOLD_SHARE * 512 * 2 ** 20) // on_disk - 1)
    with db.Trace(d, memory_limit="512MiB") as tr:  # just under: held
        tr.refresh()
        assert calls == [True]


def test_modules_are_parsed_again_only_when_a_file_changed(tmp_path, monkeypatch):
    src = Path(str(loader._sql_dir()))
    lib = tmp_path / "sql"
    shutil.copytree(src, lib)
    monkeypatch.setattr(loader, "_sql_dir", lambda: lib)
    monkeypatch.setattr(loader, "_read_cache", None)
    first = loader.modules()
    again = loader.modules()
    assert again == first and again is not first                          # a new dict each call
    assert all(again[n] is first[n] for n in first)                       # not parsed again
    f = lib / "coarse.sql"
    text = f.read_text()
    f.write_text(text + "\n-- edited\n")
    st = f.stat()
    future = st.st_mtime_ns + 10**9
    os.utime(f, ns=(future, future))
    edited = loader.modules()
    assert edited["coarse"].text.endswith("-- edited\n") and edited["coarse"] is not first["coarse"]
    assert edited["clock"] is not first["clock"] and edited["clock"] == first["clock"]
    (lib / "zz_extra.sql").write_text("-- module: zz_extra\nCREATE OR REPLACE VIEW zz_extra AS SELECT 1 AS x;\n")
    assert "zz_extra" in loader.modules() and "zz_extra" not in edited
