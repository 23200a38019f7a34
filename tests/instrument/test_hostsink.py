"""One sink per host and trace directory: real traced processes, a real sink process, real signals.

Each traced process is a fresh interpreter (``subprocess``) that records at a known pace and
prints what it saw; the sink is found from outside through ``/proc`` (``hostsink.find``) and,
independently, through psutil's process table.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import duckdb
import psutil

from pdtrace.instrument import hostsink, store

#: A traced process: records ``decode.step`` spans with real monotonic times (one every ~``GAP`` s,
#: ``step.id`` counting up), prints its sink's pid after its first flush, and on a line on stdin
#: shuts the recorder down and prints its counters.
WORKER = """
import json, os, sys, threading, time
from pdtrace.instrument import tracer
tracer.activate()
tracer.set_resource(role=sys.argv[1])
GAP = float(sys.argv[2])
stop = threading.Event()
def rec():
    i = 0
    while not stop.is_set():
        t = tracer.now()
        tracer.record('decode.step', None, t, t + 1000, {'step.id': i}); i += 1
        time.sleep(GAP)
th = threading.Thread(target=rec); th.start()
tracer.force_flush(30)
print(json.dumps({"sink": tracer._writer.sink_pid, "pid": os.getpid()}), flush=True)
sys.stdin.readline()
stop.set(); th.join()
ok = tracer.shutdown(30)
print(json.dumps({"ok": ok, "stats": tracer.stats(), "pid": os.getpid()}), flush=True)
"""


def _env(d, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    env.update({"PDTRACE_DIR": str(d), "PDTRACE_SINK_IDLE_S": "1"})
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _start(d, role, gap=0.001, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), role, str(gap)], env=_env(d, **kw),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p):
    out, err = p.communicate("\n", timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def _psutil_sinks(d):
    """The sink processes of ``d`` from psutil's process table (independent of hostsink.find's /proc reading)."""
    real = os.path.realpath(d)
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if hostsink.MODULE in cmd and real in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            try:
                if os.getsid(p.pid) != p.pid:  # not the starter that forks the sink and exits
                    out.append(p.pid)
            except ProcessLookupError:
                pass
    return sorted(out)


def _readable(d):
    files = store.store_files(d)
    for f in files:
        assert store.check_file(f).ok, f
        duckdb.sql(f"select count(*) from read_parquet('{f}')").fetchall()
    return files


def _wait_rows_from(d, sink, pids, timeout=60):
    """Wait until each of ``pids`` has rows in a file written by sink ``sink`` (its pid is in the file's
    name): those clients' records reach that sink. True when they do, False at ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = [str(f) for f in store.store_files(d) if f"-{sink}-" in f.name]
        got = set()
        if files:
            try:
                got = {r[0] for r in duckdb.sql(f"select distinct pid from read_parquet({files!r})").fetchall()}
            except duckdb.Error:  # a part merged into a segment (and removed) between listing and reading
                pass
        if set(pids) <= got:
            return True
        time.sleep(0.1)
    return False


def _wait_new_sink(d, old, timeout=60):
    """The sinks of ``d`` once one other than ``old`` runs (read once per try: a later read may differ)."""
    deadline = time.time() + timeout
    found = hostsink.find(d)
    while found in ([], [old]) and time.time() < deadline:
        time.sleep(0.05)
        found = hostsink.find(d)
    return found


def _wait_gone(d, timeout=60):
    deadline = time.time() + timeout
    while hostsink.find(d) and time.time() < deadline:
        time.sleep(0.05)
    return hostsink.find(d)


def test_traced_processes_started_together_share_one_sink(tmp_path):
    """Three traced processes started at the same moment (they race to start the sink): one sink
    process serves them all, each has its own rows and stats rows, the files are the sink's (not
    per process), and the processes view lists every traced process with its counters."""
    d = tmp_path / "t"
    procs = [_start(d, role) for role in ("router", "prefill", "decode")]
    hello = [json.loads(p.stdout.readline()) for p in procs]
    sinks = {h["sink"] for h in hello}
    assert len(sinks) == 1 and None not in sinks, hello
    assert hostsink.find(d) == sorted(sinks) == _psutil_sinks(d)
    assert all(h["sink"] != h["pid"] for h in hello)
    time.sleep(1.0)
    outs = [_finish(p)[0] for p in procs]
    assert all(o["ok"] for o in outs)
    assert hostsink.sync(d, 30)
    files = _readable(d)
    assert files and all(f.name.startswith("sink-") and f"-{sinks.pop()}-" in f.name for f in files)
    rows = dict(duckdb.sql(f"select pid, count(*) from read_parquet('{d}/*.parquet') where name='decode.step' "
                           "group by 1").fetchall())
    for o in outs:
        st = o["stats"]
        assert st["dropped"] == 0 and st["recorded"] == st["written"] == rows[o["pid"]] > 100, (st, rows)
    from pdtrace.analysis import db

    with db.open_trace(d) as tr:
        got = tr.con.execute("select pid, role, recorded, written, dropped from processes order by pid").fetchall()
    assert got == sorted((o["pid"], role, o["stats"]["recorded"], o["stats"]["written"], 0)
                         for o, role in zip(outs, ("router", "prefill", "decode")))
    assert _wait_gone(d) == []  # idle (PDTRACE_SINK_IDLE_S=1) after its last client: it exits


