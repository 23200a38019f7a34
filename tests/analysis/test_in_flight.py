"""View in_flight on hand-built stores: what is in flight at the trace end, where it is stuck.

Timeline (ms from T0; one file per process; each process flushed at 1000, 2000, 3000):

  h1 (push, stuck): router.request open from 0; P's prefill.queue 0-10 and
     prefill.compute 10-400 ended; D's dest.register open from 5, refreshed at
     each flush, waiting for its registration; P's prefill.block_hold open
     from 400 waiting for the registration.
                 0    400          1000      2000      3000 (D's last flush)
     router      [router.request ...........................  open
     P           [q][compute]
     P                   [prefill.block_hold ...............  open, wait.for registration
     D            [dest.register ...........................  open, wait.for registration
  h2 (finished): decode.queue open rows at 1000 and 2000, then its span row (same span id).
  h3 (abandoned): an open row at 1000, then one with open.state = abandoned.
  h4 (ended elsewhere): D's open handoff.prep from 100; its worker's handoff.prep
     span row (another span id) ended at 1500 -> over.
  h5 (queue reopened): prefill.queue 0-50 ended, prefill.queue open again from 900
     (between chunks): still in flight, stage prefill.queue since 900.
"""
from pdtrace_case_builder import RUN, Case, ns

from pdtrace.analysis import report


def _open(c, role, name, start_ms, flushes_ms, rid, engine=None, span_id=None, attrs=None, state="open", attempt=0):
    sid = span_id
    for t in flushes_ms:
        a = {"open.state": "open", **(attrs or {})}
        if t == flushes_ms[-1]:
            a["open.state"] = state
        c.rows[(role, engine)].append({
            "record": "open", "name": name, "span_id": sid, "start_ns": c._t(engine or role, start_ms),
            "end_ns": c._t(engine or role, t), "request_id": rid, "attempt": attempt, "attrs": a})
    return sid


def _flushes(c, role, engine=None, at=(1000, 2000, 3000)):
    for t in at:
        c.rows[(role, engine)].append({"record": "stats", "name": "recorder.stats", "start_ns": c._t(engine or role, t),
                                       "attrs": {"recorder.written": 1}})


