"""The recorder writes what call sites record, with the right values, and never raises."""
import time

import duckdb
import pytest

from pdtrace.instrument import config, recorder, store


def _tracer(tmp_path, **env):
    t = recorder.Tracer()
    e = {"PDTRACE_DIR": str(tmp_path), "PDTRACE_ROLE": "decode"}
    e.update({k: str(v) for k, v in env.items()})
    t.configure(config.from_env(e))
    return t


def _q(d, sql):
    return duckdb.sql(sql.replace("STORE", f"read_parquet('{d}/*.parquet')")).fetchall()


def test_span_event_and_open_close_round_trip(tmp_path):
    t = _tracer(tmp_path)
    t.set_resource(engine_id="d0", vllm_version="0.32.0", connector="TracedNixlPullConnector", tp_rank=1)
    t0 = t.now()
    sid = t.record("kv.transfer", "X1", t0, t0 + 5_000_000, {"kv.bytes": 4096, "kv.op": "READ", "kv.post_ns": 1200},
                   attempt=1)
    root = t.start("router.request", "X1", start_ns=t0 - 1_000_000)
    t.event("router.first_token", "X1", span_id=root, time_ns=t0 + 6_000_000)
    t.end(root, end_ns=t0 + 9_000_000, attrs={"request.mode": "pull"})
    try:
        with t.span("decode.first_step", "X1"):
            raise KeyError("prompt text must not be stored")
    except KeyError:
        pass
    assert t.shutdown()
    wall = time.time_ns()
    rows = _q(tmp_path, "select name, record, start_ns, end_ns, attr_int, attr_str, attempt, tp_rank, engine_id, "
                        "role, status_code, status_message, trace_id, span_id, parent_span_id, thread "
                        "from STORE where record in ('span','event') order by start_ns")
    by = {r[0]: r for r in rows}
    kv = by["kv.transfer"]
    assert kv[3] - kv[2] == 5_000_000
    assert abs(kv[2] - wall) < 60 * 10**9  # epoch ns, not monotonic
    assert kv[4] == {"kv.bytes": 4096, "kv.post_ns": 1200} and kv[5] == {"kv.op": "READ"}
    assert (kv[6], kv[7], kv[8], kv[9]) == (1, 1, "d0", "decode")
    assert kv[13] == sid
    rr = by["router.request"]
    assert rr[3] - rr[2] == 10_000_000 and rr[5] == {"request.mode": "pull"}
    ev = by["router.first_token"]
    assert ev[1] == "event" and ev[13] == root and ev[2] - rr[2] == 7_000_000
    assert rr[12] == ev[12] == kv[12] == t.trace_id("X1")
    fs = by["decode.first_step"]
    assert fs[10] == 2 and fs[11] == "KeyError"  # class only, never the message
    assert fs[15] == "MainThread"


def test_attribute_allowlist_drops_unknown_and_wrong_type(tmp_path):
    t = _tracer(tmp_path)
    t.record("prefill.compute", "X", 1, 2, {"prompt": "secret text", "kv.bytes": "12", "step.id": 3,
                                            "kv.op": "x" * 1000})
    t.shutdown()
    assert t.stats()["dropped_attributes"] == 2
    (ai, ast), = _q(tmp_path, "select attr_int, attr_str from STORE where name='prefill.compute'")
    assert ai == {"step.id": 3}
    assert ast == {"kv.op": "x" * 256}
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("*.parquet"))
    assert b"secret text" not in raw


def test_off_costs_nothing_and_writes_nothing(tmp_path):
    t = recorder.Tracer()
    t.configure(config.from_env({}))
    assert t.on is False
    assert t.record("kv.transfer", "X", 1, 2) == 0
    assert t.start("x") == 0 and t.event("x") == 0
    t.end(0)
    assert t.force_flush() and t.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_full_buffer_drops_and_counts_never_blocks(tmp_path):
    t = _tracer(tmp_path, PDTRACE_BUFFER_SPANS=16, PDTRACE_FLUSH_INTERVAL_S=60)
    w = t._writer
    # Hold the writer off the buffer: with a 60 s interval and no wake-up the buffer fills.
    t._wake_at = 10**9
    t0 = time.perf_counter()
    for i in range(1000):
        t.record("decode.step", None, i, i + 1)
    assert time.perf_counter() - t0 < 1.0
    st = t.stats()
    assert st["dropped"] == 1000 - 16
    t.shutdown()
    st = t.stats()
    assert st["written"] == 16 and st["recorded"] == 1000 and st["dropped"] == 984
    (n,), = _q(tmp_path, "select count(*) from STORE where name='decode.step'")
    assert n == 16
    # the counters are in the store too (last stats row)
    (d, wr), = _q(tmp_path, "select attr_int['recorder.dropped'], attr_int['recorder.written'] from STORE "
                            "where record='stats' order by start_ns desc limit 1")
    assert (d, wr) == (984, 16)
    assert w is not None


