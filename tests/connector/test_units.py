"""Engine-free checks of the traced connectors' parts: safety, per-step report, middleware, compat switch."""

import json

import pytest

pytest.importorskip("vllm")

from pdtrace.connector import vllm_compat  # noqa: E402
from pdtrace.connector.traced import safety  # noqa: E402
from pdtrace.connector.traced.common import notif_kind, split_id  # noqa: E402
from pdtrace.connector.traced.messages import StepReport  # noqa: E402


def test_safe_swallows_and_counts():
    safety.reset()

    def boom():
        raise RuntimeError("prompt text must not leak")

    assert safety.safe(boom) is None
    assert safety.error_count() == 1
    assert safety.safe(lambda: 3) == 3


def test_step_report_aggregates_ranks():
    a, b = StepReport(7), StepReport(7)
    a.recv["r"] = {0: (1, 2)}
    b.recv["r"] = {1: (3, 4)}
    b.expired.add("p")
    b.busy = True
    out = a.aggregate(b)
    assert out.step == 7 and out.recv["r"] == {0: (1, 2), 1: (3, 4)} and out.expired == {"p"} and out.busy


def test_step_info_is_named_and_pickles_small():
    """The scheduler -> worker message crosses a process boundary every step: a NamedTuple, read by name."""
    import pickle

    from pdtrace.connector.traced.messages import StepInfo

    info = StepInfo(3, 17, {"cmpl-X-0-0123abcd": 5}, {}, False)
    assert pickle.loads(pickle.dumps(info)) == info
    assert (info.step, info.sid, info.idle) == (3, 17, False) and info[2] is info.recv_alloc
    empty = pickle.dumps(StepInfo(3, 17, {}, {}, True), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(empty) < 96, len(empty)  # the class reference and five small values


def test_ids_and_notification_kinds():
    assert split_id("cmpl-X1-0-0123abcd") == ("X1", 0)
    assert split_id("chatcmpl-X2-deadbeef") == ("X2", 0)
    assert notif_kind(b"cmpl-X-0-0123abcd:1", "prefill") == ("read_done", "cmpl-X-0-0123abcd")
    assert notif_kind(b"cmpl-X-0-0123abcd:2", "decode") == ("write_done", "cmpl-X-0-0123abcd")
    assert notif_kind(b"HB:a,b", "prefill")[0] == "heartbeat"
    assert notif_kind(b"PUSH_REG:\x80", "prefill")[0] == "push_reg"


class _Cfg:
    def __init__(self, v):
        self.v = v

    def get_from_extra_config(self, key, default):
        return self.v if key == vllm_compat.PROG_THREAD_KEY else default


def test_prog_thread_switch_parsing_and_override():
    assert vllm_compat.prog_thread_setting(_Cfg(None)) is None
    assert vllm_compat.prog_thread_setting(_Cfg(False)) is False
    assert vllm_compat.prog_thread_setting(_Cfg("on")) is True
    with pytest.raises(ValueError):
        vllm_compat.prog_thread_setting(_Cfg("maybe"))
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    orig = bw.nixl_agent_config
    with vllm_compat.agent_config_override(False):
        cfg = bw.nixl_agent_config(num_threads=4, capture_telemetry=True)
        assert cfg.enable_pthread is False
    assert bw.nixl_agent_config is orig
    assert orig(num_threads=4).enable_pthread is True  # NIXL's (and vLLM's) default


def test_middleware_records_frontend_span(tmp_path, child):
    r = child(f"""
        import asyncio, glob, pyarrow.parquet as pq
        from pdtrace.instrument import tracer
        from pdtrace.connector.traced.middleware import FrontendMiddleware
        async def app(scope, receive, send):
            await send({{"type": "http.response.start", "status": 200, "headers": []}})
            await send({{"type": "http.response.body", "body": b"a", "more_body": True}})
            await send({{"type": "http.response.body", "body": b"b"}})
        mw = FrontendMiddleware(app, role="prefill")
        sent = []
        async def send(m): sent.append(m)
        async def receive(): return {{"type": "http.request", "body": b"{{}}"}}
        scope = {{"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"x-request-id", b"X42")]}}
        asyncio.run(mw(scope, receive, send))
        assert len(sent) == 3
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        names = sorted((r["record"], r["name"], r["request_id"]) for r in rows if r["record"] in ("span", "event"))
        print(names)
        assert ("span", "prefill.frontend", "X42") in names and ("event", "token", "X42") in names
    """, env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]


def test_first_output_is_noted_once_per_request_from_enginecores_timestamp(monkeypatch):
    """The API server's output hook notes each request's first output (EngineCore's timestamp when it is
    sound, else now) and leaves later batches alone; an id vLLM reuses after the request finished (its X
    taken by the middleware) is noted again."""
    import types

    from pdtrace.connector.traced import middleware as m
    from pdtrace.instrument import tracer

    monkeypatch.setattr(m, "_first_out", {})
    now = tracer.now()
    a, b = (types.SimpleNamespace(request_id=f"cmpl-{x}-0") for x in ("xa", "xb"))
    m._note_outputs([a], now / 1e9 - 0.5)  # EngineCore emitted it 0.5 s ago
    m._note_outputs([a, b], now / 1e9 + 100)  # a timestamp in the future is unsound: now instead
    first = dict(m._first_out)
    assert set(first) == {"xa", "xb"}
    assert abs(first["xa"] - (now - 500_000_000)) < 1_000 and first["xb"] >= now
    m._note_outputs([a, b], now / 1e9)  # later decode steps: nothing changes
    assert m._first_out == first
    m._first_out.pop("xa")  # the request finished (FrontendMiddleware._finish)
    m._note_outputs([a], now / 1e9)
    assert m._first_out["xa"] == int(now / 1e9 * 1e9)


def test_push_write_blocks_count_from_the_registration():
    """kv.blocks of a push WRITE: per cache group min(P's blocks, D's registered blocks); flat lists accepted."""
    from types import SimpleNamespace as NS

    from pdtrace.connector.traced.push import TracedNixlPushConnectorWorker as W
    from pdtrace.connector.traced.worker import ReqState

    st = ReqState("X", 0)
    W._pdt_blocks(st, NS(local_block_ids=[[1, 2, 3, 4]], remote=NS(block_ids=[[7, 8, 9, 10]])))
    assert st.blocks == 4
    W._pdt_blocks(st, NS(local_block_ids=[[1, 2, 3, 4]], remote=NS(block_ids=[[9, 10]])))  # D had 2 cached
    assert st.blocks == 2
    W._pdt_blocks(st, NS(local_block_ids=[1, 2, 3], remote=NS(block_ids=[5, 6, 7])))
    assert st.blocks == 3


def test_push_registration_arrival_is_the_earliest_consistent_instant():
    """P's writer reads a registration late when it slept through its arrival: the span uses
    max(previous drain, D's send) — never the read time when an earlier bound exists — capped by the read."""
    from pdtrace.connector.traced.push import reg_arrival

    assert reg_arrival(1_000, 0, None) == 1_000            # nothing known: the read time
    assert reg_arrival(1_000, 200, 300) == 300             # writer slept since 200, D sent at 300
    assert reg_arrival(1_000, 990, 300) == 990             # writer polling (~1 ms): arrived after 990
    assert reg_arrival(1_000, 990, 5_000) == 1_000         # D's clock ahead (other host): capped by the read


def test_middleware_error_response_is_no_token(tmp_path, child):
    """A 500 body (D failed the request after a failed KV load) gets a frontend span but no token event."""
    r = child(f"""
        import asyncio, glob, pyarrow.parquet as pq
        from pdtrace.instrument import tracer
        from pdtrace.connector.traced.middleware import FrontendMiddleware
        async def app(scope, receive, send):
            await send({{"type": "http.response.start", "status": 500, "headers": []}})
            await send({{"type": "http.response.body", "body": b'{{"error": 1}}'}})
        mw = FrontendMiddleware(app, role="decode")
        async def send(m): pass
        async def receive(): return {{"type": "http.request", "body": b"{{}}"}}
        scope = {{"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"x-request-id", b"X43")]}}
        asyncio.run(mw(scope, receive, send))
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        names = sorted((r["record"], r["name"], r["request_id"]) for r in rows if r["record"] in ("span", "event"))
        print(names)
        assert ("span", "decode.frontend", "X43") in names and ("event", "token", "X43") not in names
    """, env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]


def test_middleware_token_at_the_first_token_chunk_and_tokenless_responses(tmp_path, child):
    """The middleware's token event sits at the first chunk that carries a token, and a 200 response that
    carried none is no token but a response.tokenless event. vllm-project/vllm#57082: an engine-initiated
    abort (shutdown, a sleep or scale-down pause) ends an open stream with HTTP 200 and data: [DONE], which a
    client that checks the status and [DONE] counts complete. The app is a stand-in writing the bytes vLLM
    0.32's own stream generators write in each case (``OpenAIServingChat.chat_completion_stream_generator``
    and ``OpenAIServingCompletion.completion_stream_generator`` fed a request finished 'abort' / 'error'
    before its first token: compact JSON, the error event as json.dumps writes it); the real shutdown path
    is tests/lab/test_pull.py::test_sigterm_decode_mid_stream (untraced). Middleware and recorder are real.

    Before the first token: ab (chat: role chunk, [DONE]), abu (chat: role, usage 0, [DONE]), ca
    (completions: [DONE] alone), cau (completions: usage 0, [DONE]) -> no_token; er (chat: role, error
    event, [DONE]), cer (completions: error event, [DONE]) -> error_event; cut (chat: role chunk, the
    stream cut before [DONE]) -> stream_cut; nsab (stream false, completion_tokens 0, finish abort) ->
    finish_abort. With tokens: rc (chat: role, 30 ms, content, stop) -> token at the content chunk, >= 30 ms
    in; mb (chat: role, 30 ms, content "" = a token ending inside a multi-byte character) -> token at it;
    mid (completions: two tokens, then an abort chunk) -> a token and nothing more (no chunk is read after a
    token and a second chunk: EngineCore records that abort); ok, us (finished 'length') -> a token; ns
    (stream false, one token, P's answer in pull) -> a token; odd (a 200 body that is not JSON) -> token at its first chunk
    (a shape the middleware cannot read counts, as before); rh (chat, a reasoning parser with reasoning hidden
    reaching max_tokens: role, a 'length' finish with an empty delta, usage 8) -> a token at the finish; n4 (n = 4
    aborted before the first token: four role chunks, usage 0, [DONE]) -> no_token (role chunks do not use up
    the chunks read)."""
    r = child(f"""
        import asyncio, glob, json, pyarrow.parquet as pq
        from pdtrace.instrument import tracer
        from pdtrace.connector.traced.middleware import FrontendMiddleware
        def ev(o): return b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\\n\\n"
        HEAD = {{"id": "r", "object": "chat.completion.chunk", "created": 1, "model": "m"}}
        def chat(d, fr=None):
            return ev({{**HEAD, "choices": [{{"index": 0, "delta": d, "logprobs": None, "finish_reason": fr}}],
                       "prompt_token_ids": None, "prompt_text": None}})
        def cmpl(t, fr=None):
            return ev({{"id": "r", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{{"index": 0, "text": t, "logprobs": None, "finish_reason": fr, "stop_reason": None}}],
                       "usage": None}})
        ROLE = chat({{"role": "assistant", "content": ""}})
        USAGE0 = ev({{**HEAD, "choices": [], "usage": {{"prompt_tokens": 2, "total_tokens": 2, "completion_tokens": 0}}}})
        USAGE8 = ev({{**HEAD, "choices": [], "usage": {{"prompt_tokens": 2, "total_tokens": 10, "completion_tokens": 8}}}})
        ERR = b'data: {{"error": {{"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}}}\\n\\n'
        DONE = b"data: [DONE]\\n\\n"
        bodies = {{
            "ab": [ROLE, DONE], "abu": [ROLE, USAGE0, DONE], "ca": [DONE], "cau": [USAGE0, DONE],
            "er": [ROLE, ERR, DONE], "cer": [ERR, DONE], "cut": [ROLE],
            "nsab": [json.dumps({{"choices": [{{"text": "", "finish_reason": "abort"}}],
                                  "usage": {{"completion_tokens": 0}}}}, separators=(",", ":")).encode()],
            "rc": [ROLE, "sleep", chat({{"content": "x"}}), chat({{}}, "stop"), DONE],
            "mb": [ROLE, "sleep", chat({{"content": ""}}), chat({{"content": "\\u00e9"}}), DONE],
            "mid": [cmpl("a"), cmpl("b"), cmpl("", "abort"), DONE],
            "ok": [cmpl("a"), cmpl("b"), cmpl("c", "length"), DONE],
            "us": [cmpl("a"), cmpl("b", "length"), USAGE0, DONE],
            "ns": [json.dumps({{"choices": [{{"text": "x", "finish_reason": "length"}}],
                                "usage": {{"completion_tokens": 1}}}}, separators=(",", ":")).encode()],
            "odd": [b"plain", b"more"],
            # a reasoning parser with reasoning hidden reaching max_tokens: nothing shown, yet 8 tokens
            "rh": [ROLE, chat({{}}, "length"), USAGE8, DONE],
            # n = 4, aborted before the first token: a role chunk per choice, usage 0, [DONE]
            "n4": [ROLE, ROLE, ROLE, ROLE, USAGE0, DONE],
        }}
        CHAT = ("ab", "abu", "er", "cut", "rc", "mb", "rh", "n4")
        def app_for(x):
            async def app(scope, receive, send):
                await send({{"type": "http.response.start", "status": 200, "headers": []}})
                for b in bodies[x]:
                    if b == "sleep":
                        await asyncio.sleep(0.03)
                        continue
                    await send({{"type": "http.response.body", "body": b, "more_body": True}})
                await send({{"type": "http.response.body", "body": b"", "more_body": False}})
            return app
        async def send(m): pass
        async def receive(): return {{"type": "http.request", "body": b"{{}}"}}
        for x in bodies:
            path = "/v1/chat/completions" if x in CHAT else "/v1/completions"
            scope = {{"type": "http", "method": "POST", "path": path, "headers": [(b"x-request-id", x.encode())]}}
            asyncio.run(FrontendMiddleware(app_for(x), role="decode")(scope, receive, send))
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        out = {{}}
        for r in rows:
            if r["record"] not in ("span", "event") or not r["request_id"]:
                continue
            o = out.setdefault(r["request_id"], {{"events": {{}}}})
            if r["record"] == "span" and r["name"] == "decode.frontend":
                o["start"] = r["start_ns"] if "start" not in o else min(o["start"], r["start_ns"])
            elif r["record"] == "event":
                o["events"][r["name"]] = [r["start_ns"], dict(r["attr_str"] or {{}}).get("lifecycle.cause")]
        print(json.dumps(out))
    """, env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    tokenless = {x: o["events"]["response.tokenless"][1] for x, o in got.items() if "response.tokenless" in o["events"]}
    assert tokenless == {"ab": "no_token", "abu": "no_token", "ca": "no_token", "cau": "no_token", "er": "error_event",
                         "cer": "error_event", "cut": "stream_cut", "nsab": "finish_abort", "n4": "no_token"}, tokenless
    assert sorted(x for x, o in got.items() if "token" in o["events"]) == \
        ["mb", "mid", "ns", "odd", "ok", "rc", "rh", "us"]
    assert all(sorted(o["events"]) in (["token"], ["response.tokenless"]) for o in got.values()), got
    for x in ("rc", "mb"):  # the content chunk after the 30 ms sleep, not the role chunk
        assert got[x]["events"]["token"][0] - got[x]["start"] >= 30_000_000, (x, got[x])


def _ids_each_side(fraction):
    """(a sampled id, an unsampled id) at ``fraction`` by the sha256 rule, chosen here rather than hard-coded."""
    from pdtrace.instrument import ids

    cand = [f"X{i}" for i in range(64)]
    return (next(x for x in cand if ids.is_sampled(x, fraction)),
            next(x for x in cand if not ids.is_sampled(x, fraction)))


def test_notification_and_registration_events_follow_the_sampling_rule(tmp_path, child):
    """Issue 18: at PDTRACE_SAMPLE=0.5 an unsampled request leaves no notification.sent/received,
    registration.sent/received or dest.register row; a sampled one leaves each. The bookkeeping the
    sampled spans of other requests rely on (D's transfer-end time, P's registration arrival) is kept
    for both. The workers are the traced push worker built without its vLLM ``__init__`` (no engine,
    no NIXL agent); the agent under the proxy is a stand-in returning the notifications a real agent
    would (the real NIXL path at PDTRACE_SAMPLE=0.5 is tests/connector/test_traced_pull_lab.py)."""
    import json

    keep, drop = _ids_each_side(0.5)
    r = child(f"""
        import glob, json, time, msgspec, pyarrow.parquet as pq
        from pdtrace.instrument import tracer
        from pdtrace.connector.traced.agent import TracedAgent
        from pdtrace.connector.traced.common import PUSH_REG_PREFIX
        from pdtrace.connector.traced.push import ALLOC_KEY, SENT_KEY, TracedNixlPushConnectorWorker as W
        from pdtrace.connector.traced.worker import ReqState
        from pdtrace.instrument import activate
        assert activate("explicit")
        rids = {{x: f"cmpl-{{x}}-0-0123abcd" for x in ({keep!r}, {drop!r})}}

        class StandInAgent:
            def __init__(self, notifs): self.notifs = notifs
            def get_new_notifs(self): return {{"peer": self.notifs}}
            def send_notif(self, name, msg): return None

        def worker(role, notifs):
            w = object.__new__(W)  # no vLLM __init__: only the attributes the hooks read
            w._pdt_role, w._pdt_rank, w._pdt_req, w._pdt_regs = role, 0, {{}}, {{}}
            w.nixl_wrapper = TracedAgent(StandInAgent(notifs), w)
            return w

        # D: P's write_done notifications arrive; D sends its registrations
        d = worker("decode", [f"{{rid}}:1".encode() for rid in rids.values()])
        for rid in rids.values():
            d._pdt_req[rid] = ReqState(*rid.split("-")[1:3])
        d.nixl_wrapper.get_new_notifs()
        xfer_end = {{rid: d._pdt_req[rid].xfer_end for rid in rids.values()}}
        for rid in rids.values():
            d.nixl_wrapper.send_notif("peer", f"{{rid}}:1".encode())
            d._pdt_reg_sent(rid, {{"remote_engine_id": "P0"}}, time.time_ns())
        # P: the registrations arrive
        p = worker("prefill", [])
        for rid in rids.values():
            now = time.time_ns()
            reg = {{"request_id": rid, "decode_engine_id": "D0", SENT_KEY: now, ALLOC_KEY: now - 1000}}
            p._pdt_reg_received(PUSH_REG_PREFIX + msgspec.msgpack.encode(reg), tracer.now())
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        print(json.dumps({{"rows": sorted({{(r["name"], r["request_id"]) for r in rows
                                           if r["record"] in ("span", "event") and r["request_id"]}}),
                          "xfer_end": xfer_end, "regs": sorted(p._pdt_regs)}}))
    """, env={"PDTRACE_DIR": str(tmp_path), "PDTRACE_SAMPLE": "0.5"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    names = ["notification.received", "notification.sent", "registration.sent", "registration.received",
             "dest.register"]
    assert sorted(map(tuple, out["rows"])) == sorted((n, keep) for n in names)
    assert all(v > 0 for v in out["xfer_end"].values()) and len(out["xfer_end"]) == 2
    assert out["regs"] == sorted(f"{x}\x000" for x in (keep, drop))


def test_kv_ready_starts_at_the_transfer_end_when_vllm_reports_the_receive_later(tmp_path, child):
    """A worker's receive report (per rank: transfer end, seen) reaches the scheduler in the step in
    which that rank saw its receive done; vLLM lists the request in ``finished_recving`` in a later
    step when another rank is slower (TP > 1: only once every rank is done, by vLLM's
    ``KVOutputAggregator``: vllm-project/vllm#19555 moved the aggregation to the scheduler, #56430
    counts the workers still to finish each request) or when the id is held back. kv.ready must still start at each rank's
    transfer end and count both ranks, not start at the step that finally listed the request (the
    CI failure of the injected kv.ready delay: its whole interval fell outside kv.ready). The
    scheduler is the traced pull scheduler built without its vLLM ``__init__``; the step outputs are
    vLLM's ``KVConnectorOutput``."""
    import json

    r = child(f"""
        import collections, glob, json, types, pyarrow.parquet as pq
        from pdtrace.instrument import activate, tracer
        from pdtrace.connector.traced.pull import TracedNixlPullConnectorScheduler as S
        from pdtrace.connector.traced.scheduler import SReq
        from pdtrace.connector.traced.messages import StepReport
        from vllm.v1.outputs import KVConnectorOutput
        assert activate("explicit")
        s = object.__new__(S)  # no vLLM __init__: only the attributes the hooks read
        s._pdt_role, s._pdt_step_name, s._pdt_tp = "decode", "decode.step", 2
        s._pdt_reqs, s._pdt_pending, s._pdt_step_id = {{}}, collections.deque(), 3
        s._pdt_holds, s._pdt_expired, s._pdt_idle, s._pdt_cpu_mark = {{}}, set(), 0, None
        rid = "cmpl-X7-0-0123abcd"
        req = types.SimpleNamespace(request_id=rid, num_prompt_tokens=40, arrival_time=None)
        st = s._pdt_reqs[rid] = SReq(req, "decode")
        st.t_alloc, st.awaiting = tracer.now() - 5_000_000, True
        t_end0, t_end1 = tracer.now() - 3_000_000, tracer.now() - 2_000_000

        def out(rep, done=()):
            return KVConnectorOutput(kv_connector_worker_meta=rep, finished_recving=set(done),
                                     finished_sending=set(), failed_recving=set())
        # step 1: rank 0's receive is done; vLLM does not list the request yet
        rep = StepReport(1); rep.recv[rid] = {{0: (t_end0, t_end0 + 100)}}
        s._pdt_step_end(out(rep), tracer.now())
        # step 2: rank 1 done; vLLM now lists it in finished_recving
        rep = StepReport(2); rep.recv[rid] = {{1: (t_end1, t_end1 + 100)}}
        s._pdt_step_end(out(rep, {{rid}}), tracer.now())
        # step 3: nothing new; the request is promoted
        s._pdt_step_end(out(StepReport(3)), tracer.now())
        t_promote = tracer.now()
        s._pdt_promote(st, t_promote)
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        ready = sorted((r["tp_rank"], r["start_ns"], r["end_ns"], dict(r["attr_int"])["kv.ranks_received"],
                        dict(r["attr_int"])["kv.ranks_expected"])
                       for r in rows if r["record"] == "span" and r["name"] == "kv.ready")
        print(json.dumps({{"ready": ready, "ends": [t_end0, t_end1], "promote": t_promote}}))
    """, env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (r0, s0, e0, n0, x0), (r1, s1, e1, n1, x1) = out["ready"]
    assert (r0, r1) == (0, 1) and (n0, n1) == (2, 2) and (x0, x1) == (2, 2)  # expected: the engine's TP size
    # each rank's kv.ready starts at that rank's transfer end (monotonic ns -> store ns: same offset)
    assert s1 - s0 == out["ends"][1] - out["ends"][0] and e0 == e1
    assert e0 - s0 == out["promote"] - out["ends"][0]


def test_empty_steps_open_nothing_and_a_busy_one_keeps_its_attributes(tmp_path, child):
    """A step with nothing scheduled opens no step span (the idle-step cost: P steps while D reads
    its held blocks); an idle one is counted in the next recorded step's ``step.idle_before``; one
    that turns out busy (a receive finished in it) is recorded with the attributes a kept step with
    an empty batch has. And a lease expiry a worker reports steps before vLLM lists the request in
    ``finished_sending`` (TP > 1) still names the hold's release cause. Scheduler built without
    vLLM's ``__init__``; the connector metadata and step outputs are vLLM's own classes."""
    import json

    r = child(f"""
        import collections, glob, json, types, pyarrow.parquet as pq
        from pdtrace.instrument import activate, tracer
        from pdtrace.connector.traced.pull import TracedNixlPullConnectorScheduler as S
        from pdtrace.connector.traced.scheduler import SReq
        from pdtrace.connector.traced.messages import StepReport
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
        from vllm.v1.outputs import KVConnectorOutput
        assert activate("explicit")
        s = object.__new__(S)
        s._pdt_role, s._pdt_step_name, s._pdt_tp, s._pdt_mode = "prefill", "prefill.step", 1, "pull"
        s._pdt_reqs, s._pdt_pending, s._pdt_step_id = {{}}, collections.deque(), 0
        s._pdt_holds, s._pdt_expired, s._pdt_idle, s._pdt_cpu_mark = {{}}, set(), 0, None
        rid = "cmpl-X9-0-0123abcd"
        req = types.SimpleNamespace(request_id=rid, num_prompt_tokens=40, arrival_time=None)
        st = SReq(req, "prefill")
        s._pdt_holds[rid] = (tracer.now(), st)
        so = types.SimpleNamespace(num_scheduled_tokens={{}}, preempted_req_ids=set())

        def step(rep_fill=None, sending=()):
            meta = NixlConnectorMetadata()
            s._pdt_step_start(so, meta, tracer.now())
            opened = meta._pdtrace.sid in tracer._open
            rep = StepReport(meta._pdtrace.step)
            if rep_fill:
                rep_fill(rep)
            s._pdt_step_end(KVConnectorOutput(kv_connector_worker_meta=rep, finished_recving=set(),
                                              finished_sending=set(sending), failed_recving=set()),
                            tracer.now())
            return opened
        opened = [step(), step()]                                   # two idle steps
        opened.append(step(lambda rep: rep.expired.add(rid)))      # a rank's expiry; vLLM lists it later
        opened.append(step(sending={{rid}}))                        # busy: the hold is released
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        steps = [(dict(r["attr_int"]), dict(r["attr_str"])) for r in rows
                 if r["record"] == "span" and r["name"] == "prefill.step"]
        holds = [dict(r["attr_str"])["kv.release_cause"] for r in rows
                 if r["record"] == "span" and r["name"] == "prefill.block_hold"]
        print(json.dumps({{"opened": opened, "steps": steps, "holds": holds}}))
    """, env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["opened"] == [False, False, False, False]
    # the idle steps and the expiry-only step left no row; the busy one did, counting them
    (ints, strs), = out["steps"]
    assert ints == {"step.id": 3, "step.num_reqs": 0, "step.prefill_tokens": 0, "step.decode_tokens": 0,
                    "step.recompute_tokens": 0, "step.idle_before": 3}, ints
    assert strs == {"step.batch": ""}, strs
    assert out["holds"] == ["expiry"]
