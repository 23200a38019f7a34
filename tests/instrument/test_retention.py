"""Tail retention in the host's sink (PDTRACE_RETAIN=tail): real traced processes, a real sink process, a real store.

Two fresh interpreters play the router and the decode engine of the same requests (ids and TTFTs
known to the test): the router process records each request's root span, first/last token events;
the decode process records its queue span, its ``request.finished`` event and the engine's
``decode.step`` spans whose ``step.batch`` names the requests. The sink (started by the first of
them) holds, decides and writes. The store is then read with DuckDB and compared with the rule,
request by request: every slow or failed request complete (all its records from both processes),
the others present iff head-sampled, nothing else of theirs; the processes' own counters balance.
"""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest

from pdtrace.instrument import config, hostsink, retention, store
from pdtrace.instrument.recorder import R_EVENT, R_SPAN
from pdtrace.instrument.sink import Sink

#: One process of the play. argv: role, path of a JSON plan {"back_ms", "reqs": [[id, ttft_ms, failed]],
#: "steps": [[start offset ms, dur ms, [ids]]], "fe": D's API server records too}. Roles: router, prefill
#: (P's API server), decode (D's engine; its API server with "fe"), idle (records nothing). Records its
#: role's records, flushes, prints a line, waits for a line on stdin, shuts down and prints its counters.
PLAYER = """
import json, os, sys
from pdtrace.instrument import tracer
from pdtrace.instrument.schema import STATUS_ERROR
tracer.activate()
role, _, res_role = sys.argv[1].partition(":")  # "idle:decode": records nothing, resource role decode
tracer.set_resource(role=res_role or role)
plan = json.load(open(sys.argv[2]))
base = plan["base_ns"] if "base_ns" in plan else tracer.now() - int(plan["back_ms"] * 1e6)
ms = 1_000_000
for i, (rid, ttft, failed) in enumerate(plan["reqs"]):
    t0 = base + i * 2 * ms
    if role == "idle":
        break
    if role == "router":
        root = tracer.new_id()
        tracer.event("router.first_token", rid, root, time_ns=t0 + int(ttft * ms))
        tracer.event("router.last_token", rid, root, time_ns=t0 + int(ttft * ms) + 40 * ms,
                     attrs={"gen_ai.usage.output_tokens": 5})
        if failed:
            tracer.event("router.leg_failed", rid, root, time_ns=t0 + ms)
        tracer.record("router.request", rid, t0, t0 + int(ttft * ms) + 50 * ms, span_id=root,
                      status=STATUS_ERROR if failed else 0)
    elif role == "prefill":  # P's API server: its frontend span and its own token event (its answer)
        sid = tracer.record("prefill.frontend", rid, t0, t0 + 5 * ms, {"frontend.part": "whole"})
        tracer.event("token", rid, sid, time_ns=t0 + 4 * ms, attrs={"gen_ai.usage.output_tokens": 1})
    elif role == "decode":
        tracer.record("decode.queue", rid, t0 + ms, t0 + 2 * ms)
        tracer.event("request.finished", rid, time_ns=t0 + int(ttft * ms) + 40 * ms,
                     attrs={"gen_ai.usage.output_tokens": 5})
        if plan.get("fe"):  # D's API server (first chunk at the TTFT) and EngineCore's token (no span id)
            tracer.event("token", rid, time_ns=t0 + 3 * ms)
            sid = tracer.record("decode.frontend", rid, t0 + int(ttft * ms), t0 + int(ttft * ms) + 45 * ms,
                                {"frontend.part": "out"})
            tracer.event("token", rid, sid, time_ns=t0 + int(ttft * ms), attrs={"gen_ai.usage.output_tokens": 5})
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


def _play(tmp_path, d, plan, roles=("decode", "router"), wait_s=0.0, between=None, live_keep=None, **kw):
    """Run the players of ``roles`` on ``plan`` (``between()`` called after the first has flushed); after
    their flush wait ``wait_s`` s (decisions by the sink's clock) with them alive -- with ``live_keep`` (a
    set of request ids), until every one of them is in the store, at most 30 s more (a loaded machine
    slows the sink, not the rule) -- then read the store (``live``), stop them and sync. Returns (their
    final counters by role, ``live``: the store's rows then, None without ``wait_s``)."""
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
    live = _rows(d) if wait_s or live_keep is not None else None
    deadline = time.monotonic() + 30.0
    while live_keep is not None and not {r[0] for r in live} >= live_keep and time.monotonic() < deadline:
        time.sleep(0.25)
        live = _rows(d)
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
    """The last recorder.stats row of the process of ``role`` (written by the sink, counters cumulative:
    the decisions made after the process stopped are in it, not in the process's own stats())."""
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
    keep, drop = _expected(plan)
    out, live = _play(tmp_path, d, plan, wait_s=3.0, live_keep=keep)
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
    for role, st in (("decode", dec), ("router", rou)):  # the process's own count after its shutdown
        assert out[role]["stats"]["recorded"] == st["recorded"], (role, out[role]["stats"], st)
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
    # the analysis says so: view processes (retention and counters per process) and the report's note
    from pdtrace.analysis import open as open_trace, report

    with open_trace(d, cache=False) as s:
        procs = {r["role"]: r for r in s.query("SELECT role, retain, recorded, written, tail_dropped, "
                                                "tail_ttft_ms, tail_head FROM processes")}
        text = report.render(report.collect(s.cursor()))
    for role, st in (("decode", dec), ("router", rou)):
        p = procs[role]
        assert (p["retain"], p["tail_ttft_ms"], p["tail_head"]) == ("tail", THRESHOLD_MS, HEAD), p
        assert (p["recorded"], p["written"], p["tail_dropped"]) == (st["recorded"], st["written"], st["tail_dropped"])
    assert "Tail-retained store (PDTRACE_RETAIN=tail; TTFT >= 100.000 ms, TPOT >= 0.000 ms (0: no rule), head " \
           "0.250)" in text, text[:600]


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
    # (a slow request whose first token and root came in two flushes may be kept in flight, as overdue)
    r = summ["reasons"]
    assert r.get("marked") == 30 - r.get("failed", 0) - r.get("ttft", 0) - r.get("overdue", 0), r


def _host():
    return socket.gethostname().replace("-", "_")


def _stats_rows(d, role):
    """Every recorder.stats row of the process of ``role``: [(wall ns, {counter: value})], oldest first."""
    files = [str(f) for f in store.store_files(d)]
    rows = duckdb.sql(f"select start_ns, attr_int from read_parquet({files!r}) where record = 'stats' "
                      f"and role = '{role}' order by start_ns").fetchall()
    return [(t, {k.removeprefix("recorder."): v for k, v in a.items()}) for t, a in rows]


def _fe_plan(n=60, slow_every=5, back_ms=2000.0):
    plan = _plan(n=n, slow_every=slow_every, failed=(), back_ms=back_ms)
    plan["fe"] = True
    plan["base_ns"] = time.monotonic_ns() - int(back_ms * 1e6)  # one time line for P and D (CLOCK_MONOTONIC)
    return plan


def test_engine_clock_ttft_from_ds_first_chunk_not_ps_token(tmp_path):
    """Review item 2. No router: P's API server (its frontend span and its own ``token`` event, written
    4 ms after its start when it answers) and D (EngineCore's ``token`` without a span id at 3 ms, its
    API server's first chunk on decode.frontend at the TTFT) in two real processes. The engine-clock
    TTFT is D's API-server token - P's frontend start: every slow request is kept (the old code took
    the earliest token of any kind: 3 ms, every request fast, the slow ones dropped)."""
    d = tmp_path / "t"
    plan = _fe_plan()
    keep, drop = _expected(plan)
    out, live = _play(tmp_path, d, plan, roles=("idle:decode", "prefill", "decode"), wait_s=2.5, live_keep=keep)
    slow = {r[0] for r in plan["reqs"] if r[1] >= THRESHOLD_MS}
    assert len(slow) == 12 and slow <= keep
    for rows in (live, _rows(d)):  # decided at D's end + grace while they ran (no router on this host)
        assert {rid for rid, *_ in rows if rid} == keep
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["reasons"]["ttft"] == len(slow) and summ["dropped"] == len(drop), summ


def test_bad_marks_file_does_not_stop_the_sink(tmp_path):
    """Review item 1. A marks file with lines that are not marks (Infinity, 1e400, a non-UTF-8 byte, a
    list, a string bound, a negative bound, start > end, a truncated line) and one good window: the
    sink starts, skips and counts the bad lines (``bad_marks``), and keeps every request of the play as
    marked by the good one (the old sink died at start: OverflowError / UnicodeDecodeError)."""
    d = tmp_path / "t"
    d.mkdir()
    now = time.time_ns()
    bad = [b'{"start_ns": Infinity, "end_ns": 1}', b'{"start_ns": 1e400, "end_ns": 2}', b'\xff\xfe{"start_ns"',
           b"[1, 2]", b'{"start_ns": "1", "end_ns": 2}', b'{"start_ns": -5, "end_ns": 2}',
           b'{"start_ns": 9, "end_ns": 2}', b'{"start_ns": 1']
    good = json.dumps({"start_ns": now - int(30e9), "end_ns": now + int(60e9), "by": "test"}).encode()
    (d / retention.MARKS_FILE).write_bytes(b"\n".join(bad + [good]) + b"\n")
    plan = _plan(n=30, back_ms=1000.0)
    _play(tmp_path, d, plan)
    assert {rid for rid, *_ in _rows(d) if rid} == {x[0] for x in plan["reqs"]}
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["marks"] == 1 and summ["bad_marks"] == len(bad) and summ["dropped"] == 0, summ


def test_stale_lists_of_this_host_and_dead_hosts_are_not_waited_on(tmp_path):
    """Review item 3. The trace directory holds the verdict list of an earlier sink of this host and
    one of another host not touched for an hour: neither is a live sink. Requests without a router
    record (P and D only) are decided at D's end + grace, not held the hold time waiting for a verdict;
    a router host's run writes no authoritative drop lines (nobody to wait for them)."""
    d = tmp_path / "t"
    kl = d / "tail-keep"
    kl.mkdir(parents=True)
    (kl / f"{_host()}-1.ids").write_text("tr0001\t1\tR\n")  # an earlier sink of this host
    old = kl / "deadhost-2.ids"
    old.write_text("tr0002\t1\tR\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    plan = _fe_plan(n=40)
    keep, _ = _expected(plan)  # tr0001 and tr0002 by the rule: their old verdicts were not read
    _, live = _play(tmp_path, d, plan, roles=("idle:decode", "prefill", "decode"), wait_s=2.5, live_keep=keep)
    assert {rid for rid, *_ in live if rid} == keep
    assert {rid for rid, *_ in _rows(d) if rid} == keep
    # a router play in a fresh directory with the same stale lists: no R-drop lines written
    d2 = tmp_path / "t2"
    (d2 / "tail-keep").mkdir(parents=True)
    (d2 / "tail-keep" / f"{_host()}-1.ids").write_text("")
    old2 = d2 / "tail-keep" / "deadhost-2.ids"
    old2.write_text("")
    os.utime(old2, (time.time() - 3600, time.time() - 3600))
    plan2 = _plan(n=40, back_ms=1000.0)
    _play(tmp_path, d2, plan2)
    mine = [p for p in (d2 / "tail-keep").iterdir() if p.name not in (f"{_host()}-1.ids", "deadhost-2.ids")]
    (lst,) = mine
    lines = lst.read_text().splitlines()
    keep2, _ = _expected(plan2)
    assert sorted(lines) == sorted(f"{x}\t1\tR" for x in keep2)  # its keeps only


def test_an_ended_clients_held_records_are_counted_once_decided(tmp_path):
    """Review items 7a, 8. D (its API server too, no router) exits while its records are held; another
    client stays connected, so they are decided by the rule at D's end + grace, after D has gone. D's
    last stats row in the store balances (recorded = written + tail_dropped, tail_dropped = the records
    of the dropped requests), and no stats row or anchor of D is written later than that (the old
    sink wrote none for the drops, or one every flush while the other client lived)."""
    d = tmp_path / "t"
    pf = tmp_path / "plan.json"
    plan = _fe_plan(n=30, back_ms=500.0)
    pf.write_text(json.dumps(plan))

    def start(role):
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PLAYER), role, str(pf)], env=_env(d),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        json.loads(p.stdout.readline())
        return p

    idle = start("idle")
    dec = start("decode")
    o, err = dec.communicate("\n", timeout=120)  # D gone at once: its records still held (grace 0.65 s)
    assert dec.returncode == 0, err
    t_exit = time.time_ns()
    time.sleep(3.0)  # 15 flush intervals with the idle client connected
    files_before = len(store.store_files(d))
    time.sleep(1.0)
    assert len(store.store_files(d)) == files_before  # nothing more written for D (nor for the idle one)
    o2, err2 = idle.communicate("\n", timeout=120)
    assert idle.returncode == 0, err2
    assert hostsink.sync(d, 30)
    drop = {r[0] for r in plan["reqs"] if not retention.head_sampled(r[0], HEAD)}  # no P here: no TTFT known
    rows = _stats_rows(d, "decode")
    t_last, last = rows[-1]
    assert last["tail_dropped"] == 5 * len(drop), last  # queue, finished, 2 tokens, frontend per request
    assert last["recorded"] == last["written"] + last["tail_dropped"] and last["dropped"] == 0, last
    assert t_last < t_exit + int(2e9)  # written once the decisions were made (grace), not later
    assert sum(1 for t, _ in rows if t > t_exit) <= 2, rows


