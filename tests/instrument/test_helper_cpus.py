"""The writer thread and its sink leave the engine thread's pinned core (``pdtrace.instrument.cpus``).

Real threads and a real sink process: the test pins its own thread to one CPU
before the recorder starts, as vLLM's NIXL worker pins the forward thread,
then reads the kernel's affinity of the writer thread and the sink process.
"""
import os

import pytest

from pdtrace.instrument import config, cpus, recorder

needs_two = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs CPU affinity calls and at least 2 allowed CPUs")


@pytest.mark.parametrize("text, want", [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), (" 3,1, 1-2 ", (1, 2, 3)),
                                        ("5-5,", (5,))])
def test_parse_cpulist(text, want):
    assert cpus.parse_cpulist(text) == want


@pytest.mark.parametrize("text", ["", ",", "a", "3-1", "-1", "1-", "0-2-4"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError):
        cpus.parse_cpulist(text)


def test_bad_helper_cpus_warns_and_means_every_cpu(caplog):
    with caplog.at_level("WARNING", logger="pdtrace"):
        cfg = config.from_env({"PDTRACE_DIR": "/tmp/x", "PDTRACE_HELPER_CPUS": "2-1"})
    assert "PDTRACE_HELPER_CPUS" in caplog.text and cfg.helper_cpus is None
    assert config.from_env({"PDTRACE_HELPER_CPUS": "1,0"}).helper_cpus == (0, 1)


def _affinities_when_started_from_a_thread_pinned_to(cpu: int, tmp_path, **env) -> tuple[set, set, set]:
    """(writer thread's, sink process's, the pinned caller's) affinity, the recorder started from a thread on ``cpu``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    t = recorder.Tracer()
    try:
        e = {"PDTRACE_DIR": str(tmp_path), "PDTRACE_ROLE": "prefill", **env}
        t.configure(config.from_env(e))
        t.record("prefill.compute", "R1", t.now(), t.now() + 1000)
        assert t.force_flush(timeout=30)
        w = t._writer
        assert w.cpus == os.sched_getaffinity(w.native_id)  # what the writer reports is what the kernel applied
        return (os.sched_getaffinity(w.native_id), os.sched_getaffinity(w.sink_pid), os.sched_getaffinity(0))
    finally:
        t.shutdown()
        os.sched_setaffinity(0, before)


@needs_two
def test_writer_and_sink_use_every_cpu_not_the_callers_pinned_one(tmp_path):
    allowed = os.sched_getaffinity(0)
    pinned = min(allowed)
    writer, sink, caller = _affinities_when_started_from_a_thread_pinned_to(pinned, tmp_path)
    assert caller == {pinned}  # the engine thread keeps its pin
    assert writer == sink == allowed, (writer, sink, allowed)


@needs_two
def test_helper_cpus_puts_writer_and_sink_on_the_listed_cpus(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    pinned, helper = allowed[0], allowed[-1]
    writer, sink, _ = _affinities_when_started_from_a_thread_pinned_to(pinned, tmp_path,
                                                                       PDTRACE_HELPER_CPUS=str(helper))
    assert writer == sink == {helper}, (writer, sink)


def _libgomp() -> str | None:
    """Path of a GNU OpenMP runtime to preload: torch's bundled one (lab install), else the system's."""
    import ctypes.util
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec and spec.submodule_search_locations:
        found = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "lib", "libgomp*.so*"))
        if found:
            return found[0]
    name = ctypes.util.find_library("gomp")
    return name if name and os.path.isabs(name) else None


@needs_two
def test_sink_is_not_bound_by_openmp_variables_it_inherits(tmp_path, monkeypatch):
    """vLLM's CPU worker env: libgomp preloaded and GOMP_CPU_AFFINITY = the worker's core (seen in the lab).

    libgomp binds a process's main thread to the first CPU of GOMP_CPU_AFFINITY as it loads, so a sink
    started with that env runs on the engine's core whatever its parent thread's affinity; it must not get it.
    """
    lib = _libgomp()
    if lib is None:
        pytest.skip("no libgomp to preload")
    allowed = os.sched_getaffinity(0)
    pinned = min(allowed)
    monkeypatch.setenv("LD_PRELOAD", lib)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(pinned))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    writer, sink, _ = _affinities_when_started_from_a_thread_pinned_to(pinned, tmp_path)
    assert writer == sink == allowed, (writer, sink, allowed)
