"""A small store's rows held in memory (:func:`pdtrace.analysis.files.hold_rows`): read once per
refresh or per read-only cursor, the same answers as reading the files in place; and the SQL
library parsed once per process (:func:`pdtrace.analysis.loader.modules`)."""
import os
import shutil
from pathlib import Path

from pdtrace.analysis import db, files, loader, sandbox
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


def test_read_only_cursors_hold_the_rows_and_fall_back_when_a_file_vanished(tmp_path):
    """A cursor of a locked-down connection over a small store holds its rows (the connection itself
    does not: temporary tables are per DuckDB connection); the in-place views answer the same as
    without a hold; a store file deleted after the refresh leaves the cursor reading in place, so the
    views that do not read it still answer."""
    d = tmp_path / "s"
    _write(d, [("a", _case_a), ("e", _case_e)])
    cache = tmp_path / "c.duckdb"
    with db.Trace(d, cache=cache) as tr:
        tr.refresh()
    spans = "SELECT * FROM spans ORDER BY record_id"
    # one read-only connection at a time: DuckDB shares one instance per file in a process, and
    # its configuration is locked by the first lock_down
    plain = sandbox.connect_readonly(cache, hold=False)
    try:
        c0 = plain.cursor()
        assert c0.execute(_HELD).fetchone()[0] == 0
        want = c0.execute(spans).fetchall()
        transfers = sorted(map(repr, c0.execute("SELECT * FROM transfers").fetchall()))
        bd = c0.execute("SELECT * FROM ttft_breakdown ORDER BY request_id").fetchall()
        c0.close()
    finally:
        plain.close()
    assert want and bd
    held = sandbox.connect_readonly(cache)
    try:
        c1 = held.cursor()
        assert c1.execute(_HELD).fetchone()[0] == 1 and held.execute(_HELD).fetchone()[0] == 0
        assert c1.execute(spans).fetchall() == want
        assert sorted(map(repr, c1.execute("SELECT * FROM transfers").fetchall())) == transfers
        victim = sorted(d.glob("e-*.parquet"))[0]
        victim.unlink()
        c2 = held.cursor()                                               # cannot read it: not held
        assert c2.execute(_HELD).fetchone()[0] == 0
        assert c2.execute("SELECT * FROM ttft_breakdown ORDER BY request_id").fetchall() == bd
        assert c1.execute(spans).fetchall() == want                      # held before: still answers
        c1.close()
        c2.close()
    finally:
        held.close()


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
