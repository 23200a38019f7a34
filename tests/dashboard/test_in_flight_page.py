"""The overview shows what is in flight first; the waterfall draws an open stage to "now" (AppTest).

Hand-built store (ms from T0): request h1 (push) has its router root open
from 0, P's prefill.compute 1-400 ended and P's prefill.block_hold open from
400, waiting for its registration; every process flushed last at 20,000. A
second request c1 is complete. So h1 is in flight, stuck 19.6 s at P's
block hold.
"""
from __future__ import annotations

import json

from pdtrace.instrument import store

T0 = 1_750_000_000_000_000_000
MS = 1_000_000


def _res(role, engine=None):
    return {"run_id": "r", "role": role, "engine_id": engine, "host": "h", "pid": 1 if role == "router" else 2,
            "service_name": f"pdtrace-{role}"}


def _build(d):
    router, prefill = [], []
    for t in (5_000, 10_000, 20_000):
        router.append({"record": "open", "name": "router.request", "span_id": 11, "start_ns": T0,
                       "end_ns": T0 + t * MS, "request_id": "h1", "attrs": {"open.state": "open", "request.mode": "push"}})
        prefill.append({"record": "open", "name": "prefill.block_hold", "span_id": 12, "start_ns": T0 + 400 * MS,
                        "end_ns": T0 + t * MS, "request_id": "h1",
                        "attrs": {"open.state": "open", "wait.for": "registration"}})
        for rows in (router, prefill):
            rows.append({"record": "stats", "name": "recorder.stats", "start_ns": T0 + t * MS})
    router.append({"record": "span", "name": "router.dispatch", "span_id": 13, "parent_span_id": 11,
                   "start_ns": T0, "end_ns": T0 + MS, "request_id": "h1", "attrs": {"router.leg": "prefill"}})
    prefill.append({"record": "span", "name": "prefill.compute", "span_id": 14, "start_ns": T0 + MS,
                    "end_ns": T0 + 400 * MS, "request_id": "h1"})
    # c1: complete
    b = T0 + 1000 * MS
    router.append({"record": "span", "name": "router.request", "span_id": 21, "start_ns": b, "end_ns": b + 300 * MS,
                   "request_id": "c1", "attrs": {"request.mode": "push"}})
    router.append({"record": "event", "name": "router.first_token", "span_id": 21, "start_ns": b + 200 * MS,
                   "request_id": "c1"})
    prefill.append({"record": "span", "name": "prefill.compute", "span_id": 22, "start_ns": b + MS,
                    "end_ns": b + 150 * MS, "request_id": "c1"})
    store.write_rows(d, router, resource=_res("router"), name="router-h-1.parquet")
    store.write_rows(d, prefill, resource=_res("prefill", "p0"), name="prefill-h-2.parquet")
    return d


def _no_errors(at):
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_overview_shows_in_flight_first(app, tmp_path):
    d = _build(tmp_path / "s")
    at = app(d)
    _no_errors(at)
    assert at.title[0].value == "In flight now"
    m = {x.label: x.value for x in at.metric}
    assert m["In flight now"] == "1" and m["Stuck longer than 10 s"] == "1"
    tbl = next(x.value for x in at.dataframe if "waits_for" in x.value.columns)
    row = tbl.iloc[0]
    assert (row.request_id, row.stage, row.role, row.waits_for) == ("h1", "prefill.block_hold", "prefill", "registration")
    assert row.age_ms == 19_600.0
    at.number_input(key="stuck_s").set_value(30.0).run()
    assert {x.label: x.value for x in at.metric}["Stuck longer than 30 s"] == "0"


def test_no_in_flight_section_without_open_stages(app, tmp_path):
    d = tmp_path / "none"
    rows = [r for r in []]
    store.write_rows(d, rows + [{"record": "span", "name": "router.request", "span_id": 1, "start_ns": T0,
                                 "end_ns": T0 + MS, "request_id": "a"}], resource=_res("router"), name="router.parquet")
    at = app(d)
    _no_errors(at)
    assert "In flight now" not in [t.value for t in at.title]


def test_waterfall_draws_the_open_stage_to_now(app, tmp_path):
    d = _build(tmp_path / "w")
    at = app(d, page="app_pages/request.py", query_params={"request": "h1"})
    _no_errors(at)
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    bars = [tr for f in figs for tr in f["data"] if tr.get("type") == "bar"]
    lanes = {y for tr in bars for y in (tr.get("y") or [])}
    assert "prefill · p0 · open" in lanes and "router · open" in lanes, lanes


def _open_only(d):
    """A store whose one request e1 has nothing ended yet: P's prefill.queue open since 1 ms (waiting for a batch
    slot), refreshed at the flushes at 5 s and 10 s."""
    rows = []
    for t in (5_000, 10_000):
        rows.append({"record": "open", "name": "prefill.queue", "span_id": 31, "start_ns": T0 + MS,
                     "end_ns": T0 + t * MS, "request_id": "e1", "attrs": {"open.state": "open", "wait.for": "schedule"}})
        rows.append({"record": "stats", "name": "recorder.stats", "start_ns": T0 + t * MS})
    store.write_rows(d, rows, resource=_res("prefill", "p0"), name="prefill-h-2.parquet")


def test_a_request_with_only_open_stages_opens_its_waterfall(app, tmp_path):
    """Behind a router that writes no spans, a request stuck at its first stage has nothing ended yet (no
    ``requests`` row): its page must still show it in flight with its open stage, not 'No request'."""
    d = tmp_path / "o"
    _open_only(d)
    at = app(d, page="app_pages/request.py", query_params={"request": "e1"})
    _no_errors(at)
    assert not [w.value for w in at.warning if "No request" in w.value]
    assert any("stuck in `prefill.queue`" in w.value and "schedule" in w.value for w in at.warning), \
        [w.value for w in at.warning]
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    lanes = {y for f in figs for tr in f["data"] if tr.get("type") == "bar" for y in (tr.get("y") or [])}
    assert "prefill · p0 · open" in lanes, lanes


def test_overview_of_a_store_whose_only_request_is_in_flight(app, tmp_path):
    """The same open-only store on the overview: in flight first, no exception, not 'no request yet'."""
    d = tmp_path / "o2"
    _open_only(d)
    at = app(d)
    _no_errors(at)
    assert at.title[0].value == "In flight now"
    assert {x.label: x.value for x in at.metric}["In flight now"] == "1"
