"""``pdtrace check`` and the ``processes`` view on hand-built stores: each problem kind, its exit status, message.

Each process is written as the recorder's sink writes it: one file per process
(instrument/store.write_rows), resource columns per file, a ``recorder.stats``
row per flush carrying the cumulative counters (instrument/writer.py stats()).
The command runs for real (click's runner over pdtrace's own entry point, and
a subprocess for the read-only checks).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from pdtrace_case_builder import T0, Case

from pdtrace.analysis import check as _check
from pdtrace.analysis import db
from pdtrace.cli.main import main
from pdtrace import instrument
from pdtrace.instrument import store

S = 1_000_000_000  # ns per s

_COUNTERS = ("recorded", "dropped", "written", "write_errors", "export_errors", "dropped_attributes")


def write_process(d: Path, role: str | None, pid: int, flushes_s: list[float], engine: str | None = None,
                  counters: dict | None = None, host: str = "h", pdtrace_version: str = "0.1.0",
                  vllm_version: str | None = None, connector: str | None = None, activation: str | None = None,
                  sample: float | None = None, name: str | None = None) -> Path:
    """One process's file: a recorder.stats row per flush (s from T0); the last row has ``counters``,
    earlier ones all 0 (cumulative counters only grow), plus one span so that it wrote something."""
    rows = [{"record": "span", "name": "prefill.compute", "span_id": pid * 10, "request_id": f"r{pid}",
             "start_ns": T0 + round(flushes_s[0] * S) - S, "end_ns": T0 + round(flushes_s[0] * S) - S // 2}]
    for i, t in enumerate(flushes_s):
        last = i == len(flushes_s) - 1
        c = {k: 0 for k in _COUNTERS} | ((counters or {}) if last else {})
        attrs = {f"recorder.{k}": v for k, v in c.items()}
        if activation is not None:
            attrs["pdtrace.activation"] = activation
        if sample is not None:
            attrs["recorder.sample"], attrs["recorder.step_sample"] = sample, 1.0
        rows.append({"record": "stats", "name": "recorder.stats", "start_ns": T0 + round(t * S), "attrs": attrs,
                     "thread": "pdtrace-sink"})
    res = {"run_id": "run", "role": role, "engine_id": engine, "host": host, "pid": pid,
           "pdtrace_version": pdtrace_version, "vllm_version": vllm_version, "connector": connector}
    return store.write_rows(d, rows, resource=res, name=name or f"{role or 'proc'}-{host}-{pid}-s000001.parquet")


def healthy(d: Path, **kw) -> Path:
    """Router, one prefill and one decode engine, flushing every second from 0 to 10 s."""
    t = [float(i) for i in range(11)]
    write_process(d, "router", 100, t, **kw)
    write_process(d, "prefill", 200, t, engine="p0", vllm_version="0.32.0", connector="TracedNixlPullConnector", **kw)
    write_process(d, "decode", 300, t, engine="d0", vllm_version="0.32.0", connector="TracedNixlPullConnector", **kw)
    return d


def run(*args: str, env: dict | None = None):
    """``pdtrace check ARGS`` in-process; returns click's Result (exit_code, output)."""
    return CliRunner().invoke(main, ["check", "--no-cache", *args], env=env, catch_exceptions=False)


def problems(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("PROBLEM ")]


def test_healthy_store_exit_0_and_processes_view(tmp_path):
    healthy(tmp_path, activation="explicit", sample=0.25)
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 0, res.output
    assert problems(res) == [] and res.output.rstrip().endswith("OK: no problems")
    assert "Processes: 3 (3 live; age_s: since the last flush; sample: requests/steps traced)" in res.output
    with db.open_trace(tmp_path) as tr:
        rows = tr.query("SELECT role, engine_id, pid, activation, sample, step_sample, first_flush_ns, last_flush_ns, "
                        "written, files FROM processes ORDER BY pid")
    assert rows == [
        {"role": r, "engine_id": e, "pid": pid, "activation": "explicit", "sample": 0.25, "step_sample": 1.0,
         "first_flush_ns": T0, "last_flush_ns": T0 + 10 * S, "written": 0, "files": 1}
        for r, e, pid in (("router", None, 100), ("prefill", "p0", 200), ("decode", "d0", 300))]


