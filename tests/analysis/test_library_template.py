"""A new cache file starts as a copy of the installed SQL library (db.library_template), with the same answers."""
import os

import duckdb
import pytest

from pdtrace.analysis import db
from test_ttft_cases import _case_a, _case_h

_Q = "SELECT * EXCLUDE (rkey) FROM ttft_breakdown ORDER BY request_id"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache-root"
    monkeypatch.setenv("PDTRACE_CACHE_DIR", str(root))
    return root


def _store(tmp_path, name="s"):
    d = tmp_path / name
    _case_a().write(d, prefix="a-")
    _case_h().write(d, prefix="h-")
    return d


def _answers_in_memory(d):
    with db.open_trace(d) as tr:
        return tr.query(_Q)


def test_first_cache_builds_the_template_and_later_caches_copy_it(tmp_path, cache_dir):
    d = _store(tmp_path)
    tpl = db.library_template()
    assert tpl.parent == cache_dir and not tpl.exists()
    with db.Trace(d, cache=tmp_path / "one.duckdb") as tr:
        assert tr.refresh().rebuilt
        first = tr.query(_Q)
    assert tpl.exists()
    built = tpl.stat().st_mtime_ns
    with db.Trace(d, cache=tmp_path / "two.duckdb") as tr:
        r = tr.refresh()
        assert r.rebuilt and r.dirty_requests == 4          # a copy has nothing absorbed: a full build
        assert tr.query(_Q) == first == _answers_in_memory(d)
    assert tpl.stat().st_mtime_ns == built                   # copied, not rebuilt
    # the template itself never receives data: still the bare library
    con = duckdb.connect(str(tpl), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM _files").fetchone()[0] == 0
        assert con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()[0] == db._stamp()
    finally:
        con.close()
    assert sorted(p.name for p in cache_dir.iterdir()) == [tpl.name]   # no temporary file left


def test_a_corrupt_template_is_replaced_and_costs_no_answer(tmp_path, cache_dir):
    d = _store(tmp_path)
    tpl = db.library_template()
    tpl.parent.mkdir(parents=True, exist_ok=True)
    tpl.write_bytes(b"not a duckdb file" * 100)
    with db.Trace(d, cache=tmp_path / "one.duckdb") as tr:
        tr.refresh()
        assert tr.query(_Q) == _answers_in_memory(d)
    assert not tpl.exists() or tpl.read_bytes()[:17] != b"not a duckdb file"
    with db.Trace(d, cache=tmp_path / "two.duckdb") as tr:       # the next new cache builds a sound one
        tr.refresh()
        assert tr.query(_Q) == _answers_in_memory(d)
    assert tpl.exists() and tpl.read_bytes()[:17] != b"not a duckdb file"


def test_no_template_where_none_can_be_written(tmp_path, monkeypatch):
    """The cache root cannot be created (a file is in the way): the library is installed into the
    cache file itself, as before templates existed."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    monkeypatch.setenv("PDTRACE_CACHE_DIR", str(blocker / "root"))
    d = _store(tmp_path)
    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        assert tr.refresh().rebuilt
        assert tr.query(_Q) == _answers_in_memory(d)
    assert blocker.read_text() == "a file, not a directory"


def test_an_existing_cache_file_is_never_replaced_by_the_template(tmp_path, cache_dir):
    """A cache that appeared meanwhile (another process created it) is opened, not overwritten."""
    d = _store(tmp_path)
    cache = tmp_path / "c.duckdb"
    with db.Trace(d, cache=cache) as tr:
        tr.refresh()
    inode = os.stat(cache).st_ino
    assert db._copy_template(cache, db._stamp()) is False
    assert os.stat(cache).st_ino == inode
    with db.Trace(d, cache=cache) as tr:
        assert not tr.refresh().rebuilt                      # still the absorbed cache
