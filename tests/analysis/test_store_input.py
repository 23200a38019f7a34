"""Bad input: bad files skipped and named, duplicates counted once, views documented, read-only queries."""
import json
import shutil
import warnings
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdtrace.analysis import db, files, loader, sandbox
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
    with pytest.warns(files.SkippedFileWarning) as rec:
        tr = db.open_trace(d)
    msgs = " ".join(str(w.message) for w in rec)
    for n in ("empty.parquet", "truncated.parquet", "foreign.parquet", "newer.parquet"):
        assert n in msgs
    assert "major 2" in msgs
    skipped = tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"]
    assert skipped == 4
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    tr.close()


def _corrupt_first_page(path, column=0):
    """Overwrite the first data page header of ``column`` (index) in ``path``: the footer stays sound."""
    off = pq.ParquetFile(path).metadata.row_group(0).column(column).data_page_offset
    b = bytearray(path.read_bytes())
    b[off:off + 64] = b"\xff" * 64
    path.write_bytes(bytes(b))


def _column_index(path, name):
    return pq.ParquetFile(path).schema_arrow.names.index(name)


_P9 = {"role": "prefill", "engine_id": "p9", "host": "h", "pid": 9}


def _p9_rows(n=2000, first=0):
    """n prefill.compute spans of requests z<first>.. on engine p9 (a file of case H's store's size or larger)."""
    return [{"name": "prefill.compute", "request_id": f"z{i}", "span_id": 10_000 + i,
             "start_ns": 10**9 + i, "end_ns": 10**9 + i + 5} for i in range(first, first + n)]


def _assert_whole(tr):
    """Every file read: none skipped, the 2000 p9 spans (_p9_rows) and case H's TTFT (4070 ms) there."""
    assert tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"] == 0
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 2000
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070


@pytest.fixture
def decoded(monkeypatch):
    """Every path files.decode_error was asked to decode, in order (the real function runs)."""
    seen = []
    real = files.decode_error

    def spy(paths, *settings):
        seen.extend(paths)
        return real(paths, *settings)

    monkeypatch.setattr(files, "decode_error", spy)
    return seen


def _sandbox(tr, d):
    """The dashboard's file sandbox on a Trace's connection (dashboard/data.py): only ``d`` is readable."""
    tr.con.execute("SET allowed_directories = ?", [[str(d.resolve()) + "/"]])
    tr.con.execute("SET enable_external_access = false")


@pytest.mark.parametrize("column", ["record", "status_code"])
@pytest.mark.parametrize("setup", ["in-memory", "cache-file", "sandboxed"])
def test_a_file_with_corrupt_data_is_skipped_and_named(tmp_path, setup, column, decoded):
    """A store file whose footer is sound but whose data pages are not (bit rot, a bad copy), in a
    column every refresh reads (record) or one it never reads (status_code: only queries of spans do):
    the refresh that meets it skips it and names it once, decodes only the new file to find it, and
    every other file is analysed; the connection keeps its settings (the dashboard's sandbox)."""
    d = tmp_path / "s"
    _case_h().write(d)
    cache = tmp_path / "c.duckdb" if setup == "cache-file" else None
    tr = db.Trace(d, cache=cache)
    if setup == "sandboxed":
        _sandbox(tr, d)
    tr.refresh()
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    decoded.clear()
    bad = store.write_rows(d, _p9_rows(), resource=_P9, name="p9-late.parquet")
    _corrupt_first_page(bad, _column_index(bad, column))
    assert store.check_file(bad).ok  # only the data is bad
    with pytest.warns(files.SkippedFileWarning) as rec:
        r = tr.refresh()
    assert [str(w.message).split(":")[0] for w in rec] == [f"skipped store file {bad}"]  # named once
    assert "corrupt data: " in str(rec[0].message)
    assert set(decoded) == {str(bad)}  # only the refresh's new file was decoded, not the store
    assert r.skipped and r.skipped[0][0] == str(bad) and not r.rebuilt and r.new == []
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    assert tr.query("SELECT count(*) AS n FROM spans WHERE status_code = 0")[0]["n"] > 0  # spans still query
    skipped = tr.query("SELECT path, reason FROM store_files WHERE NOT ok")
    assert [s["path"] for s in skipped] == [str(bad)] and skipped[0]["reason"].startswith("corrupt data: ")
    if setup == "sandboxed":  # the sandbox is still in force: a file outside the trace dir is refused
        outside = store.write_rows(tmp_path / "elsewhere", _p9_rows(3), resource=_P9, name="x.parquet")
        with pytest.raises(duckdb.PermissionException):
            tr.con.execute("SELECT count(*) FROM read_parquet(?)", [str(outside)]).fetchall()
    if setup == "cache-file":  # a later run on the same cache remembers the file: skipped, not decoded again
        tr.close()
        decoded.clear()
        tr = db.Trace(d, cache=cache)
        with pytest.warns(files.SkippedFileWarning, match="corrupt data"):
            r = tr.refresh()
        assert not r.rebuilt and r.new == [] and [p for p, _ in r.skipped] == [str(bad)]
        assert decoded == []
        assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    # the file is rewritten whole: read again, and its requests appear
    store.write_rows(d, _p9_rows(), resource=_P9, name="p9-late.parquet")
    tr.refresh()
    _assert_whole(tr)
    tr.close()


