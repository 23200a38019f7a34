"""Decode stalls rebuilt from public reports (issue 17 kinds 7 and 8).

Kind 7 -- hung after the first token: the request keeps its TTFT, is flagged
``hung``, its TPOT counts the tokens it emitted (1 + the ended decode steps
whose step.batch gave it decode tokens, when no finish record exists), and the
rest of the hang is ``request_stalls.open_stall_ms`` (last emitted token/step
-> trace end, the latest last flush of the router and of its decode engine).
A decode.step that never ends is an engine-wide stall (view ``engine_stalls``)
lasting to its process's last flush, with the requests of its batch as victims.

Kind 8 -- stall baseline and batch growth: a step is compared with what its
load (requests in the batch, decode-equivalent scheduled tokens) costs on a
clean step (same load, else a linear fit of recent clean steps), so a batch
that grew by a newly admitted request is not a stall of its neighbours, while a
co-scheduled prefill chunk's own tokens still are.

Times are ms from T0 on the true clock.
"""
import pytest

from pdtrace_case_builder import Case

PULL = "TracedNixlPullConnector"


def _flushes(c, role, engine=None, at=()):
    """The recorder's periodic `stats` rows of one process: its last one is its trace end."""
    for t in at:
        c.rows[(role, engine)].append({"record": "stats", "name": "recorder.stats", "start_ns": c._t(engine or role, t),
                                       "attrs": {"recorder.written": 1}})


def _open_rows(c, role, engine, name, span_id, start_ms, flushes_ms, attrs=None, rid=None):
    """What the writer records at each flush for a span still open (schema 1.1 `open` rows)."""
    for t in flushes_ms:
        c.rows[(role, engine)].append({
            "record": "open", "name": name, "span_id": span_id, "start_ns": c._t(engine or role, start_ms),
            "end_ns": c._t(engine or role, t), "request_id": rid, "attempt": 0,
            "attrs": {"open.state": "open", **(attrs or {})}})


def _hung_root(c, rid, arrival_ms, end_ms, first_token_ms):
    """A router root with a first token and no last token; the router records no output-token count."""
    root = c.router_request(rid, arrival_ms, end_ms, "pull", first_token_ms=first_token_ms)
    for r in c.rows[("router", None)]:
        if r["record"] == "span" and r["span_id"] == root:
            r["attrs"].pop("gen_ai.usage.output_tokens")
    return root


def _steps(c, engine, t0_ms, batches, durs, first_id=0):
    """Consecutive decode.step spans from t0: batches[k] is step k's step.batch, durs[k] its ms."""
    t, sids = t0_ms, []
    for k, (batch, dur) in enumerate(zip(batches, durs)):
        sids.append(c.span("decode", "decode.step", t, t + dur, engine=engine, rank=0,
                           attrs={"step.id": first_id + k, "step.batch": batch}))
        t += dur
    return t, sids


def _rows(tr, sql, params=None):
    return {r["request_id"]: r for r in tr.query(sql, params)}


# ---------------------------------------------------------------------------
# H1. sgl-project/sglang#30033 ("PD disaggregation + DP-attention decode ...
#   whole-node lockstep freeze"): on the decode node one rank ran out of KV
#   blocks and every rank froze in lockstep; the requests already streaming
#   stopped mid-generation and never finished (the same shape as
#   vllm-project/vllm#52319, "silent generation stall ... /health still 200").
#   In pdtrace's vocabulary: A and B got their first token at 100 (D's first
#   step 80-100 gives it: 'p1' entries), decoded 49 steps of 20 ms (100-1080),
#   then step 50 started at 1080 and never returned. The scheduler's open
#   decode.step is written at each flush from 3000 (open >= 1 s) to D's last
#   flush at 6000; the router's clients gave up at 5000 (roots end, no last
#   token); the router flushed until 6000.
#   Right answer: A and B keep their TTFT and are hung; emitted tokens 1 + 49
#   = 50; TPOT over them (1080 - 100) / 49 = 20 ms (not NULL, not counting the
#   frozen time); open_stall 6000 - 1080 = 4920 ms each; one engine stall on
#   d0: step 50, from 1080 to the trace end 6000 (4920 ms), victims A and B;
#   no decode_stalls row without a duration.
def _case_h1():
    c = Case(connector=PULL)
    for rid, arrival in (("A", 0), ("B", 20)):
        _hung_root(c, rid, arrival, 5000, 100)
    batches = ["A:p1;B:p1"] + ["A:d1;B:d1"] * 49
    t, _ = _steps(c, "d0", 80, batches, [20] * 50)
    assert t == 1080
    _open_rows(c, "decode", "d0", "decode.step", 777_001, 1080, [3000, 4000, 5000, 6000],
               attrs={"step.id": 50, "step.batch": "A:d1;B:d1"})
    _flushes(c, "decode", "d0", at=[1000, 2000, 3000, 4000, 5000, 6000])
    _flushes(c, "router", at=[1000, 2000, 3000, 4000, 5000, 6000])
    return c