def test_sigterm_to_the_sink_writes_every_held_request(tmp_path):
    """Review item 19 (SIGTERM with records held). D's records of requests that never end (hold 60 s):
    SIGTERM to the sink while D still runs; the sink decides every held request at once (unended: kept)
    and writes them, and D's counters balance in its last stats row."""
    d = tmp_path / "t"

    def term_sink():
        time.sleep(0.5)
        (pid,) = hostsink.find(d)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while pid in hostsink.find(d):
            assert time.monotonic() < deadline, "the sink did not exit"
            time.sleep(0.05)

    plan = _plan(n=20, back_ms=500.0)
    pf = tmp_path / "plan.json"
    pf.write_text(json.dumps(plan))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PLAYER), "decode", str(pf)],
                         env=_env(d, PDTRACE_TAIL_HOLD_S="60"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    json.loads(p.stdout.readline())
    term_sink()
    assert {rid for rid, *_ in _rows(d) if rid} == {x[0] for x in plan["reqs"]}
    summ = json.loads(next(d.glob("tail-retention-*.json")).read_text())
    assert summ["kept"] == 20 and summ["dropped"] == 0 and summ["held_records"] == 0, summ
    p.communicate("\n", timeout=120)
    st = _stats_rows(d, "decode")[-1][1]
    assert st["written"] >= 40 and st["tail_dropped"] == 0, st


# ---------------------------------------------------------------- in-process, real Sink objects
def _sink(role="router", flush=0.2):
    return Sink(config.Config(trace_dir="/nonexistent", flush_interval_s=flush), {"role": role}, os.getpid(), "t")


def _ret(tmp_path, **kw):
    cfg = config.Config(trace_dir=str(tmp_path), retain="tail", flush_interval_s=0.2,
                        **{"tail_ttft_ms": 100.0, "tail_head": 0.0, **kw})
    s = _sink()
    s.tail_dropped = 0
    return retention.TailRetention(cfg, str(tmp_path), host="h"), s


def _span(name, rid, t0, t1, status=0, sid=1, **attrs):
    return (R_SPAN, sid, sid, None, name, 1, t0, t1, status, None, rid, 0, 0, None, "T", *attrs, *attrs.values())


def _ev(name, rid, t, sid=None, **attrs):
    return (R_EVENT, 2, sid, None, name, 1, t, t, 0, None, rid, 0, 0, None, "T", *attrs, *attrs.values())


def _role_sink(role, flush=0.2):
    s = _sink(role, flush)
    s.tail_dropped = 0
    return s


def test_verdicts_ttft_tpot_engine_clock_and_early(tmp_path):
    """The rule on known records: router TTFT over/under, engine-clock TTFT (P's frontend -> D's API
    server token on its span; P's own token and EngineCore's are earlier and not it), TPOT, a root
    without a first token, and an early decision of a young vs an old unended request."""
    ret, s = _ret(tmp_path, tail_tpot_ms=30.0)
    sp, sd = _role_sink("prefill"), _role_sink("decode")
    ms = 1_000_000
    now = time.monotonic_ns()
    ret.admit(s, [_ev("router.first_token", "slow", now + 150 * ms),
                  _span("router.request", "slow", now, now + 200 * ms),
                  _ev("router.first_token", "fast", now + 50 * ms),
                  _ev("router.last_token", "fast", now + 90 * ms, **{"gen_ai.usage.output_tokens": 5}),
                  _span("router.request", "fast", now, now + 100 * ms),
                  _ev("router.first_token", "stutter", now + 50 * ms),
                  _ev("router.last_token", "stutter", now + 250 * ms, **{"gen_ai.usage.output_tokens": 5}),
                  _span("router.request", "stutter", now, now + 300 * ms),
                  _span("router.request", "notoken", now, now + 300 * ms)])
    ret.admit(sp, [_span("prefill.frontend", "eng", now, now + 10 * ms, sid=7, **{"frontend.part": "whole"}),
                   _ev("token", "eng", now + 9 * ms, sid=7)])  # P's answer to the router
    ret.admit(sd, [_ev("token", "eng", now + 8 * ms),  # EngineCore's: no span id
                   _ev("token", "eng", now + 120 * ms, sid=8)])  # D's API server's first chunk
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
                  _ev("router.first_token", "oldfast", now - 860 * ms),
                  _span("router.dispatch", "oldslow", now - 900 * ms, now - 899 * ms),
                  _ev("router.first_token", "oldslow", now - 700 * ms)])
    assert ret.verdict(ret.groups["oldfast"], now, early=True) == (False, "fast")
    assert ret.verdict(ret.groups["oldslow"], now, early=True) == (True, "ttft")
    # the grace: nothing decided before it, the ended ones after it
    ret.tick(now)
    assert "slow" in ret.groups
    ret.tick(time.monotonic_ns() + ret.grace_ns)
    assert ret.decided["slow"][0] is True and ret.decided["fast"][0] is False and "young" in ret.groups
    # a late record of a decided request follows the decision
    assert ret.admit(s, [_span("decode.queue", "slow", now, now + 1)]) and not ret.admit(
        s, [_span("decode.queue", "fast", now, now + 1)])
    assert s.tail_dropped == 3 + 1  # fast's root and two events, then its late span


