"""pdtrace.analysis.open: the one way programs open a trace (cache, fallback, read-only, refresh, skipped files)."""
import subprocess
import sys

import duckdb
import pytest

from pdtrace import analysis
from pdtrace.analysis import cache as cachemod, db
from pdtrace.analysis.sandbox import ReadOnlyError
from test_ttft_cases import _case_a, _case_h

_Q = "SELECT * EXCLUDE (rkey) FROM ttft_breakdown ORDER BY request_id"


def test_answers_are_the_engines_and_the_cache_is_the_default_file(tmp_path, cache_dir):
    d = tmp_path / "s"
    _case_a().write(d)
    with db.open_trace(d) as tr:
        want = tr.query(_Q)
    with analysis.open(d) as s:
        assert s.query(_Q) == want and len(want) == 3
        assert s.cache_path == cachemod.default_cache_path(d) and s.cache_path.exists()
        assert not s.cache_locked and s.version == 1 and s.last_refresh.rebuilt
        assert list(s.df(_Q)["request_id"]) == [r["request_id"] for r in want]
    with analysis.open(d, cache=None) as s:           # in memory: no file, same answers
        assert s.cache_path is None and s.query(_Q) == want


def test_a_locked_cache_falls_back_to_memory(tmp_path, cache_dir):
    d = tmp_path / "s"
    _case_a().write(d)
    path = cachemod.default_cache_path(d)
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(60)", str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with analysis.open(d) as s:
            assert s.cache_locked and s.cache_path is None
            assert len(s.query(_Q)) == 3
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("sql", ["CREATE TABLE t AS SELECT 1", "DELETE FROM _files", "SET threads = 1",
                                 "COPY (SELECT 1) TO '{d}/x.csv'", "ATTACH '{tmp}/x.duckdb' AS x"])
def test_a_read_only_session_runs_queries_only(tmp_path, cache_dir, sql):
    d = tmp_path / "s"
    n_files = len(_case_a().write(d))
    with analysis.open(d) as s:
        with pytest.raises(ReadOnlyError, match="only queries are allowed"):
            s.execute(sql.format(d=d, tmp=tmp_path))
        assert s.query("SELECT count(*) AS n FROM _files WHERE ok")[0]["n"] == n_files   # nothing deleted
        assert s.query("SELECT count(*) AS n FROM duckdb_tables() WHERE table_name = 't'")[0]["n"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-root", "s"]


def test_a_one_look_session_reads_the_absorbed_store_files_only(tmp_path, cache_dir):
    """pdtrace sql, report, check: after its refresh the session is locked down -- the cache reopened
    read-only, only the absorbed store files readable (not the run's other files in the same
    directory), the configuration locked; it refreshes no more."""
    d = tmp_path / "s"
    paths = _case_a().write(d)
    (d / "run.json").write_text('{"secret": 1}')
    (tmp_path / "outside.parquet").write_bytes(paths[0].read_bytes())
    with analysis.open(d) as s:
        assert s.query(f"SELECT count(*) AS n FROM read_parquet('{paths[0]}')")[0]["n"] > 0
        for q in (f"SELECT * FROM read_json('{d / 'run.json'}')", f"SELECT * FROM glob('{d}/*')",
                  f"SELECT count(*) FROM read_parquet('{tmp_path / 'outside.parquet'}')"):
            with pytest.raises(duckdb.PermissionException):
                s.query(q)
        assert s.query("SELECT current_setting('lock_configuration') AS v")[0]["v"] is True
        with pytest.raises(ReadOnlyError):                  # the cursor execute returns checks what runs next
            s.execute("SELECT 1").execute("CREATE TABLE t AS SELECT 1")
        with pytest.raises(RuntimeError, match="one look"):
            s.refresh()


def test_a_live_session_reads_files_under_the_trace_directory_only(tmp_path, cache_dir):
    d = tmp_path / "s"
    paths = _case_a().write(d)
    (tmp_path / "outside.parquet").write_bytes(paths[0].read_bytes())
    with analysis.open(d, live=True) as s:
        assert s.query(f"SELECT count(*) AS n FROM read_parquet('{paths[0]}')")[0]["n"] > 0
        with pytest.raises(duckdb.PermissionException):
            s.query(f"SELECT count(*) FROM read_parquet('{tmp_path / 'outside.parquet'}')")
        with pytest.raises(ReadOnlyError):
            s.execute("SELECT 1").execute("CREATE TABLE t AS SELECT 1")
    with analysis.open(d, read_only=False) as s:      # a tool's session: any statement, any file
        s.execute("CREATE TEMP TABLE t AS SELECT 1 AS a")
        assert s.query(f"SELECT count(*) AS n FROM read_parquet('{tmp_path / 'outside.parquet'}')")[0]["n"] > 0


@pytest.mark.parametrize("live", [False, True])
def test_a_store_of_symlinks_is_read(tmp_path, cache_dir, live):
    """Store files that are symlinks to another directory (a shared volume mounted elsewhere) are
    absorbed and queried, in both kinds of session."""
    real = tmp_path / "real"
    _case_a().write(real)
    d = tmp_path / "links"
    d.mkdir()
    for f in real.iterdir():
        (d / f.name).symlink_to(f)
    with db.open_trace(real) as tr:
        want = tr.query(_Q)
    with analysis.open(d, live=live) as s:
        assert s.skipped == [] and s.query(_Q) == want


def test_refresh_absorbs_new_files_and_bumps_the_version(tmp_path, cache_dir):
    d = tmp_path / "s"
    _case_a().write(d, prefix="a-")
    with analysis.open(d, live=True) as s:
        assert s.version == 1 and len(s.query(_Q)) == 3
        assert s.refresh() is False and s.version == 1       # nothing new
        _case_h().write(d, prefix="h-")
        assert s.refresh() is True and s.version == 2
        assert len(s.query(_Q)) == 4 and len(s.last_refresh.new) > 0


def test_skipped_files_are_listed_not_warned(tmp_path, cache_dir, recwarn):
    d = tmp_path / "s"
    _case_a().write(d)
    (d / "broken.parquet").write_bytes(b"PAR1 not a parquet file")
    with analysis.open(d) as s:
        assert [p for p, _ in s.skipped] == [str(d / "broken.parquet")]
        assert len(s.query(_Q)) == 3
    assert not [w for w in recwarn if issubclass(w.category, Warning) and "broken" in str(w.message)]


def test_a_missing_directory(tmp_path, cache_dir):
    d = tmp_path / "later"
    with pytest.raises(FileNotFoundError):
        analysis.open(d)
    s = analysis.open(d, live=True, missing_ok=True)
    assert not s.exists and s.refresh() is False
    with pytest.raises(FileNotFoundError):
        s.cursor()
    _case_a().write(d)
    assert s.refresh() is True and len(s.query(_Q)) == 3
    s.close()
