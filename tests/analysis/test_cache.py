"""The incremental cache: absorbing a new file recomputes only what it touches and equals a cold build."""
from pdtrace.analysis import db
from test_ttft_cases import _case_a, _case_g, _case_h

_Q = "SELECT * EXCLUDE (rkey) FROM ttft_breakdown ORDER BY request_id"


def _assert_same_as_cold(tr, directory, queries) -> None:
    """Each query gives the same rows on the warm Trace ``tr`` as on a cold build of ``directory``."""
    with db.open_trace(directory) as cold:
        for q in queries:
            assert tr.query(q) == cold.query(q), q


def test_new_file_recomputes_only_its_requests(tmp_path):
    d = tmp_path / "s"
    _case_a().write(d, prefix="a-")
    cache = tmp_path / "c.duckdb"
    with db.Trace(d, cache=cache) as tr:
        r = tr.refresh()
        assert r.rebuilt and r.dirty_requests == 3
        assert tr.refresh().new == []                       # nothing changed: no work
    _case_h().write(d, prefix="h-")
    with db.Trace(d, cache=cache) as tr:                    # reopened: the cache persists
        r = tr.refresh()
        assert not r.rebuilt and len(r.new) == 3 and r.dirty_requests == 1
        warm = tr.query(_Q)
    with db.open_trace(d) as cold:
        assert cold.query(_Q) == warm
    assert [w["request_id"] for w in warm] == ["h1", "r1", "r2", "r3"]


def test_late_clock_evidence_recomputes_affected_requests(tmp_path):
    d = tmp_path / "s"
    c = _case_g()
    sample = [r for r in c.rows[("decode", "d0")] if r["name"] == "clock.sample"]
    c.rows[("decode", "d0")] = [r for r in c.rows[("decode", "d0")] if r["name"] != "clock.sample"]
    c.write(d)
    with db.Trace(d) as tr:
        tr.refresh()
        before = tr.query("SELECT clock_offset_ns FROM spans WHERE stage = 'prefill.compute'")[0]["clock_offset_ns"]
        from pdtrace.instrument import store
        store.write_rows(d, sample, resource={"run_id": "run-test", "role": "decode", "engine_id": "d0"},
                         name="late-decode.parquet")
        r = tr.refresh()
        assert r.dirty_requests == 1
        after = tr.query("SELECT clock_offset_ns FROM spans WHERE stage = 'prefill.compute'")[0]["clock_offset_ns"]
        assert before == 249_000_000 and after == 250_000_000     # least correction, then the sample
        assert tr.query("SELECT compute_ms FROM ttft_breakdown")[0]["compute_ms"] == 127


def test_batched_refresh_equals_one_pass(tmp_path):
    """A refresh larger than ``batch_requests`` runs in time-ordered batches, each reading only its
    requests' files; every view equals the one-pass result, linked ids (case K) included."""
    import os
    import time

    from test_handoff_cases import _case_j
    from test_incomplete import _case_e, _case_k
    from test_ttft_cases import _case_c, _case_d, _case_i, _case_l

    d = tmp_path / "s"
    cases = [("a", _case_a), ("c", _case_c), ("d", _case_d), ("h", _case_h), ("i", _case_i), ("l", _case_l),
             ("e", _case_e), ("k", _case_k), ("j", _case_j)]
    for n, (prefix, make) in enumerate(cases):
        for p in make().write(d, prefix=f"{prefix}-"):
            t = time.time_ns() - (len(cases) - n) * 10**9  # files of later cases are newer
            os.utime(p, ns=(t, t))
    views = {
        "ttft_breakdown": _Q,
        "ttft_segments": "SELECT * EXCLUDE (rkey) FROM ttft_segments ORDER BY request_id, seq",
        "requests": "SELECT * FROM requests ORDER BY request_id",
        "incomplete_requests": "SELECT * EXCLUDE (rkey) FROM incomplete_requests ORDER BY request_id",
        "request_stalls": "SELECT * FROM request_stalls ORDER BY request_id",
    }
    with db.open_trace(d) as one:
        want = {v: one.query(q) for v, q in views.items()}
        n_req = len(want["requests"])
    assert n_req >= 15 and len(want["ttft_breakdown"]) >= 8 and want["incomplete_requests"]
    for size in (1, 4):
        tr = db.Trace(d)
        tr.batch_requests = size
        with tr:
            r = tr.refresh()
            assert r.dirty_requests >= n_req
            for v, q in views.items():
                assert tr.query(q) == want[v], (size, v)


