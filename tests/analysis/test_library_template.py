"""A new cache file starts as a copy of the installed SQL library (cache.library_template), with the same answers."""
import os
import subprocess
import sys

import duckdb
import pytest

from pdtrace.analysis import cache as cachemod, db
from test_ttft_cases import _case_a, _case_h

_Q = "SELECT * EXCLUDE (rkey) FROM ttft_breakdown ORDER BY request_id"


def _store(tmp_path, name="s"):
    d = tmp_path / name
    _case_a().write(d, prefix="a-")
    _case_h().write(d, prefix="h-")
    return d


@pytest.fixture
def installs(monkeypatch):
    """The stamps of every library load (cache.install) from now on, in order; the loads still run."""
    seen = []
    real_install = cachemod.install
    monkeypatch.setattr(cachemod, "install", lambda con, stamp: (seen.append(stamp), real_install(con, stamp)))
    return seen


def _answers_in_memory(d):
    with db.open_trace(d) as tr:
        return tr.query(_Q)


def test_first_cache_builds_the_template_and_later_caches_copy_it(tmp_path, cache_dir, installs):
    d = _store(tmp_path)
    tpl = cachemod.library_template()
    assert tpl.parent == cache_dir and not tpl.exists()
    with db.Trace(d, cache=tmp_path / "one.duckdb") as tr:
        assert tr.refresh().rebuilt
        first = tr.query(_Q)
    assert tpl.exists() and len(installs) == 1              # into the template, not into the cache
    built = tpl.stat().st_mtime_ns
    with db.Trace(d, cache=tmp_path / "two.duckdb") as tr:
        r = tr.refresh()
        assert r.rebuilt and r.dirty_requests == 4          # a copy has nothing absorbed: a full build
        assert tr.query(_Q) == first
    assert tpl.stat().st_mtime_ns == built and len(installs) == 1     # copied, not rebuilt or installed
    # the template itself never receives data: still the bare library
    con = duckdb.connect(str(tpl), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM _files").fetchone()[0] == 0
        assert con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()[0] == cachemod.library_stamp()
    finally:
        con.close()
    # the template and its checksum, no temporary file left (here or beside the caches)
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([tpl.name, tpl.with_suffix(".sha256").name])
    assert not list(tmp_path.glob("*.tmp*"))
    # in memory: a copy of the same template, the same answers, nothing more in the cache root
    assert _answers_in_memory(d) == first
    assert len(installs) == 1 and tpl.stat().st_mtime_ns == built
    assert len(list(cache_dir.iterdir())) == 2


def test_a_memory_database_builds_the_template_and_copies_it(tmp_path, cache_dir, installs):
    """The first in-memory analysis builds the template (one install, into the template); later ones,
    and cache files, copy it; every answer and the library's catalog (views, macros, columns with their
    comments) equal a database the modules were loaded into."""
    d = _store(tmp_path)
    tpl = cachemod.library_template()
    a = _answers_in_memory(d)
    assert tpl.exists() and len(installs) == 1
    assert _answers_in_memory(d) == a and len(installs) == 1
    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        tr.refresh()
        assert tr.query(_Q) == a and len(installs) == 1
    loaded = duckdb.connect()
    cachemod.install(loaded, cachemod.library_stamp())
    cat = ("SELECT table_name, column_name, data_type, comment FROM duckdb_columns() "
           "WHERE database_name = current_database() ORDER BY ALL",
           "SELECT function_name, macro_definition, parameters::VARCHAR, comment FROM duckdb_functions() "
           "WHERE database_name = current_database() AND NOT internal ORDER BY ALL",
           "SELECT view_name, comment FROM duckdb_views() WHERE database_name = current_database() "
           "AND NOT internal ORDER BY ALL")
    with db.Trace(d) as tr:
        for q in cat:
            assert tr.con.execute(q).fetchall() == loaded.execute(q).fetchall(), q


def test_a_memory_database_without_a_template_installs_the_library(tmp_path, monkeypatch, installs):
    """A cache root that cannot be created: no template, the modules are loaded as before, same answers."""
    d = _store(tmp_path)
    want = _answers_in_memory(d)
    installs.clear()                                          # count from here
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("PDTRACE_CACHE_DIR", str(blocker / "root"))
    assert _answers_in_memory(d) == want and len(installs) == 1


def test_a_corrupt_template_is_replaced_and_costs_no_answer(tmp_path, cache_dir):
    d = _store(tmp_path)
    tpl = cachemod.library_template()
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


def test_a_damaged_template_is_rebuilt_before_it_is_copied(tmp_path, cache_dir):
    """Bytes of the template changed after it was built (a disk error, a crash before the data
    reached the disk): the checksum no longer matches, so it is built again, never copied."""
    d = _store(tmp_path)
    with db.Trace(d, cache=tmp_path / "one.duckdb") as tr:
        tr.refresh()
    tpl = cachemod.library_template()
    data = bytearray(tpl.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    tpl.write_bytes(bytes(data))
    with db.Trace(d, cache=tmp_path / "two.duckdb") as tr:
        tr.refresh()
        assert tr.query(_Q) == _answers_in_memory(d)
    assert tpl.read_bytes() != bytes(data)


def test_an_existing_cache_file_is_never_replaced_by_the_template(tmp_path, cache_dir):
    """A cache that appeared meanwhile (another process created it) is opened, not overwritten."""
    d = _store(tmp_path)
    cache = tmp_path / "c.duckdb"
    with db.Trace(d, cache=cache) as tr:
        tr.refresh()
    inode = os.stat(cache).st_ino
    assert cachemod.new_from_template(cache, cachemod.library_stamp()) is False
    assert os.stat(cache).st_ino == inode
    with db.Trace(d, cache=cache) as tr:
        assert not tr.refresh().rebuilt                      # still the absorbed cache


def test_a_copy_locked_by_another_process_is_reported_not_removed(tmp_path, cache_dir, monkeypatch):
    """Another process opens the new cache between the copy and this process's connect (it lost the
    race to create it, then opened it): this process gets DuckDB's lock error -- what the CLI and the
    dashboard fall back to memory on -- and the other process's file and the template stay."""
    d = _store(tmp_path)
    cache = tmp_path / "c.duckdb"
    holder = []
    real = cachemod.new_from_template

    def copy_then_lock(path, stamp):
        made = real(path, stamp)
        p = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
                              "print('held', flush=True); time.sleep(60)", str(path)],
                             stdout=subprocess.PIPE, text=True)
        holder.append(p)
        assert p.stdout.readline().strip() == "held"
        return made

    monkeypatch.setattr(cachemod, "new_from_template", copy_then_lock)
    try:
        with pytest.raises(duckdb.IOException):
            db.Trace(d, cache=cache)
        inode = os.stat(cache).st_ino
    finally:
        for p in holder:
            p.kill()
            p.wait()
    assert cachemod.library_template().exists() and os.stat(cache).st_ino == inode
    monkeypatch.setattr(cachemod, "new_from_template", real)
    with db.Trace(d, cache=cache) as tr:                     # the file is sound: its first refresh builds
        assert tr.refresh().rebuilt
        assert tr.query(_Q) == _answers_in_memory(d)


def test_a_refused_memory_copy_is_dropped_and_the_library_installed(tmp_path, cache_dir, monkeypatch, installs):
    """A template whose copy fails its check (a stamp another library wrote, say): the half-filled memory
    connection is dropped, the template too, the modules are loaded into a new one; same answers."""
    d = _store(tmp_path)
    want = _answers_in_memory(d)                              # builds the template
    installs.clear()                                          # count from here
    tpl = cachemod.library_template()
    assert tpl.exists()
    monkeypatch.setattr(cachemod, "_stamp_check", lambda stamp: (lambda con: False))
    assert _answers_in_memory(d) == want
    assert len(installs) == 1 and not tpl.exists()           # loaded into the new connection; template dropped
    assert not list(cache_dir.glob("*.tmp*"))                 # the private copy removed