def test_activation_unknown_when_not_recorded(tmp_path):
    healthy(tmp_path)
    with db.open_trace(tmp_path) as tr:
        assert {r["activation"] for r in tr.query("SELECT activation FROM processes")} == {"unknown"}
        assert {r["sample"] for r in tr.query("SELECT sample FROM processes")} == {None}


def test_last_stats_row_wins_across_files_and_resource_changes(tmp_path):
    """A process's role is set after its first flush (the lab's API servers) and its rows span two files:
    the row is the process, its resource and counters those of its newest stats row."""
    write_process(tmp_path, None, 400, [0.0, 1.0], name="proc-h-400-p000001.parquet")
    write_process(tmp_path, "prefill", 400, [2.0, 3.0], engine="p0", counters={"recorded": 7, "written": 7},
                  name="prefill-h-400-p000002.parquet")
    with db.open_trace(tmp_path) as tr:
        assert tr.query("SELECT role, engine_id, first_flush_ns, last_flush_ns, recorded, written, files "
                        "FROM processes") == [
            {"role": "prefill", "engine_id": "p0", "first_flush_ns": T0, "last_flush_ns": T0 + 3 * S,
             "recorded": 7, "written": 7, "files": 2}]


def test_no_process_ever(tmp_path):
    res = run(str(tmp_path))
    assert res.exit_code == 1
    assert problems(res) == [f"PROBLEM no_process: no process has written to {tmp_path} (no store file with records)"]


def test_missing_directory_is_a_problem_and_is_not_created(tmp_path):
    d = tmp_path / "never"
    res = run(str(d))
    assert res.exit_code == 1
    assert problems(res) == [f"PROBLEM no_process: trace directory {d} does not exist: no process has written to "
                             "it (is PDTRACE_DIR set for the engines?)"]
    assert not d.exists()


def test_default_directory_is_pdtrace_dir_and_usage_error_without_it(tmp_path):
    healthy(tmp_path)
    env = {k: None for k in os.environ if k.startswith("PDTRACE_")}
    res = run("--at-end", env=env | {"PDTRACE_DIR": str(tmp_path)})
    assert res.exit_code == 0 and f"# pdtrace check {tmp_path}" in res.output
    res = run(env=env)
    assert res.exit_code == 2 and "no DIRECTORY given and PDTRACE_DIR is not set" in res.output


def test_none_recent(tmp_path):
    healthy(tmp_path)
    with db.open_trace(tmp_path) as tr:
        data = _check.collect(tr.con, str(tmp_path), recent_s=60, now_ns=T0 + 130 * S)
    assert [p["message"] for p in data["problems"]] == [
        "no process wrote in the last 60 s (newest flush 120.0 s ago: router pid 100@h)"]
    assert [p["age_s"] for p in data["processes"]] == [120.0, 120.0, 120.0]
    res = run(str(tmp_path))  # against now: the store's flushes are from 2025
    assert res.exit_code == 1
    assert len(problems(res)) == 1 and problems(res)[0].startswith(
        "PROBLEM none_recent: no process wrote in the last 60 s (newest flush ")


@pytest.mark.parametrize("counter, text", [
    ("dropped", "dropped 5 of 40 records (buffer full, sink unreachable or failed writes)"),
    ("write_errors", "had 5 failed file writes (directory not writable, deleted, disk full?)"),
    ("export_errors", "had 5 failed OTLP exports"),
    ("dropped_attributes", "dropped 5 attributes (key not allowlisted or value of the wrong type)"),
])
def test_counter_problems(tmp_path, counter, text):
    healthy(tmp_path)
    write_process(tmp_path, "decode", 301, [9.0, 10.0], engine="d0", counters={"recorded": 40, counter: 5})
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1
    assert problems(res) == [f"PROBLEM {counter}: decode d0 pid 301@h {text}"]


