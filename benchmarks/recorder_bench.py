"""Recorder cost, side by side in one process (issue: span recorder numbers).

Prints:
  1. tracing off: cost of one call site (the ``if tracer.on:`` check), ns
  2. tracing on: median cost on the caller's thread of one span opened and
     closed with 3 attributes (``start`` + ``end``), and of one ``record``
     with explicit times, ns; the writer is kept idle while timing so the
     figure is the caller's own cost. Beside it, the floor on this machine:
     the same call site's attribute dict, two clock reads and one append of a
     record of the same shape to a deque, with no recorder (the issue puts
     that at ~0.2 us; per-call figures move with the VM, the ratio less)
  3. OpenTelemetry SDK start_span/end with a BatchSpanProcessor, measured the
     same way, and the ratio SDK / pdtrace
  4. writer GIL holds: the longest gap seen by a busy Python thread while the
     writer thread hands a full buffer to the sink process (which converts and
     writes it), vs the same thread alone; and the writer thread's longest
     stretch of CPU between two GIL releases
  5. throughput into Parquet, spans/s, with the process and its sink pinned
     to one core
  6. the buffer's memory bound, bytes per buffered record and at the default cap

Run:  .venv/bin/python benchmarks/recorder_bench.py [--quick]
      .venv/bin/python benchmarks/recorder_bench.py --gil-pinned   (figure 4 only, threads pinned apart)
      .venv/bin/python benchmarks/recorder_bench.py --gil-control  (the same, a plain-Python thread for the writer)
Each figure is a median over rounds; a single round hides scheduler noise
(the machine has 2 cores and the writer thread and the sink share them).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections import deque

from pdtrace.instrument import config, recorder

pc = time.perf_counter_ns


def per_call_ns(fn, n: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean cost of ``fn(i)`` over ``n`` calls, minus an empty loop's."""
    def loop(f):
        out = []
        for _ in range(rounds):
            t0 = pc()
            for i in range(n):
                f(i)
            out.append((pc() - t0) / n)
        return statistics.median(out)

    def empty(i):
        pass

    return loop(fn) - loop(empty)


def make_tracer(d: str, **env) -> recorder.Tracer:
    e = {"PDTRACE_DIR": d, "PDTRACE_ROLE": "bench"}
    e.update({k: str(v) for k, v in env.items()})
    t = recorder.Tracer()
    t.configure(config.from_env(e))
    return t


def bench_call_sites(d: str, n: int, rounds: int) -> dict:
    t = make_tracer(d, PDTRACE_BUFFER_SPANS=1 << 23, PDTRACE_FLUSH_INTERVAL_S=3600)
    t._wake_at = 1 << 30  # keep the writer idle while timing the caller's thread
    off = recorder.Tracer()  # never configured: on is False

    def site_off(i):
        if off.on:
            off.record("kv.transfer", "r", 0, 0)

    def open_close(i):
        if t.on:
            sid = t.start("kv.transfer", "r1", attrs={"kv.bytes": 4096, "kv.op": "READ", "step.id": i})
            t.end(sid)

    def one_shot(i):
        if t.on:
            s = t.now()
            t.record("kv.transfer", "r1", s, t.now(), {"kv.bytes": 4096, "kv.op": "READ", "step.id": i})

    # The floor any in-process recorder pays at this call site on this machine:
    # the caller's 3-attribute dict, two monotonic clock reads and one append of
    # a record of the same shape (15 slots + keys + values) to a growing deque.
    buf, ids, now = deque(), itertools.count(), time.monotonic_ns

    def floor(i):
        a = {"kv.bytes": 4096, "kv.op": "READ", "step.id": i}
        s = now()
        buf.append((0, next(ids), 0, None, "kv.transfer", 0, s, now(), 0, None, "r1", 0, 0, None, "main",
                    *a, *a.values()))

    res = {
        "off_ns": per_call_ns(site_off, n, rounds),
        "floor_ns": per_call_ns(floor, n, rounds),
        "open_close_ns": per_call_ns(open_close, n, rounds),
        "record_ns": per_call_ns(one_shot, n, rounds),
    }
    t.shutdown(60)
    return res


def bench_otel_sdk(n: int, rounds: int) -> float | None:
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    except ImportError:
        return None

    class Discard(SpanExporter):  # the cost measured is the SDK's span path, not I/O
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard(), max_queue_size=1 << 20))
    tr = provider.get_tracer("bench")

    def sdk(i):
        s = tr.start_span("kv.transfer", attributes={"kv.bytes": 4096, "kv.op": "READ", "step.id": i})
        s.end()

    v = per_call_ns(sdk, n, rounds)
    provider.shutdown()
    return v


