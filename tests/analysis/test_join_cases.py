"""Issue 17, kind 3: parent links never nest stages across processes (DESIGN.md §3 "Joins").

A request's spans are joined by (run, base request id, prompt index, attempt)
and time. An OpenTelemetry parent nests a stage only when the parent is a
stage of the same request and attempt recorded by the same process, in the
same trace id; a parent in another process (a router's dispatch span taken
from ``traceparent``, the API server's span taken from vLLM's trace headers),
in another trace, or not in the store counts as no parent. A request whose
spans sit in several trace ids gets the same breakdown; ``requests.trace_count``
says how many.

Each case is rebuilt from a public report: the same request is written once
the plain way (no parents, one trace id: the baseline) and once the way the
report's deployment would record it; the right answer is the baseline's
breakdown, segment for segment, with nothing left unattributed.
Times are ms from the request's arrival at the router.
"""
import secrets

import pytest

from pdtrace.instrument import ids
from pdtrace_case_builder import Case

BREAKDOWN = ("ttft_ns", "queue_ns", "compute_ns", "transfer_ns", "coordination_ns", "unattributed_ns",
             "hidden_ns", "dominant_stage", "dominant_ms", "segments")


def _answer(tr, rid):
    """(breakdown columns, segments (stage, category, start offset, duration)) of request ``rid``."""
    b = tr.query(f"SELECT {', '.join(BREAKDOWN)}, arrival_ns FROM ttft_breakdown WHERE request_id = ?", [rid])
    assert len(b) == 1, b
    b = b[0]
    segs = tr.query("SELECT stage, category, start_ns, dur_ns FROM ttft_segments WHERE request_id = ? ORDER BY seq",
                    [rid])
    return ({k: b[k] for k in BREAKDOWN},
            [(s["stage"], s["category"], s["start_ns"] - b["arrival_ns"], s["dur_ns"]) for s in segs])


def _trace_count(tr, rid):
    rows = tr.query("SELECT trace_count, flags FROM requests WHERE request_id = ?", [rid])
    assert len(rows) == 1, rows
    # requests.flags says split_trace exactly when the spans sit in more than one trace id
    assert ("split_trace" in rows[0]["flags"]) == (rows[0]["trace_count"] > 1), rows[0]
    return rows[0]["trace_count"]


def _rows(c, rid):
    """(role, engine, row) of every row of request ``rid``."""
    for (role, engine), rows in c.rows.items():
        for r in rows:
            if r.get("request_id") == rid:
                yield role, engine, r


def _one_trace(c, rid):
    """Every row of ``rid`` in the trace pdtrace derives from its id (router, P and D agree)."""
    for _, _, r in _rows(c, rid):
        r["trace_id"] = ids.trace_id(rid)


def _new_trace():
    return secrets.token_hex(16)