def test_hook_errors_problem_names_the_first(tmp_path):
    """A live process that swallowed errors in its hooks (connector/traced/safety.py) is a problem; the
    message names the first error by hook and exception class, as the sink writes it."""
    healthy(tmp_path)
    write_process(tmp_path, "prefill", 201, [9.0, 10.0], engine="p1",
                  counters={"recorded": 40, "hook_errors": 3, "hook_error_first": "TracedScheduler.step: KeyError"})
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1
    assert problems(res) == [
        "PROBLEM hook_errors: prefill p1 pid 201@h swallowed 3 errors of pdtrace's code in its hooks (first: "
        "TracedScheduler.step: KeyError; the engine ran on, those hooks' records may be missing; the process's "
        "log has the first traceback of each kind)"]
    with db.open_trace(tmp_path) as tr:
        assert tr.query("SELECT pid, hook_errors, hook_error_first FROM processes WHERE hook_errors > 0") == [
            {"pid": 201, "hook_errors": 3, "hook_error_first": "TracedScheduler.step: KeyError"}]


def test_stale_process_counters_not_judged(tmp_path):
    """A process that stopped flushing 100 s before the trace end (an engine restarted) is listed, not judged."""
    healthy(tmp_path)
    write_process(tmp_path, "decode", 299, [-100.0, -90.0], engine="d0", counters={"recorded": 40, "dropped": 5})
    res = run(str(tmp_path), "--at-end", "--recent", "30")
    assert res.exit_code == 0, res.output
    assert "Processes: 4 (3 live" in res.output
    line = next(x for x in res.output.splitlines() if "  299  " in x)
    assert line.rstrip().endswith("stale") and " 100.000 " in line


def test_skipped_file(tmp_path):
    healthy(tmp_path)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1
    assert problems(res) == [f"PROBLEM skipped_file: store file skipped: {junk}: not a Parquet file: ArrowInvalid"]
    assert "Store files: 3 read, 1 skipped" in res.output


def _pull(c: Case, rid: str, p_shift_ms: float = 0.0) -> None:
    """One pull request, router on the true clock: dispatch P 0-2, P compute 2-100 (recorded p_shift_ms
    late), dispatch D 101-103, D first step 110-150, first token 150."""
    root = c.router_request(rid, 0, 160, "pull", first_token_ms=150)
    c.span("router", "router.dispatch", 0, 2, rid=rid, parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 2 + p_shift_ms, 100 + p_shift_ms, rid=rid, engine="p0")
    c.span("router", "router.dispatch", 101, 103, rid=rid, parent=root, attrs={"router.leg": "decode"})
    c.span("decode", "decode.first_step", 110, 150, rid=rid, engine="d0")


def _clock(tr) -> dict[tuple, dict]:
    return {(r["clock_a"], r["clock_b"]): r for r in tr.query(
        "SELECT clock_a, clock_b, offset_ms, bound_ms, consistent FROM clock_offsets WHERE window_start_ns IS NULL")}


def test_clock_bound_above_threshold(tmp_path):
    c = Case()
    _pull(c, "a1")
    c.write(tmp_path)
    with db.open_trace(tmp_path) as tr:
        pairs = _clock(tr)
    rp = pairs[("router", "p0")]
    assert rp["bound_ms"] is not None and rp["consistent"]
    limit = rp["bound_ms"] / 2
    res = run(str(tmp_path), "--at-end", "--max-clock-bound-ms", f"{limit}")
    want = (f"PROBLEM clock_bound: clock offset router / p0: {rp['offset_ms']:.3f} ms +- {rp['bound_ms']:.3f} ms, "
            f"bound above {limit:g} ms")
    assert want in problems(res) and res.exit_code == 1
    res = run(str(tmp_path), "--at-end", "--max-clock-bound-ms", f"{max(p['bound_ms'] for p in pairs.values()) + 1}")
    assert not [p for p in problems(res) if "clock" in p], res.output


def test_clock_inconsistent(tmp_path):
    """P's compute recorded inside its dispatch window for one request and 500 ms late for another:
    no single offset satisfies both."""
    c = Case()
    _pull(c, "a1")
    _pull(c, "a2", p_shift_ms=500)
    c.write(tmp_path)
    with db.open_trace(tmp_path) as tr:
        rp = _clock(tr)[("router", "p0")]
    assert rp["consistent"] is False
    res = run(str(tmp_path), "--at-end")
    assert "PROBLEM clock_inconsistent: clock offset router / p0: its bounds contradict each other (clock drift or " \
           "a bad sample)" in problems(res)
    assert res.exit_code == 1


