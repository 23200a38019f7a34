"""Clock-skew rules (analysis/sql/clock.sql, DESIGN.md §3) on hand-built stores, each with its right answer.

Times in ms from T0 on the true clock (pdtrace_case_builder); a shifted clock's raw times are true + shift.
"""
from __future__ import annotations

from pdtrace_case_builder import T0, Case, ns


def _pull(c: Case, rid: str, d_api: bool = False, api_engine: str | None = None) -> None:
    """One pull request, router on the true clock: dispatch P 0-2, P compute 2-100, dispatch D 101-103,
    D first step 110-150, first token 150. With d_api, D's API server records decode.frontend 103-151
    on D's host clock (engine_id api_engine: None as an older middleware wrote it)."""
    root = c.router_request(rid, 0, 160, "pull", first_token_ms=150)
    c.span("router", "router.dispatch", 0, 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 2, 100, rid=rid, engine="p0")
    c.span("router", "router.dispatch", 101, 103, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.first_step", 110, 150, rid=rid, engine="d0")
    if d_api:
        c.span("decode", "decode.frontend", 103.5, 151, rid=rid, engine=api_engine,
               attrs={"frontend.part": "whole"})


def _offsets(tr) -> dict[str, dict]:
    return {r["domain"]: r for r in tr.query("SELECT * FROM _domain_offsets WHERE window_idx IS NULL")}


# -- bug 3: anchors exact in integers ------------------------------------------------------------

def test_anchor_wall_minus_mono_is_exact_integer(analyse):
    """median() of epoch-ns BIGINTs goes through DOUBLE (53 bits) and lost up to 128 ns; now exact."""
    c = Case()
    _pull(c, "a1")
    base = T0 + 123_456_789                                   # not a multiple of 256
    for k, extra in enumerate([0, 250_000_001, 250_000_003]):  # d0: three anchors, median the middle one
        c.rows[("decode", "d0")].append({"record": "clock", "name": "clock.anchor", "start_ns": base + k,
                                         "attrs": {"clock.mono_ns": k - extra}})
    for k, extra in enumerate([250_000_000, 250_000_002]):     # p0: two, the mean of the two middle values
        c.rows[("prefill", "p0")].append({"record": "clock", "name": "clock.anchor", "start_ns": base + k,
                                          "attrs": {"clock.mono_ns": k - extra}})
    tr = analyse(c)
    a = {r["domain"]: r for r in tr.query("SELECT * FROM _clock_anchors")}
    assert a["d0"]["wall_minus_mono"] == base + 250_000_001 and a["d0"]["anchors"] == 3
    assert a["p0"]["wall_minus_mono"] == base + 250_000_001 and a["p0"]["anchors"] == 2


def test_monotonic_sample_converted_exactly():
    """The converted handshake offset keeps every ns: anchors 250,000,000 ns apart give exactly that."""
    import tempfile

    from pdtrace.analysis import db

    c = Case()
    _pull(c, "m1")
    base = T0 + 987_654_321
    c.rows[("decode", "d0")].append({"record": "clock", "name": "clock.anchor", "start_ns": base,
                                     "attrs": {"clock.mono_ns": 1_000}})
    c.rows[("prefill", "p0")].append({"record": "clock", "name": "clock.anchor", "start_ns": base + 250_000_000,
                                      "attrs": {"clock.mono_ns": 1_000}})
    c.event("decode", "clock.sample", 103, engine="d0",
            attrs={"clock.offset_ns": 0, "clock.rtt_bound_ns": 2_000_000, "clock.peer_engine_id": "p0",
                   "clock.domain": "monotonic"})
    with tempfile.TemporaryDirectory() as d:
        c.write(d)
        with db.open_trace(d) as tr:
            b = tr.query("SELECT point_ns FROM _clock_bounds WHERE kind = 'clock.sample'")
    assert b == [{"point_ns": 250_000_000}]


# -- bug 1: API-server rows join their engine's clock domain ----------------------------------------

def test_api_server_rows_with_engine_id_take_the_engine_offset(analyse):
    c = Case(clock_shift_ms={"d0": 250})
    _pull(c, "e1", d_api=True, api_engine="d0")
    tr = analyse(c)
    rows = tr.query("""SELECT engine_id, stage, raw_start_ns - start_ns AS corr, clock_domain
                       FROM spans WHERE role = 'decode' ORDER BY stage""")
    assert [(r["stage"], r["corr"], r["clock_domain"]) for r in rows] == [
        ("decode.first_step", 250_000_000, "d0"), ("decode.frontend", 250_000_000, "d0")]


def test_api_server_rows_without_engine_id_mapped_to_the_single_engine(analyse):
    """An older middleware wrote no engine_id: same host, role and run with one engine -> its domain."""
    c = Case(clock_shift_ms={"d0": 250, "decode": 250})
    _pull(c, "n1", d_api=True, api_engine=None)
    tr = analyse(c)
    rows = {r["stage"]: r for r in tr.query("SELECT * FROM spans WHERE role = 'decode'")}
    assert rows["decode.frontend"]["engine_id"] is None
    assert rows["decode.frontend"]["clock_domain"] == "api:decode@h/run-test"
    assert rows["decode.frontend"]["raw_start_ns"] - rows["decode.frontend"]["start_ns"] == 250_000_000
    assert rows["decode.frontend"]["clock_offset_ns"] == rows["decode.first_step"]["clock_offset_ns"]
    assert rows["decode.frontend"]["clock_bound_ns"] == rows["decode.first_step"]["clock_bound_ns"]
    dom = {r["domain"]: r for r in tr.query("SELECT * FROM clock_domains")}
    assert dom["api:decode@h/run-test"] == {"domain": "api:decode@h/run-test", "offset_domain": "d0",
                                             "status": "inherited", "engines": 1}
    assert dom["d0"]["status"] == "measured"


def test_api_server_rows_without_engine_id_ambiguous_are_flagged(analyse):
    """Two decode engines on the host: the API-server domain is not guessed; clock_domains flags it."""
    c = Case()
    _pull(c, "u1", d_api=True, api_engine=None)
    c.span("decode", "decode.first_step", 210, 250, rid="u2", engine="d1")
    tr = analyse(c)
    dom = {r["domain"]: r for r in tr.query("SELECT * FROM clock_domains")}
    assert dom["api:decode@h/run-test"]["status"] == "unresolved"
    assert dom["api:decode@h/run-test"]["offset_domain"] is None and dom["api:decode@h/run-test"]["engines"] == 2


# -- bug 2: a wide sample does not move engines whose router bounds contain 0 -----------------------

def _same_host_wide_sample(d_to_p_ms: float, rtt_ms: float) -> Case:
    """No skew; router<->engine round trips bound P in [-2, +1] ms, D in [-1, +7] ms (from the first
    step's end 150 -> first token 151 and dispatch 101-103 -> D's first span 110)."""
    c = Case()
    root = c.router_request("w1", 0, 160, "pull", first_token_ms=151)
    c.span("router", "router.dispatch", 0, 2, rid="w1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 3, 100, rid="w1", engine="p0")
    c.span("router", "router.dispatch", 101, 102, rid="w1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.first_step", 109, 150, rid="w1", engine="d0")
    c.event("decode", "clock.sample", 103, engine="d0",
            attrs={"clock.offset_ns": round(d_to_p_ms * 1e6), "clock.rtt_ns": round(rtt_ms * 1e6),
                   "clock.peer_engine_id": "p0"})
    return c


def test_wide_sample_does_not_shift_same_host_engines(analyse):
    """The reported case: D->P sample 181 +- 302 ms; the truth is 0 for both engines."""
    tr = analyse(_same_host_wide_sample(181, 604))
    off = _offsets(tr)
    assert off["p0"]["offset_ns"] == 0 and off["d0"]["offset_ns"] == 0
    # P: router->P upper 3 - 2 = 1 ms; P's compute end -> D dispatched: lower 100 - 101 = -1 ms
    assert off["p0"]["bound_ns"] == 1_000_000
    # D: router->D upper 109 - 102 = 7 ms; D->router lower 150 - 151 = -1 ms
    assert off["d0"]["bound_ns"] == 7_000_000


def test_wide_sample_inside_bounds_that_admit_zero_is_not_used(analyse):
    """A sample wider than the router bounds, even with its point inside them, does not beat 'no skew'."""
    tr = analyse(_same_host_wide_sample(0.5, 604))
    off = _offsets(tr)
    assert off["p0"]["offset_ns"] == 0 and off["d0"]["offset_ns"] == 0


def test_tight_sample_is_used_only_where_it_tightens(analyse):
    """Sample P - D = 0.5 +- 0.25 ms. For D, through P: [-1, 1] - [0.25, 0.75] = [-1.75, 0.75] (width 2.5)
    is tighter than D's own [-1, 7]: D = 0 - 0.5 = -0.5 ms, inside [-1, 0.75], bound 1.25 ms. For P, through
    D: [-1, 7] + [0.25, 0.75] is wider than P's own [-1, 1], which admits 0: P stays 0 +- 1 ms."""
    tr = analyse(_same_host_wide_sample(0.5, 0.5))
    off = _offsets(tr)
    assert off["d0"]["offset_ns"] == -500_000 and off["d0"]["bound_ns"] == 1_250_000
    assert off["p0"]["offset_ns"] == 0 and off["p0"]["bound_ns"] == 1_000_000


# -- bug 2: the engine pair row combines the bounds through the router -----------------------------

def test_engine_pair_row_combines_router_bounds(analyse):
    """D's clock +250 ms; the handshake sample under load is wide and off (P - D = -128 +- 267 ms). Through
    the router: P in [-1, 1], D in [249, 257] -> P - D in [-258, -248]; the row is the domains' difference."""
    c = Case(clock_shift_ms={"d0": 250})
    root = c.router_request("s1", 0, 160, "pull", first_token_ms=151)
    c.span("router", "router.dispatch", 0, 2, rid="s1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 3, 100, rid="s1", engine="p0")
    c.span("router", "router.dispatch", 101, 102, rid="s1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.first_step", 109, 150, rid="s1", engine="d0")
    c.event("decode", "clock.sample", 103, engine="d0",
            attrs={"clock.offset_ns": -128_000_000, "clock.rtt_ns": 534_000_000, "clock.peer_engine_id": "p0"})
    tr = analyse(c)
    off = _offsets(tr)
    assert off["d0"]["offset_ns"] == 249_000_000 and off["d0"]["bound_ns"] == 8_000_000   # least correction
    assert off["p0"]["offset_ns"] == 0
    row = tr.query("""SELECT * FROM clock_offsets WHERE clock_a = 'd0' AND clock_b = 'p0'
                      AND window_start_ns IS NULL""")[0]
    assert row["lower_ns"] == -258_000_000 and row["upper_ns"] == -248_000_000
    assert row["offset_ns"] == -249_000_000 and row["bound_ns"] == 9_000_000
    assert row["samples"] == 1 and row["sources"] == "clock.sample,via_router" and row["consistent"]


# -- bug 1 at the source: the middleware writes its engine's engine_id -----------------------------

_MW_CHILD = """
    import asyncio, glob, sys, types, pyarrow.parquet as pq
    sys.argv = {argv!r}
    from pdtrace.instrument import tracer
    from pdtrace.connector.traced.middleware import FrontendMiddleware
    async def app(scope, receive, send):
        await send({{"type": "http.response.start", "status": 200, "headers": []}})
        await send({{"type": "http.response.body", "body": b"a"}})
    mw = FrontendMiddleware(app)
    kvc = types.SimpleNamespace(engine_id="engine-from-app")
    state = types.SimpleNamespace(vllm_config=types.SimpleNamespace(kv_transfer_config=kvc))
    async def send(m): pass
    async def receive(): return {{"type": "http.request", "body": b"{{}}"}}
    scope = {{"type": "http", "method": "POST", "path": "/v1/completions", "app": types.SimpleNamespace(state=state),
             "headers": [(b"x-request-id", b"X7")]}}
    asyncio.run(mw(scope, receive, send))
    tracer.shutdown()
    rows = [r for f in glob.glob("{d}/*.parquet") for r in pq.read_table(f).to_pylist()]
    print(sorted({{(r["role"], r["engine_id"]) for r in rows if r["name"] == "decode.frontend"}}))
"""


def test_middleware_engine_id_from_argv(tmp_path, child):
    argv = ["api_server", "--kv-transfer-config",
            '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "engine-from-argv"}']
    r = child(_MW_CHILD.format(argv=argv, d=tmp_path), env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[('decode', 'engine-from-argv')]"


def test_middleware_engine_id_from_app_state(tmp_path, child):
    """No engine_id on the command line (vLLM draws a uuid4): read from app.state.vllm_config."""
    argv = ["api_server", '--kv-transfer-config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}']
    r = child(_MW_CHILD.format(argv=argv, d=tmp_path), env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[('decode', 'engine-from-app')]"


def test_sample_judged_on_its_own_interval_not_with_the_messages(analyse):
    """A registration D -> P (sent 104 on D, received 105 on P: P - D <= 1 ms) and a sample
    P - D = 0.3 +- 20 ms. P's router bounds [-40, 1] admit 0; the sample through D ([-1, 7] + [-19.7, 20.3],
    width 48 ms) is wider than them (41 ms), so it is not used even though the registration narrows the
    pair's row: P = 0, bound 20.7 ms (the sample's lower side -20.7 is the tightest lower bound)."""
    c = Case()
    root = c.router_request("p1", 0, 160, "pull", first_token_ms=151)   # P's lower bound: 60 - 100
    c.span("router", "router.dispatch", 0, 2, rid="p1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 3, 60, rid="p1", engine="p0")
    c.span("router", "router.dispatch", 100, 102, rid="p1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.first_step", 109, 150, rid="p1", engine="d0")
    c.event("prefill", "registration.received", 105, rid="p1", engine="p0",
            attrs={"clock.send_ns": ns(104), "clock.peer_engine_id": "d0"})
    c.event("decode", "clock.sample", 103, engine="d0",
            attrs={"clock.offset_ns": 300_000, "clock.rtt_ns": 40_000_000, "clock.peer_engine_id": "p0"})
    tr = analyse(c)
    off = _offsets(tr)
    assert off["d0"]["offset_ns"] == 0 and off["p0"]["offset_ns"] == 0
    assert off["p0"]["bound_ns"] == 20_700_000



def _push_p_bound(analyse, wait_end_ms: float, wait_status: int, first_token_ms: float = 260) -> tuple[int, int]:
    """One push request, P's clock +30 ms: router dispatch of both legs 0-1, router.wait on P's leg 1 to
    ``wait_end_ms`` (status ``wait_status``), P compute 2-100, D first step 150-250, first token
    ``first_token_ms`` (true times). Returns the (lower, upper) ns of P - router."""
    c = Case(clock_shift_ms={"p0": 30})
    root = c.router_request("w", 0, first_token_ms + 20, "push", first_token_ms=first_token_ms)
    c.span("router", "router.dispatch", 0, 1, rid="w", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", 1, wait_end_ms, rid="w", parent=root, attrs={"router.leg": "prefill"},
           status=wait_status)
    c.span("router", "router.dispatch", 0, 1, rid="w", parent=root, attrs={"router.leg": "decode"})
    c.span("prefill", "prefill.compute", 2, 100, rid="w", engine="p0")
    c.span("decode", "decode.first_step", 150, 250, rid="w", engine="d0")
    row = analyse(c).query("""SELECT * FROM clock_offsets WHERE clock_a = 'router' AND clock_b = 'p0'
                              AND window_start_ns IS NULL""")[0]
    return row["lower_ns"], row["upper_ns"]


def test_push_prefill_bound_from_the_routers_receipt_of_ps_response(analyse):
    """P answers its leg (router.wait ends at 102 on the router) after its compute (2-100), so P - router is
    in [100 - 102, 2 - 1] + 30 = [28, 31] ms. Before, P's response was paired with the first token only
    (260: transfer, D's step and the stream on top) and the bound's lower side was -130 ms (in a CI run
    on 2 loaded cores, 2026-12-07, such a bound was 79 ms and ``pdtrace check`` flagged it)."""
    assert _push_p_bound(analyse, 102, 0) == (28_000_000, 31_000_000)


def test_a_prefill_wait_cut_short_is_no_receipt(analyse):
    """The router.wait on P ended in an error at 50 ms (the router cancelled the leg): that end is no
    receipt of P's response, the first token (260) is; P - router in [100 + 30 - 260, 31] = [-130, 31] ms."""
    assert _push_p_bound(analyse, 50, 2) == (-130_000_000, 31_000_000)


def test_ps_response_after_the_first_token_leaves_the_first_token_as_receipt(analyse):
    """P's response reached the router at 300 ms, after the first token (260: P's API server stalled after
    computing); both come after P's compute, so the earlier, 260, bounds: P - router in [-130, 31] ms."""
    assert _push_p_bound(analyse, 300, 0) == (-130_000_000, 31_000_000)


def test_late_response_joined_before_the_first_token_sglang_22853(analyse):
    """sgl-project/sglang#22853: the router sends both legs at once and streams D's first token only after
    P's HTTP response, which P's event loop sends between two batches, ~200 ms after its compute under
    load. Here P answers at 290 ms (compute ended at 100) and the first token follows at 300. The late
    response is still a receipt after P's compute, the earliest one: P - router in
    [100 + 30 - 290, 2 + 30 - 1] = [-160, 31] ms, which holds the true offset (30 ms)."""
    lower, upper = _push_p_bound(analyse, 290, 0, first_token_ms=300)
    assert (lower, upper) == (-160_000_000, 31_000_000)
    assert lower <= 30_000_000 <= upper
