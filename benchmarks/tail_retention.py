"""Tail retention in the sink (PDTRACE_RETAIN=tail): the memory bound under a 10x burst, and the sink's CPU
per request with retention on vs off.

    .venv/bin/python benchmarks/tail_retention.py [--requests 4000] [--rounds 4] [--rate 150] [--bound-mb 8]

The real sink code (:class:`pdtrace.instrument.sink.Collector`, its message handler, part files, merge;
:class:`pdtrace.instrument.retention.TailRetention`) runs in this process, fed through its message handler
with the record tuples three clients (router, P, D) would send for each request of a pull handoff (16
records: the router's root, two dispatches, a wait, first/last token events; P's frontend, queue,
compute, block hold; D's frontend, queue, transfer, ready, first step, finished; DESIGN.md §2), times on
this host's monotonic clock. No socket reading (the handler is called directly): what is measured is the
sink's own work per record, which is what retention changes.

1. **CPU per request** (thread CPU clock of this thread: admit, decisions, conversion, Parquet writes,
   merge): the same requests through a collector with retention off and one with it on
   (TTFT threshold 100 ms, 10 % of requests slow, head 0.1), rounds interleaved off/on/on/off.
2. **Memory bound under a 10x burst** (real time): requests arrive at ``--rate`` per second for 3 s, then
   10x that for 3 s, then ``--rate`` again for 3 s; each ends (its router root arrives) 1 s after it
   started. Printed per phase: records/s offered and taken, the held bytes (the sink's estimate) at
   their peak against the bound, requests evicted, and whether every slow request was kept.
3. **Calibration** of the estimate (:func:`pdtrace.instrument.retention.held_bytes`): tracemalloc's
   count of the memory held for 20,000 request records against the estimate, then for the decode.step
   spans over them (8 per 256 requests, each naming 256 requests in its ``step.batch``).

D's EngineCore also sends ``decode.step`` spans (:func:`decode_steps`) in 1. and 2.: held with their
requests, their ``step.batch`` strings are most of the held bytes of a large batch.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import deque

from pdtrace.instrument import config, retention
from pdtrace.instrument.recorder import R_EVENT, R_SPAN
from pdtrace.instrument.sink import Collector, _Conn

MS = 1_000_000
SLOW_EVERY = 10  # every 10th request has TTFT 300 ms, the others 40 ms
THRESHOLD_MS = 100.0


def _span(name, rid, t0, t1, sid, **a):
    return (R_SPAN, sid, sid, None, name, 1, t0, t1, 0, None, rid, 0, 0, None, "MainThread", *a, *a.values())


def _ev(name, rid, t, sid, **a):
    return (R_EVENT, sid + 1, sid, None, name, 1, t, t, 0, None, rid, 0, 0, None, "MainThread", *a, *a.values())


def request_records(i: int, t0: int) -> tuple[dict, list]:
    """The records of request ``i`` starting at ``t0`` (monotonic ns): ({role: records sent at once},
    the router's root span sent at its end)."""
    rid = f"bench{i:08d}"
    ttft = (300 if i % SLOW_EVERY == 0 else 40) * MS
    s = i * 64
    router = [_span("router.dispatch", rid, t0, t0 + MS, s + 1),
              _span("router.wait", rid, t0 + MS, t0 + 20 * MS, s + 2),
              _span("router.dispatch", rid, t0 + 20 * MS, t0 + 21 * MS, s + 3),
              _ev("router.first_token", rid, t0 + ttft, s + 4),
              _ev("router.last_token", rid, t0 + ttft + 50 * MS, s + 6, **{"gen_ai.usage.output_tokens": 8})]
    p = [_span("prefill.frontend", rid, t0 + MS, t0 + 2 * MS, s + 8, **{"frontend.part": "in"}),
         _span("prefill.queue", rid, t0 + 2 * MS, t0 + 3 * MS, s + 9, **{"request.internal_id": rid + "-0-abcd"}),
         _span("prefill.compute", rid, t0 + 3 * MS, t0 + 15 * MS, s + 10, **{"step.id": i}),
         _span("prefill.block_hold", rid, t0 + 15 * MS, t0 + 30 * MS, s + 11, **{"kv.blocks": 4})]
    d = [_span("decode.frontend", rid, t0 + 21 * MS, t0 + 22 * MS, s + 12, **{"frontend.part": "in"}),
         _span("decode.queue", rid, t0 + 22 * MS, t0 + 23 * MS, s + 13),
         _span("kv.transfer", rid, t0 + 23 * MS, t0 + 28 * MS, s + 14, **{"kv.bytes": 1 << 20, "kv.descriptors": 8}),
         _span("kv.ready", rid, t0 + 28 * MS, t0 + 30 * MS, s + 15),
         _span("decode.first_step", rid, t0 + 30 * MS, t0 + 38 * MS, s + 16),
         _ev("request.finished", rid, t0 + ttft + 45 * MS, s + 17, **{"gen_ai.usage.output_tokens": 8})]
    root = [_span("router.request", rid, t0, t0 + ttft + 60 * MS, s + 20)]
    return {"router": router, "prefill": p, "decode": d}, root


STEP_BATCH = 256  # requests named in one decode.step's step.batch (the review's example)
STEPS_PER_BATCH = 8  # decode steps over one batch: one per output token (8 tokens, request_records)
_step_seq = [0]


def decode_steps(ids: list, t0: int, n: int = STEPS_PER_BATCH) -> list:
    """``n`` ordinary (10 ms, not stalled once the baseline is known) decode.step spans of D's EngineCore
    over the requests ``ids`` (``step.batch`` = ``id:d1;...``, as the traced scheduler writes it)."""
    batch = ";".join(f"{x}:d1" for x in ids)
    out = []
    for k in range(n):
        _step_seq[0] += 1
        t = t0 + k * 10 * MS
        out.append(_span("decode.step", None, t, t + 10 * MS, (1 << 40) + _step_seq[0],
                         **{"step.id": _step_seq[0], "step.batch": batch}))
    return out


class Bench:
    """A real Collector in this process with three clients (router, P, D) on socket pairs whose far ends a
    thread drains (the sink's answers)."""

    def __init__(self, retain: str, d: str, bound_mb: float = 256.0, flush_s: float = 0.05) -> None:
        cfg = config.Config(trace_dir=d, retain=retain, tail_ttft_ms=THRESHOLD_MS, tail_head=0.1,
                            tail_memory_mb=bound_mb, flush_interval_s=flush_s, rotate_s=0.0)
        self.lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.col = Collector(cfg, self.lst)
        self.conns, self._far = {}, []
        for k, role in enumerate(("router", "prefill", "decode")):
            a, b = socket.socketpair()
            a.setblocking(False)
            c = _Conn(a)
            self.col.conns[a.fileno()] = c
            self.col._handle(c, ("init", cfg, {"role": role, "run_id": "bench"}, 1000 + k, "b", "explicit"))
            self.conns[role] = c
            self._far.append(b)
        self._stop = False
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        while not self._stop:
            for b in self._far:
                b.setblocking(False)
                try:
                    while b.recv(1 << 16):
                        pass
                except (BlockingIOError, OSError):
                    pass
            time.sleep(0.01)

    def send(self, role: str, recs: list) -> None:
        self.col._handle(self.conns[role], ("recs", recs))

    def step(self) -> None:
        """What the sink's loop does between reads: decisions due, then a part file."""
        if self.col.retention is not None:
            self.col.retention.tick()
        self.col.write_part()

    def finish(self) -> None:
        for c in self.conns.values():
            c.final = True
        self.col.write_part()
        self.col._merge_parts()
        self._stop = True
        self._t.join()


def cpu_per_request(n: int, rounds: int) -> None:
    print(f"1. sink CPU per request (thread CPU), {n} requests x 16 records, and {STEPS_PER_BATCH} decode.step "
          f"spans per {STEP_BATCH} requests (a {STEP_BATCH}-request step.batch each), {rounds} rounds interleaved")
    res = {"all": [], "tail": []}
    kept = None
    for r in range(rounds):
        for mode in (("all", "tail") if r % 2 == 0 else ("tail", "all")):
            with tempfile.TemporaryDirectory() as d:
                b = Bench(mode, d)
                base = time.monotonic_ns() - 5_000 * MS
                reqs = [request_records(i, base + i * MS) for i in range(n)]
                c0 = time.thread_time_ns()
                for j in range(0, n, STEP_BATCH):
                    chunk = reqs[j:j + STEP_BATCH]
                    for role in ("router", "prefill", "decode"):
                        b.send(role, [x for recs, _ in chunk for x in recs[role]])
                    b.send("decode", decode_steps([f"bench{i:08d}" for i in range(j, j + len(chunk))],
                                                  base + j * MS))
                    b.send("router", [x for _, root in chunk for x in root])
                    b.step()
                c1 = time.thread_time_ns()
                time.sleep(b.col.retention.grace_ns / 1e9 + 0.05 if b.col.retention else 0)
                c2 = time.thread_time_ns()
                b.step()
                b.finish()
                c3 = time.thread_time_ns()
                res[mode].append((c1 - c0 + c3 - c2) / n)
                if b.col.retention is not None:
                    kept = b.col.retention.summary()
    for mode in ("all", "tail"):
        v = res[mode]
        print(f"   retention {mode:4s}: median {statistics.median(v) / 1e3:.1f} us/request "
              f"(rounds: {', '.join(f'{x / 1e3:.1f}' for x in v)})")
    print(f"   ratio on/off {statistics.median(res['tail']) / statistics.median(res['all']):.2f}; "
          f"kept {kept['kept']} of {kept['kept'] + kept['dropped']} requests ({kept['reasons']})")


def burst(rate: float, bound_mb: float) -> None:
    print(f"2. memory bound under a 10x burst: {rate:g} req/s, then {10 * rate:g}, then {rate:g} (3 s each), "
          f"each request ends 1 s after it starts; one decode.step every 10 ms over the (up to {STEP_BATCH}) "
          f"requests started in the last second; bound {bound_mb:g} MiB")
    with tempfile.TemporaryDirectory() as d:
        b = Bench("tail", d, bound_mb=bound_mb, flush_s=0.2)
        ret = b.col.retention
        pending = deque()  # (due ns, root records)
        running = deque()  # (started ns, id) of the last second: the decode batch
        i = 0
        slow_ids = []
        for phase, r in (("base", rate), ("burst", 10 * rate), ("after", rate)):
            t_end = time.monotonic() + 3.0
            sent = 0
            ret.peak = ret.held
            ev0 = ret.counts["evicted"]
            t_start = time.monotonic()
            i0 = i
            while time.monotonic() < t_end:
                tick = time.monotonic()
                want = int((tick - t_start) * r) - (i - i0)
                now = time.monotonic_ns()
                batch = {"router": [], "prefill": [], "decode": []}
                for _ in range(max(0, want)):
                    recs, root = request_records(i, now)
                    if i % SLOW_EVERY == 0:
                        slow_ids.append(f"bench{i:08d}")
                    for k in batch:
                        batch[k] += recs[k]
                    pending.append((now + 1000 * MS, root))
                    running.append((now, f"bench{i:08d}"))
                    i += 1
                    sent += 16
                while running and running[0][0] < now - 1000 * MS:
                    running.popleft()
                if running:
                    batch["decode"] += decode_steps([x for _, x in list(running)[-STEP_BATCH:]], now, 1)
                    sent += 1
                for k, v in batch.items():
                    if v:
                        b.send(k, v)
                now = time.monotonic_ns()
                roots = []
                while pending and pending[0][0] <= now:
                    roots += pending.popleft()[1]
                if roots:
                    b.send("router", roots)
                b.step()
                time.sleep(max(0.0, 0.01 - (time.monotonic() - tick)))
            el = time.monotonic() - t_start
            print(f"   {phase:5s}: offered {r * 16:,.0f} records/s, taken {sent / el:,.0f} records/s; held peak "
                  f"{ret.peak / (1 << 20):.2f} MiB of {ret.bound / (1 << 20):.2f} MiB (estimate); "
                  f"evicted {ret.counts['evicted'] - ev0} requests; held now {ret.held_records} records")
        for _, root in pending:
            b.send("router", root)
        time.sleep(ret.grace_ns / 1e9 + 0.05)
        b.step()
        lost_slow = [x for x in slow_ids if not (ret.decided.get(x) or (False,))[0]]
        b.finish()
        s = ret.summary()
        print(f"   total: {i} requests, kept {s['kept']} ({s['reasons']}), dropped {s['dropped']}, evicted "
              f"{s['evicted']}; slow requests (TTFT 300 ms >= {THRESHOLD_MS:g}) kept {len(slow_ids) - len(lost_slow)} "
              f"of {len(slow_ids)}")


def calibrate(n: int = 20000) -> None:
    with tempfile.TemporaryDirectory() as d:
        b = Bench("tail", d)
        ret = b.col.retention
        ret.step_ns = 10 ** 12  # no step is a stall here: every step is held with its requests
        base = time.monotonic_ns()
        reqs = [request_records(i, base) for i in range(n // 15)]
        tracemalloc.start()
        m0 = tracemalloc.get_traced_memory()[0]
        est0, h0 = ret.held, ret.held_records
        for recs, _ in reqs:
            for role in ("router", "prefill", "decode"):
                b.send(role, pickle.loads(pickle.dumps(recs[role])))  # fresh objects, as the sink receives them
        m1 = tracemalloc.get_traced_memory()[0]
        est1, h1 = ret.held, ret.held_records
        ids = [f"bench{i:08d}" for i in range(len(reqs))]
        for j in range(0, len(ids), STEP_BATCH):  # 8 steps over each 256 of them, one message per batch
            b.send("decode", pickle.loads(pickle.dumps(decode_steps(ids[j:j + STEP_BATCH], base))))
        m2 = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        est, est_s = est1 - est0, ret.held - est1
        print(f"3. estimate vs tracemalloc for {h1 - h0} held request records of {len(reqs)} requests: "
              f"estimate {est / (1 << 20):.2f} MiB, traced {(m1 - m0) / (1 << 20):.2f} MiB (ratio traced/estimate "
              f"{(m1 - m0) / est:.2f}; records unpickled one request and role per message)")
        print(f"   and for {ret.held_records - h1} held decode.step spans ({STEP_BATCH}-request step.batch): "
              f"estimate {est_s / (1 << 20):.2f} MiB, traced {(m2 - m1) / (1 << 20):.2f} MiB (ratio traced/estimate "
              f"{(m2 - m1) / est_s:.2f}; {est_s / max(1, ret.held_records - h1):,.0f} B per step estimated)")
        b.finish()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", type=float, default=150.0, help="base rate, requests/s (x16 records)")
    ap.add_argument("--bound-mb", type=float, default=8.0)
    a = ap.parse_args(argv)
    logging.getLogger("pdtrace").setLevel(logging.ERROR)  # the sink's start-up line per collector
    print(f"tail_retention: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}, "
          f"python {sys.version.split()[0]}")
    cpu_per_request(a.requests, a.rounds)
    burst(a.rate, a.bound_mb)
    calibrate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