# --- the request shapes -----------------------------------------------------------------------------------
def _pull(c, rid, b, parent=lambda leg, dispatch: None):
    """A pull request; ``parent(leg, dispatch span id)`` gives the parent of each engine stage that has no
    parent in its own process (None: the plain way).

      router |disp 2|------- wait 118 ------|disp 2|------------------- wait 68 -------------------|
      P             |fe 2|queue 6|compute 108|
      D                                           |fe 1|prep 27 (handshake 22)|xfer 10|ready 2|first_step 26|
    TTFT 190 = queue 6 + compute 134 + transfer 10 + coordination 40 (dispatch 4, router waits 4, frontends 3,
    handoff.prep 27, kv.ready 2); unattributed 0.
    """
    root = c.router_request(rid, b, b + 200, "pull", first_token_ms=b + 190)
    dp = c.span("router", "router.dispatch", b, b + 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.wait", b + 2, b + 120, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    pp = parent("prefill", dp)
    c.span("prefill", "prefill.frontend", b + 2, b + 4, rid=rid, engine="p0", parent=pp, attrs={"frontend.part": "in"})
    c.span("prefill", "prefill.queue", b + 4, b + 10, rid=rid, engine="p0", parent=pp)
    c.span("prefill", "prefill.compute", b + 10, b + 118, rid=rid, engine="p0", parent=pp)
    dd = c.span("router", "router.dispatch", b + 120, b + 122, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("router", "router.wait", b + 122, b + 190, rid=rid, parent=root, attrs={"router.leg": "decode"})
    pd = parent("decode", dd)
    c.span("decode", "decode.frontend", b + 122, b + 123, rid=rid, engine="d0", parent=pd, attrs={"frontend.part": "in"})
    hp = c.span("decode", "handoff.prep", b + 123, b + 150, rid=rid, engine="d0", rank=0, parent=pd,
                attrs={"peer.engine_id": "p0", "kv.first_contact": 1})
    c.span("decode", "handoff.handshake", b + 123, b + 145, rid=rid, engine="d0", rank=0, parent=hp)
    c.span("decode", "kv.transfer", b + 150, b + 160, rid=rid, engine="d0", rank=0, parent=pd,
           attrs={"kv.bytes": 1 << 20, "kv.descriptors": 64, "kv.op": "READ", "peer.engine_id": "p0"})
    c.span("decode", "kv.ready", b + 160, b + 162, rid=rid, engine="d0", parent=pd)
    c.span("decode", "decode.first_step", b + 162, b + 188, rid=rid, engine="d0", parent=pd)


PULL_SEGMENTS = [  # (stage, category, start, duration) in ms
    ("router.dispatch", "coordination", 0, 2), ("prefill.frontend", "coordination", 2, 2),
    ("prefill.queue", "queue", 4, 6), ("prefill.compute", "compute", 10, 108),
    ("router.wait", "coordination", 118, 2), ("router.dispatch", "coordination", 120, 2),
    ("decode.frontend", "coordination", 122, 1), ("handoff.handshake", "coordination", 123, 22),
    ("handoff.prep", "coordination", 145, 5), ("kv.transfer", "transfer", 150, 10),
    ("kv.ready", "coordination", 160, 2), ("decode.first_step", "compute", 162, 26),
    ("router.wait", "coordination", 188, 2)]


def _push(c, rid, b, parent=lambda leg, dispatch: None):
    """A push request (both legs dispatched at once; P writes the KV into D's registered blocks).

      router |dp 2|dd 1|----------------------------- wait 177 ------------------------------|
      P           |fe 1|queue 5|---- compute 112 ----|prep 5 (writer_queue 3)|xfer 15|
      D                |fe 1|q 2|-- dest.register 24 --|                              |ready 5|first_step 33|
    """
    root = c.router_request(rid, b, b + 200, "push", first_token_ms=b + 180)
    dp = c.span("router", "router.dispatch", b, b + 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    dd = c.span("router", "router.dispatch", b + 2, b + 3, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("router", "router.wait", b + 3, b + 180, rid=rid, parent=root, attrs={"router.leg": "decode"})
    pp = parent("prefill", dp)
    c.span("prefill", "prefill.frontend", b + 2, b + 3, rid=rid, engine="p0", parent=pp, attrs={"frontend.part": "in"})
    c.span("prefill", "prefill.queue", b + 3, b + 8, rid=rid, engine="p0", parent=pp)
    c.span("prefill", "prefill.compute", b + 8, b + 120, rid=rid, engine="p0", parent=pp)
    hp = c.span("prefill", "handoff.prep", b + 120, b + 125, rid=rid, engine="p0", rank=0, parent=pp,
                attrs={"peer.engine_id": "d0"})
    c.span("prefill", "handoff.writer_queue", b + 120, b + 123, rid=rid, engine="p0", rank=0, parent=hp)
    c.span("prefill", "kv.transfer", b + 125, b + 140, rid=rid, engine="p0", rank=0, parent=pp,
           attrs={"kv.bytes": 1 << 20, "kv.descriptors": 64, "kv.op": "WRITE", "peer.engine_id": "d0"})
    pd = parent("decode", dd)
    c.span("decode", "decode.frontend", b + 3, b + 4, rid=rid, engine="d0", parent=pd, attrs={"frontend.part": "in"})
    c.span("decode", "decode.queue", b + 4, b + 6, rid=rid, engine="d0", parent=pd)
    c.span("decode", "dest.register", b + 6, b + 30, rid=rid, engine="d0", parent=pd)
    c.span("decode", "kv.ready", b + 140, b + 145, rid=rid, engine="d0", parent=pd)
    c.span("decode", "decode.first_step", b + 145, b + 178, rid=rid, engine="d0", parent=pd)


def _baseline(analyse, shape):
    c = Case()
    shape(c, "base", 0)
    _one_trace(c, "base")
    tr = analyse(c)
    assert _trace_count(tr, "base") == 1
    return _answer(tr, "base")


def _ms(segs):
    return [(s, cat, start / 1e6, d / 1e6) for s, cat, start, d in segs]


# --- ai-dynamo/dynamo#13345 (fix: PR #13713) ----------------------------------------------------------
def test_engine_stages_parented_to_the_routers_dispatch_span(analyse):
    """ai-dynamo/dynamo#13345 (fixed by PR #13713): trace context was not propagated through the KV router's
    dispatch, so "frontend spans and worker/backend spans can appear as separate traces"; the fix makes
    `kv_router.route_request` -- the router's short routing-decision span -- the span whose context goes out
    in `traceparent`, so every worker/engine span of the leg becomes its child.

    Rebuilt as a pull request twice: `fixed` (one trace; every P and D stage without a parent in its own
    process has the leg's router.dispatch as parent) and `split` (before the fix: the router's spans in one
    trace, each engine's in a trace of its own, no parents). Right answer for both: the plain request's
    breakdown -- the engines' stages are what the request waited for, whatever their OpenTelemetry parent:
    a 2 ms router span cannot contain P's 108 ms prefill. Nesting clipped the engine stages to the dispatch
    span and left 68 ms unattributed (and hid P's compute). handoff.handshake stays nested in handoff.prep
    (same process): its 22 ms are still split out. trace_count: 1 and 3.
    """
    base = _baseline(analyse, _pull)
    assert _ms(base[1]) == PULL_SEGMENTS
    assert (base[0]["ttft_ns"], base[0]["queue_ns"], base[0]["compute_ns"], base[0]["transfer_ns"],
            base[0]["coordination_ns"], base[0]["unattributed_ns"]) == (190e6, 6e6, 134e6, 10e6, 40e6, 0)

    c = Case()
    _pull(c, "fixed", 0, parent=lambda leg, dispatch: dispatch)
    _one_trace(c, "fixed")
    _pull(c, "split", 1000)
    split = {"router": ids.trace_id("split"), "prefill": _new_trace(), "decode": _new_trace()}
    for role, _, r in _rows(c, "split"):
        r["trace_id"] = split[role]
    tr = analyse(c)
    for rid, traces in (("fixed", 1), ("split", 3)):
        assert _answer(tr, rid) == base, rid
        assert _trace_count(tr, rid) == traces
    assert tr.query("SELECT count(*) AS n FROM ttft_segments WHERE request_id = 'fixed' "
                    "AND stage = 'handoff.handshake'")[0]["n"] == 1


# --- ai-dynamo/dynamo#7030 ------------------------------------------------------------------------------
@pytest.mark.parametrize("d_parent", ["own_root", "parent_in_other_trace"])
def test_decode_leg_in_a_separate_trace(analyse, d_parent):
    """ai-dynamo/dynamo#7030: in Dynamo's E/P/D disaggregated flow the trace context was not propagated into
    the decode hop: "the decode/encode handle_payload span appears as a separate root trace with no link to
    the frontend's trace ID", while the P/D spans share the frontend's trace.

    Rebuilt as a push request: the router's and P's spans in the request's trace, every D span in a second
    trace -- as a root of its own (`own_root`, as reported), or keeping the router's dispatch span as parent
    under the new trace id (`parent_in_other_trace`: the shape open-telemetry/opentelemetry-js#3783 shows,
    right parent span id, wrong trace id, "invalid parent span IDs" in Jaeger). Right answer: the plain
    request's breakdown (the request is joined by its id, not by its trace: D's registration, readiness and
    first step are on its critical path either way), nothing unattributed, trace_count 2.
    """
    base = _baseline(analyse, _push)
    assert base[0]["ttft_ns"] == 180e6 and base[0]["unattributed_ns"] == 0
    c = Case()
    if d_parent == "own_root":
        _push(c, "x", 0)
    else:
        _push(c, "x", 0, parent=lambda leg, dispatch: dispatch if leg == "decode" else None)
    d_trace = _new_trace()
    for role, _, r in _rows(c, "x"):
        r["trace_id"] = d_trace if role == "decode" else ids.trace_id("x")
    tr = analyse(c)
    assert _answer(tr, "x") == base
    assert _trace_count(tr, "x") == 2


# --- vllm-project/vllm#33272 ----------------------------------------------------------------------------
API_PID, CORE_PID, WORKER_PID = 7001, 7002, 7003


@pytest.mark.parametrize("engine_trace", ["same_trace", "engine_core_own_trace"])
def test_engine_core_stages_parented_to_the_api_servers_span(analyse, engine_trace):
    """vllm-project/vllm#33272: vLLM passes the API server's trace context to EngineCore in the request's
    trace headers, so EngineCore's spans (`llm_core`) are children of the API server's `llm_request`
    (another process); with the API server's tracer not initialised they got "different trace IDs,
    breaking distributed tracing hierarchy" instead.

    Rebuilt as a pull request whose engines are three processes each (API server, EngineCore, a worker:
    same engine id, different pids): every EngineCore and worker stage has the API server's
    prefill.frontend / decode.frontend span -- its 1-2 ms `in` part -- as parent, in the same trace
    (`same_trace`, vLLM after the fix) or with EngineCore's and the worker's spans in a trace of their own
    per engine (`engine_core_own_trace`, before it). Right answer: the plain request's breakdown; the same
    engine id does not make the API server's short span a container of EngineCore's stages (a process is
    host + pid). handoff.handshake stays nested in handoff.prep: both were recorded by D's worker.
    trace_count: 1, and 3 (the request's trace and one per engine's EngineCore).
    """
    base = _baseline(analyse, _pull)
    c = Case()
    _pull(c, "v", 0)
    _one_trace(c, "v")
    fe = {role: r["span_id"] for role, _, r in _rows(c, "v") if r["name"].endswith(".frontend")}
    own = {"prefill": _new_trace(), "decode": _new_trace()}
    for role, _, r in _rows(c, "v"):
        if role == "router" or r["record"] != "span":
            continue
        if r["name"].endswith(".frontend"):
            r["pid"] = API_PID
            continue
        r["pid"] = WORKER_PID if r["tp_rank"] is not None else CORE_PID
        if r["parent_span_id"] is None:
            r["parent_span_id"] = fe[role]
        if engine_trace == "engine_core_own_trace":
            r["trace_id"] = own[role]
    tr = analyse(c)
    assert _answer(tr, "v") == base
    assert _trace_count(tr, "v") == (1 if engine_trace == "same_trace" else 3)


# --- llm-d/llm-d-router#1667: spans ingested by `pdtrace collect` ---------------------------------------
def _any(v):
    from opentelemetry.proto.common.v1 import common_pb2

    if isinstance(v, list):
        return common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[_any(x) for x in v]))
    if isinstance(v, int):
        return common_pb2.AnyValue(int_value=v)
    return common_pb2.AnyValue(string_value=str(v))


def _export(resource, spans):
    """An ExportTraceServiceRequest of one resource; spans: dicts (name, trace, sid, parent, start, end, kind,
    attrs, events) with times in ms."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from pdtrace_case_builder import ns

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for k, v in resource.items():
        rs.resource.attributes.add(key=k, value=_any(v))
    ss = rs.scope_spans.add()
    ss.scope.name = "test"
    for s in spans:
        sp = ss.spans.add(name=s["name"], kind=s.get("kind", 1), start_time_unix_nano=ns(s["start"]),
                          end_time_unix_nano=ns(s["end"]))
        sp.trace_id = bytes.fromhex(s["trace"])
        sp.span_id = s["sid"].to_bytes(8, "big")
        if s.get("parent"):
            sp.parent_span_id = s["parent"].to_bytes(8, "big")
        for k, v in s.get("attrs", {}).items():
            sp.attributes.add(key=k, value=_any(v))
        for name, at in s.get("events", ()):
            sp.events.add(name=name, time_unix_nano=ns(at))
    return req


def _collect(directory, messages):
    """Write ``messages`` into ``directory`` as `pdtrace collect` does (otlp_ingest mapping, then the converter)."""
    import pyarrow as pa

    from pdtrace.instrument import otlp_ingest, store
    from pdtrace.instrument.convert import Converter
    from pdtrace_case_builder import RUN

    ing = otlp_ingest.Ingest(run_id=RUN, join_wait_s=0.0)
    for m in messages:
        ing.add(m, now=0.0)
    conv, tables = Converter(), []
    for key, (recs, tids) in ing.ready(now=1.0, final=True).items():
        t = conv.table(recs, ing.resources[key], 0)
        tables.append(t.set_column(t.schema.get_field_index("trace_id"), "trace_id", pa.array(tids, pa.string())))
    store.write_tables(directory, tables, "collect-h-1-0-s1.parquet")


P_API_PID, D_API_PID = 8101, 8201
P_LLM, D_LLM, PROXY_P, PROXY_D, GW_ROOT = 0x51, 0x52, 0x61, 0x62, 0x60


def _foreign_store(directory, rid, propagated, parented):
    """A request served behind a foreign router (llm-d: gateway + P/D routing proxy), its engines traced by
    pdtrace and vLLM's own tracing on: the router's spans and vLLM's `llm_request` spans arrive over OTLP."""
    c = Case()
    _pull(c, rid, 0, parent=(lambda leg, _: P_LLM if leg == "prefill" else PROXY_D) if parented else
          (lambda leg, _: None))
    del c.rows[("router", None)]
    _one_trace(c, rid)
    for role, _, r in _rows(c, rid):
        if r["name"].endswith(".frontend") or r["record"] == "event":
            r["pid"] = P_API_PID if role == "prefill" else D_API_PID
    c.write(directory)
    f = _new_trace()
    hdr = {"http.request.header.x-request-id": [rid]}
    router = _export({"service.name": "llm-d-gateway", "host.name": "gw"}, [
        {"name": "gateway.request", "trace": f, "sid": GW_ROOT, "start": 0, "end": 200, "kind": 2, "attrs": hdr,
         "events": [("first_token", 190), ("last_token", 199)]}])
    # the routing proxy's per-leg spans, named after pdtrace's vocabulary so that they count in the breakdown
    proxy = _export({"service.name": "llm-d-routing-proxy", "host.name": "d-host", "process.pid": 1}, [
        {"name": "router.dispatch", "trace": f, "sid": PROXY_P, "parent": GW_ROOT, "start": 0, "end": 2,
         "kind": 3, "attrs": {**hdr, "router.leg": "prefill"}},
        {"name": "router.dispatch", "trace": f, "sid": PROXY_D, "parent": GW_ROOT, "start": 120, "end": 122,
         "kind": 3, "attrs": {**hdr, "router.leg": "decode"}}])
    engines = [
        _export({"service.name": f"vllm-{leg}", "host.name": "h", "vllm.process_id": pid}, [
            {"name": "llm_request", "trace": f if propagated else _new_trace(), "sid": sid,
             "parent": proxy_sid if propagated else None, "start": start, "end": end, "kind": 2,
             "attrs": {"gen_ai.request.id": f"cmpl-{rid}-0", "gen_ai.usage.prompt_tokens": 100}}])
        for leg, pid, sid, proxy_sid, start, end in (("prefill", P_API_PID, P_LLM, PROXY_P, 2, 118),
                                                      ("decode", D_API_PID, D_LLM, PROXY_D, 122, 190))]
    _collect(directory, [router, proxy, *engines])


@pytest.mark.parametrize("propagated", [True, False], ids=["sidecar_injects", "sidecar_drops_traceparent"])
def test_foreign_router_and_vllm_spans_are_never_parents_of_pdtrace_stages(analyse, tmp_path, propagated):
    """llm-d/llm-d-router#1667: the P/D routing sidecar did not inject the W3C trace context on its outbound
    requests, so "vLLM's spans attached as unrelated traces in Jaeger instead of under the same trace as EPP
    and the routing proxy"; with the fix they are children of the proxy's per-leg span.

    Rebuilt with `pdtrace collect`'s own mapping (otlp_ingest + converter): a foreign gateway root (the
    router window), the proxy's per-leg dispatch spans and vLLM's `llm_request` spans (the API server's
    process: same host and pid as pdtrace's frontend spans), with pdtrace's P stages parented to P's
    `llm_request` and D's to the proxy's decode-leg span (the parent an engine would take from the
    context it received). Right answer: the same store without those parents -- a foreign span is never a
    container of pdtrace's stages (another process, or not a stage), and the 4 ms the engines leave
    between the legs stay the only unattributed time. trace_count: the foreign trace and pdtrace's own
    (2), plus one per `llm_request` when the sidecar drops the context (4).
    """
    plain, nested = tmp_path / "plain", tmp_path / "nested"
    _foreign_store(plain, "fx", propagated, parented=False)
    _foreign_store(nested, "fx", propagated, parented=True)
    want = _answer(analyse(Case(), plain), "fx")
    assert want[0]["ttft_ns"] == 190e6 and want[0]["unattributed_ns"] == 4e6
    assert [s[0] for s in want[1]][:2] == ["router.dispatch", "prefill.frontend"]  # the proxy's span counts
    tr = analyse(Case(), nested)
    assert _answer(tr, "fx") == want
    assert _trace_count(tr, "fx") == (2 if propagated else 4)