def test_clock_unbounded(tmp_path):
    """The router dispatched to P, but no later leg or response brackets P's clock from above: no bound."""
    c = Case()
    root = c.router_request("u1", 0, 160, "pull")
    c.span("router", "router.dispatch", 0, 2, rid="u1", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 2, 100, rid="u1", engine="p0")
    c.write(tmp_path)
    with db.open_trace(tmp_path) as tr:
        assert _clock(tr)[("router", "p0")]["bound_ms"] is None
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1
    assert "PROBLEM clock_unbounded: clock offset router / p0 has no bound (evidence in one direction only): its " \
           "skew correction cannot be trusted" in problems(res)


@pytest.mark.parametrize("role, other", [("prefill", "decode"), ("decode", "prefill")])
def test_one_side_without_the_other(tmp_path, role, other):
    t = [0.0, 1.0]
    write_process(tmp_path, "router", 100, t)
    write_process(tmp_path, role, 200, t, engine=f"{role[0]}0")
    write_process(tmp_path, role, 201, t, engine=f"{role[0]}1")
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1
    assert problems(res) == [f"PROBLEM {role}_without_{other}: {role} engines write ({role[0]}0, {role[0]}1) but no "
                             f"{other} process does (is tracing on for the {other} engines?)"]


def test_one_side_stale_is_one_side(tmp_path):
    """The decode engines stopped writing 300 s before the trace end: prefill writes alone."""
    write_process(tmp_path, "prefill", 200, [299.0, 300.0], engine="p0")
    write_process(tmp_path, "decode", 300, [0.0], engine="d0")
    res = run(str(tmp_path), "--at-end")
    assert problems(res) == ["PROBLEM prefill_without_decode: prefill engines write (p0) but no decode process does "
                             "(is tracing on for the decode engines?)"]


def test_version_mismatch(tmp_path):
    healthy(tmp_path)
    write_process(tmp_path, "prefill", 201, [9.0, 10.0], engine="p1", pdtrace_version="0.2.0", vllm_version="0.33.0")
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1
    assert problems(res) == [
        "PROBLEM version_mismatch: live processes run different pdtrace versions: 0.1.0 (pid 100@h, pid 200@h, "
        "pid 300@h); 0.2.0 (pid 201@h)",
        "PROBLEM version_mismatch: live processes run different vLLM versions: 0.32.0 (pid 200@h, pid 300@h); "
        "0.33.0 (pid 201@h)"]


def test_json_format(tmp_path):
    healthy(tmp_path)
    write_process(tmp_path, "decode", 301, [10.0], engine="d0", counters={"recorded": 3, "dropped": 1})
    res = run(str(tmp_path), "--at-end", "--format", "json")
    assert res.exit_code == 1
    data = json.loads(res.output)
    assert data["ok"] is False and data["reference"] == "trace end" and data["recent_s"] == 60.0
    assert data["problems"] == [{"kind": "dropped", "message": "decode d0 pid 301@h dropped 1 of 3 records "
                                                               "(buffer full, sink unreachable or failed writes)"}]
    assert [(p["role"], p["pid"], p["live"]) for p in data["processes"]] == [
        ("router", 100, True), ("prefill", 200, True), ("decode", 300, True), ("decode", 301, True)]
    assert data["files"] == {"read": 4, "skipped": []}
    assert {p["kind"] for p in data["problems"]} <= set(_check.PROBLEM_KINDS)


def test_real_recorder_writes_sampling_and_counters(tmp_path, child):
    """A real traced process (recorder, writer thread, sink) with PDTRACE_SAMPLE=0.5: the processes view
    shows its sampling, its pid and a clean recorder; pdtrace check passes on it."""
    d = tmp_path / "trace"
    r = child("""
        import os
        from pdtrace.instrument import tracer
        tracer.configure(role="prefill", engine_id="p0")  # started explicitly, as a traced process does
        t = tracer.now()
        tracer.record("prefill.compute", "r1", t, t + 1000)
        assert tracer.force_flush(10.0)
        print(os.getpid())
    """, env={"PDTRACE_DIR": str(d), "PDTRACE_SAMPLE": "0.5", "PDTRACE_STEP_SAMPLE": "0.25"})
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[-1])
    with db.open_trace(d) as tr:
        rows = tr.query("SELECT role, engine_id, pid, sample, step_sample, dropped, write_errors, "
                        "dropped_attributes, hook_errors, hook_error_first FROM processes")
    assert rows == [{"role": "prefill", "engine_id": "p0", "pid": pid, "sample": 0.5, "step_sample": 0.25,
                     "dropped": 0, "write_errors": 0, "dropped_attributes": 0, "hook_errors": 0,
                     "hook_error_first": None}]