def test_no_first_token_kept_without_a_ttft_threshold(tmp_path):
    """Review item 10: a router root without router.first_token is kept (incomplete) with no TTFT rule."""
    ret, s = _ret(tmp_path, tail_ttft_ms=0.0)
    now = time.monotonic_ns()
    ret.admit(s, [_span("router.request", "nt", now, now + 10)])
    assert ret.verdict(ret.groups["nt"], now) == (True, "no_first_token")


def test_grace_from_the_slowest_client_and_routed_requests_wait_for_their_root(tmp_path):
    """Review items 11, 12. The grace is 2 flush intervals of the slowest current client + 0.25 s (a
    client flushing every 2 s: 4.25 s), back to the sink's own when it goes. A request whose router
    records are here is not decided at D's end + grace: only its router.request ends it."""
    ret, s = _ret(tmp_path)
    assert ret.grace_ns == int(0.65e9)
    slow_client = _role_sink("decode", flush=2.0)
    now = time.monotonic_ns()
    ms = 1_000_000
    # a quick first token (a late one would be kept in flight as overdue: test_overdue_...)
    ret.admit(s, [_ev("router.first_token", "r", now + 50 * ms)])
    ret.admit(slow_client, [_span("decode.frontend", "r", now, now + 500 * ms, **{"frontend.part": "out"})])
    assert ret.grace_ns == int(4.25e9)
    ret.tick(time.monotonic_ns() + ret.grace_ns + 1)
    assert "r" in ret.groups  # D's end: its router root still to come
    ret.admit(s, [_span("router.request", "r", now - 10 * ms, now + 600 * ms)])
    ret.tick(time.monotonic_ns() + ret.grace_ns + 1)
    assert ret.decided["r"] == (False, ret.decided["r"][1]) and ret.reasons == {"fast": 1}
    ret.forget(slow_client)
    assert ret.grace_ns == int(0.65e9)