def test_a_corrupt_file_in_a_cold_build_is_skipped(tmp_path):
    """The first refresh of a directory that already holds a corrupt file: skipped and named, the rest analysed."""
    d = tmp_path / "s"
    _case_h().write(d)
    bad = store.write_rows(d, _p9_rows(), resource=_P9, name="p9-late.parquet")
    _corrupt_first_page(bad)
    with pytest.warns(files.SkippedFileWarning, match="p9-late.parquet: corrupt data"):
        tr = db.open_trace(d)
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 0
    tr.close()


def test_a_file_that_cannot_be_opened_is_not_called_corrupt(tmp_path, child):
    """Failing to open a file says nothing about its bytes: a file gone, and a sound file
    while the process is out of file descriptors (a real EMFILE: the soft RLIMIT_NOFILE lowered to 0,
    which leaves the open descriptors alone) are not 'corrupt data'. The limit is lowered in a
    child interpreter: in the pytest process it would starve every other thread for the while."""
    sound = store.write_rows(tmp_path, _p9_rows(10), resource=_P9, name="p9.parquet")
    assert files.decode_error([str(tmp_path / "gone.parquet")])[0] == "unknown"
    r = child(f"""
        import json, resource, duckdb
        from pdtrace.analysis import files
        sound = {str(sound)!r}
        con = duckdb.connect()  # opened before the limit: decoding needs no new connection's descriptors
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))  # open descriptors stay; every new open: EMFILE
        try:
            try:
                con.execute("SELECT count(*) FROM read_parquet(?)", [sound]).fetchall()
                raised = None
            except duckdb.Error as exc:
                raised = [type(exc).__name__, bool(files.access_error(exc)), str(exc)]
            errors = {{k: list(v) for k, v in files.decode_errors([sound]).items()}}
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            con.close()
        print(json.dumps({{"raised": raised, "errors": errors}}))
        """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["raised"] and out["raised"][1], out  # the read failed, and as an access error
    assert out["errors"] == {str(sound): ["unknown", "IOException"]}  # not blamed
    assert files.decode_error([str(sound)]) == ("sound", "")  # and the file itself is sound


def _part_name(seq, kind="p"):
    """A file name as the sink writes it (``store.PART_FILE``): a part (kind p) or a segment (s)."""
    return f"prefill-h-9-20261202T000000-{kind}{seq:06d}.parquet"


def test_part_files_are_named_by_the_sinks_pattern():
    assert store.is_part_file(_part_name(3)) and not store.is_part_file(_part_name(4, "s"))
    assert store.is_part_file("prefill-h-9-20261202T014026r2-p000001.parquet")  # a restarted sink
    assert store.is_part_file("prefill-h-9-20261202T014026-p1000000.parquet")  # past a million parts
    assert not store.is_part_file("a-prefill-p1.parquet")  # an engine named p1 is not a part


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_file_compacted_away_while_read_does_not_fail_the_refresh(tmp_path, warm):
    """The recorder deletes its part files once merged into a segment, so a file listed by a
    refresh can be gone when DuckDB opens it. The deletion here is real, but forced right after
    the listing (a subclass of Trace deletes the part in scan()) instead of waiting for the race.
    The refresh lists the directory again and analyses what is there."""
    d = tmp_path / "s"
    _case_h().write(d)
    armed = [not warm]
    part = d / _part_name(1)

    class CompactedWhileRead(db.Trace):
        def scan(self):
            listed = super().scan()
            if armed[0] and part.exists():
                part.unlink()  # compaction: the part is gone once listed
            return listed

    with CompactedWhileRead(d) as tr:
        if warm:
            tr.refresh()
            armed[0] = True
        store.write_rows(d, _p9_rows(50), resource=_P9, name=part.name)
        r = tr.refresh()
        assert r.skipped == [] and r.rebuilt == (not warm)
        assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
        assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 0
        assert str(part) not in {x["path"] for x in tr.query("SELECT path FROM store_files")}
        armed[0] = False  # the part comes back (a new flush): absorbed
        store.write_rows(d, _p9_rows(50), resource=_P9, name=part.name)
        tr.refresh()
        assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 50


@pytest.mark.parametrize("warm", [False, True], ids=["rebuild", "backlog"])
def test_a_long_refresh_does_not_race_compaction(tmp_path, warm, decoded):
    """A long refresh -- a rebuild of a live store (70 s for 1M requests), or a dashboard catching up
    on a backlog -- outlasts the recorder's rotation (60 s), so parts are compacted while it runs,
    every time. Here each pass that reads a segment meets a real compaction (the parts merged into
    a segment, then deleted, during the pass) and a new part: the long pass reads the segments
    only, the parts come in a short pass of their own, and the refresh neither fails nor loses or
    double-counts a row."""
    d = tmp_path / "s"
    _case_h().write(d)
    seq = [0]

    def flush(n=100):
        seq[0] += 1
        return store.write_rows(d, _p9_rows(n, first=seq[0] * 1000), resource=_P9, name=_part_name(seq[0]))

    def compact():
        parts = sorted(p for p in d.glob("prefill-h-9-*.parquet") if store.is_part_file(p))
        seq[0] += 1
        store.write_tables(d, [pq.read_table(p) for p in parts], _part_name(seq[0], "s"))
        for p in parts:
            p.unlink()

    class LiveStore(db.Trace):
        passes = []
        armed = True

        def _absorb(self, new, gone, good, cold):
            self.passes.append(sorted("part" if store.is_part_file(p) else "other" for p in new))
            if self.armed and len(self.passes) == 1:  # the long pass: the recorder compacts and flushes meanwhile
                compact()
                flush()
            return super()._absorb(new, gone, good, cold)

    tr = LiveStore(d)
    if warm:
        tr.armed = False
        tr.refresh()
        tr.passes.clear()
        tr.armed = True
    for _ in range(3):
        flush()
    compact()
    flush()
    flush()
    r = tr.refresh()
    assert r.rebuilt == (not warm) and r.skipped == []
    # the segments (and case H's files when rebuilding), then what is new since: the segment the
    # compaction wrote during the first pass and the part flushed after it; no retry
    assert tr.passes == [["other"] * (4 if not warm else 1), ["other", "part"]]
    n_store = sum(pq.read_metadata(p).num_rows for p in d.glob("prefill-h-9-*.parquet"))
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == n_store == 600
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    assert tr.query("SELECT count(*) AS n FROM requests")[0]["n"] == 601
    assert r.dirty_requests == (601 if not warm else 600)  # each request once, though two passes ran
    assert len(decoded) == len(set(decoded))  # no file decoded twice (deferred parts wait for their pass)
    tr.close()


def test_after_a_failed_refresh_spans_fail_loudly_not_short(tmp_path):
    """Views read the store's files in place. A part absorbed earlier is compacted away, then a refresh
    fails (a real out-of-memory error) and is rolled back: ``spans`` names the missing file rather
    than answering without its rows (a rebuilt ``_records`` with the old duplicate list hid both
    copies of every compacted record), and the next refresh that succeeds answers in full."""
    d = tmp_path / "s"
    _case_h().write(d)
    part = store.write_rows(d, _p9_rows(50), resource=_P9, name=_part_name(1))
    tr = db.Trace(d)
    tr.refresh()
    store.write_tables(d, [pq.read_table(part)], _part_name(2, "s"))
    tr.refresh()  # the segment holds copies of the part's records: the part's are shown
    part.unlink()
    store.write_rows(d, _p9_rows(5, first=5000), resource=_P9, name="p9-late.parquet")
    used = tr.con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()[0]
    tr.con.execute(f"SET memory_limit = '{used // 1024 + 512}KB'")
    with pytest.raises(duckdb.OutOfMemoryException):
        tr.refresh()
    tr.con.execute("RESET memory_limit")
    with pytest.raises(duckdb.IOException, match=part.name):
        tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")
    tr.refresh()
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 55
    tr.close()


def test_an_absorbed_file_replaced_by_a_directory_is_gone(tmp_path):
    """A directory named like a store file is not a store file: never listed, never warned about; an
    absorbed file replaced by one is gone (before, it blocked every later refresh)."""
    d = tmp_path / "s"
    _case_h().write(d)
    seg = store.write_rows(d, _p9_rows(20), resource=_P9, name=_part_name(1, "s"))
    (d / "nested.parquet").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = db.open_trace(d)
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 20
    seg.unlink()
    seg.mkdir()
    r = tr.refresh()
    assert r.gone == [str(seg)] and r.skipped == []
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 0
    assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070
    tr.close()


def test_parts_are_deferred_once_even_when_the_other_new_files_cannot_be_decoded(tmp_path, monkeypatch):
    """A new segment whose decode keeps answering 'unknown' (say, EMFILE every time: not something a
    test can cause on demand, so the decode check is replaced for that one file, and the stand-in
    stops the test after 50 calls instead of hanging) while a new part waits: the part is deferred
    once, then absorbed; the segment is left out, unblamed. Before, the refresh deferred the part
    forever."""
    d = tmp_path / "s"
    _case_h().write(d)
    tr = db.Trace(d)
    tr.refresh()
    seg = store.write_rows(d, _p9_rows(10), resource=_P9, name=_part_name(1, "s"))
    part = store.write_rows(d, _p9_rows(10, first=100), resource=_P9, name=_part_name(2))
    real, calls = files.decode_error, []

    def unknown_for_the_segment(paths, *settings):
        calls.append(paths)
        assert len(calls) < 50, "refresh loops"
        return ("unknown", "IOException") if str(seg) in paths else real(paths, *settings)

    monkeypatch.setattr(files, "decode_error", unknown_for_the_segment)
    with pytest.warns(files.SkippedFileWarning, match="unreadable now"):
        r = tr.refresh()
    assert r.new == [str(part)] and [p for p, _ in r.skipped] == [str(seg)]
    assert tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"] == 10
    tr.close()


def test_a_refresh_without_file_descriptors_blames_no_file(tmp_path, child):
    """While the process is out of file descriptors (a real EMFILE: soft RLIMIT_NOFILE 0) a refresh
    cannot even list the directory: it raises, blames no file and changes nothing; the next one
    absorbs the new file. (The decode check's own answer under EMFILE, 'unknown', is tested in
    test_a_file_that_cannot_be_opened_is_not_called_corrupt.) In a child interpreter, as there."""
    d = tmp_path / "s"
    _case_h().write(d)
    r = child(f"""
        import json, resource, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pdtrace.analysis import db
        from pdtrace.instrument import store
        from test_store_input import _p9_rows, _P9
        d = {str(d)!r}
        tr = db.Trace(d)
        tr.refresh()
        late = store.write_rows(d, _p9_rows(), resource=_P9, name="p9-late.parquet")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
        try:
            try:
                tr.refresh()
                raised = None
            except OSError as exc:
                raised = type(exc).__name__
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        out = {{"raised": raised,
               "blamed": tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"],
               "requests": tr.query("SELECT count(*) AS n FROM requests")[0]["n"]}}
        r = tr.refresh()
        out.update(new=r.new, skipped=r.skipped, late=str(late),
                   p9_spans=tr.query("SELECT count(*) AS n FROM spans WHERE engine_id = 'p9'")[0]["n"])
        tr.close()
        print(json.dumps(out))
        """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["raised"] is not None, out  # an OSError
    assert out["blamed"] == 0 and out["requests"] == 1  # no file blamed; case H kept
    assert out["new"] == [out["late"]] and out["skipped"] == [] and out["p9_spans"] == 2000


def test_a_part_gone_between_listing_and_check_is_not_a_bad_file(tmp_path, monkeypatch):
    """The listing names a part the recorder deletes a moment later (a real deletion, forced right
    after the listing): not a bad file, no warning, simply not there."""
    d = tmp_path / "s"
    _case_h().write(d)
    part = store.write_rows(d, _p9_rows(5), resource=_P9, name=_part_name(1))
    real = store.store_files

    def listing_then_compaction(directory):
        listed = real(directory)
        if part.exists():
            part.unlink()
        return listed

    monkeypatch.setattr(store, "store_files", listing_then_compaction)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = db.open_trace(d)
    assert not part.exists() and store.check_file(part).unreadable
    assert tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"] == 0
    tr.close()


def test_files_of_two_schema_minors_decode_in_one_statement(tmp_path, decoded):
    """A newer minor adds columns; the decode check reads the union of the columns, so a store
    mixing minors is still checked in one statement, not file by file."""
    a = store.write_rows(tmp_path, _p9_rows(10), resource=_P9, name="a.parquet")
    t = pq.read_table(a)
    t = t.append_column("new_col", pa.array([1] * t.num_rows, pa.int64()))
    pq.write_table(t.replace_schema_metadata(dict(t.schema.metadata or {})), tmp_path / "0-newer.parquet")
    paths = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    assert store.check_file(paths[0]).ok
    assert files.decode_errors(paths) == {}
    assert decoded == paths  # one statement over both


def test_a_store_without_requests_is_not_rebuilt_on_every_refresh(tmp_path):
    """Engines flush their per-step spans before the first request (a dashboard opened on an idle
    deployment): a refresh with nothing new reads nothing and rebuilds nothing; a new file is
    absorbed incrementally, and a failed refresh (out of memory, for real) keeps what was there."""
    d = tmp_path / "s"
    dec = {"role": "decode", "engine_id": "d0", "host": "h", "pid": 7}
    for k in range(3):
        store.write_rows(d, [{"name": "decode.step", "span_id": 100 * k + i, "start_ns": 10**9 + 1000 * (100 * k + i),
                              "end_ns": 10**9 + 1000 * (100 * k + i) + 500} for i in range(100)],
                         resource=dec, name=f"decode-h-7-T-s{k:06d}.parquet")
    tr = db.Trace(d)
    assert tr.refresh().rebuilt
    r = tr.refresh()
    assert (r.new, r.rebuilt) == ([], False)
    assert tr.query("SELECT count(*) AS n FROM spans")[0]["n"] == 300
    store.write_rows(d, [{"name": "decode.step", "span_id": 999, "start_ns": 2 * 10**9, "end_ns": 2 * 10**9 + 5}],
                     resource=dec, name="decode-h-7-T-s000009.parquet")
    used = tr.con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()[0]
    tr.con.execute(f"SET memory_limit = '{used // 1024 + 512}KB'")
    with pytest.raises(duckdb.OutOfMemoryException):
        tr.refresh()
    tr.con.execute("RESET memory_limit")
    assert tr.query("SELECT count(*) AS n FROM spans")[0]["n"] == 300  # rolled back, not emptied
    r = tr.refresh()
    assert (len(r.new), r.rebuilt) == (1, False)
    assert tr.query("SELECT count(*) AS n FROM spans")[0]["n"] == 301
    tr.close()


class _FailsLate(db.Trace):
    """A Trace whose refresh raises a duckdb.Error late: after the new files were recorded in
    ``_files`` and their request keys read. A stand-in for a failure that cannot be caused for
    real at that point on demand (an interrupt, or memory running out there rather than earlier)."""

    fail = False

    def _refresh_changed(self, cold):
        super()._refresh_changed(cold)
        if self.fail:
            raise duckdb.Error("injected failure after the new files were recorded")


@pytest.mark.parametrize("failure", ["out-of-memory", "late-error"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_refresh_that_fails_not_for_a_file_blames_none_and_loses_nothing(tmp_path, warm, failure):
    """A refresh that fails for a reason other than a file is raised as it is and marks no file
    bad, and the next refresh of the same Trace -- as the dashboard does -- has every file's rows:
    a warm refresh is rolled back whole, a cold build half-done is built again. The out-of-memory
    error is real (a DuckDB memory limit 0.5 MiB above what the database holds: it strikes early);
    the late error is injected (``_FailsLate``)."""
    d = tmp_path / "s"
    _case_h().write(d)
    tr = _FailsLate(d)
    if warm:
        tr.refresh()
    store.write_rows(d, _p9_rows(), resource=_P9, name="p9-late.parquet")
    if failure == "out-of-memory":
        used = tr.con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()[0]
        tr.con.execute(f"SET memory_limit = '{used // 1024 + 512}KB'")
        with pytest.raises(duckdb.OutOfMemoryException):
            tr.refresh()
        tr.con.execute("RESET memory_limit")
    else:
        tr.fail = True
        with pytest.raises(duckdb.Error, match="injected"):
            tr.refresh()
        tr.fail = False
    assert tr.query("SELECT count(*) AS n FROM store_files WHERE NOT ok")[0]["n"] == 0  # no file blamed
    if warm:  # rolled back: the views answer as before the failed refresh
        assert tr.query("SELECT count(*) AS n FROM requests")[0]["n"] == 1
    r = tr.refresh()
    assert r.skipped == [] and r.rebuilt == (not warm)
    _assert_whole(tr)
    assert tr.query("SELECT count(*) AS n FROM requests")[0]["n"] == 2001
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
        warnings.simplefilter("error", files.SkippedFileWarning)
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
    con = sandbox.connect_readonly(cache)
    assert con.execute("SELECT ttft_ms FROM ttft_breakdown").fetchone()[0] == 4070
    out = tmp_path / "out.csv"
    for q in (f"COPY (SELECT 1) TO '{out}'", f"ATTACH '{tmp_path / 'x.duckdb'}' AS x",
              "CREATE TABLE t AS SELECT 1", "DROP VIEW spans", "SET enable_external_access = true",
              f"SELECT * FROM read_csv('{out}')", "INSTALL httpfs", f"EXPORT DATABASE '{tmp_path / 'exp'}'"):
        with pytest.raises(duckdb.Error):
            con.execute(q)
    assert not out.exists() and not (tmp_path / "x.duckdb").exists() and not (tmp_path / "exp").exists()
    con.close()


def test_footers_read_by_duckdb_give_pyarrows_verdicts(tmp_path):
    """scan reads every footer in one DuckDB statement (files.footers) and applies the same rule
    (store.check_metadata) as store.check_file: on valid Parquet files of every kind -- spans, a
    foreign file, a newer major, a bad version string, the lab's client records -- both ways give the
    same good and bad lists; a file DuckDB cannot read as Parquet (empty, truncated) is found by
    halving the list and checked by check_file alone, the others' footers still read by DuckDB."""
    from pdtrace.connector.lab.replay import ClientRecord, write_records

    d = tmp_path / "s"
    _case_h().write(d)
    pq.write_table(pa.table({"x": [1]}), d / "foreign.parquet")
    t = store.rows_to_table([{"name": "router.request", "span_id": 1, "start_ns": 1}])
    pq.write_table(t.replace_schema_metadata({schema.VERSION_KEY: b"2.0"}), d / "newer.parquet")
    pq.write_table(t.replace_schema_metadata({schema.VERSION_KEY: b"one.x"}), d / "badversion.parquet")
    write_records([ClientRecord(0, 0, 12, 4, 0, status="ok")], d / "client", "run-1")
    con = duckdb.connect()
    kvs = files.footers(con, store.store_files(d))
    assert None not in kvs.values() and kvs[str(d / "foreign.parquet")] == {}  # pyarrow's own ARROW:schema key not read
    assert kvs[str(d / "newer.parquet")] == {schema.VERSION_KEY: b"2.0"}
    by_duckdb, by_pyarrow = files.scan(d, con=con), files.scan(d)
    assert by_duckdb == by_pyarrow
    good, bad = by_duckdb
    assert len(good) == len(store.store_files(d)) - 4  # client records: neither good nor bad
    assert sorted(Path(p).name for p, _ in bad) == ["badversion.parquet", "foreign.parquet", "newer.parquet"]
    (d / "empty.parquet").write_bytes(b"")
    (d / "truncated.parquet").write_bytes(Path(next(iter(good))).read_bytes()[:200])
    kvs2 = files.footers(con, store.store_files(d))
    assert sorted(Path(p).name for p, kv in kvs2.items() if kv is None) == ["empty.parquet", "truncated.parquet"]
    assert {p: kv for p, kv in kvs2.items() if kv is not None} == kvs  # the other footers still read by DuckDB
    assert files.scan(d, con=con) == files.scan(d)
    good2, bad2 = files.scan(d, con=con)
    assert good2 == good and ("empty file" in [r for p, r in bad2 if Path(p).name == "empty.parquet"])
    assert any(Path(p).name == "truncated.parquet" and r.startswith("not a Parquet file") for p, r in bad2), bad2
    con.close()