def test_h1_pd_decode_freeze_keeps_ttft_counts_emitted_tokens(analyse):
    tr = analyse(_case_h1())
    rq = _rows(tr, "SELECT * FROM requests")
    assert {k: (r["status"], r["hung"], r["ttft_ms"]) for k, r in rq.items()} == {
        "A": ("complete", True, 100.0), "B": ("complete", True, 80.0)}
    for rid in "AB":
        assert rq[rid]["emitted_tokens"] == 50
        assert round(rq[rid]["tpot_ms"], 9) == 20.0
    rs = _rows(tr, "SELECT * FROM request_stalls")
    for rid in "AB":
        r = rs[rid]
        assert r["hung"] is True and r["emitted_tokens"] == 50 and round(r["tpot_ms"], 9) == 20.0
        assert r["open_stall_ms"] == 4920.0 and r["stall_ms"] == 0
        assert round(r["tpot_without_stalls_ms"], 9) == 20.0
    # the report's summaries (one TPOT definition, request_base _tpot_ms) take finished requests only:
    # the hung ones are reported by request_stalls
    m = tr.query("SELECT tpot_mean_ms, tpot_p50_ms FROM summary_by_mode WHERE mode = 'pull'")[0]
    assert m == {"tpot_mean_ms": None, "tpot_p50_ms": None}


# H1b. A hung request whose only decode step ended before the router wrote its first token (a
#   two-token warm-up request of a lab run: D's step ended at 95, the router wrote the first token at
#   100, the second token never reached the router). That step says nothing about the time per token
#   after the first: TPOT is NULL, not (95 - 100) / 1 = -5 ms.
def test_h1b_a_step_before_the_first_token_gives_no_tpot(analyse):
    c = Case(connector=PULL)
    _hung_root(c, "W", 0, 300, 100)
    _steps(c, "d0", 75, ["W:p1", "W:d1"], [10, 10])
    tr = analyse(c)
    rq = _rows(tr, "SELECT request_id, hung, tpot_ms FROM requests")
    assert rq == {"W": {"request_id": "W", "hung": True, "tpot_ms": None}}
    assert tr.query("SELECT tpot_ms, stall_tpot_ms, tpot_without_stalls_ms FROM request_stalls "
                    "WHERE request_id = 'W'") == [{"tpot_ms": None, "stall_tpot_ms": 0.0, "tpot_without_stalls_ms": None}]


def test_h1_step_that_never_returns_is_an_engine_stall(analyse):
    tr = analyse(_case_h1())
    es = tr.query("SELECT * FROM engine_stalls")
    assert len(es) == 1
    e = es[0]
    assert (e["engine_id"], e["step_id"], e["dur_ms"], e["victims"], e["victim_request_ids"], e["evidence"]) == (
        "d0", 50, 4920.0, 2, ["A", "B"], "open_row")
    # the 50 steps that ended are decode_stalls rows, each with a duration; the stuck one is not among them
    agg = tr.query("SELECT count(*) AS n, count(dur_ns) AS timed, max(step_id) AS last FROM decode_stalls")[0]
    assert agg == {"n": 50, "timed": 50, "last": 49}