def test_admit_holds_or_passes_each_record_never_both(tmp_path):
    """Review item 13. Records with a time that is not an int are passed through (never held); a first
    token without a time after one with a time is held (no TypeError half-way): each record is either
    returned or held. A Collector given records before a client's init ignores them (nothing held with
    no client to count on)."""
    ret, s = _ret(tmp_path)
    now = time.monotonic_ns()
    recs = [_ev("router.first_token", "x", now), _ev("router.first_token", "x", None),
            _span("decode.queue", "x", "soon", now), _span("decode.queue", "y", now, 1.5)]
    out = ret.admit(s, recs)
    assert len(out) == 2 and ret.held_records == 2 and s.tail_held == 2 and set(ret.groups) == {"x"}
    ret.decide_all()
    assert ret.held_records == 0 and s.tail_held == 0
    from pdtrace.instrument.sink import Collector, _Conn

    a, b = socket.socketpair()
    try:
        col = Collector(config.Config(trace_dir=str(tmp_path), retain="tail"), socket.socket(socket.AF_UNIX))
        col._handle(_Conn(a), ("recs", [_span("decode.queue", "z", now, now + 1)]))
        assert not col.retention.groups
        col.retention.tick()
        col.retention.close()
    finally:
        a.close()
        b.close()


def test_requests_longer_than_the_hold_time_are_held_while_fed(tmp_path):
    """Review item 4. Hold 0.5 s, absolute cap 2 s: a request fed a record every 0.2 s for 1.5 s is still
    held at 1.5 s (the hold counts from its last record), then ends fast and is dropped (the old rule kept
    it as 'unended' at 0.5 s); one fed for 3 s is decided at the cap (2 s), kept as unended."""
    ret, s = _ret(tmp_path, tail_hold_s=0.5, tail_max_hold_s=2.0)
    t_start = time.monotonic_ns()
    ms = 1_000_000
    i = 0
    while time.monotonic_ns() - t_start < 3.0e9:
        t = time.monotonic_ns()
        recs = [_span("decode.step.part", "endless", t, t + ms, sid=i)]
        if t - t_start < 1.5e9:
            recs.append(_span("decode.queue", "long", t, t + ms, sid=i))
        ret.admit(s, recs)
        ret.tick()
        if 1.2e9 < t - t_start < 1.5e9:
            assert "long" in ret.groups
        i += 1
        time.sleep(0.2)
        if t - t_start >= 1.5e9 and "long" in ret.groups and not ret.groups["long"].ended:
            ret.admit(s, [_ev("router.first_token", "long", t + 10 * ms),
                          _span("router.request", "long", t, t + 20 * ms)])
    ret.tick(time.monotonic_ns() + ret.grace_ns)
    assert not ret.groups and ret.reasons == {"fast": 1, "unended": 1}, ret.reasons


def test_cross_host_wait_liveness_and_lists_read_from_their_end(tmp_path):
    """Review items 3, 5. A list present when the sink starts is read from its end (its verdicts are of
    requests gone by); a live list of another host makes an ended request wait; P's frontend end (no D
    on this host) ends P's part, and an R verdict decides it at once; the other sinks' verdicts are
    forgotten after keep_ns (memory bounded)."""
    kl = tmp_path / "tail-keep"
    kl.mkdir()
    other = kl / "routerhost-7.ids"
    other.write_text("p1\t1\tR\n")
    ret, _ = _ret(tmp_path, tail_hold_s=10.0)
    sp = _role_sink("prefill")
    now = time.monotonic_ns()
    ms = 1_000_000
    ret.admit(sp, [_span("prefill.frontend", x, now, now + 5 * ms, **{"frontend.part": "whole"})
                   for x in ("p1", "p2", "p3")])
    ret.tick(time.monotonic_ns() + ret.grace_ns)
    assert ret._waiting == {"p1", "p2", "p3"}  # p1's old keep not read
    with open(other, "a") as f:
        f.write("p2\t0\tR\np3\t1\tE\n")
    ret.poll_files()
    assert set(ret.groups) == {"p1"} and ret.decided["p2"][0] is False and ret.decided["p3"][0] is True
    assert ret.reasons == {"remote_drop": 1, "remote": 1}
    assert len(ret._remote) == 2
    ret.tick(time.monotonic_ns() + ret.keep_ns + 1)
    assert ret.reasons["fast"] == 1 and set(ret.decided) == {"p1"}  # p1 at the hold time, by the rule
    assert not ret._remote and ret.summary()["remote_bytes"] == 0
    ret.tick(time.monotonic_ns() + 2 * ret.keep_ns + 1)
    assert not ret.decided and ret.summary()["decisions_bytes"] == 0


def test_decisions_outlive_a_burst_and_are_forgotten_by_age(tmp_path):
    """Review item 14. 70,000 requests decided within a second (more than the old 65,536-entry table):
    a late record of the first one still follows its decision; a decision unused for keep_ns is forgotten
    and counted in the summary's memory."""
    ret, s = _ret(tmp_path)
    now = time.monotonic_ns()
    n = 70_000
    ret.admit(s, [r for i in range(n) for r in (_ev("router.first_token", f"q{i}", now + 1),
                                                 _span("router.request", f"q{i}", now, now + 2))])
    ret.decide_all()
    assert len(ret.decided) == n and ret.summary()["decisions_bytes"] >= n * retention.DECISION_BYTES
    assert ret.decided["q0"][0] is False and ret.reasons == {"fast": n}
    before = s.tail_dropped
    assert ret.admit(s, [_span("decode.queue", "q0", now, now + 1)]) == [] and "q0" not in ret.groups
    assert s.tail_dropped == before + 1
    ret.tick(time.monotonic_ns() + ret.keep_ns + 1)
    assert not ret.decided and ret.decided_bytes == 0


def test_client_state_is_forgotten(tmp_path):
    """Review item 15. Stall baselines are per client object and dropped with it; marked windows that
    ended before every held record and longer than keep_ns ago are pruned."""
    ret, s = _ret(tmp_path)
    for i in range(20):
        ret._stalled(s, "decode.step", 10 + i)
    assert any(k[0] is s for k in ret._base)
    ret.forget(s)
    assert not ret._base
    t = time.time_ns()
    ret._add_window(t - int(3600e9), t - int(3500e9))
    ret._add_window(t - int(1e9), t + int(60e9))
    ret._prune_marks(time.monotonic_ns())
    assert len(ret._marks) == 1 and ret.counts["marks"] == 2