def busy_loop(stop: threading.Event, out: list, core: int | None = None) -> None:
    """The busy thread: short plain-Python iterations until ``stop``; appends to ``out``
    ``(longest gap between iterations ns, gaps > 1 ms, iterations/s, seconds run)``.
    ``core``: pin this thread to that core first (Linux: affinity 0 = the calling thread)."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    t0 = last = pc()
    worst = over = iters = 0
    while not stop.is_set():
        x = 0
        for _ in range(50):
            x += 1
        now = pc()
        g = now - last
        worst = g if g > worst else worst
        over += g > 1_000_000
        iters += 1
        last = now
    out.append((worst, over, iters / ((last - t0) / 1e9), (last - t0) / 1e9))


def bench_gil(d: str, records: int, busy_core: int | None = None, helper_core: int | None = None) -> dict:
    """The busy thread's gaps and progress, alone and while the writer flushes a full buffer.

    Returns ``{"alone": round, "writer": round, "stretch_cpu_ns": int}``, each
    round the least noisy of three: ``(max gap ns, gaps > 1 ms, iterations/s,
    seconds)``. ``busy_core``: pin the busy thread to that core (the caller has
    pinned this process's other threads elsewhere): the thread then waits only
    for the GIL, never for a core this process holds. ``helper_core``: the
    writer thread and its sink run there (``PDTRACE_HELPER_CPUS``; they would
    otherwise move to every CPU, as in an engine).
    """
    helper = {} if helper_core is None else {"PDTRACE_HELPER_CPUS": str(helper_core)}

    def run(with_writer: bool) -> tuple:
        t = make_tracer(d, PDTRACE_BUFFER_SPANS=records + 10, PDTRACE_FLUSH_INTERVAL_S=3600, **helper)
        t._wake_at = 1 << 30
        for i in range(records):
            t.record("decode.step", None, i, i + 1, {"step.id": i, "step.num_reqs": 8, "vllm.method": "get_finished"})
        stop, out = threading.Event(), []
        th = threading.Thread(target=busy_loop, args=(stop, out, busy_core))
        th.start()
        time.sleep(0.2)
        if with_writer:
            w = t._writer
            t.force_flush(600)
            stretches.append(w.max_stretch_cpu_ns)
        else:
            time.sleep(1.0)
        stop.set()
        th.join()
        t.shutdown(60)
        return out[0]

    stretches: list[int] = []
    alone = [run(False) for _ in range(3)]
    writer = [run(True) for _ in range(3)]
    # the least noisy of three rounds: other processes on the 2 cores add gaps to any round
    return {"alone": min(alone), "writer": min(writer), "stretch_cpu_ns": max(stretches)}


def pin_apart(option: str) -> list[int]:
    """Pin every thread of this process to the last core (later threads inherit it); return the cores.

    The busy thread moves itself to the first core (``bench_gil(busy_core=...)``).
    Raises SystemExit naming ``option`` on a machine with fewer than 2 cores.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"{option} needs 2 cores")
    for tid in os.listdir("/proc/self/task"):  # threads already started (imports) too
        os.sched_setaffinity(int(tid), {cores[-1]})
    return cores


def print_gil(gil: dict) -> None:
    """Print :func:`bench_gil`'s result: the busy thread's gaps (ms) and progress, the writer's longest CPU stretch."""
    rate_alone = gil["alone"][2]
    for label, key in (("alone", "alone"), ("while the writer flushes a full buffer", "writer")):
        mx, over, rate, secs = gil[key]
        print(f"busy thread's gaps, {label}: max {mx / 1e6:.3f} ms, {over} gaps > 1 ms in {secs:.1f} s; "
              f"progress {100 * rate / rate_alone:.1f} % of its rate alone"
              + ("   (goal: max <= 1 ms)" if key == "writer" else ""))
    print(f"writer's longest CPU stretch between GIL releases: {gil['stretch_cpu_ns'] / 1e6:.3f} ms "
          "(thread CPU time; goal <= 1 ms)")


def gil_pinned(records: int) -> None:
    """Print the GIL figure with the busy thread and the rest of the process on separate cores.

    The main thread is pinned to the last core before any other thread starts,
    the writer thread and the sink are put there too (``PDTRACE_HELPER_CPUS``);
    the busy thread moves itself to the first core. On a shared machine a gap is then a wait for the
    GIL or the whole VM being descheduled, not the writer taking the core.
    """
    cores = pin_apart("--gil-pinned")
    with tempfile.TemporaryDirectory() as d:
        gil = bench_gil(d, records, busy_core=cores[0], helper_core=cores[-1])
    print(f"pinned: busy thread on core {cores[0]}, writer thread + sink process on core {cores[-1]}")
    print_gil(gil)