def test_clock_anchor_rows_and_test_offset(tmp_path):
    off = 250_000_000
    t = _tracer(tmp_path, PDTRACE_TEST_WALL_OFFSET_NS=off)
    m = t.now()
    wall = time.time_ns()
    t.record("prefill.compute", "X", m, m)
    t.shutdown()
    (s,), = _q(tmp_path, "select start_ns from STORE where name='prefill.compute'")
    assert 200_000_000 < s - wall < 300_000_000  # shifted by +250 ms
    rows = _q(tmp_path, "select start_ns, attr_int['clock.mono_ns'], attr_int['clock.test_offset_ns'], "
                        "attr_int['clock.read_cost_ns'], attr_str['clock.source'] from STORE where record='clock'")
    assert len(rows) >= 1
    for wall_a, mono_a, toff, cost, src in rows:
        assert toff == off and cost > 0 and "monotonic" in src.lower()
        assert abs((wall_a - mono_a) - (s - m)) < 5_000_000


def test_flush_interval_writes_parts_then_merges(tmp_path):
    t = _tracer(tmp_path, PDTRACE_FLUSH_INTERVAL_S=0.05, PDTRACE_ROTATE_S=3600)
    for i in range(5):
        t.record("decode.step", None, i, i + 1)
        assert t.force_flush(5)
    parts = sorted(p.name for p in tmp_path.glob("*.parquet"))
    assert len(parts) >= 5 and all(store.is_part_file(p) for p in parts)  # what the analysis defers
    for p in tmp_path.glob("*.parquet"):
        assert store.check_file(p).ok
    t.shutdown()
    files = list(tmp_path.glob("*.parquet"))
    assert len(files) == 1 and "-s" in files[0].name and not store.is_part_file(files[0])
    (n,), = _q(tmp_path, "select count(*) from STORE where name='decode.step'")
    assert n == 5


def test_threads_record_concurrently(tmp_path):
    import threading
    t = _tracer(tmp_path)

    def work(k):
        for i in range(2000):
            t.record("connector.poll", f"R{k}", i, i + 1)

    ths = [threading.Thread(target=work, args=(k,), name=f"fwd-{k}") for k in range(4)]
    [x.start() for x in ths]
    [x.join() for x in ths]
    t.shutdown()
    rows = dict(_q(tmp_path, "select thread, count(*) from STORE where name='connector.poll' group by 1"))
    assert rows == {f"fwd-{k}": 2000 for k in range(4)}
    (u,), = _q(tmp_path, "select count(distinct record_id) from STORE")
    (n,), = _q(tmp_path, "select count(*) from STORE")
    assert u == n


def test_step_sampling_every_kth(tmp_path):
    t = _tracer(tmp_path, PDTRACE_STEP_SAMPLE=0.25)
    assert [s for s in range(12) if t.step_sampled(s)] == [0, 4, 8]
    t.shutdown()


@pytest.mark.parametrize("var, raw", [("PDTRACE_SAMPLE", "abc"), ("PDTRACE_SAMPLE", "2"),
                                      ("PDTRACE_BUFFER_SPANS", "-5"), ("PDTRACE_FLUSH_INTERVAL_S", "nan")])
def test_bad_env_values_warn_and_default(var, raw, caplog):
    with caplog.at_level("WARNING", logger="pdtrace"):
        cfg = config.from_env({"PDTRACE_DIR": "/tmp/x", var: raw})
    assert var in caplog.text
    assert getattr(cfg, {"PDTRACE_SAMPLE": "sample", "PDTRACE_BUFFER_SPANS": "buffer_spans",
                         "PDTRACE_FLUSH_INTERVAL_S": "flush_interval_s"}[var]) == getattr(config.Config(), {
        "PDTRACE_SAMPLE": "sample", "PDTRACE_BUFFER_SPANS": "buffer_spans",
        "PDTRACE_FLUSH_INTERVAL_S": "flush_interval_s"}[var])