def test_held_bytes_covers_a_large_step_batch(tmp_path):
    """Review item 6: a decode.step with a 256-request step.batch, unpickled as the sink receives it,
    costs (tracemalloc) no more than held_bytes says (the old estimate: 784 B for ~24 kB)."""
    import pickle
    import tracemalloc

    recs = []
    for k in range(200):
        batch = ";".join(f"cmpl-{k:04d}-{i:04d}-0-abcdef12:d1" for i in range(256))
        recs.append(_span("decode.step", None, 1, 2, sid=k, **{"step.id": k, "step.batch": batch}))
    blob = pickle.dumps(recs)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    got = pickle.loads(blob)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    est = sum(retention.held_bytes(r) for r in got)
    assert est >= used * 0.95 and est < 2 * used, (est, used)


def test_keep_list_of_another_host_keeps_a_request_here(tmp_path):
    """Cross-host: an id another host's sink appended to its keep-list is kept here though fast; this
    sink appends what it keeps to its own list."""
    ret, s = _ret(tmp_path)
    (tmp_path / "tail-keep" / "otherhost-1.ids").write_text("far\n")
    now = time.monotonic_ns()
    ret.admit(s, [_span("decode.queue", "far", now, now + 1), _span("decode.queue", "near", now, now + 1)])
    ret.decide_all()
    assert ret.decided["far"][0] is True and ret.reasons.get("remote") == 1
    assert (tmp_path / "tail-keep" / f"h-{os.getpid()}.ids").read_text().splitlines() == \
        ["far\t1\tE", "near\t1\tE"]  # near: unended at the decide_all; E: no router record here


def test_engine_host_waits_for_the_router_hosts_verdict(tmp_path):
    """Cross-host, the engine side: D's records of three ended requests, no router record on this host,
    another host's list present. Past the grace nothing is decided (waiting); when the router host's
    verdicts arrive (A kept, B dropped with its root: R) A is kept and B dropped at the next look; C,
    with no verdict, is decided by the local rule at the hold time. A router root here is never waited on."""
    ret, _ = _ret(tmp_path, tail_hold_s=10.0)
    s, sr = _role_sink("decode"), _role_sink("router")
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
    ret.admit(s, recs)
    ret.admit(sr, [_ev("router.first_token", "R1", now - 20 * ms),
                   _span("router.request", "R1", now - 50 * ms, now)])  # a root here: the rule, no wait
    ret.tick(time.monotonic_ns() + ret.grace_ns)
    assert set(ret.groups) == {"A", "B", "C"} and ret._waiting == {"A", "B", "C"} and "R1" in ret.decided
    with open(other, "a") as f:
        f.write("A\t1\tR\nB\t0\tR\n")
    ret.poll_files(force=True)
    assert ret.decided["A"][0] is True and ret.decided["B"][0] is False and set(ret.groups) == {"C"}
    assert ret.reasons["remote"] == 1 and ret.reasons["remote_drop"] == 1
    ret.tick(time.monotonic_ns() + ret.hold_ns)
    assert ret.decided["C"][0] is False and ret.reasons["fast"] == 2  # R1 and C: fast, not head-sampled
    mine = (tmp_path / "tail-keep" / f"h-{os.getpid()}.ids").read_text().splitlines()
    assert mine == ["R1\t0\tR", "A\t1\tE"]  # its authoritative drop (others wait for it), its keep


def test_head_sampling_threshold_is_exact():
    """Review item 20: the head rule uses ids.sample_threshold (exact for the float): 0 keeps none, 1 all."""
    from pdtrace.instrument import ids

    assert not retention.head_sampled("a", 0.0) and retention.head_sampled("a", 1.0)
    h = retention.head_hash("abc")
    f = h / (1 << 256)
    assert retention.head_sampled("abc", min(1.0, f * 1.0000001)) and not retention.head_sampled("abc", f * 0.9999999)
    assert ids.sample_threshold(0.5) == 1 << 255


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


def test_overdue_requests_are_kept_while_in_flight(tmp_path):
    """Issue 18 leftover: held records made an in-flight request invisible until decided. With a TTFT
    threshold (100 ms; grace 0.65 s), a request still without a first token at its first record +
    threshold + grace is kept then (``overdue``), and so is one whose first token came late; one whose
    first token came within the threshold stays held; an ended one waits for its grace as before. A
    kept request's later records are written as they come."""
    ret, s = _ret(tmp_path)
    ms = 1_000_000
    now = time.monotonic_ns()
    ret.admit(s, [_span("router.dispatch", "stuck", now, now + ms),
                  _span("router.dispatch", "late", now, now + ms), _ev("router.first_token", "late", now + 300 * ms),
                  _span("router.dispatch", "quick", now, now + ms), _ev("router.first_token", "quick", now + 50 * ms)])
    due = time.monotonic_ns() + 100 * ms + ret.grace_ns
    ret.tick(due - 300 * ms)
    # the sink's loop wakes for it (not at the 30 s hold time)
    assert set(ret.groups) == {"stuck", "late", "quick"} and ret.next_due_s() <= (100 * ms + ret.grace_ns) / 1e9
    assert ret.summary()["overdue_checks"] == 3  # one pending check per routed request, reported
    ret.tick(due + ms)
    assert set(ret.groups) == {"quick"} and ret.reasons == {"overdue": 2}
    assert ret.summary()["overdue_checks"] == 0  # checked: "quick" waits for its root, not for a check
    assert ret.decided["stuck"][0] and ret.decided["late"][0]
    assert ret.admit(s, [_span("decode.queue", "stuck", now, now + 2 * ms)])  # written at once
    # no threshold: nothing is decided in flight
    ret2, s2 = _ret(tmp_path / "b", tail_ttft_ms=0.0)
    (tmp_path / "b").mkdir(exist_ok=True)
    ret2.admit(s2, [_span("router.dispatch", "stuck", now, now + ms)])
    ret2.tick(time.monotonic_ns() + 10 * ret2.grace_ns)
    assert set(ret2.groups) == {"stuck"} and not ret2._dueq


STUCK_PLAYER = """
import sys
from pdtrace.instrument import tracer
tracer.activate()
tracer.set_resource(role="router")
t = tracer.now()
root = tracer.start("router.request", "stuck-1")   # never ends: no first token, the request is stuck
tracer.record("router.dispatch", "stuck-1", t, t + 1_000_000, parent=root, attrs={"router.leg": "prefill"})
q = tracer.new_id()  # a quick request: its first token at 1 ms, its root ended
tracer.event("router.first_token", "quick-1", q, time_ns=t + 1_000_000)
tracer.record("router.request", "quick-1", t, t + 3_000_000, span_id=q)
tracer.force_flush(30)
print("flushed", flush=True)
sys.stdin.readline()
tracer.shutdown(30)
"""


