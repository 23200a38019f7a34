"""A time window over a store (issue 20: "the analysis prunes by the time window asked for"): the
requests that arrived in it, read from the files that can hold them only (Hive partitions first, then
footer statistics), with the whole store's answers where what they depend on lies in those files
(here: one clock domain per process, no decode steps); rules in pdtrace.analysis.window."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from answers import answers, differences
from pdtrace import analysis
from pdtrace.analysis import cli as _cli, db
from pdtrace.analysis.materialized import manifest, write as materialize
from pdtrace.analysis.window import HOUR_NS, NS, Window, parse_duration, parse_instant, partition_hour
from pdtrace.instrument import compact
from pdtrace_case_builder import Case, ns
from test_in_flight import _case as _in_flight_case, _open as _open_record
from test_incomplete import _case_k
from test_root_cause_cases import case_sglang_31800

H = 3_600_000.0  # one hour in ms
SINCE, UNTIL = ns(H), ns(2 * H)  # T0 + 1 h .. T0 + 2 h (T0 = 2025-06-15 15:06:40 UTC)
ISO_SINCE, ISO_UNTIL = "2025-06-15T16:06:40Z", "2025-06-15T17:06:40+00:00"
IN_WINDOW = {f"h1-r{i}" for i in range(6)} | {"x-late"}
HELD = "held-r0"  # the hive store's in-window request whose file a later partition holds


def _store(d: Path) -> Path:
    """Four hours of six pull requests each (one every 10 min, files per hour: ``h<hour>-*``), and two
    requests across the window's edges in files of their own: ``x-early`` arrives 2 min before
    ``since`` and ends 1 min after it (out), ``x-late`` arrives 1 s before ``until`` and its router root
    ends 3 min after it (in, complete: its rows are read through the lookahead)."""
    for h in range(4):
        Case().pull_requests(6, gap_ms=H / 6, t0_ms=h * H, prefix=f"h{h}-").write(d, prefix=f"h{h}-")
    c = Case()
    for rid, t, end in (("x-early", H - 120_000, H + 60_000), ("x-late", 2 * H - 1000, 2 * H + 180_000)):
        c.router_request(rid, t, end, "pull", first_token_ms=t + 40, last_token_ms=end - 2)
        c.span("prefill", "prefill.queue", t + 1, t + 5, rid=rid, engine="p0")
        c.span("prefill", "prefill.compute", t + 5, t + 20, rid=rid, engine="p0")
        c.span("decode", "kv.transfer", t + 21, t + 30, rid=rid, engine="d0", attrs={"kv.bytes": 4096})
        c.span("decode", "decode.first_step", t + 31, t + 39, rid=rid, engine="d0")
    c.write(d, prefix="x-")
    return d


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """{'flat': the store as written, 'hive': the same rows compacted into hourly partitions, plus a
    file of garbage in a partition before the window, and a sink file in a partition after it that
    holds an in-window request (records a sink held, e.g. by tail retention, are written late)}."""
    root = tmp_path_factory.mktemp("window")
    flat = _store(root / "flat")
    hive = root / "hive"
    res = compact.compact(flat, hive, min_age_s=0, part_age_s=0)
    assert not res.skipped and res.rows > 0
    junk = hive / "date=2025-06-15" / "hour=14" / "host=h"
    junk.mkdir(parents=True)
    (junk / "junk.parquet").write_bytes(b"not parquet at all")
    Case().pull_requests(1, t0_ms=H + 1_800_000, prefix="held-").write(
        hive / "date=2025-06-15" / "hour=19" / "host=h", prefix="held-")
    return {"flat": flat, "hive": hive}


_COMPARED = {
    "requests": "SELECT * EXCLUDE (rkey) FROM requests",
    "ttft_breakdown": "SELECT b.* EXCLUDE (rkey) FROM ttft_breakdown b",
    "ttft_segments": "SELECT s.* EXCLUDE (rkey) FROM ttft_segments s",
    "incomplete_requests": "SELECT * EXCLUDE (rkey) FROM incomplete_requests",
}


def _rows(s, sql: str, ids: set[str] | None = None) -> list[tuple]:
    cur = s.execute(sql)
    cols = [c[0] for c in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    return sorted((tuple(sorted((k, str(v)) for k, v in r.items())) for r in rows
                   if ids is None or r.get("request_id") in ids))


@pytest.mark.parametrize("layout", ["flat", "hive"])
def test_a_window_holds_the_requests_that_arrived_in_it_with_the_whole_stores_answers(stores, layout):
    d = stores[layout]
    with analysis.open(d, cache=None) as whole, \
            analysis.open(d, cache=None, window=Window(SINCE, UNTIL)) as part:
        got = {r["request_id"]: r for r in part.query("SELECT request_id, status, ttft_ms FROM requests")}
        assert set(got) == IN_WINDOW | ({HELD} if layout == "hive" else set())
        assert got["x-late"]["status"] == "complete" and got["x-late"]["ttft_ms"] == 40.0
        for view, sql in _COMPARED.items():
            if "request_id" not in [c[0] for c in whole.execute(sql + " LIMIT 0").description]:
                continue
            a, b = _rows(whole, sql, set(got)), _rows(part, sql)
            assert a == b, view
            assert view != "requests" or len(b) == len(got)
        n_segments = part.query("SELECT count(DISTINCT request_id) AS n FROM ttft_segments")[0]["n"]
        assert n_segments == len(got)


def test_a_flat_store_is_pruned_by_footer_statistics(stores):
    with analysis.open(stores["flat"], cache=None, window=Window(SINCE, UNTIL)) as s:
        read = {Path(p).name.split("-")[0] for p in s.last_refresh.new}
        pruned = {Path(p).name.split("-")[0] for p in s.last_refresh.pruned}
    # hour 0's rows end 5 min or more before since - margin; hour 3's start after until + lookahead;
    # hour 2's rows end within the lookahead: read, their requests dropped by arrival
    assert read == {"h1", "h2", "x"} and pruned == {"h0", "h3"}


def test_a_hive_store_is_pruned_by_partition_before_any_file_is_opened(stores):
    hive = stores["hive"]
    with analysis.open(hive, cache=None) as whole:
        assert [Path(p).name for p, _ in whole.skipped] == ["junk.parquet"]
    with analysis.open(hive, cache=None, window=Window(SINCE, UNTIL)) as s:
        # hour 14 ends before since - margin: its garbage is never opened, so never named
        assert s.skipped == []
        read = sorted(((partition_hour(p, hive), Path(p).name.split("-")[0]) for p in s.last_refresh.new))
        pruned = sorted(((partition_hour(p, hive), Path(p).name.split("-")[0]) for p in s.last_refresh.pruned))
    base = partition_hour(hive / "date=2025-06-15" / "hour=15" / "f.parquet", hive)
    # compaction outputs hold rows ending within their hour: hours 15 and 18 are out by partition;
    # a sink's file of hour 19 may hold rows that ended long before (held): read by its footer statistics
    assert [((h - base) // HOUR_NS, n) for h, n in read] == [(1, "compact"), (2, "compact")] + [(4, "held")] * 3
    assert [((h - base) // HOUR_NS, n) for h, n in pruned] == [(-1, "junk.parquet"), (0, "compact"), (3, "compact")]


def test_a_cause_in_an_earlier_request_outside_the_window_is_found(tmp_path):
    # sglang#31800: s2 waits for a slot that s1 (arrived 1 s earlier) holds as an orphan
    d = tmp_path / "s"
    case_sglang_31800().write(d)
    with analysis.open(d, cache=None, window=Window(ns(500), ns(H))) as s:
        rows = s.query("SELECT request_id, cause, root_request_id, root_engine_id FROM incomplete_requests")
        assert [r["request_id"] for r in s.query("SELECT request_id FROM requests")] == ["s2"]
    assert rows == [{"request_id": "s2", "cause": "slot_held_by_orphan", "root_request_id": "s1",
                     "root_engine_id": "d0"}]


def test_an_id_the_router_linked_goes_with_its_request(tmp_path):
    # X1 (arrived at 0) names its decode leg X2; Y arrives at 40 s
    d = tmp_path / "s"
    _case_k().write(d)
    with analysis.open(d, cache=None) as whole:
        assert {r["request_id"] for r in whole.query("SELECT request_id FROM request_events")} == {"X1", "X2"}
    with analysis.open(d, cache=None, window=Window(ns(20_000), ns(H))) as s:
        assert [r["request_id"] for r in s.query("SELECT request_id FROM requests")] == ["Y"]
        assert s.query("SELECT request_id, incident FROM request_events") == []
    with analysis.open(d, cache=None, window=Window(ns(0), ns(20_000))) as s:
        assert [r["request_id"] for r in s.query("SELECT request_id FROM requests")] == ["X1"]
        assert {r["request_id"] for r in s.query("SELECT request_id FROM request_events")} == {"X1", "X2"}


def test_a_request_without_an_arrival_is_placed_by_its_earliest_record(tmp_path):
    # 'mid' (1 min after since) and 'late' (1 min after until): each has its router.dispatch in a file
    # read and its root (ended two hours later) in a file the window leaves out, so no arrival is known
    d = tmp_path / "s"
    Case().pull_requests(1, t0_ms=1000).write(d, prefix="a-")
    for rid, t, prefix in (("mid", 60_000, "m"), ("late", H + 60_000, "l")):
        e = Case()
        e.span("router", "router.dispatch", t, t + 1, rid=rid, attrs={"router.leg": "prefill"})
        e.write(d, prefix=f"{prefix}1-")
        f = Case()
        f.router_request(rid, t, 2 * H + t, "pull")
        f.write(d, prefix=f"{prefix}2-")
    with analysis.open(d, cache=None, window=Window(ns(0), ns(H))) as s:
        got = {r["request_id"]: r["arrival_ns"] for r in s.query("SELECT request_id, arrival_ns FROM requests")}
        assert got == {"r0": ns(1000), "mid": None}
        assert sorted(Path(p).name for p in s.last_refresh.pruned) == ["l2-router-router.parquet",
                                                                       "m2-router-router.parquet"]


def test_requests_known_only_by_open_records_or_coarse_spans_are_placed_too(tmp_path):
    # a request that just arrived has only open records (no span, no arrival); a `pdtrace collect`
    # store's engines (role 'engine') give no requests row at all: both are placed by their records
    d = tmp_path / "live"
    c = _in_flight_case()
    _open_record(c, "router", "router.request", 2500, [3000], "fresh", span_id=91, attrs={"request.mode": "pull"})
    _open_record(c, "prefill", "prefill.queue", 2501, [3000], "fresh", engine="p0", span_id=92)
    c.write(d)
    with analysis.open(d, cache=None, window=Window(ns(-H), ns(H))) as s:
        assert sorted(r["request_id"] for r in s.query("SELECT request_id FROM in_flight")) == ["fresh", "h1", "h5"]
    with analysis.open(d, cache=None, window=Window(ns(2400), ns(H))) as s:
        assert [r["request_id"] for r in s.query("SELECT request_id FROM in_flight")] == ["fresh"]
    d = tmp_path / "coarse"
    c = Case()
    for i in range(4):
        c.span("engine", "llm_request", i * 600_000, i * 600_000 + 500, rid=f"c{i}", engine="e0",
               attrs={"gen_ai.latency.time_to_first_token": 0.1, "gen_ai.latency.time_in_queue": 0.01})
    c.span("engine", "llm_request", 650_000, 650_500, rid=None, engine="e0",
           attrs={"gen_ai.latency.time_to_first_token": 0.1})  # joined to no request: kept with its file
    c.write(d)
    with analysis.open(d, cache=None, window=Window(ns(500_000), ns(H))) as s:
        rows = s.query("SELECT request_id FROM coarse_breakdown")
    assert sorted(str(r["request_id"]) for r in rows) == ["None", "c1", "c2", "c3"]


def test_adjacent_windows_hold_each_incident_and_cause_once(tmp_path):
    # incomplete requests with a cross-request root cause (s1, s2), incidents under a linked id (X1/X2)
    d = tmp_path / "s"
    case_sglang_31800().write(d, prefix="a-")
    _case_k().write(d, prefix="b-")
    views = ("requests", "incomplete_requests", "request_events")
    with analysis.open(d, cache=None) as whole:
        want = {v: whole.query(f"SELECT count(*) AS n FROM {v}")[0]["n"] for v in views}
    got = dict.fromkeys(views, 0)
    for lo, hi in ((0, 500), (500, 20_000), (20_000, H)):
        with analysis.open(d, cache=None, window=Window(ns(lo), ns(hi))) as s:
            for v in views:
                got[v] += s.query(f"SELECT count(*) AS n FROM {v}")[0]["n"]
            if lo == 500:  # s2's root cause, s1, arrived in the window before
                s2 = s.query("SELECT cause, root_request_id FROM incomplete_requests WHERE request_id = 's2'")
                assert s2 == [{"cause": "slot_held_by_orphan", "root_request_id": "s1"}]
    assert got == want and min(want.values()) >= 3


def test_adjacent_windows_add_up_to_the_whole_store(stores):
    # hour by hour (as a fleet materializes a day), every request and its request-level rows once
    views = ("requests", "ttft_segments", "transfers", "block_holds", "request_events", "incomplete_requests")
    with analysis.open(stores["hive"], cache=None) as whole:
        want = {v: whole.query(f"SELECT count(*) AS n FROM {v}")[0]["n"] for v in views}
    got = dict.fromkeys(views, 0)
    for h in range(-1, 5):
        with analysis.open(stores["hive"], cache=None, window=Window(ns(h * H), ns((h + 1) * H))) as s:
            for v in views:
                got[v] += s.query(f"SELECT count(*) AS n FROM {v}")[0]["n"]
    assert got == want and want["requests"] == 27 and want["transfers"] == 27


def test_an_open_bound_reads_everything_on_that_side(stores):
    with analysis.open(stores["hive"], cache=None, window=Window(since_ns=SINCE)) as s:
        ids = {r["request_id"] for r in s.query("SELECT request_id FROM requests")}
    assert ids == IN_WINDOW | {HELD} | {f"h{h}-r{i}" for h in (2, 3) for i in range(6)}
    with analysis.open(stores["flat"], cache=None, window=Window(until_ns=SINCE)) as s:
        ids = {r["request_id"] for r in s.query("SELECT request_id FROM requests")}
    assert ids == {f"h0-r{i}" for i in range(6)} | {"x-early"}


def test_a_cache_file_is_rebuilt_when_its_window_changes(stores, tmp_path):
    cache = tmp_path / "c.duckdb"
    counts = []
    for w in (Window(SINCE, UNTIL), None, Window(SINCE, UNTIL), Window(SINCE, UNTIL)):
        with db.Trace(stores["flat"], cache=cache, window=w) as tr:
            res = tr.refresh(warn=False)
            counts.append((res.rebuilt, tr.con.execute("SELECT count(*) FROM requests").fetchone()[0]))
    assert counts == [(True, 7), (True, 26), (True, 7), (False, 7)]


def test_the_window_options_of_report_sql_and_materialize(stores, tmp_path):
    run = CliRunner().invoke
    d = str(stores["hive"])
    out = run(_cli.sql, [d, "--since", ISO_SINCE, "--until", ISO_UNTIL, "--format", "csv",
                         "SELECT count(*) AS n FROM requests"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == ["n", "8"]
    out = run(_cli.report, [d, "--since", ISO_SINCE, "--until", ISO_UNTIL, "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["window"]["since"] == "2025-06-15T16:06:40.000000Z" and data["window"]["pruned_files"] == 3
    assert sum(r["requests"] for r in data["by_mode"]) == 8
    out = run(_cli.report, [d, "--since", ISO_SINCE, "--until", ISO_UNTIL])
    assert out.output.startswith("Window: requests arriving in [2025-06-15T16:06:40.000000Z, "
                                 "2025-06-15T17:06:40.000000Z) (lookahead 600 s); 3 store file(s) outside it not read")
    dest = tmp_path / "m"
    out = run(_cli.materialize, [d, str(dest), "--since", ISO_SINCE, "--until", ISO_UNTIL])
    assert out.exit_code == 0, out.output
    doc = manifest(dest)
    assert doc["views"]["requests"]["rows"] == 8 and doc["pruned_files"] == 3
    assert doc["window"]["until"] == "2025-06-15T17:06:40.000000Z"
    # a materialization's requests are fixed when it is made
    out = run(_cli.report, [str(dest), "--since", ISO_SINCE])
    assert out.exit_code == 1 and "is a materialization" in out.output
    for bad in (["--since", "yesterday"], ["--since", ISO_UNTIL, "--until", ISO_SINCE], ["--lookahead", "5m"],
                ["--since", ISO_SINCE, "--lookahead", "5m"], ["--until", ISO_UNTIL, "--lookahead", "5 minutes"]):
        out = run(_cli.report, [d, *bad])
        assert out.exit_code == 2, (bad, out.output)


def test_instants_and_durations_parse_as_documented():
    now = 1_800_000_000 * NS
    assert parse_instant("2h", now) == now - 2 * HOUR_NS
    assert parse_instant("90s", now) == now - 90 * NS
    assert parse_instant("1.5d", now) == now - 36 * HOUR_NS
    assert parse_instant("2025-06-15T16:06:40") == SINCE  # no zone: UTC
    assert parse_instant("2025-06-15T16:06:40Z") == SINCE
    assert parse_instant("2025-06-15T18:06:40+02:00") == SINCE
    assert parse_instant("2025-06-15") == ns(H) - (16 * 3600 + 6 * 60 + 40) * NS
    assert parse_duration("10m") == 600 * NS
    for bad in ("", "soon", "10 minutes", "-5m"):
        with pytest.raises(ValueError):
            parse_instant(bad, now)
    with pytest.raises(ValueError, match="empty window"):
        Window(UNTIL, SINCE)
    assert Window.from_options(None, None) is None


def test_spark_gives_the_windowed_answers_duckdb_gives(stores, spark):
    from pdtrace.analysis.spark import SparkTrace

    w = Window(SINCE, UNTIL)
    with db.Trace(stores["hive"], window=w) as a, SparkTrace(stores["hive"], spark=spark, window=w) as b:
        ra, rb = a.refresh(warn=False), b.refresh(warn=False)
        assert b.spark_stats["batches"] >= 2
        assert sorted(ra.new) == sorted(rb.new) and sorted(ra.pruned) == sorted(rb.pruned)
        assert a.con.execute("SELECT count(*) FROM requests").fetchone()[0] == 8
        assert differences(answers(a.con), answers(b.con)) == []