def test_sink_killed_mid_run_loses_at_most_one_interval_counted_and_restarts(tmp_path):
    """SIGKILL of the shared sink while two traced processes record (a record every ~2 ms each,
    flush interval 0.2 s): each writer counts what the sink had not answered for as dropped, the
    next send starts a new sink (one, for both), writing resumes, and every file is readable. The
    records missing from the store are at most what was counted as dropped, and they fall in one
    gap per process no longer than about one flush interval (plus scheduling slack)."""
    d = tmp_path / "t"
    interval = 0.2
    procs = [_start(d, role, gap=0.002, PDTRACE_FLUSH_INTERVAL_S=interval) for role in ("prefill", "decode")]
    hello = [json.loads(p.stdout.readline()) for p in procs]
    (first,) = {h["sink"] for h in hello}
    time.sleep(1.5)
    os.kill(first, signal.SIGKILL)
    kill_wall = time.time_ns()
    (second,) = _wait_new_sink(d, first)
    assert second != first
    assert _wait_rows_from(d, second, [h["pid"] for h in hello])  # both write again, to the new sink
    assert hostsink.find(d) == [second] == _psutil_sinks(d)  # one new sink for both
    outs = [_finish(p) for p in procs]
    assert hostsink.sync(d, 30)
    _readable(d)
    for (o, err) in outs:
        st = o["stats"]
        assert o["ok"] and st["recorded"] == st["written"] + st["dropped"], st
        assert err.count("sink process is gone") == 1, err
        ids = [r[0] for r in duckdb.sql(
            f"select attr_int['step.id'] from read_parquet('{d}/*.parquet') where name='decode.step' "
            f"and pid={o['pid']} order by 1").fetchall()]
        missing = sorted(set(range(max(ids) + 1)) - set(ids))
        assert len(missing) <= st["dropped"], (len(missing), st)
        assert len(ids) == st["written"] <= st["recorded"]  # every record of the worker is a decode.step
        if missing:  # one contiguous run around the kill, at most ~one interval of records
            times = dict(duckdb.sql(
                f"select attr_int['step.id'], start_ns from read_parquet('{d}/*.parquet') where name='decode.step' "
                f"and pid={o['pid']}").fetchall())
            before, after = times[missing[0] - 1], times[missing[-1] + 1]
            assert after - before < (interval + 1.0) * 1e9, (missing[0], missing[-1], (after - before) / 1e9)
            assert before < kill_wall + 1e9 and after > kill_wall - (interval + 1.0) * 1e9
    assert _wait_gone(d) == []


def test_sigterm_to_the_sink_writes_what_it_holds_and_clients_go_on(tmp_path):
    """SIGTERM to the sink (started by a writer thread, which blocks SIGTERM: the sink unblocks it):
    it takes in what its client sent, writes it and answers before exiting; the next send starts a
    new one. What the client sent after the sink's last read is counted as dropped (at this pace, a
    record every 2 ms, a few hundred ms of records at most), so the store holds exactly what was
    counted written."""
    d = tmp_path / "t"
    p = _start(d, "decode", gap=0.002, PDTRACE_FLUSH_INTERVAL_S=0.2)
    hello = json.loads(p.stdout.readline())
    first = hello["sink"]
    time.sleep(1.0)
    os.kill(first, signal.SIGTERM)
    (second,) = _wait_new_sink(d, first)
    assert second != first  # the first one exited
    assert _wait_rows_from(d, second, [hello["pid"]])  # the client goes on, into the new sink
    o, err = _finish(p)
    st = o["stats"]
    assert hostsink.sync(d, 30)
    _readable(d)
    (n,), = duckdb.sql(f"select count(*) from read_parquet('{d}/*.parquet') where name='decode.step'").fetchall()
    assert st["recorded"] == st["written"] + st["dropped"] and st["written"] == n, st
    assert st["dropped"] <= 500, st  # ~1 s of records: more would be records the sink had received and lost
    assert _wait_gone(d) == []