def test_a_stuck_request_shows_in_in_flight_while_the_sink_holds_tail_retention(tmp_path):
    """A real traced router process and its host's sink (PDTRACE_RETAIN=tail, TTFT threshold 100 ms): a
    request whose root never ends, without a first token, is in the store's ``in_flight`` view within a
    few flushes, while its process runs; a quick request of the same process, ended, is dropped at its
    end + grace as before."""
    from pdtrace import analysis

    d = tmp_path / "trace"
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STUCK_PLAYER)],
                         env=_env(d, PDTRACE_OPEN_AFTER_S="0", PDTRACE_TAIL_HEAD="0"),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "flushed"
        seen, deadline = [], time.monotonic() + 20
        while time.monotonic() < deadline:
            if store.store_files(d):
                with analysis.open(d, cache=False) as tr:
                    seen = tr.query("SELECT request_id, stage, role FROM in_flight")
                if seen:
                    break
            time.sleep(0.3)
        assert p.poll() is None  # still running: this is the live view
        assert [(r["request_id"], r["stage"], r["role"]) for r in seen] == [("stuck-1", "router.request", "router")]
        assert not [r for r in _rows(d) if r[0] == "quick-1"]
    finally:
        p.communicate("\n", timeout=120)
    assert p.returncode == 0


def test_verdict_lists_rotate_and_old_segments_are_deleted(tmp_path, monkeypatch):
    """Issue 18 leftover: a sink's verdict list grew without bound (a line per kept request, forever). With
    a 200-byte segment: the list continues in <host>-<pid>.1.ids, .2.ids ...; a reader on another host reads
    every verdict across the segments, once; a segment this sink no longer writes, and a list of an earlier
    sink of this host, are deleted once unmodified for keep_ns + LIVE_S, and the reader forgets them; the
    current segment and other hosts' lists stay."""
    monkeypatch.setattr(retention, "KEEP_LIST_BYTES", 200)
    ret, s = _ret(tmp_path, tail_head=1.0)  # every request kept: one line each
    other = retention.TailRetention(config.Config(trace_dir=str(tmp_path), retain="tail", flush_interval_s=0.2),
                                    str(tmp_path), host="otherhost")
    kd = tmp_path / "tail-keep"
    earlier = kd / "h-1.ids"  # an earlier sink of this host
    earlier.write_text("old\t1\tR\n")
    # a live sink of the same host name (another user's, a container's): its current segment is touched
    # by its heartbeat, its pre-created next one is not; neither is deleted
    live_cur, live_next = kd / "h-7.2.ids", kd / "h-7.3.ids"
    live_cur.write_text("live\t1\tR\n")
    live_next.write_text("")
    # other hosts: a gone one (a pod's host name that never returns: every segment older than
    # FOREIGN_LIST_S) and a live one with an old segment
    gone_host = [kd / "pod_a1-3.ids", kd / "pod_a1-3.1.ids"]
    live_host_old, live_host_cur = kd / "farhost-4.ids", kd / "farhost-4.1.ids"
    for p in gone_host + [live_host_old, live_host_cur]:
        p.write_text("")
    foreign = kd / "farhost-9.ids"
    foreign.write_text("far\t1\tR\n")
    now = time.monotonic_ns()
    ids = [f"request-{i:04d}-" + "x" * 30 for i in range(20)]  # 43 + 5 bytes a line: rotated after 5
    for rid in ids:
        ret.admit(s, [_ev("router.first_token", rid, now + 1), _span("router.request", rid, now, now + 2)])
    ret.tick(time.monotonic_ns() + ret.grace_ns + 1)
    assert ret.reasons == {"head": 20}
    segs = sorted(p.name for p in kd.iterdir() if p.name.startswith(f"h-{os.getpid()}"))
    assert len(segs) == 4 + 1 and all(p.stat().st_size <= 200 + 48 for p in kd.iterdir())  # 4 full, 1 new empty
    other.remote_keeps()
    assert [rid for rid in ids if other._remote.get(rid, (False,))[0]] == ids  # every verdict, across segments
    n_remote = len(other._remote)
    other.remote_keeps()
    assert len(other._remote) == n_remote  # read once
    # the old segments and the earlier sink's list are deleted once unmodified for keep_ns + LIVE_S
    old_t = time.time() - ret.keep_ns / 1e9 - retention.LIVE_S - 5
    for p in list(kd.iterdir()):
        if p != live_cur:
            os.utime(p, (old_t, old_t))
    gone_t = time.time() - retention.FOREIGN_LIST_S - 5
    for p in gone_host + [live_host_old]:
        os.utime(p, (gone_t, gone_t))
    ret._prune_lists()
    left = sorted(p.name for p in kd.iterdir())
    assert left == sorted([os.path.basename(ret._keep_path), "farhost-9.ids", "otherhost-" + str(os.getpid()) + ".ids",
                           "h-7.2.ids", "h-7.3.ids", "farhost-4.ids", "farhost-4.1.ids"])
    assert ret.counts["lists_pruned"] == 4 + 1 + 2
    os.utime(live_cur, (old_t, old_t))  # that sink is gone: its heartbeat stopped
    ret._prune_lists()
    assert not live_cur.exists() and not live_next.exists() and ret.counts["lists_pruned"] == 4 + 1 + 2 + 2
    other.remote_keeps()
    assert "farhost-9.ids" in other._remote_pos and set(other._remote_pos) <= set(left)  # the deleted forgotten
    assert set(other._live) <= set(left)
    ret.close()
    other.close()


def test_a_sink_whose_list_was_deleted_continues_in_a_new_segment(tmp_path, monkeypatch):
    """A sink stalled longer than the others' pruning age (FOREIGN_LIST_S) finds its current segment
    deleted at its next heartbeat: it continues in the next segment (a new name, which readers read from
    the start), so its later verdicts are seen; a heartbeat with the segment in place changes nothing."""
    ret, s = _ret(tmp_path, tail_head=1.0)
    other = retention.TailRetention(config.Config(trace_dir=str(tmp_path), retain="tail", flush_interval_s=0.2),
                                    str(tmp_path), host="otherhost")
    first = ret._keep_path
    ret._next_beat = 0
    ret.poll_files(force=True)
    assert ret._keep_path == first and ret.counts["lists_reopened"] == 0
    os.unlink(first)
    ret._next_beat = 0
    ret.poll_files(force=True)
    assert ret.counts["lists_reopened"] == 1 and ret._keep_path.endswith(".1.ids") and os.path.exists(ret._keep_path)
    # deleted by a sink on another NFS client: this host's fd goes stale (ESTALE). No NFS here: a fake
    # fstat raising ESTALE stands for it (the one failure this test cannot cause for real)
    real_fstat = os.fstat

    def stale_fstat(fd):
        if fd == ret._keep_fd:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_fstat(fd)

    monkeypatch.setattr(retention.os, "fstat", stale_fstat)
    ret._next_beat = 0
    ret.poll_files(force=True)
    monkeypatch.setattr(retention.os, "fstat", real_fstat)
    assert ret.counts["lists_reopened"] == 2 and ret._keep_path.endswith(".2.ids")
    now = time.monotonic_ns()
    ret.admit(s, [_ev("router.first_token", "after", now + 1), _span("router.request", "after", now, now + 2)])
    ret.tick(time.monotonic_ns() + ret.grace_ns + 1)
    other.remote_keeps()
    assert other._remote["after"][0]  # the verdict made after the deletion reaches the other host
    ret.close()
    other.close()