def gil_control(seconds: float = 2.0) -> None:
    """Print the busy thread's gaps beside a plain-Python thread in the writer's rhythm (pinned apart).

    The control thread works 400 µs, then sleeps 50 µs, the rhythm of the
    in-process writer pdtrace had before the sink process (BENCHMARKS.md "Host sink"); "with
    releases" it also drops and re-takes the GIL every few µs inside that work
    (``zlib.crc32`` of 20 kB, ``time.sleep(0)``), as pyarrow's ``with nogil``
    sections do. It measures what CPython's GIL hand-over alone costs a
    waiting thread on this machine (BENCHMARKS.md "Recorder overhead").
    """
    import zlib

    cores = pin_apart("--gil-control")
    blob = os.urandom(20_000)

    def control(stop: threading.Event, releases: bool):
        while not stop.is_set():
            t = pc()
            while pc() - t < 400_000:
                for _ in range(20):
                    pass
                if releases:
                    zlib.crc32(blob)
                    time.sleep(0)
            time.sleep(0.00005)

    for releases in (False, True):
        stop, out = threading.Event(), []
        threads = [threading.Thread(target=busy_loop, args=(stop, out, cores[0])),
                   threading.Thread(target=control, args=(stop, releases))]
        for th in threads:
            th.start()
        time.sleep(seconds)
        stop.set()
        for th in threads:
            th.join()
        label = "with brief GIL releases" if releases else "plain Python"
        print(f"busy thread's gaps beside a control thread ({label}, 400 us work / 50 us sleep): "
              f"max {out[0][0] / 1e6:.3f} ms, {out[0][1]} gaps > 1 ms")


def bench_throughput(d: str, records: int) -> float:
    """Spans/s from the buffer into Parquet files, the process, its writer thread and its sink on one core."""
    core = min(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    t = make_tracer(d, PDTRACE_BUFFER_SPANS=records + 10, PDTRACE_FLUSH_INTERVAL_S=3600, PDTRACE_ROTATE_S=3600,
                    PDTRACE_HELPER_CPUS=str(core))
    t._wake_at = 1 << 30
    for i in range(records):
        t.record("kv.transfer", f"r{i % 1000}", i, i + 1, {"kv.bytes": 4096, "kv.op": "READ", "step.id": i})
    t0 = time.perf_counter()
    t.force_flush(600)
    dt = time.perf_counter() - t0
    t.shutdown(60)
    return records / dt


def bench_memory(n: int = 20000) -> float:
    """Bytes held per buffered record (3 attributes), from tracemalloc."""
    d = tempfile.mkdtemp()
    t = make_tracer(d, PDTRACE_BUFFER_SPANS=n + 10, PDTRACE_FLUSH_INTERVAL_S=3600)
    t._wake_at = 1 << 30
    gc.collect()
    tracemalloc.start()
    a = tracemalloc.take_snapshot()
    for i in range(n):
        t.record("kv.transfer", "r1", 10**12 + i, 10**12 + i + 1, {"kv.bytes": 4096 + i, "kv.op": "READ", "step.id": i})
    b = tracemalloc.take_snapshot()
    tracemalloc.stop()
    per = sum(s.size_diff for s in b.compare_to(a, "filename")) / n
    t.shutdown(60)
    return per


def reference_loop_s(n: int = 10_000_000) -> float:
    """Seconds for a plain-Python loop of ``n`` additions: this machine's speed at the time of
    the run, printed so figures from different days can be compared (2-3x swings seen on this VM)."""
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (CI smoke run)")
    ap.add_argument("--gil-pinned", action="store_true",
                    help="only the GIL figure, with the busy thread on one core and every other thread "
                         "of the process (writer thread) and its sink on another: separates GIL waits from CPU sharing")
    ap.add_argument("--gil-control", action="store_true",
                    help="only the control: the busy thread beside a plain-Python thread in the writer's "
                         "rhythm, pinned apart (is CPython's GIL hand-over itself the limit?)")
    args = ap.parse_args()
    print(f"reference: plain-Python loop of 10M additions: {reference_loop_s():.2f} s")
    if args.gil_control:
        return gil_control()
    if args.gil_pinned:
        return gil_pinned(100_000 if args.quick else 400_000)
    n, rounds = (200, 50) if args.quick else (200, 400)
    with tempfile.TemporaryDirectory() as d:
        cs = bench_call_sites(d, n, rounds)
        sdk = bench_otel_sdk(n, max(10, rounds // 4))
        gil = bench_gil(d, 100_000 if args.quick else 400_000)
        mem = bench_memory()
        thr = bench_throughput(d, 200_000 if args.quick else 1_000_000)
    cap = config.Config().buffer_spans
    print(f"tracing off, per call site:            {cs['off_ns']:8.1f} ns   (goal <= 50)")
    print(f"floor: attrs dict + 2 clock reads + append: {cs['floor_ns']:8.1f} ns   (the issue's estimate: ~200)")
    print(f"tracing on, span open+close, 3 attrs:  {cs['open_close_ns']:8.1f} ns   (goal <= 1000, aim 500; "
          f"{cs['open_close_ns'] / cs['floor_ns']:.1f}x the floor)")
    print(f"tracing on, record() explicit times:   {cs['record_ns']:8.1f} ns")
    if sdk is not None:
        print(f"opentelemetry-sdk start/end + BSP:     {sdk:8.1f} ns   ratio sdk/pdtrace = {sdk / cs['open_close_ns']:.1f}x (goal >= 10x)")
    print_gil(gil)
    print(f"writer throughput into Parquet, 1 core:{thr:10.0f} spans/s (goal >= 200000)")
    print(f"buffer memory: {mem:.0f} B/record; default cap {cap} records -> {mem * cap / 2**20:.1f} MiB bound")


if __name__ == "__main__":
    main()
