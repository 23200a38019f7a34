"""Every dashboard page through Streamlit's AppTest: no exception, and the numbers shown equal the views'.

The expected numbers are computed here straight from the analysis views (an
independent in-memory analysis database over the same store), not through
the dashboard's data module.
"""
from __future__ import annotations

import json

import pytest

from pdtrace.dashboard.data import fmt_ms

CATS = ("queue", "compute", "transfer", "coordination")


def _no_errors(at):
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _metrics(at) -> dict:
    return {m.label: m.value for m in at.metric}


def _arr(v):
    """A trace's array as a list (plotly's JSON packs numeric arrays as {'dtype', 'bdata': base64})."""
    if isinstance(v, dict) and "bdata" in v:
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v) if v is not None else []


def _charts(at) -> list[dict]:
    """The plotly figures shown, as JSON dicts."""
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def _df(at, *cols):
    """The first dataframe shown whose columns include ``cols`` (tables without a selection have no key)."""
    for d in at.dataframe:
        v = d.value
        if set(cols) <= set(v.columns):
            return v
    raise AssertionError(f"no table with columns {cols}")


def _one(tr, sql, params=None):
    rows = tr.query(sql, params)
    assert len(rows) == 1
    return rows[0]


def test_overview_numbers_equal_views(app, views, store_dir):
    at = app(store_dir)
    _no_errors(at)
    tr = views(store_dir)
    exp = _one(tr, """SELECT count(*) AS n, count(*) FILTER (WHERE status <> 'complete') AS inc,
                             quantile_cont(ttft_ms, 0.5) AS p50, quantile_cont(ttft_ms, 0.9) AS p90,
                             quantile_cont(ttft_ms, 0.99) AS p99, quantile_cont(tpot_ms, 0.5) AS tpot50,
                             quantile_cont(tpot_ms, 0.99) AS tpot99 FROM requests""")
    m = _metrics(at)
    assert m["Requests"] == f"{exp['n']:,}"
    assert m["Incomplete"] == f"{exp['inc']:,}"
    assert m["TTFT p50"] == fmt_ms(exp["p50"])
    assert m["TTFT p90"] == fmt_ms(exp["p90"])
    assert m["TTFT p99"] == fmt_ms(exp["p99"])
    assert m["TPOT p50"] == fmt_ms(exp["tpot50"])
    assert m["TPOT p99"] == fmt_ms(exp["tpot99"])
    # the first chart is the queue/compute/transfer/coordination split, from ttft_breakdown
    split = _charts(at)[0]
    shown = {tr_["name"]: _arr(tr_["x"])[0] for tr_ in split["data"]}
    s = _one(tr, "SELECT sum(ttft_ms) AS t, " + ", ".join(f"sum({c}_ms) AS {c}" for c in CATS)
             + " FROM ttft_breakdown")
    for c in CATS:
        assert shown[c] == pytest.approx(s[c] / s["t"] * 100, rel=1e-9, abs=1e-9)
    assert sum(shown.values()) == pytest.approx(100.0)
    # the TPOT chart says when there is no TPOT at all (lab stores: no output-token counts recorded)
    tpot = next(c for c in _charts(at) if c["layout"]["title"]["text"].startswith("TPOT"))
    n_tpot = _one(tr, "SELECT count(tpot_ms) AS n FROM requests WHERE status = 'complete'")["n"]
    notes = [a.get("text", "") for a in tpot["layout"].get("annotations", [])]
    assert (n_tpot == 0) == any(n.startswith("No TPOT values") for n in notes), (n_tpot, notes)
    # slowest requests: the first row is the largest TTFT of ttft_breakdown
    slow = _df(at, "request_id", "dominant_stage")
    top = _one(tr, "SELECT request_id, ttft_ms FROM ttft_breakdown ORDER BY ttft_ms DESC, request_id LIMIT 1")
    assert slow.iloc[0]["request_id"] == top["request_id"]
    assert slow.iloc[0]["ttft_ms"] == pytest.approx(top["ttft_ms"])
    assert top["request_id"] in at.button(key="open_slowest").label
    # incomplete causes table equals incomplete_requests grouped by cause
    causes = tr.query("SELECT cause, count(*) AS n FROM incomplete_requests GROUP BY cause ORDER BY n DESC, cause")
    if causes:
        tab = _df(at, "cause", "median_time_to_failure_ms")
        assert list(tab["cause"]) == [r["cause"] for r in causes]
        assert list(tab["requests"]) == [r["n"] for r in causes]