def test_without_pdtrace_router_each_side_keeps_a_request_over_the_threshold(tmp_path):
    """Issue 18 leftover: a router other than pdtrace's, P and D on different hosts, so neither has the
    engine-clock TTFT (before, neither kept a slow request unless it failed). D's host keeps a request
    whose D side (its API server's receipt -> its first chunk) alone is over the 100 ms threshold, P's
    host one whose P side (its API server's receipt -> the end of its prefill) is (``ttft_side``), each at
    once at its end; the other host, waiting while that sink is live, follows the keep line (``remote``).
    A request with both sides under the threshold is dropped on both at the hold time; so is one whose
    sides are each under it though their sum is over (65 + 65 ms: the rule's stated gap)."""
    ms = 1_000_000

    def host(name):
        cfg = config.Config(trace_dir=str(tmp_path), retain="tail", flush_interval_s=0.2, tail_ttft_ms=100.0,
                            tail_head=0.0)
        return retention.TailRetention(cfg, str(tmp_path), host=name)

    pret, dret = host("phost"), host("dhost")
    pret.remote_keeps()
    dret.remote_keeps()  # each sees the other's list: live
    sp, sd = _role_sink("prefill"), _role_sink("decode")
    now = time.monotonic_ns()
    sides = {"slow_d": (20, 150), "slow_p": (150, 20), "fast": (20, 20), "split": (65, 65)}  # (P, D) ms
    for rid, (p_ms, d_ms) in sides.items():
        pret.admit(sp, [_span("prefill.compute", rid, now + 2 * ms, now + p_ms * ms, sid=8),
                        _span("prefill.frontend", rid, now, now + (p_ms + 5) * ms, sid=7,
                              **{"frontend.part": "whole"})])  # P answered: its end on P's host
        t = now + (p_ms + 6) * ms  # pull: D's leg sent after P answered
        dret.admit(sd, [_span("decode.frontend", rid, t, t + ms, sid=5, **{"frontend.part": "in"}),
                        _ev("token", rid, t + d_ms * ms, sid=5),
                        _span("decode.frontend", rid, t + d_ms * ms, t + (d_ms + 1) * ms, sid=6,
                              **{"frontend.part": "out"})])
    assert pret.ttft_side(pret.groups["slow_p"]) == 150 * ms and dret.ttft_side(dret.groups["slow_d"]) == 150 * ms
    end = time.monotonic_ns() + max(pret.grace_ns, dret.grace_ns) + ms
    pret.tick(end)
    assert pret.reasons == {"ttft_side": 1} and set(pret.groups) == {"slow_d", "fast", "split"}  # others wait
    dret.tick(end)  # (its poll reads P's keep line first)
    pret.remote_keeps()
    assert pret.reasons == dret.reasons == {"ttft_side": 1, "remote": 1}
    assert set(pret.groups) == set(dret.groups) == {"fast", "split"}
    later = time.monotonic_ns() + max(pret.hold_ns, dret.hold_ns) + ms
    pret.tick(later)
    dret.tick(later)
    for ret in (pret, dret):
        assert ret.reasons == {"ttft_side": 1, "remote": 1, "fast": 2}
        assert {rid for rid, (keep, _) in ret.decided.items() if keep} == {"slow_d", "slow_p"}
        ret.close()


def test_a_d_side_over_the_threshold_is_kept_at_its_first_chunk(tmp_path):
    """Review: D's host without router records used to decide at D's end, which a long generation puts
    after P's host's hold time, so P's side was dropped. Now D's side, once known over the threshold (its
    first chunk 150 ms after D's API server received it), is kept at the next tick with the request still
    generating, its keep line goes out, and P's host, still holding its side, follows it. A D side under
    the threshold is not decided in flight."""
    ms = 1_000_000
    cfg = dict(trace_dir=str(tmp_path), retain="tail", flush_interval_s=0.2, tail_ttft_ms=100.0, tail_head=0.0)
    pret = retention.TailRetention(config.Config(**cfg), str(tmp_path), host="phost")
    dret = retention.TailRetention(config.Config(**cfg), str(tmp_path), host="dhost")
    pret.remote_keeps()
    dret.remote_keeps()
    sp, sd = _role_sink("prefill"), _role_sink("decode")
    now = time.monotonic_ns()
    for rid, d_ms in (("long", 150), ("quick", 20)):
        pret.admit(sp, [_span("prefill.compute", rid, now + 2 * ms, now + 20 * ms, sid=8),
                        _span("prefill.frontend", rid, now, now + 25 * ms, sid=7, **{"frontend.part": "whole"})])
        t = now + 26 * ms
        dret.admit(sd, [_span("decode.frontend", rid, t, t + ms, sid=5, **{"frontend.part": "in"}),
                        _ev("token", rid, t + d_ms * ms, sid=5)])  # still generating: no 'out' part yet
    assert dret.summary()["overdue_checks"] == 1
    dret.tick(time.monotonic_ns())
    assert dret.reasons == {"ttft_side": 1} and set(dret.groups) == {"quick"}
    pret.tick(time.monotonic_ns() + pret.grace_ns + ms)  # P's ends are due: both wait (D's sink is live)...
    assert set(pret.groups) == {"quick"} and pret.reasons == {"remote": 1}  # ...and its poll read D's keep
    assert pret.decided["long"][0] and dret.decided["long"][0]
    pret.close()
    dret.close()