def test_shutdown_twice_and_flush_after_shutdown(tmp_path):
    t = _tracer(tmp_path)
    t.record("decode.step", None, 1, 2)
    assert t.shutdown() and t.shutdown()
    assert t.force_flush()
    assert t.record("decode.step", None, 1, 2) == 0


def test_keys_registered_in_the_traced_process_reach_the_store(tmp_path):
    """The sink filters by the traced process's allowlist, including keys a plug-in
    registers after tracing started (the traced connectors register theirs on import)."""
    from pdtrace.instrument import attributes

    t = _tracer(tmp_path)
    t.record("decode.step", "before", 1, 2, {"test.plugin_part": "in"})
    t.force_flush()
    attributes.register("test.plugin_part", str, "a key registered late, by a test", max_len=4)
    t.record("decode.step", "after", 3, 4, {"test.plugin_part": "outside"})
    t.shutdown()
    rows = _q(tmp_path, "select request_id, attr_str['test.plugin_part'] from STORE where name='decode.step' order by 1")
    assert rows == [("after", "outs"), ("before", None)]  # unknown before registering; then kept, cut to max_len
    assert t.stats()["dropped_attributes"] == 1


def test_records_keep_the_resource_of_their_time_across_unflushed_sends(tmp_path):
    """The sink converts received records in batches; records sent before a resource
    change (no part file written in between) keep the resource they were sent with."""
    t = _tracer(tmp_path, PDTRACE_BUFFER_SPANS=100, PDTRACE_FLUSH_INTERVAL_S=3600)
    t.set_resource(engine_id="engine-a")
    for i in range(50):  # the 50th record wakes the writer (half the buffer): a drain, no tick
        t.record("kv.transfer", f"a{i}", 10 + i, 20 + i, {"kv.bytes": 1})
    deadline = time.monotonic() + 30
    while t._writer.drained < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t._writer.drained == 50
    t.set_resource(engine_id="engine-b")
    for i in range(7):
        t.record("kv.transfer", f"b{i}", 100 + i, 110 + i, {"kv.bytes": 2})
    t.shutdown()
    rows = _q(tmp_path, "select left(request_id, 1), engine_id, count(*), sum(attr_int['kv.bytes']) "
                        "from STORE where name='kv.transfer' group by all order by 1")
    assert rows == [("a", "engine-a", 50, 50), ("b", "engine-b", 7, 14)]
    assert len(list(tmp_path.glob("*.parquet"))) == 1  # no part file before the final one: one segment


def test_buffered_records_leave_the_cyclic_gc(tmp_path):
    """A record waiting in the buffer is untracked after one young collection, attributes and all.

    A record holding a dict stays tracked (CPython tracks any tuple holding a dict), and a full
    buffer of tracked records cost ~0.7 µs of gen-2 collection per record, and 3.5-4.4 ms full collections
    after gc.freeze() (BENCHMARKS.md "Recorder overhead").
    """
    import gc

    t = _tracer(tmp_path, PDTRACE_BUFFER_SPANS=100, PDTRACE_FLUSH_INTERVAL_S=3600)
    t._wake_at = 1 << 30
    t0 = t.now()
    t.record("kv.transfer", "G1", t0, t0 + 5, {"kv.bytes": 4096, "kv.op": "READ"})
    sid = t.start("decode.first_step", "G1", attrs={"step.id": 7})
    t.end(sid, attrs={"step.num_reqs": 3})
    t.event("request.finished", "G1", attrs={"gen_ai.usage.output_tokens": 9})
    t.record("kv.ready", "G1", t0, t0 + 9)
    gc.collect(0)
    assert [gc.is_tracked(r) for r in t._buf] == [False] * 4
    assert t.shutdown()
    rows = _q(tmp_path, "select name, attr_int, attr_str from STORE where request_id = 'G1' order by name")
    assert rows == [("decode.first_step", {"step.id": 7, "step.num_reqs": 3}, {}),
                    ("kv.ready", {}, {}),
                    ("kv.transfer", {"kv.bytes": 4096}, {"kv.op": "READ"}),
                    ("request.finished", {"gen_ai.usage.output_tokens": 9}, {})]