def test_h1_step_that_ended_later_is_no_engine_stall(analyse):
    """The same store where step 50 did end at 5500 (its span row has the open rows' id): no engine stall."""
    c = _case_h1()
    c.span("decode", "decode.step", 1080, 5500, engine="d0", rank=0, span_id=777_001,
           attrs={"step.id": 50, "step.batch": "A:d1;B:d1"})
    tr = analyse(c)
    assert tr.query("SELECT * FROM engine_stalls") == []
    rs = _rows(tr, "SELECT * FROM request_stalls")
    # its token was sampled at 5500: 51 tokens, the last 500 ms of the trace are the open stall
    assert rs["A"]["emitted_tokens"] == 51 and rs["A"]["open_stall_ms"] == 500.0


# ---------------------------------------------------------------------------
# H2. vllm-project/vllm#2731 ("vLLM getting stuck. Nothing is generated while
#   requests are running ... server keeps printing the status ... as if the
#   loop is stuck") with an engine-clock window (no router record: a foreign
#   router) and D's clock 7 ms ahead of P's. C finished normally before the
#   engine got stuck (request.finished with 11 tokens, D's frontend out part
#   ended at its last chunk); A and B were mid-stream when a step that began at
#   600 never returned. The step reached the store through OTLP ingestion with
#   no end (end before its start): evidence 'no_end'. D flushed last at 4000.
#   Right answer: C is complete and not hung (TPOT (400 - 200) / 10 = 20 ms,
#   open_stall NULL); A and B hung: first token at 200 (D's token event,
#   corrected), 1 + 20 decode steps (200-600), TPOT 400 / 20 = 20 ms,
#   open_stall 4000 - 600 = 3400 ms; the engine stall lasts 3400 ms and its
#   victims are A and B (C had left the batch).
def _case_h2():
    shift = {"d0": 7}
    c = Case(clock_shift_ms=shift, connector=PULL)
    for rid in "ABC":
        c.span("prefill", "prefill.frontend", 0, 2, rid=rid, engine="p0", attrs={"frontend.part": "in"})
        c.span("prefill", "prefill.queue", 2, 5, rid=rid, engine="p0")
        c.span("prefill", "prefill.compute", 5, 150, rid=rid, engine="p0")
        out_p = c.span("prefill", "prefill.frontend", 150, 155, rid=rid, engine="p0", attrs={"frontend.part": "out"})
        c.event("prefill", "token", 151, rid=rid, engine="p0", span=out_p)
        c.span("decode", "decode.frontend", 156, 158, rid=rid, engine="d0", attrs={"frontend.part": "in"})
    # D's API server: the out part of the frontend opens at the first chunk (200)
    out_c = c.span("decode", "decode.frontend", 199, 400, rid="C", engine="d0", attrs={"frontend.part": "out"})
    c.event("decode", "token", 200, rid="C", engine="d0", span=out_c)
    c.event("decode", "request.finished", 399, rid="C", engine="d0", attrs={"gen_ai.usage.output_tokens": 11})
    for k, rid in enumerate("AB"):
        sid = 880_000 + k
        _open_rows(c, "decode", "d0", "decode.frontend", sid, 199, [1000, 2000, 3000, 4000], rid=rid,
                   attrs={"frontend.part": "out"})
        c.event("decode", "token", 200, rid=rid, engine="d0", span=sid)
    batches = ["A:p1;B:p1;C:p1"] + ["A:d1;B:d1;C:d1"] * 10 + ["A:d1;B:d1"] * 10
    t, _ = _steps(c, "d0", 180, batches, [20] * 21)
    assert t == 600
    c.rows[("decode", "d0")].append({
        "record": "span", "name": "decode.step", "span_id": 990_001, "parent_span_id": None,
        "start_ns": c._t("d0", 600), "end_ns": 0, "request_id": None, "attempt": 0, "tp_rank": 0,
        "thread": None, "status_code": 0, "attrs": {"step.id": 21, "step.batch": "A:d1;B:d1"}})
    _flushes(c, "decode", "d0", at=[1000, 2000, 3000, 4000])
    _flushes(c, "prefill", "p0", at=[1000, 2000])
    # the handshake's clock sample: D minus P = +7 ms (rtt 1 ms)
    c.event("decode", "clock.sample", 170, engine="d0", attrs={
        "clock.peer_engine_id": "p0", "clock.offset_ns": -7_000_000, "clock.rtt_ns": 1_000_000})
    return c