def test_cache_built_with_another_stage_vocabulary_is_rebuilt(tmp_path, monkeypatch):
    # The vocabulary is stored in the cache and fixes the _stage_name ENUM: a
    # cache from a pdtrace with other stages must not be reused (a new stage
    # name would not even cast to the old ENUM).
    from pdtrace.instrument import stages
    d = tmp_path / "s"
    _case_h().write(d)
    cache = tmp_path / "c.duckdb"
    with db.Trace(d, cache=cache) as tr:
        assert tr.refresh().rebuilt
    with db.Trace(d, cache=cache) as tr:
        assert not tr.refresh().rebuilt
    monkeypatch.setitem(stages.STAGES, "handoff.new_step",
                        stages.Stage("prefill", "coordination", "a stage a later pdtrace adds"))
    with db.Trace(d, cache=cache) as tr:
        assert tr.refresh().rebuilt
        names = tr.query("SELECT unnest(enum_range(NULL::_stage_name)) AS s")
        assert {"handoff.new_step", "unattributed", "kv.transfer"} <= {n["s"] for n in names}
        assert tr.query("SELECT ttft_ms FROM ttft_breakdown")[0]["ttft_ms"] == 4070


def test_clock_evidence_absorbed_per_file_equals_a_cold_build(tmp_path):
    # The clock evidence is kept per store file (materialize kind 'file') and
    # merged by the views: absorbing a file reads only it, and removing it
    # removes its evidence. Here a second decode engine on the API server's
    # host arrives and leaves: the API-server domain goes unresolved and back,
    # and every state equals a cold build of the same directory.
    from pdtrace_case_builder import T0, Case
    from test_clock_rules import _pull
    d = tmp_path / "s"
    a = Case(clock_shift_ms={"d0": 250, "decode": 250})
    _pull(a, "n1", d_api=True, api_engine=None)
    for k, mono in enumerate((1_000, 2_000)):
        a.rows[("decode", "d0")].append({"record": "clock", "name": "clock.anchor", "start_ns": T0 + k,
                                         "attrs": {"clock.mono_ns": mono}})
        a.rows[("prefill", "p0")].append({"record": "clock", "name": "clock.anchor", "start_ns": T0 + k,
                                          "attrs": {"clock.mono_ns": mono}})
    a.write(d, prefix="a-")
    b = Case()
    b.span("decode", "decode.first_step", 210, 250, rid="u2", engine="d1")
    queries = ("SELECT * FROM clock_domains ORDER BY domain",
               "SELECT * FROM _domain_offsets ORDER BY ALL",
               "SELECT * FROM clock_offsets ORDER BY ALL",
               "SELECT * FROM _clock_anchors ORDER BY ALL",
               "SELECT record_id, start_ns, end_ns, clock_offset_ns, clock_bound_ns FROM spans ORDER BY record_id",
               _Q)

    def same_as_cold(tr):
        _assert_same_as_cold(tr, d, queries)
        return {r["domain"]: r["status"] for r in tr.query("SELECT * FROM clock_domains")}

    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        tr.refresh()
        assert same_as_cold(tr)["api:decode@h/run-test"] == "inherited"
        new = b.write(d, prefix="b-")
        r = tr.refresh()
        assert not r.rebuilt and sorted(r.new) == sorted(map(str, new))
        assert same_as_cold(tr)["api:decode@h/run-test"] == "unresolved"
        for p in new:
            p.unlink()
        tr.refresh()
        assert same_as_cold(tr)["api:decode@h/run-test"] == "inherited"
        assert tr.query("SELECT count(*) AS n FROM _mat_clock_engine_part WHERE domain = 'd1'")[0]["n"] == 0