def test_hand_built_incident_is_visible(app, hand_stores):
    """The pull store's incident (handshakes) puts handoff.prep on top of the slowest requests."""
    at = app(hand_stores["pull"])
    _no_errors(at)
    slow = _df(at, "request_id", "dominant_stage")
    assert slow.iloc[0]["dominant_stage"] == "handoff.prep"
    assert bool(slow.iloc[0]["first_contact"]) is True
    assert _metrics(at)["Incomplete"] == "2"


def test_overview_to_waterfall_click(app, views, store_dir):
    at = app(store_dir)
    at.button(key="open_slowest").click().run()
    _no_errors(at)
    tr = views(store_dir)
    top = _one(tr, """SELECT b.request_id, b.ttft_ms, b.queue_ms, b.compute_ms, b.transfer_ms, b.coordination_ms,
                             b.rkey FROM ttft_breakdown b ORDER BY ttft_ms DESC, request_id LIMIT 1""")
    assert at.query_params["request"] == [top["request_id"]] or at.query_params["request"] == top["request_id"]
    m = _metrics(at)
    assert m["TTFT"] == fmt_ms(top["ttft_ms"])
    for c in CATS:
        assert m[c.capitalize()] == fmt_ms(top[f"{c}_ms"])
    # the waterfall's critical-path lane is ttft_segments, and it tiles the TTFT
    wf = next(c for c in _charts(at) if "Waterfall" in c["layout"]["title"]["text"])
    crit = [x for t in wf["data"] if t.get("type") == "bar" and _arr(t.get("y"))[:1] == ["critical path"]
            for x in _arr(t["x"])]
    segs = tr.query("SELECT dur_ns FROM ttft_segments WHERE rkey = ? ORDER BY seq", [top["rkey"]])
    assert len(crit) == len(segs)
    assert sum(crit) == pytest.approx(top["ttft_ms"], abs=1e-6)
    table = _df(at, "seq", "stage", "dur_ms")
    assert table["dur_ms"].sum() == pytest.approx(top["ttft_ms"], abs=1e-6)


def test_waterfall_events_on_their_own_lanes(app, views, store_dir):
    """Every event of the slowest request is drawn on the lane of the thread that recorded it (its own lane
    when that thread has no span of the request), never on the critical-path lane."""
    tr = views(store_dir)
    top = _one(tr, "SELECT request_id, rkey FROM ttft_breakdown ORDER BY ttft_ms DESC, request_id LIMIT 1")
    at = app(store_dir, "app_pages/request.py", {"request": top["request_id"]})
    _no_errors(at)
    exp = tr.query("""SELECT event, role || coalesce(' · ' || engine_id, '') || coalesce(' · rank ' || tp_rank, '')
                             || ' · ' || coalesce(thread, '?') AS lane
                      FROM events WHERE rkey = ? ORDER BY time_ns""", [top["rkey"]])
    wf = next(c for c in _charts(at) if "Waterfall" in c["layout"]["title"]["text"])
    marks = [t for t in wf["data"] if t.get("name") == "event"]
    shown = sorted(zip(_arr(marks[0]["text"]), _arr(marks[0]["y"]))) if marks else []
    assert shown == sorted((r["event"], r["lane"]) for r in exp)
    assert "critical path" not in [lane for _, lane in shown]
    assert set(lane for _, lane in shown) <= set(wf["layout"]["yaxis"]["categoryarray"])


def test_request_page_shows_hidden_time_and_events(app, views, hand_stores):
    """Push with a late registration: prefill.compute is hidden behind dest.register, and shown so."""
    d = hand_stores["push"]
    tr = views(d)
    top = _one(tr, "SELECT request_id, rkey, hidden_ms FROM ttft_breakdown ORDER BY ttft_ms DESC, request_id LIMIT 1")
    at = app(d, "app_pages/request.py", {"request": top["request_id"]})
    _no_errors(at)
    assert _metrics(at)["Hidden"] == fmt_ms(top["hidden_ms"])
    hid = _df(at, "stage", "hidden_ms")
    exp = tr.query("SELECT stage, hidden_ms FROM ttft_hidden WHERE rkey = ? ORDER BY hidden_ms DESC", [top["rkey"]])
    assert list(hid["stage"]) == [r["stage"] for r in exp]
    assert "prefill.compute" in list(hid["stage"])
    ev = _df(at, "event", "lane")
    assert "router.first_token" in set(ev["event"]) and "registration.sent" in set(ev["event"])


