"""Errors swallowed in pdtrace's hooks (connector/traced/safety.py ``safe``) are counted and reach the store.

The traced process is a real child (recorder, writer thread, the host's sink writing Parquet into a temporary
PDTRACE_DIR); the store is read through the analysis views (``processes``).
"""
from __future__ import annotations

import os

import duckdb

from pdtrace.analysis import db
from pdtrace.instrument import hookerrors, store, writer

#: A message that must never reach the store or the log: exception messages can hold prompt text.
SECRET = "prompt text 7f3c9e must not leak"


def _all_text(d) -> str:
    """Every value of every row of every store file, as text (DuckDB reads the files; nothing is sampled)."""
    out = []
    for f in store.store_files(d):
        out += [repr(r) for r in duckdb.sql(f"SELECT * FROM read_parquet('{f}')").fetchall()]
    return "\n".join(out)


def test_swallowed_hook_errors_reach_processes_without_their_message(child, tmp_path):
    d = tmp_path / "trace"
    r = child(f"""
        import os
        from pdtrace.connector.traced import safety
        from pdtrace.instrument import tracer
        tracer.configure(role="prefill", engine_id="p0")

        def hook_that_raises(x):
            raise RuntimeError({SECRET!r} + str(x))

        class Other:
            def hook(self):
                raise KeyError({SECRET!r})

        t = tracer.now()
        tracer.record("prefill.compute", "r1", t, t + 1000)
        for i in range(3):
            assert safety.safe(hook_that_raises, i) is None
        assert safety.safe(tracer.force_flush, 10.0)  # a flush between errors: the count is cumulative
        assert safety.safe(Other().hook) is None
        assert safety.safe(lambda: 5) == 5  # a call that does not raise is not counted
        assert safety.error_count() == 4
        assert tracer.force_flush(10.0)
        print(os.getpid())
    """, env={"PDTRACE_DIR": str(d)})
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[-1])
    with db.open_trace(d) as tr:
        rows = tr.query("SELECT pid, role, hook_errors, hook_error_first, dropped, dropped_attributes "
                        "FROM processes")
    assert rows == [{"pid": pid, "role": "prefill", "hook_errors": 4, "hook_error_first": "hook_that_raises: RuntimeError",
                     "dropped": 0, "dropped_attributes": 0}]
    # each kind (hook, exception class) is logged once, by its names and code, never its message
    assert r.stderr.count("tracing error in hook_that_raises swallowed (RuntimeError") == 1
    assert r.stderr.count("tracing error in Other.hook swallowed (KeyError") == 1
    assert ", in hook_that_raises" in r.stderr  # the traceback's frames: code, not data
    assert "7f3c9e" not in r.stderr
    text = _all_text(d)
    assert "hook_that_raises: RuntimeError" in text and "7f3c9e" not in text
    for f in store.store_files(d):  # nor in the files' bytes (metadata, dictionaries)
        assert b"7f3c9e" not in open(f, "rb").read()


def test_no_error_writes_zero_and_no_first(child, tmp_path):
    d = tmp_path / "trace"
    r = child("""
        from pdtrace.connector.traced import safety
        from pdtrace.instrument import tracer
        tracer.configure(role="decode", engine_id="d0")
        assert safety.safe(lambda: 1) == 1
        assert tracer.force_flush(10.0)
    """, env={"PDTRACE_DIR": str(d)})
    assert r.returncode == 0, r.stderr
    with db.open_trace(d) as tr:
        assert tr.query("SELECT hook_errors, hook_error_first FROM processes") == [
            {"hook_errors": 0, "hook_error_first": None}]


def test_counter_unit_zero_kinds_and_stats():
    hookerrors.reset()
    try:
        assert (hookerrors.total(), hookerrors.first()) == (0, None)
        assert writer.stats({}, {})["hook_errors"] == 0
        assert hookerrors.count("A.hook", ValueError("x")) is True
        assert hookerrors.count("A.hook", ValueError("y")) is False  # same kind: not logged again
        assert hookerrors.count("A.hook", KeyError("z")) is True
        assert hookerrors.count("B" * 500, ValueError()) is True
        assert hookerrors.total() == 4 and hookerrors.first() == "A.hook: ValueError"
        assert writer.stats({"hook_errors": hookerrors.total()}, {})["hook_errors"] == 4
    finally:
        hookerrors.reset()
    assert hookerrors.total() == 0


def test_forked_child_starts_at_zero():
    hookerrors.reset()
    try:
        hookerrors.count("A.hook", ValueError())
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its counter, exit without running the test runner's exit code
            os.write(wr, f"{hookerrors.total()} {hookerrors.first()}".encode())
            os._exit(0)
        os.close(wr)
        got = os.read(rd, 100).decode()
        os.waitpid(pid, 0)
        assert got == "0 None"
        assert hookerrors.total() == 1
    finally:
        hookerrors.reset()