def _listing(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("with_env", [
    False,
    # Before issue 16 item 6 (h/plugin: pdtrace.instrument.activate, nothing starts on import), importing
    # pdtrace.instrument with PDTRACE_DIR set started a recorder that wrote into the directory.
    pytest.param(True, marks=pytest.mark.xfail(
        not hasattr(instrument, "activate"), strict=True,
        reason="importing pdtrace.instrument with PDTRACE_DIR set starts a recorder (issue 16 item 6 not merged)")),
])
def test_reads_only(tmp_path, with_env):
    """The directory's file list, sizes and mtimes are unchanged after ``pdtrace check`` (a real process,
    default cache under PDTRACE_CACHE_DIR), also with PDTRACE_DIR naming the directory."""
    d = healthy(tmp_path / "trace")
    before = _listing(d)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    env["PDTRACE_CACHE_DIR"] = str(tmp_path / "cache")
    args = [sys.executable, "-m", "pdtrace.cli.main", "check", "--at-end"]
    if with_env:
        env["PDTRACE_DIR"] = str(d)
    else:
        args.append(str(d))
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"# pdtrace check {d}" in r.stdout
    assert _listing(d) == before


def test_processes_follow_incremental_refresh(tmp_path):
    """A warm refresh absorbs a new flush file and forgets a vanished one (compaction): the row follows."""
    d = tmp_path / "trace"
    first = write_process(d, "decode", 300, [0.0, 1.0], engine="d0", name="decode-h-300-p000001.parquet")
    with db.Trace(d, cache=tmp_path / "cache.duckdb") as tr:
        tr.refresh()
        assert tr.query("SELECT last_flush_ns, files FROM processes") == [{"last_flush_ns": T0 + S, "files": 1}]
        write_process(d, "decode", 300, [2.0], engine="d0", counters={"recorded": 9, "dropped": 2},
                      name="decode-h-300-p000002.parquet")
        assert not tr.refresh().rebuilt
        assert tr.query("SELECT last_flush_ns, dropped, files FROM processes") == [
            {"last_flush_ns": T0 + 2 * S, "dropped": 2, "files": 2}]
        first.unlink()
        tr.refresh()
        assert tr.query("SELECT first_flush_ns, last_flush_ns, files FROM processes") == [
            {"first_flush_ns": T0 + 2 * S, "last_flush_ns": T0 + 2 * S, "files": 1}]


@pytest.mark.parametrize("counter, kind, text", [
    ("dropped_spans", "collect_dropped", "dropped 3 spans (queue full or a failed write)"),
    ("write_errors", "collect_write_errors", "had 3 failed file writes"),
    ("bad_bodies", "collect_bad_bodies", "refused 3 OTLP bodies (not decodable, too large or another content "
                                         "type: is a sender misconfigured?)"),
])
def test_collector_counter_problems(tmp_path, counter, kind, text):
    """pdtrace collect's own counters (collect.stats rows) are judged like a recorder's; a stale collector is not."""
    healthy(tmp_path)
    base = {f"collect.{k}": 0 for k in ("received_spans", "written_spans", "dropped_spans", "bad_bodies",
                                       "write_errors")}
    rows = [{"record": "stats", "name": "collect.stats", "start_ns": T0 + 10 * S,
             "attrs": base | {f"collect.{counter}": 3}}]
    store.write_rows(tmp_path, rows, resource={"run_id": "run", "role": "collect", "host": "h", "pid": 400},
                     name="collect-h-400-s000001.parquet")
    res = run(str(tmp_path), "--at-end")
    assert res.exit_code == 1, res.output
    assert problems(res) == [f"PROBLEM {kind}: pdtrace collect pid 400@h {text}"]
    stale = tmp_path / "stale"
    healthy(stale)
    store.write_rows(stale, [dict(rows[0], start_ns=T0 - 100 * S)],
                     resource={"run_id": "run", "role": "collect", "host": "h", "pid": 400},
                     name="collect-h-400-s000001.parquet")
    assert run(str(stale), "--at-end", "--recent", "30").exit_code == 0
