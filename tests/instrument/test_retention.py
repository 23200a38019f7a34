"""Tail retention in the host's sink (PDTRACE_RETAIN=tail): real traced processes, a real sink process, a real store.

Two fresh interpreters play the router and the decode engine of the same requests (ids and TTFTs
known to the test): the router process records each request's root span, first/last token events;
the decode process records its queue span, its ``request.finished`` event and the engine's
``decode.step`` spans whose ``step.batch`` names the requests. The sink (started by the first of
them) holds, decides and writes. The store is then read with DuckDB and compared with the rule,
request by request: every slow or failed request complete (all its records from both processes),
the others present iff head-sampled, nothing else of theirs; the processes' own counters balance.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest

from pdtrace.instrument import config, hostsink, retention, store
from pdtrace.instrument.recorder import R_SPAN
from pdtrace.instrument.sink import Sink

#: One process of the play. argv: role, path of a JSON plan {"base_ns", "reqs": [[id, ttft_ms, failed]],
#: "steps": [[start offset ms, dur ms, [ids]]]}. Records its role's records, flushes, prints a line,
#: waits for a line on stdin, shuts down and prints its counters.
PLAYER = """
import json, os, sys
from pdtrace.instrument import tracer
from pdtrace.instrument.schema import STATUS_ERROR
tracer.activate()
role = sys.argv[1]
tracer.set_resource(role=role)
plan = json.load(open(sys.argv[2]))
base = tracer.now() - int(plan["back_ms"] * 1e6)
ms = 1_000_000
for i, (rid, ttft, failed) in enumerate(plan["reqs"]):
    t0 = base + i * 2 * ms
    if role == "router":
        root = tracer.new_id()
        tracer.event("router.first_token", rid, root, time_ns=t0 + int(ttft * ms))
        tracer.event("router.last_token", rid, root, time_ns=t0 + int(ttft * ms) + 40 * ms,
                     attrs={"gen_ai.usage.output_tokens": 5})
        if failed:
            tracer.event("router.leg_failed", rid, root, time_ns=t0 + ms)
        tracer.record("router.request", rid, t0, t0 + int(ttft * ms) + 50 * ms, span_id=root,
                      status=STATUS_ERROR if failed else 0)
    else:
        tracer.record("decode.queue", rid, t0 + ms, t0 + 2 * ms)
        tracer.event("request.finished", rid, time_ns=t0 + int(ttft * ms) + 40 * ms,
                     attrs={"gen_ai.usage.output_tokens": 5})
if role == "decode":
    for off, dur, ids in plan["steps"]:
        t = base + int(off * ms)
        tracer.record("decode.step", None, t, t + int(dur * ms),
                      {"step.id": int(off), "step.batch": ";".join(f"{x}:d1" for x in ids)})
