"""The recorder starts only where a process traces: :func:`pdtrace.instrument.activate`, never on import.

Each case runs in a fresh interpreter with ``PDTRACE_DIR`` set (``child``),
the way a traced host's environment is, and reads the threads and the trace
directory afterwards.
"""
import duckdb


def _threads():
    return "import threading\nprint(sorted(t.name for t in threading.enumerate()))\n"


def test_import_starts_nothing(child, tmp_path):
    """Importing the recorder, the store helpers, the analysis and the dashboard's data module starts no writer."""
    d = tmp_path / "t"
    d.mkdir()
    r = child("""
        import threading, time
        from pdtrace.instrument import tracer, schema, stages, store, ids
        import pdtrace.analysis.db, pdtrace.analysis.report
        tracer.record('decode.step', None, 1, 2)
        time.sleep(0.3)
        print(tracer.on, sorted(t.name for t in threading.enumerate()))
    """, {"PDTRACE_DIR": str(d)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False ['MainThread']"
    assert list(d.iterdir()) == []


def test_activate_starts_once_and_records_how(child, tmp_path):
    d = tmp_path / "t"
    r = child("""
        import threading
        from pdtrace.instrument import activate, tracer
        print(activate('plugin'), activate('explicit'), tracer.activation)
        print(sum(t.name == 'pdtrace-writer' for t in threading.enumerate()))
        tracer.record('decode.step', None, 1, 2)
        tracer.shutdown()
        print(activate('explicit'), tracer.on)  # a process that stopped tracing is not restarted
    """, {"PDTRACE_DIR": str(d)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines() == ["True True plugin", "1", "False False"]
    rows = duckdb.sql(f"""SELECT name, attr_str['pdtrace.activation'] AS a FROM read_parquet('{d}/*.parquet')
                          WHERE name IN ('recorder.stats', 'decode.step')""").fetchall()
    assert ("decode.step", None) in rows
    stats = [a for n, a in rows if n == "recorder.stats"]
    assert stats and set(stats) == {"plugin"}


def test_activate_without_trace_dir_is_off(child):
    r = child("""
        import threading
        from pdtrace.instrument import activate, tracer
        print(activate('plugin'), tracer.on, sorted(t.name for t in threading.enumerate()))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False False ['MainThread']"


def test_explicit_configure_is_recorded_as_explicit(child, tmp_path):
    d = tmp_path / "t"
    r = child(f"""
        from pdtrace.instrument import config, tracer
        tracer.configure(config.from_env({{"PDTRACE_DIR": "{d}"}}))
        tracer.shutdown()
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    (a,), = duckdb.sql(f"""SELECT list(DISTINCT attr_str['pdtrace.activation']) FROM read_parquet('{d}/*.parquet')
                           WHERE name = 'recorder.stats'""").fetchall()
    assert a == ["explicit"]


def test_bad_activation_raises():
    import pytest

    from pdtrace.instrument import tracer
    with pytest.raises(ValueError, match="activation"):
        tracer.activate("sometimes")


def test_resource_given_to_activate_is_on_every_row(child, tmp_path):
    """The process's role and engine id go with the start: the sink writes the process's first
    ``recorder.stats`` row and clock anchor as soon as its writer connects, before any record (here:
    the first record waits for that first file), and none of them is written without the role (the CI
    failure behind vllm-router: one process's first stats row had role NULL). A later call adds
    resource columns (here the connector; on the rows converted after it, the final stats row among them)."""
    d = tmp_path / "t"
    r = child(f"""
        import glob, time
        from pdtrace.instrument import activate, tracer
        assert activate('plugin', role='decode', engine_id='E1')
        deadline = time.monotonic() + 30
        while not glob.glob({str(d)!r} + '/*.parquet'):  # the sink's first file: written before any record
            assert time.monotonic() < deadline, 'the sink wrote no file before the first record'
            time.sleep(0.02)
        tracer.record('decode.step', None, 1, 2)
        assert activate('plugin', connector='TracedNixlPullConnector')
        tracer.record('decode.step', None, 3, 4)
        tracer.shutdown()
    """, {"PDTRACE_DIR": str(d), "PDTRACE_FLUSH_INTERVAL_S": "0.1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = duckdb.sql(f"""SELECT record, name, role, engine_id, connector, start_ns
                          FROM read_parquet('{d}/*.parquet', union_by_name = true)""").fetchall()
    kinds = {(rec, name) for rec, name, *_ in rows}
    assert {("stats", "recorder.stats"), ("clock", "clock.anchor"), ("span", "decode.step")} <= kinds, kinds
    assert {(role, eng) for _, _, role, eng, _, _ in rows} == {("decode", "E1")}, rows
    last_stats = max((s, c) for rec, _, _, _, c, s in rows if rec == "stats")
    assert last_stats[1] == "TracedNixlPullConnector"