def test_request_page_unknown_id(app, hand_stores):
    at = app(hand_stores["pull"], "app_pages/request.py", {"request": "no-such-request"})
    _no_errors(at)
    assert any("No request `no-such-request`" in w.value for w in at.warning)


def test_compare_two_modes(app, views, hand_stores):
    d = hand_stores["mixed"]
    at = app(d, "app_pages/compare.py")
    _no_errors(at)
    tr = views(d)
    vals = [m.value for m in at.metric]
    for i, mode in enumerate(("pull", "push")):
        e = _one(tr, """SELECT quantile_cont(ttft_ms, 0.5) AS p50, quantile_cont(ttft_ms, 0.99) AS p99,
                               quantile_cont(tpot_ms, 0.5) AS t50, count(*) FILTER (WHERE status <> 'complete') AS inc
                        FROM requests WHERE mode = ?""", [mode])
        assert vals[4 * i: 4 * i + 4] == [fmt_ms(e["p50"]), fmt_ms(e["p99"]), fmt_ms(e["t50"]), f"{e['inc']:,}"]


def test_compare_buckets_are_the_reports(app, views, hand_stores):
    """The compare page's prompt-length buckets are those of ``pdtrace report`` and the
    summary_by_prompt_bucket view ([lo, 2*lo) tokens, labelled 'lo-(2*lo-1)'), listed in token
    order, with the view's complete-request counts and TTFT p50 (the dashboard once had buckets of
    its own, so the two disagreed)."""
    d = hand_stores["mixed"]
    at = app(d, "app_pages/compare.py")
    _no_errors(at)
    pct = _df(at, "prompt_bucket", "trace")
    exp = views(d).query("""SELECT mode, prompt_bucket_lo AS lo, complete, ttft_p50_ms FROM summary_by_prompt_bucket
                            WHERE complete > 0 AND mode IN ('pull', 'push') ORDER BY prompt_bucket_lo, mode""")
    assert len({e["lo"] for e in exp}) >= 3  # the store spans several buckets
    got = [(r.trace, r.prompt_bucket, r.requests, r.ttft_p50_ms) for r in pct.itertuples()]
    assert got == [(e["mode"], f"{e['lo']}-{2 * e['lo'] - 1}", e["complete"], pytest.approx(e["ttft_p50_ms"]))
                   for e in exp]


def test_compare_two_directories(app, views, hand_stores):
    at = app(hand_stores["pull"], "app_pages/compare.py")
    at.radio(key="cmp_how").set_value("another trace directory").run()
    at.text_input(key="cmp_dir").input(str(hand_stores["push"])).run()
    _no_errors(at)
    vals = [m.value for m in at.metric]
    for i, name in enumerate(("pull", "push")):
        e = _one(views(hand_stores[name]), "SELECT quantile_cont(ttft_ms, 0.5) AS p50 FROM requests")
        assert vals[4 * i] == fmt_ms(e["p50"])
    pct = _df(at, "prompt_bucket", "trace")
    assert set(pct["trace"]) == {"pull (pull)", "push (push)"}


def test_stalls_page(app, views, store_dir):
    at = app(store_dir, "app_pages/stalls.py")
    _no_errors(at)
    tr = views(store_dir)
    e = _one(tr, """SELECT count(*) AS n, count(*) FILTER (WHERE excess_ns > 0) AS stalled,
                           coalesce(sum(excess_ms), 0) AS excess, coalesce(sum(connector_ms), 0) AS conn
                    FROM decode_stalls""")
    if e["n"] == 0:
        assert any("No decode steps" in i.value for i in at.info)
        return
    m = _metrics(at)
    assert m["Steps"] == f"{e['n']:,}"
    assert m["Stalled steps"] == f"{e['stalled']:,}"
    assert m["Stall time (excess)"] == fmt_ms(e["excess"])
    assert m["Connector on forward thread"] == fmt_ms(e["conn"])
    # the step chart shows the forward thread's connector time: all of it on a step without a baseline,
    # the part within the excess on a step with one
    steps = next(c for c in _charts(at) if c["layout"]["title"]["text"] == "Decode engine steps")
    conn = next(t_ for t_ in steps["data"] if t_["name"] == "connector on forward thread")
    shown_conn = sum(v for v in _arr(conn["y"]) if v == v)
    exp_conn = _one(tr, """SELECT coalesce(sum(CASE WHEN baseline_ms IS NULL THEN least(greatest(connector_ms, 0), dur_ms)
                                                    ELSE least(greatest(connector_ms, 0),
                                                               greatest(dur_ms - least(baseline_ms, dur_ms), 0)) END), 0) AS c
                           FROM decode_stalls""")["c"]
    assert shown_conn == pytest.approx(exp_conn, rel=1e-6, abs=1e-6)
    if e["conn"] > 0 and _one(tr, "SELECT count(*) AS n FROM decode_stalls WHERE baseline_ms IS NULL")["n"] == e["n"]:
        assert shown_conn == pytest.approx(e["conn"], rel=1e-6)
    worst = tr.query("SELECT request_id, stall_ms FROM request_stalls ORDER BY stall_ms DESC NULLS LAST, request_id LIMIT 1")
    if worst and (worst[0]["stall_ms"] or 0) > 0:
        shown = _df(at, "request_id", "stall_ms")
        assert shown.iloc[0]["request_id"] == worst[0]["request_id"]
        cul = _df(at, "culprit_request_id", "share_ms")
        assert len(cul) >= 1 and cul["share_ms"].sum() > 0
        assert worst[0]["request_id"] not in set(cul["culprit_request_id"])