def _case(shift=None):
    c = Case(clock_shift_ms=shift)
    F = [1000, 2000, 3000]
    # h1: stuck waiting for its registration
    _open(c, "router", "router.request", 0, F, "h1", span_id=11, attrs={"request.mode": "push"})
    c.span("router", "router.dispatch", 0, 1, rid="h1", parent=11, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.queue", 1, 10, rid="h1", engine="p0")
    c.span("prefill", "prefill.compute", 10, 400, rid="h1", engine="p0")
    _open(c, "prefill", "prefill.block_hold", 400, F, "h1", engine="p0", span_id=12,
          attrs={"wait.for": "registration", "request.mode": "push"})
    _open(c, "decode", "dest.register", 5, F, "h1", engine="d0", span_id=13,
          attrs={"wait.for": "registration", "wait.expected": 1, "wait.received": 0})
    # h2: finished (its span row has the open rows' span id)
    _open(c, "decode", "decode.queue", 100, [1000, 2000], "h2", engine="d0", span_id=21)
    c.span("decode", "decode.queue", 100, 2500, rid="h2", engine="d0", span_id=21)
    # h3: abandoned
    _open(c, "decode", "decode.queue", 200, [1000, 2000], "h3", engine="d0", span_id=31, state="abandoned")
    # h4: D's open handoff.prep ended by the worker's row of the same stage (another span id)
    _open(c, "decode", "handoff.prep", 100, [1000], "h4", engine="d0", span_id=41, attrs={"wait.for": "read_post"})
    c.span("decode", "handoff.prep", 100, 1500, rid="h4", engine="d0", span_id=42)
    # h5: queue between chunks (an earlier prefill.queue ended before this one started)
    c.span("prefill", "prefill.queue", 0, 50, rid="h5", engine="p0")
    c.span("prefill", "prefill.compute", 50, 900, rid="h5", engine="p0")
    _open(c, "prefill", "prefill.queue", 900, [1000, 2000, 3000], "h5", engine="p0", span_id=51,
          attrs={"wait.for": "schedule"})
    _flushes(c, "router")
    _flushes(c, "prefill", "p0")
    _flushes(c, "decode", "d0", at=(1000, 2000, 3000, 3500))
    return c


def test_in_flight_lists_stuck_requests_with_stage_age_and_wait(analyse):
    tr = analyse(_case())
    rows = {r["request_id"]: r for r in tr.query("SELECT * FROM in_flight ORDER BY request_id")}
    assert set(rows) == {"h1", "h5"}
    h1 = rows["h1"]
    # the open stage owning time that started last: P's block hold is a parent (no category) ->
    # D's dest.register (coordination) is the current stage
    assert (h1["stage"], h1["category"], h1["role"], h1["engine_id"]) == ("dest.register", "coordination", "decode", "d0")
    assert h1["since_ns"] == ns(5)
    assert h1["trace_end_ns"] == ns(3500)  # D's last flush
    assert h1["age_ms"] == 3495.0
    assert h1["waits_for"] == "registration 0 of 1"
    assert (h1["wait_for"], h1["wait_expected"], h1["wait_received"]) == ("registration", 1, 0)
    assert h1["mode"] == "push" and h1["run_id"] == RUN
    assert h1["open_stages"] == ["router.request", "dest.register", "prefill.block_hold"]
    h5 = rows["h5"]
    assert (h5["stage"], h5["since_ns"], h5["age_ms"], h5["waits_for"]) == ("prefill.queue", ns(900), 2100.0, "schedule")
    spans = tr.query("SELECT request_id, stage, age_ms FROM in_flight_spans ORDER BY request_id, stage")
    assert [(r["request_id"], r["stage"], r["age_ms"]) for r in spans] == [
        ("h1", "dest.register", 3495.0), ("h1", "prefill.block_hold", 2600.0), ("h1", "router.request", 3000.0),
        ("h5", "prefill.queue", 2100.0)]


def test_open_rows_change_no_answer_about_requests(analyse, tmp_path):
    """The same store without its open and stats rows gives the same spans, requests and incomplete rows,
    except the times that run to the trace end (DESIGN.md §4: a request still open runs to each process's
    last flush): time_to_failure / failure_ns of an open request, and orphan waits."""
    with_open = _case()
    without = Case()
    for k, rows in with_open.rows.items():
        without.rows[k] = [r for r in rows if r["record"] not in ("open", "stats")]
    a, b = analyse(with_open), analyse(without)
    for q in ("SELECT * EXCLUDE (record_id) FROM spans ORDER BY request_id, stage, start_ns",
              "SELECT * EXCLUDE (flags) FROM requests ORDER BY request_id",
              "SELECT * EXCLUDE (rkey, failure_ns, time_to_failure_ms, orphan_wait_ms, orphan_side, detail) "
              "FROM incomplete_requests ORDER BY request_id"):
        assert a.query(q) == b.query(q), q
    assert b.query("SELECT * FROM in_flight") == []
    # h1 is open at the router (arrival: its first engine record, P's queue at 1): with the flushes it
    # runs to the router's trace end (3000), without them to its last record (P's compute ending at 400)
    q = "SELECT time_to_failure_ms FROM incomplete_requests WHERE request_id = 'h1'"
    assert (a.query(q)[0]["time_to_failure_ms"], b.query(q)[0]["time_to_failure_ms"]) == (2999, 399)
    # the one exception: an open block hold is evidence that blocks are still held at the trace end
    # (DESIGN.md §4 block holds): only in-flight requests gain the flag blocks_never_released
    fa = {r["request_id"]: r["flags"] for r in a.query("SELECT request_id, flags FROM requests")}
    fb = {r["request_id"]: r["flags"] for r in b.query("SELECT request_id, flags FROM requests")}
    in_flight = {r["request_id"] for r in a.query("SELECT request_id FROM in_flight")}
    changed = {rid for rid in fa if fa[rid] != fb[rid]}
    assert changed <= in_flight
    assert all(set(fa[rid]) - set(fb[rid]) == {"blocks_never_released"} for rid in changed)


def test_refresh_drops_a_request_that_finished(analyse, tmp_path):
    """A later file with h1's span rows (same span ids) takes it out of in_flight on the next refresh."""
    c = _case()
    d = tmp_path / "live"
    tr = analyse(c, directory=d)
    assert {r["request_id"] for r in tr.query("SELECT request_id FROM in_flight")} == {"h1", "h5"}
    later = Case()
    later.span("decode", "dest.register", 5, 3600, rid="h1", engine="d0", span_id=13)
    later.span("router", "router.request", 0, 3700, rid="h1", span_id=11, attrs={"request.mode": "push"})
    later.span("prefill", "prefill.block_hold", 400, 3650, rid="h1", engine="p0", span_id=12)
    later.write(d, prefix="z-")
    tr.refresh()
    assert [r["request_id"] for r in tr.query("SELECT request_id FROM in_flight")] == ["h5"]


def test_report_prints_in_flight_first(analyse):
    tr = analyse(_case())
    data = report.collect(tr.readonly() if hasattr(tr, "readonly") else tr.con)
    assert [r["request_id"] for r in data["in_flight"]] == ["h1", "h5"]
    text = report.render(data)
    assert text.startswith("In flight now (2 requests")
    first = text.split("\n\n")[0]
    assert "h1" in first and "dest.register" in first and "registration 0 of 1" in first and "3495" in first
    empty = dict(data, in_flight=[])
    assert "In flight" not in report.render(empty)
