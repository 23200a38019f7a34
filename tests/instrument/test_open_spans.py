"""Open spans are visible while they stay open (record type ``open``, schema 1.1).

Real recorder, real writer thread and sink process, real Parquet read back
with DuckDB. Flush interval 0.2 s, PDTRACE_OPEN_AFTER_S 0.2 s, so three
flushes take well under a second.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import duckdb

from pdtrace.instrument import config, hostsink, recorder, store

FLUSH = 0.2


def _tracer(tmp_path, **env):
    t = recorder.Tracer()
    e = {"PDTRACE_DIR": str(tmp_path), "PDTRACE_ROLE": "decode", "PDTRACE_FLUSH_INTERVAL_S": str(FLUSH),
         "PDTRACE_OPEN_AFTER_S": str(FLUSH)}
    e.update({k: str(v) for k, v in env.items()})
    t.configure(config.from_env(e))
    return t


def _rows(d, where="true"):
    files = store.store_files(d) if os.path.isdir(d) else []
    if not files:
        return []
    lst = "[" + ",".join(f"'{f}'" for f in files) + "]"
    return duckdb.sql(f"""select record, record_id, span_id, name, start_ns, end_ns, request_id,
                                 attr_int, attr_str, schema_version
                          from read_parquet({lst}, union_by_name=true) where {where}
                          order by end_ns""").fetchall()


def test_span_held_open_across_three_flushes_is_written_refreshed_and_closed(tmp_path):
    t = _tracer(tmp_path)
    t0 = t.now()
    sid = t.start("decode.queue", "X1", start_ns=t0, attrs={"wait.for": "blocks"}, attempt=1)
    quick = t.start("kv.ready", "X2")  # closed before the threshold: never written as open
    t.end(quick)
    for i in range(3):
        t.update(sid, {"wait.received": i, "wait.expected": 3})
        assert t.force_flush(10)
        time.sleep(FLUSH)
    assert t.force_flush(10)
    opens = _rows(tmp_path, "record = 'open'")
    assert len(opens) >= 3, opens
    assert {r[2] for r in opens} == {sid} and {r[3] for r in opens} == {"decode.queue"}
    assert len({r[1] for r in opens}) == len(opens)  # each refresh is its own row (record id)
    assert all(r[1] != sid for r in opens)  # ... never the span's own record id
    assert {r[4] for r in opens} == {opens[0][4]}  # the start stays the span's start
    ends = [r[5] for r in opens]
    assert ends == sorted(ends) and ends[-1] - ends[0] >= 2 * FLUSH * 1e9 * 0.9  # refreshed at each flush
    assert all(r[5] - r[4] >= FLUSH * 1e9 for r in opens)  # written only once open >= threshold
    assert opens[-1][7] == {"wait.received": 2, "wait.expected": 3}  # the latest attributes
    assert opens[-1][8] == {"wait.for": "blocks", "open.state": "open"}
    assert opens[-1][9] == "1.1"
    # closed: its span row is written, and no open row after it
    t_end = t.now()
    t.end(sid, end_ns=t_end)
    assert t.force_flush(10)  # a flush after the close (and shutdown's final one): neither writes an open row
    assert t.shutdown()
    spans = _rows(tmp_path, "record = 'span'")
    by = {r[3]: r for r in spans}
    assert by["decode.queue"][2] == by["decode.queue"][1] == sid
    assert by["decode.queue"][5] - by["decode.queue"][4] == t_end - t0
    assert len(_rows(tmp_path, "record = 'open'")) == len(opens)
    assert not _rows(tmp_path, "record = 'open' and span_id = %d" % quick)


def test_record_after_the_fact_with_close_and_abandon(tmp_path):
    """The connectors' pattern: start() while waiting, the final row by record(span_id=...) + close();
    abandon() when no span follows leaves one last 'abandoned' open row."""
    t = _tracer(tmp_path)
    t0 = t.now() - int(2 * FLUSH * 1e9)  # started two thresholds ago: open long enough at the first flush
    a = t.start("prefill.queue", "A", start_ns=t0, attrs={"wait.for": "schedule"})
    b = t.start("dest.register", "B", start_ns=t0, attrs={"wait.for": "registration"})
    c = t.start("prefill.queue", "C", start_ns=t0)
    assert t.force_flush(10)
    t1 = t.now()
    assert t.record("prefill.queue", "A", t0 + 5, t1, {"request.mode": "push"}, span_id=a) == a
    t.close(a)
    t.abandon(b)
    t.abandon(c, time_ns=t0 + 1000)  # ended before the threshold: nothing written
    t.close(12345)  # unknown ids: ignored
    t.abandon(12345)
    t.update(12345, {"wait.received": 1})
    assert t._open == {}
    assert t.force_flush(10)
    assert t.shutdown()
    opens = _rows(tmp_path, "record = 'open'")
    last = {}
    for r in opens:
        last[r[2]] = r
    assert set(last) == {a, b, c}  # all three were open >= threshold at the first flush
    assert last[b][8]["open.state"] == "abandoned" and last[b][8]["wait.for"] == "registration"
    assert last[a][8]["open.state"] == "open" and last[c][8]["open.state"] == "open"
    span_a = _rows(tmp_path, f"record = 'span' and span_id = {a}")
    # the caller's own times (each file converts monotonic -> epoch through its anchor: within 1 µs)
    assert len(span_a) == 1 and abs(span_a[0][4] - opens[0][4] - 5) < 1000
    assert not _rows(tmp_path, f"record = 'span' and span_id in ({b}, {c})")
    st = t.stats()
    assert st["recorded"] == st["written"] + st["dropped"]


def test_open_records_snapshot_threshold_and_off(tmp_path):
    t = _tracer(tmp_path, PDTRACE_OPEN_AFTER_S=5)
    now = t.now()
    old = t.start("decode.queue", "X", start_ns=now - 6 * 10**9)
    t.start("decode.queue", "Y", start_ns=now - 4 * 10**9)
    recs = t.open_records(now)
    assert [r[2] for r in recs] == [old]
    assert recs[0][0] == recorder.R_OPEN and recs[0][7] == now and recs[0][6] == now - 6 * 10**9
    assert t.shutdown()
    off = recorder.Tracer()
    assert off.start("decode.queue", "X") == 0 and off.open_records() == []
    off.update(0, {"wait.received": 1})
    off.abandon(0)
    off.close(0)


def test_sigkill_while_a_span_is_open_leaves_readable_open_rows(tmp_path):
    d = tmp_path / "t"
    code = """
import time
from pdtrace.instrument import activate, tracer
activate('explicit')
sid = tracer.start('kv.ready', 'HUNG', attrs={'wait.for': 'write_done', 'wait.expected': 2, 'wait.received': 1})
print('ready', flush=True)
time.sleep(60)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDTRACE_")}
    env.update({"PDTRACE_DIR": str(d), "PDTRACE_FLUSH_INTERVAL_S": str(FLUSH), "PDTRACE_OPEN_AFTER_S": str(FLUSH),
                "PDTRACE_ROLE": "decode"})
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE)
    try:
        p.stdout.readline()
        deadline = time.time() + 30
        while time.time() < deadline and len(_rows(d, "record = 'open'")) < 3:
            time.sleep(FLUSH / 2)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    assert hostsink.sync(d, 30)  # the sink has written what the killed process sent (it saw end of file)
    for f in store.store_files(d):
        assert store.check_file(f).ok
    opens = _rows(d, "record = 'open'")
    assert len(opens) >= 3
    assert {r[6] for r in opens} == {"HUNG"}
    assert opens[-1][7] == {"wait.expected": 2, "wait.received": 1}
    assert not _rows(d, "record = 'span'")