def test_h2_engine_stuck_with_engine_clock_window(analyse):
    tr = analyse(_case_h2())
    rq = _rows(tr, "SELECT * FROM requests")
    assert {k: (r["ttft_source"], r["hung"]) for k, r in rq.items()} == {
        "A": ("engine", True), "B": ("engine", True), "C": ("engine", False)}
    assert rq["C"]["emitted_tokens"] == 11 and round(rq["C"]["tpot_ms"], 9) == 20.0
    rs = _rows(tr, "SELECT * FROM request_stalls")
    assert rs["C"]["open_stall_ms"] is None and rs["C"]["hung"] is False
    for rid in "AB":
        assert rq[rid]["emitted_tokens"] == 21 and round(rq[rid]["tpot_ms"], 6) == 20.0
        assert rs[rid]["emitted_tokens"] == 21 and round(rs[rid]["tpot_ms"], 6) == 20.0
        assert round(rs[rid]["open_stall_ms"], 6) == 3400.0
    es = tr.query("SELECT * FROM engine_stalls")
    assert len(es) == 1
    assert (es[0]["step_id"], round(es[0]["dur_ms"], 6), es[0]["victim_request_ids"], es[0]["evidence"]) == (
        21, 3400.0, ["A", "B"], "no_end")
    assert tr.query("SELECT count(*) AS n FROM decode_stalls WHERE dur_ns IS NULL OR dur_ns < 0")[0]["n"] == 0


# ---------------------------------------------------------------------------
# G1. gittensor-ai-lab/sparkinfer#994 ("a packed decode step costs a fixed
#   weight read plus a small per-row term -- measured 14.85 ms fixed against
#   0.41 ms/row"; the scheduler admits one new request per iteration) and
#   sgl-project/sglang#12972 (P/D decode ITL grows with the decode batch): on
#   D requests R1..R6 are admitted one every 10 steps. Each admission step
#   carries the newcomer's first forward (D recomputes its last prompt token:
#   'p1') beside the running decodes, and every step costs 14.85 + 0.41 n ms
#   for the n requests in it. At step 60, R7 is admitted and R1 leaves right
#   after (R1's last step is 60): a batch of 7 never occurs on a clean step, so only
#   the linear fit of the clean steps (n = 1..6) gives its baseline.
#   Right answer: no step stalls (excess 0 everywhere, no cause, no victim);
#   each admission step's baseline is its load's clean cost (14.85 + 0.41 n);
#   the old per-shape rule charged each admission 0.41 ms to the newcomer as
#   'prefill' and put it in its neighbours' TPOT.
def _case_g1():
    c = Case(connector=PULL)
    batches, durs = [], []
    for k in range(70):
        running = [f"R{i}" for i in range(1, 7) if 10 * (i - 1) < k] + (["R7"] if k > 60 else [])
        if k > 60:
            running = [r for r in running if r != "R1"]
        entries = [f"{r}:d1" for r in running]
        newcomer = f"R{k // 10 + 1}" if k % 10 == 0 else None
        if newcomer:
            entries.append(f"{newcomer}:p1")
        batches.append(";".join(entries))
        durs.append(14.85 + 0.41 * len(entries))
    t, _ = _steps(c, "d0", 1000, batches, durs)
    for i in range(1, 8):
        first = 1000 + sum(durs[: 10 * (i - 1) + 1])
        c.router_request(f"R{i}", 900, t + 10, "pull", first_token_ms=first, last_token_ms=t, output_tokens=10)
    return c, batches


def test_g1_batch_growth_is_not_a_stall(analyse):
    c, batches = _case_g1()
    tr = analyse(c)
    st = {r["step_id"]: r for r in tr.query("SELECT * FROM decode_stalls")}
    assert len(st) == 70
    assert [k for k, r in st.items() if r["excess_ns"] > 0] == []
    assert tr.query("SELECT * FROM decode_stall_causes") == []
    assert all(r["stall_ns"] == 0 for r in tr.query("SELECT * FROM request_stalls"))
    for k in range(0, 70, 10):                                  # the admission steps
        n = len(batches[k].split(";"))
        assert abs(st[k]["baseline_ns"] - round((14.85 + 0.41 * n) * 1e6)) <= 1, (k, st[k])
        assert st[k]["batch_reqs"] == n and not st[k]["clean"]
    assert st[60]["baseline_rule"] == "fit" and st[60]["batch_reqs"] == 7
    assert round(st[60]["fit_per_req_ns"]) == 410_000
    assert st[10]["baseline_rule"] == "load"