def test_what_changed_ranks_the_incident_stage(app, hand_stores):
    """Pull store: requests 60-80 % of the way in pay a handshake in handoff.prep; incident = 2nd half."""
    at = app(hand_stores["pull"], "app_pages/changed.py")
    _no_errors(at)
    stg = _df(at, "stage", "growth_pp")
    assert stg.iloc[0]["stage"] == "handoff.prep"
    assert stg.iloc[0]["growth_pp"] > 20
    assert stg["growth_pp"].iloc[0] == pytest.approx(
        (stg.iloc[0]["share_incident"] - stg.iloc[0]["share_baseline"]) * 100)
    att = _df(at, "attribute", "value", "growth_pp")
    top = att.iloc[0]
    assert (top["attribute"], top["value"]) == ("first contact", "first contact")
    assert any("handoff.prep" in m.value for m in at.markdown)


def test_what_changed_matches_views(app, views, store_dir):
    at = app(store_dir, "app_pages/changed.py")
    _no_errors(at)
    if not at.dataframe:
        return  # no complete request in the default windows
    stg = _df(at, "stage", "growth_pp")
    tr = views(store_dir)
    lo, hi = _one(tr, "SELECT min(arrival_ns) AS lo, max(arrival_ns) AS hi FROM requests").values()
    # default windows: slider halves of [lo, hi + 1 s] rounded to the second (see ui.window_picker)
    sl_inc = at.slider(key="inc_range").value
    sl_base = at.slider(key="base_range").value
    ns = [int(x.timestamp()) * 1_000_000_000 for x in (*sl_inc, *sl_base)]
    exp = tr.query("""
        WITH b AS (SELECT rkey, ttft_ns, arrival_ns >= ? AND arrival_ns < ? AS inc, arrival_ns >= ? AND arrival_ns < ? AS base
                   FROM ttft_breakdown)
        SELECT s.stage_group AS stage,
               sum(s.dur_ns) FILTER (WHERE inc) / (SELECT sum(ttft_ns) FILTER (WHERE inc) FROM b) AS si,
               sum(s.dur_ns) FILTER (WHERE base) / (SELECT sum(ttft_ns) FILTER (WHERE base) FROM b) AS sb
        FROM ttft_segments s JOIN b USING (rkey) GROUP BY 1""", ns)
    got = {r.stage: r.growth_pp for r in stg.itertuples()}
    for r in exp:
        assert got[r["stage"]] == pytest.approx(((r["si"] or 0) - (r["sb"] or 0)) * 100, abs=1e-9)


def test_sql_console(app, views, store_dir):
    at = app(store_dir, "app_pages/sql.py")
    _no_errors(at)
    at.button(key="sql_run").click().run()
    _no_errors(at)
    got = _df(at, "mode", "ttft_p99_ms")
    exp = views(store_dir).query(at.text_area(key="sql_text").value)
    assert list(got["mode"]) == [r["mode"] for r in exp]
    assert list(got["ttft_p99_ms"]) == [r["ttft_p99_ms"] for r in exp]
    docs = _df(at, "column", "column_doc")
    assert len(docs) and docs["column_doc"].notna().all()