def test_sink_address_fits_any_directory_length(tmp_path):
    """The socket name does not grow with the directory's path (an abstract name of fixed length,
    far below the 108-byte sun_path limit), and differs between directories."""
    deep = tmp_path / ("x" * 200) / ("y" * 200)
    a, b = hostsink.address(deep), hostsink.address(tmp_path)
    assert len(a) == len(b) < 108 and a != b and a.startswith(b"\0")


def _wall_shim(step: list):
    """``time`` with a wall clock that can step by ``step[0]`` ns; every other function the real one."""
    import time as real

    class Wall:
        def __getattr__(self, name):
            return getattr(real, name)

        def time_ns(self):
            return real.time_ns() + step[0]

    return Wall()


def test_clients_convert_through_the_host_anchors_through_a_wall_clock_step(monkeypatch):
    """Two clients of one sink, a wall-clock step of +34.3 s between two anchors (seen on this machine
    kind): a record converts through the anchor in effect at its monotonic start, whichever client
    holds it and whenever it is converted, so records of the same instant get the same epoch time
    in both, and no duration contains the step.

    The step is a FAKE wall clock (``clock.time`` replaced): stepping the real one would move the
    clock of everything on this machine, the test runner's included."""
    from pdtrace.instrument import clock, config
    from pdtrace.instrument import sink as sinkmod

    step = [0]
    monkeypatch.setattr(clock, "time", _wall_shim(step))
    anchors = clock.HostAnchors(interval_s=0.0)  # every refresh takes a new anchor
    cfg = config.Config(trace_dir="/nonexistent")
    a = sinkmod.Sink(cfg, {"role": "router"}, 1, "a", anchors=anchors)
    b = sinkmod.Sink(cfg, {"role": "decode"}, 2, "b", anchors=anchors)

    def rec(i, start, end):
        return (0, i, i, None, "kv.transfer", 1, start, end, 0, None, f"X{i}", 0, 0, None, "T")

    t0 = clock.now_ns()
    a.add([rec(1, t0, t0 + 5_000_000)])
    a.convert_received()  # before the step
    step[0] = 34_300_000_000
    anchors.refresh()
    t1 = clock.now_ns()
    b.add([rec(2, t0, t0 + 5_000_000), rec(3, t1, t1 + 1_000)])
    b.convert_received()  # after it: record 2 started before the new anchor
    a.add([rec(4, t1, t1 + 1_000)])
    a.convert_received()
    got = {}
    for s in (a, b):
        for t in s._pending:
            for rid, st, en in zip(t["record_id"].to_pylist(), t["start_ns"].to_pylist(), t["end_ns"].to_pylist()):
                got[rid] = (st, en - st)
    assert got[1] == got[2] == (got[1][0], 5_000_000)  # the same instant in both clients; duration exact
    assert got[3][0] == got[4][0]
    # records after the new anchor carry the step (within the two anchors' read windows, well under 0.1 ms)
    assert abs((got[3][0] - t1) - (got[1][0] - t0) - 34_300_000_000) < 100_000


def test_host_anchors_split_by_start():
    """Records grouped by the anchor in effect at their start: before the oldest kept one -> the oldest;
    no start (None) -> the latest; later anchors after earlier ones; the oldest anchors are let go."""
    from pdtrace.instrument import clock

    h = clock.HostAnchors(interval_s=0.0, keep=3)
    for _ in range(4):
        h.refresh()
    monos = list(h._monos)
    assert len(monos) == 3  # the first of the four was let go
    offs = [x.offset_ns for x in h._anchors]
    recs = [("late", monos[2] + 1), ("none", None), ("early", monos[0] - 10**9), ("mid", monos[1]),
            ("first", monos[0])]
    got = {r[0]: off for g, off in h.split(recs, 1, test_offset_ns=0) for r in g}
    assert got == {"late": offs[2], "none": offs[2], "early": offs[0], "mid": offs[1], "first": offs[0]}
    groups = h.split(recs, 1, test_offset_ns=7)
    assert [off for _, off in groups] == [offs[0] + 7, offs[1] + 7, offs[2] + 7]
    assert h.split([], 1) == []
    assert h.split([("late", monos[2] + 5)], 1) == [([("late", monos[2] + 5)], offs[2])]  # the common case