def test_overdue_only_where_the_first_token_will_be_seen(tmp_path):
    """Review of the overdue rule. (1) An engine host without the request's router records (P here, D and
    the router elsewhere) cannot tell a stuck request from one whose first token is written on another
    host: nothing is decided early (before, every such request was kept and its keep line made every host
    keep it). (2) On a host with the router and P only, P's answer does not end a routed request (only its
    root does), so a request stuck after it (in the transfer, in D's queue) is still kept in flight."""
    ms = 1_000_000
    ret, _ = _ret(tmp_path)
    sp, sd = _role_sink("prefill"), _role_sink("decode")
    now = time.monotonic_ns()
    ret.admit(sd, [_span("decode.queue", "other-d", now, now + ms)])  # a D client on this host
    ret.admit(sp, [_span("prefill.frontend", "elsewhere", now, now + 2 * ms, **{"frontend.part": "whole"})])
    ret.tick(time.monotonic_ns() + 100 * ms + 10 * ret.grace_ns)
    assert "elsewhere" in ret.groups and not ret.reasons and not ret._dueq
    ret2, sr = _ret(tmp_path / "b")
    sp2 = _role_sink("prefill")
    ret2.admit(sr, [_span("router.dispatch", "stuck", now, now + ms)])
    ret2.admit(sp2, [_span("prefill.frontend", "stuck", now, now + 2 * ms, **{"frontend.part": "whole"})])
    g = ret2.groups["stuck"]
    assert g.ended and not g.closing  # P answered; only the root ends a routed request
    ret2.tick(time.monotonic_ns() + 100 * ms + ret2.grace_ns + ms)
    assert ret2.reasons == {"overdue": 1}


def test_a_failed_rotation_never_writes_into_another_file(tmp_path, monkeypatch):
    """Review of the list rotation: closing the full segment fails (a deferred NFS write error) and the next
    segment cannot be opened. No error reaches the decision (a record both written and returned), the old
    fd number is not written to again (it may belong to another file by then), and a heartbeat opens the
    segment later."""
    monkeypatch.setattr(retention, "KEEP_LIST_BYTES", 100)
    ret, s = _ret(tmp_path, tail_head=1.0)
    real_close, real_open = os.close, os.open
    fail = {"close": True, "open": True}

    def bad_close(fd):
        real_close(fd)
        if fail["close"] and fd == bad_close.keep_fd:
            # the freed fd number now belongs to another file (the lowest free number is reused)
            bad_close.victim = real_open(str(tmp_path / "victim"), os.O_WRONLY | os.O_CREAT, 0o644)
            assert bad_close.victim == fd
            raise OSError(5, "Input/output error")

    def bad_open(path, *a, **k):
        if fail["open"] and path.endswith(".1.ids"):
            raise OSError(24, "Too many open files")
        return real_open(path, *a, **k)

    bad_close.keep_fd = ret._keep_fd
    monkeypatch.setattr(retention.os, "close", bad_close)
    monkeypatch.setattr(retention.os, "open", bad_open)
    now = time.monotonic_ns()
    for i in range(4):
        rid = f"r{i}-" + "y" * 40
        out = ret.admit(s, [_ev("router.first_token", rid, now + 1), _span("router.request", rid, now, now + 2)])
        assert out == []  # held, not returned
    ret.tick(time.monotonic_ns() + ret.grace_ns + 1)
    assert ret.reasons == {"head": 4} and ret._keep_fd == -3 and ret.held_records == 0
    assert os.path.getsize(tmp_path / "victim") == 0
    ret._keep_line("late", True, True)  # a verdict while the list is closed: not written anywhere
    assert os.path.getsize(tmp_path / "victim") == 0
    tries = []
    counting_open = retention.os.open

    def spy_open(path, *a, **k):
        if path.endswith(".1.ids"):
            tries.append(path)
        return counting_open(path, *a, **k)

    monkeypatch.setattr(retention.os, "open", spy_open)
    ret._next_beat = 0  # the heartbeat is due: it retries, the retry fails
    before = time.monotonic_ns()
    ret.poll_files(force=True)
    assert len(tries) == 1 and ret._keep_fd == -3
    beat = ret._next_beat
    assert beat >= before + int(retention.HEARTBEAT_S * 1e9)  # no retry again before HEARTBEAT_S
    fail["open"] = False
    ret.poll_files(force=True)
    assert len(tries) == 1 and ret._keep_fd == -3 and ret._next_beat == beat
    ret._next_beat = 0  # HEARTBEAT_S later
    ret.poll_files(force=True)
    assert len(tries) == 2 and ret._keep_fd >= 0 and ret._keep_path.endswith(".1.ids")
    real_close(bad_close.victim)
    ret.close()


def test_a_reused_pid_counts_its_segment_and_an_empty_deleted_list_is_forgotten(tmp_path, monkeypatch):
    """A sink whose pid an earlier sink had (containers) appends to that segment: the bytes already in it
    count towards the rotation. A reader forgets a deleted list it never read a line of (empty: known only
    by its liveness)."""
    monkeypatch.setattr(retention, "KEEP_LIST_BYTES", 200)
    kd = tmp_path / "tail-keep"
    kd.mkdir()
    (kd / f"h-{os.getpid()}.ids").write_text("x" * 150 + "\t1\tR\n")
    ret, s = _ret(tmp_path, tail_head=1.0)
    assert ret._keep_bytes == 155
    now = time.monotonic_ns()
    rid = "r-" + "z" * 50  # 57 bytes: over 200 with the 155 already there
    ret.admit(s, [_ev("router.first_token", rid, now + 1), _span("router.request", rid, now, now + 2)])
    ret.tick(time.monotonic_ns() + ret.grace_ns + 1)
    assert ret._keep_path.endswith(".1.ids")
    empty = kd / "gonehost-7.ids"
    empty.write_text("")
    reader = retention.TailRetention(config.Config(trace_dir=str(tmp_path), retain="tail", flush_interval_s=0.2),
                                     str(tmp_path), host="readerhost")
    reader.remote_keeps()
    assert "gonehost-7.ids" in reader._live
    empty.unlink()
    reader.remote_keeps()
    assert "gonehost-7.ids" not in reader._live and "gonehost-7.ids" not in reader._remote_pos
    ret.close()
    reader.close()


def test_a_routed_request_ended_by_an_engine_is_kept_unended_at_a_sync(tmp_path):
    """Router and P on this host: P's answer does not end a routed request (only its root does). At a sync
    or exit while it still decodes elsewhere (its first token quick: not overdue), it is kept as unended,
    not dropped as fast with no TTFT known (its later root would follow that decision)."""
    ms = 1_000_000
    ret, sr = _ret(tmp_path)
    sp = _role_sink("prefill")
    now = time.monotonic_ns()
    ret.admit(sr, [_span("router.dispatch", "dec", now, now + ms), _ev("router.first_token", "dec", now + 20 * ms)])
    ret.admit(sp, [_span("prefill.frontend", "dec", now, now + 10 * ms, **{"frontend.part": "whole"})])
    ret.tick(time.monotonic_ns() + 100 * ms + ret.grace_ns + ms)
    assert "dec" in ret.groups  # quick first token: not overdue
    ret.decide_all()
    assert ret.decided["dec"][0] and ret.reasons == {"unended": 1}