@pytest.mark.parametrize("bad, message", [
    ("DELETE FROM ttft_breakdown", "only queries are allowed, not DELETE"),
    ("SELECT 1; SELECT 2", "one statement at a time, got 2"),
    ("COPY (SELECT 1) TO '{tmp}/copy.csv'", "only queries are allowed, not COPY"),
    ("COPY (SELECT 1) TO '{store}/copy.csv'", "only queries are allowed, not COPY"),
    ("EXPORT DATABASE '{tmp}/export'", "only queries are allowed, not EXPORT"),
    ("ATTACH '{tmp}/x.duckdb' AS x", "only queries are allowed, not ATTACH"),
    ("CREATE TABLE console_made AS SELECT 1 AS a", "only queries are allowed, not CREATE"),
    ("INSTALL httpfs", "only queries are allowed, not LOAD"),
    ("LOAD json", "only queries are allowed, not LOAD"),
    ("SET threads = 1", "only queries are allowed, not SET"),
    # EXPLAIN ANALYZE runs the statement it explains: refused unless that is a query
    ("EXPLAIN ANALYZE CREATE TABLE console_made AS SELECT 1 AS a", "not EXPLAIN of CREATE"),
    ("EXPLAIN (ANALYZE) COPY (SELECT 1) TO '{store}/copy.csv'", "not EXPLAIN of COPY"),
    ("/* note */ explain analyse DELETE FROM _files", "not EXPLAIN of DELETE"),
    # file access: DuckDB itself refuses files outside the trace directory
    ("SELECT * FROM read_csv('/etc/passwd')", "Permission"),
    ("SELECT * FROM read_text('/etc/hostname')", "Permission"),
    ("SELECT * FROM read_parquet('{tmp}/*.parquet')", "Permission"),
])
def test_sql_console_is_read_only(app, tmp_path, hand_stores, bad, message):
    """The console refuses writes, attaches, installs, settings and foreign files; nothing it refused took effect."""
    from pdtrace.dashboard import data

    import shutil

    store = tmp_path / "store"
    shutil.copytree(hand_stores["pull"], store)
    (tmp_path / "outside.parquet").write_bytes((store / "router-run-pull-1.parquet").read_bytes())
    bad = bad.format(tmp=tmp_path, store=store)
    at = app(store, "app_pages/sql.py")
    t = data.session(store)  # the dashboard's own session (AppTest runs the app in this process)
    threads = t.df("SELECT current_setting('threads') AS v")["v"][0]
    at.text_area(key="sql_text").input(bad)
    at.button(key="sql_run").click().run()
    assert not at.exception
    assert any(message in e.value for e in at.error), [e.value for e in at.error]
    assert not any(c.value.endswith(" rows") for c in at.caption)  # no result table
    # nothing happened: no file written, no table made, no row deleted, no setting changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.parquet", "store"]
    assert sorted(p.name for p in store.iterdir()) == sorted(p.name for p in hand_stores["pull"].iterdir())
    assert t.df("SELECT count(*) AS n FROM duckdb_tables() WHERE table_name = 'console_made'")["n"][0] == 0
    assert t.df("SELECT count(*) AS n FROM _files WHERE ok")["n"][0] == 3
    assert t.df("SELECT current_setting('threads') AS v")["v"][0] == threads
    assert t.df("SELECT count(*) AS n FROM requests")["n"][0] == 60


def test_sql_console_runs_queries_of_every_read_only_kind(app, views, hand_stores):
    """SELECT, WITH, FROM-first, DESCRIBE, SUMMARIZE, EXPLAIN and EXPLAIN ANALYZE of a query all run."""
    d = hand_stores["pull"]
    tr = views(d)
    cases = {
        "WITH x AS (SELECT request_id, ttft_ms FROM requests) SELECT count(*) AS n FROM x":
            ("n", tr.query("SELECT count(*) AS n FROM requests")[0]["n"]),
        "FROM ttft_breakdown SELECT max(ttft_ms) AS m": ("m", tr.query("SELECT max(ttft_ms) AS m FROM ttft_breakdown")[0]["m"]),
        "DESCRIBE requests": ("column_name", "request_id"),
        "EXPLAIN SELECT 1": ("explain_key", "physical_plan"),
        "EXPLAIN ANALYZE SELECT count(*) FROM spans": ("explain_key", "analyzed_plan"),
    }
    at = app(d, "app_pages/sql.py")
    for sql, (col, want) in cases.items():
        at.text_area(key="sql_text").input(sql)
        at.button(key="sql_run").click().run()
        _no_errors(at)
        got = _df(at, col)
        assert want in list(got[col]), (sql, got)


