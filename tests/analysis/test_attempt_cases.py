"""Retries and attempts (DESIGN.md §3 "Attempt", issue 17 kind 4), each rebuilt from a public report.

Times in ms from T0 on the true clock (pdtrace_case_builder); an engine's raw times are true + its shift.
The rules under test:
- clock evidence pairs a send and a receive of the same attempt and the same engine pair only, so a
  retried request gives no fake offset (every engine's offset within its evidence bounds, and the true
  shift within offset +- bound);
- TTFT runs from the original arrival through every attempt to the first token; the attempt that
  delivered the first token defines the handoff, so the retry's prefill is on the critical path;
- requests.wasted_compute_ms = compute whose output did not feed the delivered first token.
"""
from __future__ import annotations

import pytest
from pdtrace_case_builder import Case

SHIFT = {"p0": 40.0, "p1": -25.0, "d0": 15.0, "d1": -10.0}


def _plain_pull(c: Case, rid: str, t: float, p: str, d: str) -> None:
    """A request without retry on (p, d): the evidence every engine's offset is estimated from."""
    root = c.router_request(rid, t, t + 100, "pull", first_token_ms=t + 90)
    c.span("router", "router.dispatch", t, t + 1, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", t + 2, t + 40, rid=rid, engine=p)
    c.span("router", "router.wait", t + 1, t + 41, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", t + 41, t + 42, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "handoff.prep", t + 43, t + 45, rid=rid, engine=d)
    c.span("decode", "kv.transfer", t + 45, t + 60, rid=rid, engine=d)
    c.span("decode", "decode.first_step", t + 60, t + 89, rid=rid, engine=d)


def _check_clocks(tr) -> None:
    offs = tr.query("SELECT * FROM clock_offsets WHERE window_start_ns IS NULL AND clock_a = 'router'")
    seen = {r["clock_b"] for r in offs}
    assert seen >= {"p0", "p1", "d0", "d1"}
    for r in offs:
        true_ns = SHIFT[r["clock_b"]] * 1e6
        assert r["consistent"], r
        assert r["lower_ns"] <= r["offset_ns"] <= r["upper_ns"], r
        assert abs(r["offset_ns"] - true_ns) <= r["bound_ns"], r      # the truth is inside the estimate's bound
        assert abs(r["offset_ns"] - true_ns) < 5e6, r                  # no fake (multi-second) offset


# -- 1: router retry to another prefill worker after a failed KV transfer ----------------------------

def _retry_case(engine_attempts: str, waits: bool) -> Case:
    """llm-d/llm-d-router#2345 (coordinator fail-over: a P/D call fails before any token streams -> the
    failed pod is excluded and the request re-issued to another pod) and vllm-project/vllm-ascend#13929
    (the load-balancing proxy retried P/D backend failures). Pull, request "r1":
      attempt 0: P on p0 (queue 2-10, compute 10-100 in two chunks), D on d0: READ 110-150 fails (status error), D's leg
                 ends in error at 2000 (the router's 2 s timeout); the router waits until 2100 (backoff).
      attempt 1: P on p1 (queue 2102-2105, compute 2105-2190), D on d1 (prep 2195-2200, READ 2200-2230,
                 ready 2230-2235, first step 2235-2278); first token 2280.
    engine_attempts 'local': the engines number their own attempts (p1/d1 see the request for the first
    time: attempt 0), as vLLM does; 'router': they carry the router's attempt 1. waits=False: a router that
    records no router.wait (P's answer then comes from the decode leg's dispatch)."""
    c = Case(clock_shift_ms=SHIFT)
    a1 = 0 if engine_attempts == "local" else 1
    root = c.router_request("r1", 0, 2400, "pull", first_token_ms=2280)
    c.span("router", "router.dispatch", 0, 1, rid="r1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.queue", 2, 10, rid="r1", engine="p0")
    whole = c.span("prefill", "prefill.compute", 10, 100, rid="r1", engine="p0")
    for lo, hi in ((10, 55), (55, 100)):   # two chunks: children of the whole (counted once)
        c.span("prefill", "prefill.compute", lo, hi, rid="r1", engine="p0", parent=whole)
    c.span("router", "router.dispatch", 102, 103, rid="r1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 104, 106, rid="r1", engine="d0")
    c.span("decode", "handoff.prep", 106, 110, rid="r1", engine="d0")
    c.span("decode", "kv.transfer", 110, 150, rid="r1", engine="d0", status=2)
    c.event("decode", "kv.transfer_failed", 150, rid="r1", engine="d0")
    c.event("router", "router.leg_failed", 2000, rid="r1", span=root, attrs={"router.leg": "decode"})
    if waits:
        c.span("router", "router.wait", 1, 101, rid="r1", parent=root, attrs={"router.leg": "prefill"})
        c.span("router", "router.wait", 103, 2000, rid="r1", parent=root, attrs={"router.leg": "decode"},
               status=2)
    # attempt 1 (the router's), to other engines
    c.span("router", "router.dispatch", 2100, 2101, rid="r1", parent=root, attrs={"router.leg": "prefill"},
           attempt=1)
    c.span("prefill", "prefill.queue", 2102, 2105, rid="r1", engine="p1", attempt=a1)
    c.span("prefill", "prefill.compute", 2105, 2190, rid="r1", engine="p1", attempt=a1)
    c.span("router", "router.dispatch", 2192, 2193, rid="r1", parent=root, attrs={"router.leg": "decode"},
           attempt=1)
    c.span("decode", "decode.queue", 2194, 2195, rid="r1", engine="d1", attempt=a1)
    c.span("decode", "handoff.prep", 2195, 2200, rid="r1", engine="d1", attempt=a1)
    c.span("decode", "kv.transfer", 2200, 2230, rid="r1", engine="d1", attempt=a1)
    c.span("decode", "kv.ready", 2230, 2235, rid="r1", engine="d1", attempt=a1)
    c.span("decode", "decode.first_step", 2235, 2278, rid="r1", engine="d1", attempt=a1)
    if waits:
        c.span("router", "router.wait", 2101, 2191, rid="r1", parent=root, attrs={"router.leg": "prefill"},
               attempt=1)
        c.span("router", "router.wait", 2193, 2279, rid="r1", parent=root, attrs={"router.leg": "decode"},
               attempt=1)
    for k, (p, d) in enumerate([("p0", "d0"), ("p1", "d1"), ("p0", "d1"), ("p1", "d0")]):
        _plain_pull(c, f"n{k}", 3000 + 200 * k, p, d)
    return c


@pytest.mark.parametrize("engine_attempts", ["local", "router"])
@pytest.mark.parametrize("waits", [True, False])
def test_router_retry_to_another_prefill_worker(analyse, engine_attempts, waits):
    """Right answer (from the reports' sequence: the first P/D pair failed, the request was re-issued to
    healthy pods, and the client got its first token from the second pair): the client's TTFT is the
    whole 2280 ms from its original arrival; the retry's prefill on p1 (85 ms) is on the critical path as
    compute; the first attempt's prefill (90 ms on p0) is on the path too (the client waited through it)
    but fed nothing: wasted_compute_ms = 90. The retried request gives no clock evidence that pairs an
    attempt-0 receive with an attempt-1 send or p0's receive with the send to p1: before the fix the
    router's latest dispatch (2101) against p0's first receive (2) bounded p0 by ~-2.1 s."""
    tr = analyse(_retry_case(engine_attempts, waits))
    _check_clocks(tr)
    req = tr.query("SELECT * FROM requests WHERE request_id = 'r1'")[0]
    assert req["status"] == "complete"
    assert req["ttft_ms"] == pytest.approx(2280, abs=1e-6)
    assert req["wasted_compute_ms"] == pytest.approx(90, abs=1e-3)
    seg = tr.query("""SELECT stage, engine_id, sum(dur_ns) / 1e6 AS ms FROM ttft_segments
                      WHERE request_id = 'r1' GROUP BY ALL""")
    by = {(r["stage"], r["engine_id"]): r["ms"] for r in seg}
    assert by[("prefill.compute", "p1")] == pytest.approx(85, abs=5.5)   # clock bounds of a few ms
    assert by[("prefill.compute", "p0")] == pytest.approx(90, abs=5.5)
    assert by[("decode.first_step", "d1")] == pytest.approx(43, abs=5.5)
    assert sum(r["ms"] for r in seg) == pytest.approx(2280, abs=1e-6)
    bd = tr.query("SELECT * FROM ttft_breakdown WHERE request_id = 'r1'")[0]
    assert bd["wasted_compute_ms"] == pytest.approx(90, abs=1e-3)
    assert bd["compute_ms"] >= 85 + 90 + 43 - 16
    clean = tr.query("SELECT wasted_compute_ms, flags FROM requests WHERE request_id LIKE 'n%'")
    assert [r["wasted_compute_ms"] for r in clean] == [0, 0, 0, 0]
    # the flag follows the column: set for the retried request, not for the clean ones
    assert "wasted_compute" in req["flags"]
    assert not any("wasted_compute" in r["flags"] for r in clean)


# -- 2: D's KV load fails, D recomputes locally; the recompute is preempted once more ----------------

def _load_failed_case(preempt_again: bool) -> Case:
    """vllm-project/vllm#26171 ([P/D][NixlConnector] kv load recovery: after a failed handshake or READ,
    "decode does local prefill", kv_load_failure_policy=recompute) and vllm-project/vllm#56733 (a request
    whose KV load failed is recomputed; under KV pressure it is preempted and restarted, its earlier
    output stale). Pull, request "k1", no router retry (router attempt 0):
      P on p0: compute 5-100; router got P's answer at 101, D's leg sent 101-102.
      D on d0: queue 103-105, prep 105-110, READ 110-140 fails -> kv.load_failed at 141 (attempt 0).
      attempt 1 (D's own): local recompute 145-225 (prefill.compute on D);
      preempt_again: request.preempted at 226, attempt 2: recompute 240-330.
      first step to the first token, first token written 20 ms after the last recompute."""
    c = Case(clock_shift_ms=SHIFT)
    end = 330 if preempt_again else 225
    root = c.router_request("k1", 0, end + 60, "pull", first_token_ms=end + 21)
    c.span("router", "router.dispatch", 0, 1, rid="k1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.queue", 2, 5, rid="k1", engine="p0")
    c.span("prefill", "prefill.compute", 5, 100, rid="k1", engine="p0")
    c.span("router", "router.wait", 1, 101, rid="k1", parent=root, attrs={"router.leg": "prefill"})
    c.span("router", "router.dispatch", 101, 102, rid="k1", parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.queue", 103, 105, rid="k1", engine="d0")
    c.span("decode", "handoff.prep", 105, 110, rid="k1", engine="d0")
    c.span("decode", "kv.transfer", 110, 140, rid="k1", engine="d0", status=2)
    c.event("decode", "kv.load_failed", 141, rid="k1", engine="d0",
            attrs={"lifecycle.cause": "load_failed_recompute"})
    c.span("decode", "decode.queue", 141, 145, rid="k1", engine="d0", attempt=1)
    c.span("decode", "prefill.compute", 145, 225, rid="k1", engine="d0", attempt=1)
    last = 1
    if preempt_again:
        c.event("decode", "request.preempted", 226, rid="k1", engine="d0", attempt=1)
        c.span("decode", "decode.queue", 226, 240, rid="k1", engine="d0", attempt=2)
        c.span("decode", "prefill.compute", 240, 330, rid="k1", engine="d0", attempt=2)
        last = 2
    c.span("decode", "decode.first_step", end, end + 19, rid="k1", engine="d0", attempt=last)
    c.span("router", "router.wait", 102, end + 20, rid="k1", parent=root, attrs={"router.leg": "decode"})
    for k, (p, d) in enumerate([("p0", "d0"), ("p1", "d1"), ("p0", "d1"), ("p1", "d0")]):
        _plain_pull(c, f"n{k}", 3000 + 200 * k, p, d)
    return c


@pytest.mark.parametrize("preempt_again", [False, True])
def test_kv_load_failed_then_local_recompute(analyse, preempt_again):
    """Right answer (vllm#26171: the failed load falls back to a local prefill on D, the request still
    completes): TTFT = arrival -> first token (246 ms; 351 ms with the second preemption); D's recompute
    is compute on the critical path; P's prefill (95 ms) did not feed the token -- D never got its KV --
    so it is wasted; with the preemption (vllm#56733) the first recompute (80 ms) was discarded too:
    wasted = 95 + 80. The attempt-1/2 rows on D (D's own attempts, no router attempt) are paired with
    the router's attempt 0 and give no fake clock offset."""
    tr = analyse(_load_failed_case(preempt_again))
    _check_clocks(tr)
    req = tr.query("SELECT * FROM requests WHERE request_id = 'k1'")[0]
    assert req["status"] == "complete" and req["recomputed"]
    end = 330 if preempt_again else 225
    assert req["ttft_ms"] == pytest.approx(end + 21, abs=1e-6)
    assert req["wasted_compute_ms"] == pytest.approx(95 + (80 if preempt_again else 0), abs=1e-3)
    seg = tr.query("""SELECT stage, role, sum(dur_ns) / 1e6 AS ms FROM ttft_segments
                      WHERE request_id = 'k1' GROUP BY ALL""")
    by = {(r["stage"], r["role"]): r["ms"] for r in seg}
    recompute = 80 + (90 if preempt_again else 0)
    assert by[("prefill.compute", "decode")] == pytest.approx(recompute, abs=1e-6)   # one clock: exact
    assert by[("prefill.compute", "prefill")] == pytest.approx(95, abs=5.5)
    assert sum(r["ms"] for r in seg) == pytest.approx(end + 21, abs=1e-6)


def test_clock_pairs_are_not_mixed_across_attempts_of_one_engine(analyse):
    """llm-d/llm-d-router#1206 ([sidecar] retry prefill queries): a transient 5xx from the prefill pod is
    retried on the SAME prefill host after a backoff. p0 received attempt 0 (it queued it, then answered
    503) and attempt 1 2 s later, both under its own attempt 0 (vLLM numbers nothing). Before the fix the
    router's latest P dispatch (2001) was paired with p0's first receive (2): an upper bound ~2 s below
    the truth. Now the request's P messages are not used (the router's attempt 1 has no P rows of its
    own: the engine did not number it), and the offsets stay those of the clean requests; TTFT runs from
    the original arrival (0) and the retry's compute is on the path."""
    c = Case(clock_shift_ms=SHIFT)
    root = c.router_request("s1", 0, 2300, "pull", first_token_ms=2200)
    c.span("router", "router.dispatch", 0, 1, rid="s1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.queue", 2, 30, rid="s1", engine="p0")
    c.span("router", "router.wait", 1, 31, rid="s1", parent=root, attrs={"router.leg": "prefill"}, status=2)
    c.event("router", "router.leg_failed", 31, rid="s1", span=root,
            attrs={"router.leg": "prefill", "http.response.status_code": 503})
    c.span("router", "router.dispatch", 2000, 2001, rid="s1", parent=root, attrs={"router.leg": "prefill"},
           attempt=1)
    c.span("prefill", "prefill.queue", 2002, 2005, rid="s1", engine="p0")
    c.span("prefill", "prefill.compute", 2005, 2100, rid="s1", engine="p0")
    c.span("router", "router.wait", 2001, 2101, rid="s1", parent=root, attrs={"router.leg": "prefill"},
           attempt=1)
    c.span("router", "router.dispatch", 2101, 2102, rid="s1", parent=root, attrs={"router.leg": "decode"},
           attempt=1)
    c.span("decode", "handoff.prep", 2103, 2110, rid="s1", engine="d0")
    c.span("decode", "kv.transfer", 2110, 2150, rid="s1", engine="d0")
    c.span("decode", "decode.first_step", 2150, 2199, rid="s1", engine="d0")
    for k, (p, d) in enumerate([("p0", "d0"), ("p1", "d1"), ("p0", "d1"), ("p1", "d0")]):
        _plain_pull(c, f"n{k}", 3000 + 200 * k, p, d)
    tr = analyse(c)
    _check_clocks(tr)
    req = tr.query("SELECT * FROM requests WHERE request_id = 's1'")[0]
    assert req["ttft_ms"] == pytest.approx(2200, abs=1e-6)
    assert req["wasted_compute_ms"] == 0          # attempt 0 queued only: nothing computed, nothing wasted
    seg = tr.query("""SELECT stage, sum(dur_ns) / 1e6 AS ms FROM ttft_segments
                      WHERE request_id = 's1' GROUP BY ALL""")
    by = {r["stage"]: r["ms"] for r in seg}
    assert by["prefill.compute"] == pytest.approx(95, abs=5.5)
    assert sum(r["ms"] for r in seg) == pytest.approx(2200, abs=1e-6)
