"""pdtrace's self-measured CPU: the PDTRACE_SELF_CPU switch, the hook timing in ``safe``, the writer's CPU."""
from __future__ import annotations

import threading
import time

import pytest

from pdtrace.connector.traced import safety
from pdtrace.instrument import config, recorder, selfcpu


def _burn(cpu_ns: int) -> int:
    """Spin until this thread has used ``cpu_ns`` of CPU; return what it used."""
    t0 = time.thread_time_ns()
    while time.thread_time_ns() - t0 < cpu_ns:
        pass
    return time.thread_time_ns() - t0


@pytest.fixture
def self_cpu_on():
    selfcpu.configure(config.from_env({"PDTRACE_SELF_CPU": "1"}))
    selfcpu.reset()
    yield
    selfcpu.configure(config.from_env({}))
    selfcpu.reset()


def test_switch_parsing():
    assert config.from_env({"PDTRACE_SELF_CPU": "1"}).self_cpu is True
    assert config.from_env({}).self_cpu is False
    assert config.from_env({"PDTRACE_SELF_CPU": "yes"}).self_cpu is False  # bad value: warning + default


def test_safe_charges_the_hooks_cpu_across_threads(self_cpu_on):
    used = []
    th = threading.Thread(target=lambda: used.append(safety.safe(_burn, 30_000_000)))
    th.start()
    used.append(safety.safe(_burn, 20_000_000))
    th.join()
    total = selfcpu.total_ns()
    # the counter holds exactly the hooks' own CPU plus the two clock reads around each
    assert sum(used) <= total <= sum(used) + 2_000_000, (used, total)


def test_safe_charges_a_hook_that_raises(self_cpu_on):
    def bad():
        _burn(5_000_000)
        raise ValueError("x")

    before = safety.error_count()
    assert safety.safe(bad) is None
    assert safety.error_count() == before + 1
    assert selfcpu.total_ns() >= 5_000_000


def test_off_charges_nothing():
    selfcpu.configure(config.from_env({}))
    selfcpu.reset()
    safety.safe(_burn, 5_000_000)
    assert selfcpu.total_ns() == 0


def test_writer_cpu_counter_grows_and_reaches_the_store(tmp_path):
    t = recorder.Tracer()
    t.configure(config.from_env({"PDTRACE_DIR": str(tmp_path), "PDTRACE_ROLE": "test"}))
    for i in range(20000):
        t.record("decode.step", None, i, i + 1, {"step.id": i})
    assert t.force_flush(60)
    cpu = t.stats()["writer_cpu_ns"]
    assert cpu > 0
    t.shutdown(30)
    import duckdb

    rows = duckdb.connect().execute(
        f"SELECT max(attr_int['recorder.writer_cpu_ns']) FROM read_parquet('{tmp_path}/*.parquet') "
        "WHERE record = 'stats'").fetchall()
    assert rows[0][0] >= cpu