PAGES = ["app_pages/request.py", "app_pages/compare.py", "app_pages/stalls.py", "app_pages/changed.py", "app_pages/sql.py"]


@pytest.mark.parametrize("page", [None] + PAGES)
def test_empty_directory_gives_a_message(app, empty_dir, page):
    at = app(empty_dir, page)
    assert not at.exception
    assert any("No readable span files" in i.value for i in at.info)


@pytest.mark.parametrize("page", [None] + PAGES)
def test_only_corrupt_files_gives_a_message_naming_them(app, corrupt_dir, page):
    at = app(corrupt_dir, page)
    assert not at.exception
    banner = " ".join(w.value for w in at.warning)
    for name in ("empty.parquet", "truncated.parquet", "foreign.parquet"):
        assert name in banner
    assert any("No readable span files" in i.value for i in at.info)


def test_missing_directory_gives_a_message(app, tmp_path):
    at = app(tmp_path / "not-yet")
    assert not at.exception
    assert any("does not exist (yet)" in i.value for i in at.info)


def test_corrupt_file_beside_good_ones_is_named_and_the_rest_shown(app, tmp_path, hand_stores):
    import shutil

    from storegen import write_corrupt

    d = tmp_path / "mixed-bad"
    shutil.copytree(hand_stores["pull"], d)
    write_corrupt(d)
    at = app(d)
    _no_errors(at)
    assert "truncated.parquet" in " ".join(w.value for w in at.warning)
    assert _metrics(at)["Requests"] == "60"


def test_new_files_are_picked_up(app, tmp_path):
    """A growing directory: files written after the first render show up on the next refresh."""
    from storegen import build_store

    from pdtrace.dashboard import ui

    d = tmp_path / "growing"
    build_store(d, n_requests=10, mode="pull", seed=7, incident=None, n_incomplete=0)
    at = app(d)
    assert _metrics(at)["Requests"] == "10"
    build_store(d, n_requests=10, mode="push", seed=8, incident=None, n_incomplete=0,
                start_ns=1_735_689_700 * 1_000_000_000)
    assert ui.open_trace(str(d)).refresh() is True  # what the follow fragment runs every few seconds
    at.run()
    assert _metrics(at)["Requests"] == "20"


@pytest.mark.lab
def test_compare_lab_pull_with_lab_push(app, views, lab_store_pull, lab_store_push):
    """Push vs pull on the two lab runs of the same 20 requests: each side's numbers equal its own views'."""
    at = app(lab_store_pull, "app_pages/compare.py")
    assert at.radio(key="cmp_how").value == "another trace directory"  # one mode per lab store
    at.text_input(key="cmp_dir").input(str(lab_store_push)).run()
    _no_errors(at)
    vals = [m.value for m in at.metric]
    splits = [c for c in _charts(at) if c["layout"]["title"]["text"].startswith("Share of TTFT")]
    assert len(splits) == 2
    pct = _df(at, "prompt_bucket", "trace")
    for i, d in enumerate((lab_store_pull, lab_store_push)):
        tr = views(d)
        e = _one(tr, """SELECT quantile_cont(ttft_ms, 0.5) AS p50, quantile_cont(ttft_ms, 0.99) AS p99,
                               quantile_cont(tpot_ms, 0.5) AS t50, count(*) FILTER (WHERE status <> 'complete') AS inc
                        FROM requests""")
        assert vals[4 * i: 4 * i + 4] == [fmt_ms(e["p50"]), fmt_ms(e["p99"]), fmt_ms(e["t50"]), f"{e['inc']:,}"]
        s = _one(tr, "SELECT sum(ttft_ms) AS t, " + ", ".join(f"sum({c}_ms) AS {c}" for c in CATS)
                 + " FROM ttft_breakdown")
        shown = {t_["name"]: _arr(t_["x"])[0] for t_ in splits[i]["data"]}
        for c in CATS:
            assert shown[c] == pytest.approx(s[c] / s["t"] * 100, rel=1e-9, abs=1e-9)
        mode = ("pull", "push")[i]
        rows = pct[pct["trace"] == f"{d.name} ({mode})"]
        n = _one(tr, "SELECT count(*) AS n FROM requests WHERE status = 'complete'")["n"]
        assert rows["requests"].sum() == n
        assert rows["ttft_p50_ms"].notna().all()