def test_engine_steps_absorbed_per_file_equal_a_cold_build(tmp_path):
    # decode.step spans and their connector.* children are kept per store file
    # (materialize kind 'file'). Case J's steps (step 50 stalled 600 ms by R's
    # recompute and a 150 ms connector.load for Z) arrive in a later file set,
    # then vanish: each state equals a cold build.
    from copy import deepcopy
    from test_handoff_cases import _case_j
    d = tmp_path / "s"
    full = _case_j(connector_ms=150)
    first, steps = deepcopy(full), deepcopy(full)
    for key in full.rows:
        first.rows[key] = [r for r in full.rows[key] if r["name"] not in ("decode.step", "connector.load")]
        steps.rows[key] = [r for r in full.rows[key] if r["name"] in ("decode.step", "connector.load")]
    first.write(d, prefix="a-")
    queries = ("SELECT * FROM decode_stalls ORDER BY step_span_id",
               "SELECT * FROM decode_stall_causes ORDER BY ALL",
               "SELECT * EXCLUDE (rkey) FROM request_stalls ORDER BY request_id")

    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        assert tr.query("SELECT count(*) AS n FROM decode_stalls")[0]["n"] == 0
        new = steps.write(d, prefix="b-")
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        causes = {r["kind"]: r["share_ms"] for r in tr.query("SELECT * FROM decode_stall_causes")}
        assert causes == {"connector.load": 150, "recompute": 450}
        assert {r["request_id"]: r["stall_ms"] for r in tr.query("SELECT * FROM request_stalls")
                if r["request_id"] in "ABC"} == {"A": 600, "B": 600, "C": 600}
        for p in new:
            p.unlink()
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        assert tr.query("SELECT count(*) AS n FROM decode_stalls")[0]["n"] == 0


def test_engine_steps_copied_by_compaction_count_once(tmp_path):
    # The batch entries of each decode.step are parsed once per file (kind
    # 'file'); a compaction copy of the steps' file must not double them. Case
    # J with a 150 ms connector.load: step 50's 600 ms excess is 150 for Z's
    # load and 450 for R's recompute, and each of A, B, C pays 600 once.
    import shutil
    from test_handoff_cases import _case_j
    d = tmp_path / "s"
    paths = _case_j(connector_ms=150).write(d)
    queries = ("SELECT * FROM decode_stalls ORDER BY step_span_id",
               "SELECT * FROM decode_stall_causes ORDER BY ALL",
               "SELECT * EXCLUDE (rkey) FROM request_stalls ORDER BY request_id")
    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        tr.refresh()
        first = [tr.query(q) for q in queries]
        dec = [p for p in paths if "decode" in p.name][0]
        shutil.copy(dec, d / ("0-" + dec.name))             # sorts first: its copies become the visible ones
        assert not tr.refresh().rebuilt
        assert [tr.query(q) for q in queries] == first
        _assert_same_as_cold(tr, d, queries)
        assert {r["kind"]: r["share_ms"] for r in tr.query("SELECT * FROM decode_stall_causes")} == {
            "connector.load": 150, "recompute": 450}
        assert {r["request_id"]: r["stall_ms"] for r in tr.query("SELECT * FROM request_stalls")
                if r["request_id"] in "ABC"} == {"A": 600, "B": 600, "C": 600}


def test_router_link_arriving_later_joins_the_legs(tmp_path):
    # Case K (the router sent X1 to P and X2 to D): the engines' files come
    # first, so X2 is a request of its own (no router record); the router's file
    # then links X2 to X1 (kept per file: an absorb reads only the new file for
    # links) and X2 is no longer a request; when the router's file vanishes, X2
    # is back. Every state equals a cold build.
    from copy import deepcopy
    from test_incomplete import _case_k
    d = tmp_path / "s"
    full = _case_k()
    engines, router = deepcopy(full), deepcopy(full)
    for key in full.rows:
        (router if key[0] == "router" else engines).rows[key] = full.rows[key]
        (engines if key[0] == "router" else router).rows[key] = []
    engines.write(d, prefix="a-")
    queries = ("SELECT * EXCLUDE (rkey) FROM requests ORDER BY request_id",
               "SELECT * EXCLUDE (rkey) FROM incomplete_requests ORDER BY request_id", _Q)
    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        assert "X2" in {r["request_id"] for r in tr.query("SELECT request_id FROM requests")}
        new = router.write(d, prefix="b-")
        assert not tr.refresh().rebuilt
        _assert_same_as_cold(tr, d, queries)
        assert {r["request_id"] for r in tr.query("SELECT request_id FROM requests")} == {"X1", "Y"}
        inc = tr.query("SELECT * FROM incomplete_requests")
        assert [(r["request_id"], r["cause"], r["linked_request_id"]) for r in inc] == [("X1", "id_mismatch", "X2")]
        for p in new:
            p.unlink()
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        assert "X2" in {r["request_id"] for r in tr.query("SELECT request_id FROM requests")}