tracer.force_flush(30)
print(json.dumps({"pid": os.getpid()}), flush=True)
sys.stdin.readline()
ok = tracer.shutdown(30)
print(json.dumps({"ok": ok, "stats": tracer.stats(), "pid": os.getpid()}), flush=True)
"""

THRESHOLD_MS = 100.0
HEAD = 0.25


def _env(d, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    env.update({"PDTRACE_DIR": str(d), "PDTRACE_SINK_IDLE_S": "1", "PDTRACE_RETAIN": "tail",
                "PDTRACE_TAIL_TTFT_MS": str(THRESHOLD_MS), "PDTRACE_TAIL_HEAD": str(HEAD),
                "PDTRACE_FLUSH_INTERVAL_S": "0.2", "PDTRACE_ROTATE_S": "0"})
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _play(tmp_path, d, plan, roles=("decode", "router"), wait_s=0.0, between=None, **kw):
    """Run the players of ``roles`` on ``plan`` (``between()`` called after the first has flushed); after
    their flush wait ``wait_s`` s (decisions by the sink's clock) with them alive, then stop them and
    sync. Returns their final counters by role."""
    pf = tmp_path / "plan.json"
    pf.write_text(json.dumps(plan))
    procs = {}
    for role in roles:  # one after the other: the decode rows reach the sink before the router's end
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PLAYER), role, str(pf)], env=_env(d, **kw),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        json.loads(p.stdout.readline())
        procs[role] = p
        if between is not None and len(procs) == 1:
            between()
    time.sleep(wait_s)
    live = _rows(d) if wait_s else None
    out = {}
    for role, p in procs.items():
        o, err = p.communicate("\n", timeout=120)
        assert p.returncode == 0, err
        out[role] = json.loads(o.strip().splitlines()[-1])
        assert out[role]["ok"], err
    assert hostsink.sync(d, 30)
    return out, live


def _rows(d):
    files = [str(f) for f in store.store_files(d)]
    if not files:
        return []
    return duckdb.sql(f"select request_id, role, name, record from read_parquet({files!r}, union_by_name=true) "
                      "where record in ('span', 'event')").fetchall()


def _final_stats(d, role):
    """The last recorder.stats row of the process of ``role`` (written by the sink, counters cumulative).
    (Read from the store: the recorder's own stats() after its shutdown leaves tail_dropped out of
    'recorded'.)"""
    files = [str(f) for f in store.store_files(d)]
    row = duckdb.sql(f"select attr_int from read_parquet({files!r}) where record = 'stats' and role = '{role}' "
                     "order by attr_int['recorder.written'] desc, start_ns desc limit 1").fetchall()[0][0]
    return {k.removeprefix("recorder."): v for k, v in row.items()}


def _plan(n=120, slow_every=6, failed=(7,), back_ms=5000.0):
    reqs = []
    for i in range(n):
        rid = f"tr{i:04d}"
        ttft = 300.0 if i % slow_every == 0 else 20.0
        reqs.append([rid, ttft, i in failed])
    return {"back_ms": back_ms, "reqs": reqs, "steps": []}


def _expected(plan):
    """(kept ids, dropped ids) by the rule of pdtrace.instrument.retention."""
    keep, drop = set(), set()
    for rid, ttft, failed in plan["reqs"]:
        (keep if failed or ttft >= THRESHOLD_MS or retention.head_sampled(rid, HEAD) else drop).add(rid)
    return keep, drop


def test_slow_and_failed_requests_kept_whole_others_at_the_head_rate(tmp_path):
    """Decided by the sink's own clock (end + grace) while the players still run: every slow and
    failed request has all four of its records from both processes in the store, a fast one is
    there (whole) iff head-sampled, nothing else of it; steps follow their requests (a step of
    dropped requests only is dropped unless it stalled); counters balance per process."""
    d = tmp_path / "t"
    plan = _plan()
    reqs = plan["reqs"]
    # 40 ordinary 10 ms steps over pairs of requests, then one 200 ms step (a stall) and one 10 ms
    # step over two fast requests that are not head-sampled
    fast_out = [r[0] for r in reqs if r[1] < THRESHOLD_MS and not r[2] and not retention.head_sampled(r[0], HEAD)]
    steps = [[i * 3.0, 10.0, [reqs[2 * i][0], reqs[2 * i + 1][0]]] for i in range(40)]
    steps += [[150.0, 200.0, fast_out[:2]], [400.0, 10.0, fast_out[2:4]]]
    plan["steps"] = steps
    out, live = _play(tmp_path, d, plan, wait_s=3.0)
    keep, drop = _expected(plan)
    assert len(keep) >= 20 and len(drop) >= 60  # both sides well populated
    for rows in (live, _rows(d)):  # decided while the players ran, and the same after the sync
        by_req = {}
        for rid, role, name, rec in rows:
            if rid is not None:
                by_req.setdefault(rid, set()).add((role, name))
        whole = {("router", "router.request"), ("router", "router.first_token"), ("router", "router.last_token"),
                 ("decode", "decode.queue"), ("decode", "request.finished")}
        assert set(by_req) == keep
        for rid, ttft, failed in reqs:
            if rid in keep:
                assert whole <= by_req[rid], (rid, by_req[rid])
    rows = _rows(d)
    step_batches = duckdb.sql(
        f"select attr_str['step.batch'] from read_parquet({[str(f) for f in store.store_files(d)]!r}) "
        "where name = 'decode.step'").fetchall()
    kept_steps = {b for (b,) in step_batches}
    for off, dur, ids in steps:
        batch = ";".join(f"{x}:d1" for x in ids)
        want = dur >= 200 or off < 16 * 3.0 or any(x in keep for x in ids)  # stalled, no baseline yet, or kept
        assert (batch in kept_steps) == want, (off, dur, ids)
    # counters: recorded = written + dropped + tail_dropped, per process, and the dropped ones are those
    n_drop = len(drop)
    dec, rou = _final_stats(d, "decode"), _final_stats(d, "router")
    for st in (dec, rou):
        assert st["dropped"] == 0 and st["recorded"] == st["written"] + st["tail_dropped"], st
    assert rou["tail_dropped"] == 3 * n_drop  # router.request + 2 token events per dropped request
    dropped_steps = sum(1 for off, dur, ids in steps if not (dur >= 200 or off < 48 or any(x in keep for x in ids)))
    assert dec["tail_dropped"] == 2 * n_drop + dropped_steps
    files = [str(f) for f in store.store_files(d)]
    settings = duckdb.sql(f"select distinct attr_float['recorder.tail_ttft_ms'], attr_float['recorder.tail_head'] "
                          f"from read_parquet({files!r}) where record = 'stats'").fetchall()
    assert settings == [(THRESHOLD_MS, HEAD)]  # the retention in force, on every stats row
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["kept"] == len(keep) and summ["dropped"] == n_drop and summ["evicted"] == 0, summ
    assert summ["reasons"]["failed"] == 1 and summ["held_records"] == 0, summ


def test_marked_window_keeps_every_request_in_it(tmp_path):
    """``pdtrace mark`` (the real command) before the play: every request whose records fall in the
    window is kept whatever its TTFT, with the reason 'marked'; a request from before the window is not."""
    d = tmp_path / "t"
    d.mkdir()
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pdtrace"), "mark", "--before", "2",
                        "--seconds", "60", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = _plan(n=40, back_ms=1000.0)  # records 1 s ago: inside the window (from 2 s before the mark)
    _play(tmp_path, d, plan, roles=("decode", "router"))
    got = {rid for rid, *_ in _rows(d) if rid}
    assert got == {x[0] for x in plan["reqs"]}
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["marks"] == 1 and summ["dropped"] == 0, summ
    # a play placed 120 s in the past is outside the window: back to the rule
    d2 = tmp_path / "t2"
    d2.mkdir()
    (d2 / retention.MARKS_FILE).write_text((d / retention.MARKS_FILE).read_text())
    plan2 = _plan(n=40, back_ms=120_000.0)
    _play(tmp_path, d2, plan2, roles=("decode", "router"))
    keep, _ = _expected(plan2)
    assert {rid for rid, *_ in _rows(d2) if rid} == keep


def test_memory_bound_holds_under_a_burst_and_unended_requests_are_kept_at_the_end(tmp_path):
    """One process records 30,000 records of 15,000 requests that never end (no router root) as fast
    as it can, with a 1 MiB bound: the sink's held bytes never exceed the bound, the oldest are
    decided early (evicted and counted: none of them is over the threshold yet, none head-sampled),
    nothing evicted is in the store, and what was still held at the end is kept as unended."""
    d = tmp_path / "t"
    plan = {"back_ms": 0.0, "reqs": [[f"b{i:05d}", 20.0, False] for i in range(15000)], "steps": []}
    out, _ = _play(tmp_path, d, plan, roles=("decode",), PDTRACE_TAIL_MEMORY_MB="1", PDTRACE_TAIL_HEAD="0",
                   PDTRACE_TAIL_TTFT_MS="60000")
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["bound_bytes"] == 1 << 20 and 0.8 * (1 << 20) < summ["peak_bytes"] <= 1 << 20, summ
    assert summ["evicted"] > 10000 and summ["kept"] == 15000 - summ["evicted"], summ
    assert summ["reasons"]["unended"] == summ["kept"], summ
    st = _final_stats(d, "decode")
    assert st["tail_dropped"] == 2 * summ["evicted"] and st["written"] == st["recorded"] - st["tail_dropped"], st
    got = {rid for rid, *_ in _rows(d) if rid}
    assert len(got) == summ["kept"] and all(x >= f"b{15000 - summ['kept']:05d}" for x in got)  # the newest


def test_sigusr1_to_the_sink_marks_a_window(tmp_path):
    """SIGUSR1 to the running sink (found through /proc) while the decode side's records are held: the
    sink writes the window [now - 30 s, now + 60 s] to the marks file, and every request of the play is
    kept as 'marked', fast ones included."""
    d = tmp_path / "t"

    def signal_sink():
        (pid,) = hostsink.find(d)
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not (d / retention.MARKS_FILE).exists():
            assert time.monotonic() < deadline, "the sink wrote no mark"
            time.sleep(0.05)

    plan = _plan(n=30, back_ms=1000.0)
    _play(tmp_path, d, plan, between=signal_sink)
    assert {rid for rid, *_ in _rows(d) if rid} == {x[0] for x in plan["reqs"]}
    (m,) = [json.loads(x) for x in (d / retention.MARKS_FILE).read_text().splitlines()]
    assert m["by"] == "signal" and m["end_ns"] - m["start_ns"] == int(90e9)
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["reasons"].get("marked") == 30 - summ["reasons"].get("failed", 0) - summ["reasons"].get("ttft", 0)


# ---------------------------------------------------------------- in-process, real Sink objects
def _sink():
    return Sink(config.Config(trace_dir="/nonexistent"), {"role": "router"}, os.getpid(), "t")


def _ret(tmp_path, **kw):
    cfg = config.Config(trace_dir=str(tmp_path), retain="tail", **{"tail_ttft_ms": 100.0, "tail_head": 0.0, **kw})
    s = _sink()
    s.tail_dropped = 0
    return retention.TailRetention(cfg, str(tmp_path), host="h"), s


def _span(name, rid, t0, t1, status=0, **attrs):
    return (R_SPAN, 1, 1, None, name, 1, t0, t1, status, None, rid, 0, 0, None, "T", *attrs, *attrs.values())


def test_verdicts_ttft_tpot_engine_clock_and_early(tmp_path):
    """The rule on known records: router TTFT over/under, engine-clock TTFT (P's frontend -> D's token),
    TPOT, a root without a first token, and an early decision of a young vs an old unended request."""
    from pdtrace.instrument.recorder import R_EVENT

    def ev(name, rid, t, **attrs):
        return (R_EVENT, 2, None, None, name, 1, t, t, 0, None, rid, 0, 0, None, "T", *attrs, *attrs.values())

    ret, s = _ret(tmp_path, tail_tpot_ms=30.0)
    ms = 1_000_000
    now = time.monotonic_ns()
    ret.admit(s, [ev("router.first_token", "slow", now + 150 * ms),
                  _span("router.request", "slow", now, now + 200 * ms),
                  ev("router.first_token", "fast", now + 50 * ms),
                  ev("router.last_token", "fast", now + 90 * ms, **{"gen_ai.usage.output_tokens": 5}),
                  _span("router.request", "fast", now, now + 100 * ms),
                  ev("router.first_token", "stutter", now + 50 * ms),
                  ev("router.last_token", "stutter", now + 250 * ms, **{"gen_ai.usage.output_tokens": 5}),
                  _span("router.request", "stutter", now, now + 300 * ms),
                  _span("router.request", "notoken", now, now + 300 * ms),
                  _span("prefill.frontend", "eng", now, now + 10 * ms),
                  ev("token", "eng", now + 120 * ms)])
    v = {rid: ret.verdict(g, now) for rid, g in ret.groups.items()}
    assert v["slow"] == (True, "ttft") and v["fast"] == (False, "fast") and v["stutter"] == (True, "tpot")
    assert v["notoken"] == (True, "no_first_token") and v["eng"] == (True, "ttft")
    assert ret.ttft(ret.groups["eng"]) == 120 * ms and ret.ttft(ret.groups["fast"]) == 50 * ms
    # unended: young -> dropped early; older than the threshold with no first token -> kept early
    ret.admit(s, [_span("decode.queue", "young", now, now + ms), _span("decode.queue", "old", now - 500 * ms, now)])
    assert ret.verdict(ret.groups["young"], now, early=True) == (False, "fast")
    assert ret.verdict(ret.groups["old"], now + 1, early=True) == (True, "ttft")
    # unended with its first token already here: judged by that token, not by its age
    ret.admit(s, [_span("router.dispatch", "oldfast", now - 900 * ms, now - 899 * ms),
                  ev("router.first_token", "oldfast", now - 860 * ms),
                  _span("router.dispatch", "oldslow", now - 900 * ms, now - 899 * ms),
                  ev("router.first_token", "oldslow", now - 700 * ms)])
    assert ret.verdict(ret.groups["oldfast"], now, early=True) == (False, "fast")
    assert ret.verdict(ret.groups["oldslow"], now, early=True) == (True, "ttft")
    # the grace: nothing decided before it, the ended ones after it
    ret.tick(now)
    assert "slow" in ret.groups
    ret.tick(time.monotonic_ns() + ret.grace_ns)
    assert ret.decided["slow"] is True and ret.decided["fast"] is False and "young" in ret.groups
    # a late record of a decided request follows the decision
    assert ret.admit(s, [_span("decode.queue", "slow", now, now + 1)]) and not ret.admit(
        s, [_span("decode.queue", "fast", now, now + 1)])
    assert s.tail_dropped == 3 + 1  # fast's root and two events, then its late span


def test_keep_list_of_another_host_keeps_a_request_here(tmp_path):
    """Cross-host: an id another host's sink appended to its keep-list is kept here though fast; this
    sink appends what it keeps to its own list."""
    ret, s = _ret(tmp_path)
    (tmp_path / "tail-keep" / "otherhost-1.ids").write_text("far\n")
    now = time.monotonic_ns()
    ret.admit(s, [_span("decode.queue", "far", now, now + 1), _span("decode.queue", "near", now, now + 1)])
    ret.decide_all()
    assert ret.decided["far"] is True and ret.reasons.get("remote") == 1
    assert (tmp_path / "tail-keep" / f"h-{os.getpid()}.ids").read_text().splitlines() == \
        ["far\t1\tE", "near\t1\tE"]  # near: unended at the decide_all; E: no router record here


def test_engine_host_waits_for_the_router_hosts_verdict(tmp_path):
    """Cross-host, the engine side: D's records of three ended requests, no router record on this host,
    another host's list present. Past the grace nothing is decided (waiting); when the router host's
    verdicts arrive (A kept, B dropped with its root: R) A is kept and B dropped at the next look; C,
    with no verdict, is decided by the local rule at the hold time. A router root here is never waited on."""
    ret, s = _ret(tmp_path, tail_hold_s=10.0)
    other = tmp_path / "tail-keep" / "routerhost-7.ids"
    assert other.parent.is_dir()  # made by the sink at its start, with its own empty list
    other.write_text("")
    ret.poll_files(force=True)
    now = time.monotonic_ns()
    ms = 1_000_000
    recs = []
    for x in ("A", "B", "C"):
        recs += [_span("decode.queue", x, now, now + ms),
                 _span("decode.frontend", x, now, now + 5 * ms, **{"frontend.part": "out"})]
    from pdtrace.instrument.recorder import R_EVENT

    recs += [(R_EVENT, 9, None, None, "router.first_token", 1, now - 20 * ms, now - 20 * ms, 0, None, "R1", 0, 0,
              None, "T"), _span("router.request", "R1", now - 50 * ms, now)]  # a root here: the rule, no wait
    ret.admit(s, recs)
    ret.tick(time.monotonic_ns() + ret.grace_ns)
    assert set(ret.groups) == {"A", "B", "C"} and ret._waiting == {"A", "B", "C"} and "R1" in ret.decided
    with open(other, "a") as f:
        f.write("A\t1\tR\nB\t0\tR\n")
    ret.poll_files(force=True)
    assert ret.decided["A"] is True and ret.decided["B"] is False and set(ret.groups) == {"C"}
    assert ret.reasons["remote"] == 1 and ret.reasons["remote_drop"] == 1
    ret.tick(time.monotonic_ns() + ret.hold_ns)
    assert ret.decided["C"] is False and ret.reasons["fast"] == 2  # R1 and C: fast, not head-sampled
    mine = (tmp_path / "tail-keep" / f"h-{os.getpid()}.ids").read_text().splitlines()
    assert mine == ["R1\t0\tR", "A\t1\tE"]  # its authoritative drop (others wait for it), its keep


@pytest.mark.parametrize("n", [2000])
def test_stall_baseline_keeps_long_steps_only(tmp_path, n):
    """The automatic stall rule: steps of 10 ms are not stalls once 16 are known; one of 25 ms is
    (> 2 x median); with PDTRACE_TAIL_STEP_MS the fixed threshold is used instead."""
    ret, s = _ret(tmp_path)
    ms = 1_000_000
    flags = [ret._stalled(s, "decode.step", 10 * ms + i) for i in range(n)]
    assert all(flags[:16]) and not any(flags[16:])
    assert ret._stalled(s, "decode.step", 25 * ms) and not ret._stalled(s, "decode.step", 19 * ms)
    fixed, s2 = _ret(tmp_path, tail_step_ms=15.0)
    assert fixed._stalled(s2, "decode.step", 15 * ms) and not fixed._stalled(s2, "decode.step", 14 * ms)