# ---------------------------------------------------------------------------
# G2. FlashML-org/FreeToken#483 ("prefill priority starves in-flight decodes
#   for the whole chunked-prefill burst") and tenstorrent/vllm-tt-plugin#109
#   (long chunked prefills stall running decodes): A, B, C decode at 20 ms a
#   step (steps 0-39); X's prompt is prefilled in three 512-token chunks
#   co-scheduled with them (steps 40-42, 120.5 ms each); then X decodes with
#   them, a batch of 4 at 20.5 ms (steps 43-80).
#   Right answer: the chunk steps are compared with a clean batch of 4 (20.5
#   ms, X is one more member of the batch), so each stalls 100 ms, all X's
#   prefill: A, B and C pay 300 ms each; X's own steps as a member of the batch
#   (20.5 - 20 = 0.5 ms a step) are no stall. The old rule compared the chunk
#   steps with a batch of 3 (excess 100.5 each, 301.5 ms): the 0.5 ms is X's
#   cost as a batch member, which it pays on every later step anyway -- the
#   answer of the old rule was wrong by that amount.
def _case_g2():
    c = Case(connector=PULL)
    batches = ["A:d1;B:d1;C:d1"] * 40 + ["A:d1;B:d1;C:d1;X:p512"] * 3 + ["A:d1;B:d1;C:d1;X:d1"] * 38
    durs = [20] * 40 + [120.5] * 3 + [20.5] * 38
    t, _ = _steps(c, "d0", 1000, batches, durs)
    assert t == 2940.5
    for rid in "ABC":
        c.router_request(rid, 0, 3000, "pull", first_token_ms=1000, last_token_ms=t, output_tokens=82)
    c.router_request("X", 900, 3000, "pull", first_token_ms=1000 + 800 + 361.5, last_token_ms=t, output_tokens=39)
    return c


def test_g2_chunked_prefill_stalls_neighbours_by_its_own_tokens_only(analyse):
    tr = analyse(_case_g2())
    st = tr.query("SELECT step_id, baseline_ns, excess_ns, culprit_request_id, culprit_kind, baseline_rule "
                  "FROM decode_stalls WHERE excess_ns > 0 ORDER BY step_id")
    assert [(r["step_id"], r["baseline_ns"], r["excess_ns"], r["culprit_request_id"], r["culprit_kind"])
            for r in st] == [(k, 20_500_000, 100_000_000, "X", "prefill") for k in (40, 41, 42)]
    assert {r["baseline_rule"] for r in st} == {"load"}
    rs = _rows(tr, "SELECT * FROM request_stalls")
    for rid in "ABC":
        assert rs[rid]["stall_ms"] == 300 and rs[rid]["top_culprit_request_id"] == "X"
        assert rs[rid]["top_culprit_kind"] == "prefill"
        assert round(rs[rid]["tpot_ms"], 9) == round(1940.5 / 81, 9)
        assert round(rs[rid]["tpot_without_stalls_ms"], 9) == round(1640.5 / 81, 9)
    assert rs["X"]["stall_ms"] == 0


@pytest.mark.parametrize("growth_ms", [0.41, 2.0])
def test_g1_growth_cost_does_not_matter(analyse, growth_ms):
    """Kind 8 holds whatever the per-request cost: a steeper batch (2 ms a request) is still no stall."""
    c = Case(connector=PULL)
    batches = []
    for k in range(40):
        n_run = k // 10 + (0 if k % 10 == 0 else 1)
        entries = [f"Q{i}:d1" for i in range(n_run)] + ([f"Q{k // 10}:p1"] if k % 10 == 0 else [])
        batches.append(";".join(entries))
    durs = [10 + growth_ms * len(b.split(";")) for b in batches]
    _steps(c, "d0", 0, batches, durs)
    tr = analyse(c)
    assert tr.query("SELECT count(*) AS n FROM decode_stalls WHERE excess_ns > 1")[0]["n"] == 0