def test_request_clock_bounds_follow_files_arriving_and_leaving(tmp_path):
    # The router<->engine bounds of each request are kept per request (kind
    # 'changed') and recomputed when a file holding the request's rows arrives
    # or leaves. Case G (P's clock 250 ms ahead) arrives file by file: router,
    # then P, then D; then P's file vanishes. Each state equals a cold build.
    from copy import deepcopy
    d = tmp_path / "s"
    full = _case_g()
    queries = ("SELECT * FROM clock_offsets ORDER BY ALL",
               "SELECT * EXCLUDE (rkey) FROM spans ORDER BY record_id", _Q)
    parts = {}
    for role in ("router", "prefill", "decode"):
        parts[role] = deepcopy(full)
        for key in full.rows:
            parts[role].rows[key] = full.rows[key] if key[0] == role else []
    d.mkdir()
    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        written = {}
        for role in ("router", "prefill", "decode"):
            written[role] = parts[role].write(d, prefix=role + "-")
            tr.refresh()
            _assert_same_as_cold(tr, d, queries)
        assert tr.query("SELECT offset_ms FROM clock_offsets WHERE clock_a = 'd0' AND clock_b = 'p0' "
                        "AND window_start_ns IS NULL")[0]["offset_ms"] == 250
        assert tr.query("SELECT compute_ms FROM ttft_breakdown")[0]["compute_ms"] == 127
        for p in written["prefill"]:
            p.unlink()
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        # P's HTTP bounds are gone with its file; D's handshake sample of P's clock stays
        left = tr.query("SELECT clock_a, clock_b, messages, samples FROM clock_offsets "
                        "WHERE 'p0' IN (clock_a, clock_b) AND window_start_ns IS NULL")
        assert left == [{"clock_a": "d0", "clock_b": "p0", "messages": 0, "samples": 1}]


def test_clock_window_emptied_by_a_vanished_request(tmp_path):
    # The kept clock bounds are rolled up per window (kind 'window'); a window
    # is recomputed when rows of a changed request were in it before or after
    # the change. Case G (window 0) plus a request 200 s later (its own
    # clock window, P 250 ms ahead there too) in a second file set; when that
    # set vanishes, its window's roll-up must go: every state equals a cold build.
    from pdtrace_case_builder import Case
    d = tmp_path / "s"
    _case_g().write(d, prefix="a-")
    late = Case(clock_shift_ms={"p0": 250})
    b = 200_000
    root = late.router_request("late", b, b + 160, "pull", first_token_ms=b + 150)
    late.span("router", "router.dispatch", b, b + 2, rid="late", parent=root, attrs={"router.leg": "prefill"})
    late.span("prefill", "prefill.compute", b + 2, b + 100, rid="late", engine="p0")
    late.span("router", "router.dispatch", b + 101, b + 103, rid="late", parent=root, attrs={"router.leg": "decode"})
    late.span("decode", "decode.first_step", b + 103, b + 150, rid="late", engine="d0")
    queries = ("SELECT * FROM clock_offsets ORDER BY ALL", _Q)
    windows = "SELECT DISTINCT window_start_ns FROM clock_offsets WHERE window_start_ns IS NOT NULL"
    with db.Trace(d, cache=tmp_path / "c.duckdb") as tr:
        tr.refresh()
        n0 = len(tr.query(windows))
        new = late.write(d, prefix="b-")
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        assert len(tr.query(windows)) == n0 + 1
        for p in new:
            p.unlink()
        tr.refresh()
        _assert_same_as_cold(tr, d, queries)
        assert len(tr.query(windows)) == n0
