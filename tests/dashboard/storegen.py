"""Hand-built span stores for the dashboard tests (written with pdtrace.instrument.store.write_rows).

:func:`build_store` writes a small but complete P/D trace: one router file,
one file per engine, every request with the DESIGN.md §2 stages of its mode,
decode steps on D with connector work on the forward thread, clock anchors,
an incident window in which handoffs pay a first-contact handshake, and a few
incomplete requests (push with a missing rank notification). Times are ns
since the Unix epoch; durations below are given in ms and converted.

It is deterministic for a given seed, so tests can compare the dashboard's
numbers with the analysis views' on the same input.
"""
from __future__ import annotations

import random
from pathlib import Path

from pdtrace.instrument.store import write_rows

MS = 1_000_000
#: arrival of the first request (ns since the Unix epoch): 2025-01-01 00:00:00 UTC
T0 = 1_735_689_600 * 1_000_000_000


class _Ids:
    def __init__(self, start: int):
        self.n = start

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _res(role: str, engine_id: str | None, pid: int, mode: str, run_id: str) -> dict:
    svc = {"router": "pdtrace-router", "prefill": "vllm-prefill", "decode": "vllm-decode"}[role]
    conn = None if role == "router" else ("TracedNixlPushConnector" if mode == "push" else "TracedNixlPullConnector")
    return {"role": role, "engine_id": engine_id, "host": "lab", "pid": pid, "run_id": run_id,
            "service_name": svc, "connector": conn, "vllm_version": None if role == "router" else "0.32.0",
            "pdtrace_version": "0.1.0"}


def _anchors(t_first: int, t_last: int, offset_ns: int = 0) -> list[dict]:
    """Clock anchors every 10 s over [t_first, t_last] (wall = start_ns, monotonic = wall - T0)."""
    rows, t = [], t_first - 1_000 * MS
    while t <= t_last + 10_000 * MS:
        rows.append({"record": "clock", "name": "clock.anchor", "start_ns": t + offset_ns, "thread": "MainThread",
                     "attrs": {"clock.mono_ns": t - T0 + 5_000 * MS, "clock.uncertainty_ns": 2_000,
                               "clock.read_cost_ns": 40, "clock.test_offset_ns": 0, "clock.source": "monotonic_ns"}})
        t += 10_000 * MS
    return rows


def build_store(directory: str | Path, n_requests: int = 60, mode: str = "pull", seed: int = 1,
                incident: tuple[float, float] | None = (0.6, 0.8), n_incomplete: int = 2,
                run_id: str | None = None, start_ns: int = T0, gap_ms: float = 250.0,
                p_clock_ahead_ms: float | None = None) -> Path:
    """Write a trace of ``n_requests`` requests of ``mode`` ('pull', 'push' or 'mixed') into ``directory``.

    ``incident`` = (from, to) as fractions of the request sequence: requests in
    it pay a 900 ms first-contact handshake in ``handoff.prep`` (pull) or a late
    destination registration (push). The last ``n_incomplete`` push requests (or
    requests, in pull mode: a READ that fails to post) get no first token.
    Requests arrive every ``gap_ms`` ms.

    ``p_clock_ahead_ms`` (ms; None: no skew and no sample): P's wall clock reads
    this much ahead of D's and the router's. Every prefill row (spans, events,
    clock anchors) is written on P's clock, so its times are raw = true + skew,
    and D records one NIXL-handshake clock sample at its first request (as the
    traced pull connector does: peer minus own on the monotonic clocks, which
    agree, so 0, with a 2 ms round-trip bound); the analysis converts it through
    both processes' anchors into P - D = the skew. Returns the directory.
    """
    d = Path(directory)
    rng = random.Random(seed)
    run_id = run_id or f"run-{mode}-{seed}"
    sid = _Ids(seed * 10_000_000)
    router, pre, dec = [], [], []
    connector_work: list[tuple[int, int, str]] = []  # (start, end, request id) on D's forward thread
    decoding: list[tuple[str, int, int]] = []  # (request id, first token ns, last token ns)
    inc_lo, inc_hi = incident if incident else (2.0, 2.0)
    for i in range(n_requests):
        m = mode if mode != "mixed" else ("pull" if i % 2 == 0 else "push")
        x = f"{m}-{seed}-{i:04d}"
        a = start_ns + int(i * gap_ms * MS) + rng.randrange(0, 20) * MS
        prompt = rng.choice([64, 128, 256, 512, 1024, 2048])
        out_tokens = rng.randrange(8, 40)
        in_incident = inc_lo <= i / n_requests < inc_hi
        incomplete = i >= n_requests - n_incomplete
        t = a
        root = sid()
        r_attrs = {"request.mode": m, "gen_ai.usage.input_tokens": prompt, "router.policy": "round-robin",
                   "gen_ai.request.max_tokens": out_tokens}
        # --- prefill leg ---
        router.append({"name": "router.dispatch", "request_id": x, "span_id": sid(), "parent_span_id": root,
                       "start_ns": t, "end_ns": t + 2 * MS, "attrs": {"router.leg": "prefill"}})
        if m == "push":
            router.append({"name": "router.dispatch", "request_id": x, "span_id": sid(), "parent_span_id": root,
                           "start_ns": t, "end_ns": t + 2 * MS, "attrs": {"router.leg": "decode"}})
        t += 2 * MS
        pq_ms = rng.uniform(0.5, 4.0) + (30.0 if in_incident and m == "pull" else 0.0)
        pc_ms = prompt / 8.0 + rng.uniform(0, 5)
        pre.append({"name": "prefill.frontend", "request_id": f"cmpl-{x}-0-{i:08x}", "span_id": sid(),
                    "start_ns": t, "end_ns": t + 1 * MS, "thread": "MainThread"})
        t += 1 * MS
        pre.append({"name": "prefill.queue", "request_id": x, "span_id": sid(), "start_ns": t,
                    "end_ns": t + int(pq_ms * MS), "thread": "EngineCore"})
        t += int(pq_ms * MS)
        pre.append({"name": "prefill.compute", "request_id": x, "span_id": sid(), "start_ns": t,
                    "end_ns": t + int(pc_ms * MS), "thread": "EngineCore",
                    "attrs": {"gen_ai.usage.input_tokens": prompt, "request.num_cached_tokens": 0}})
        t += int(pc_ms * MS)
        kv_ready = t
        nbytes = prompt * 16 * 1024
        ndesc = prompt // 16 * 4
        xfer_ms = nbytes / (2.0e9) * 1e3 + rng.uniform(0.2, 1.0)
        post_ms = xfer_ms * 0.1
        first_contact = in_incident and m == "pull"
        if m == "pull":
            pre.append({"name": "prefill.frontend", "request_id": x, "span_id": sid(), "start_ns": t,
                        "end_ns": t + 1 * MS, "thread": "MainThread"})
            t += 1 * MS
            router.append({"name": "router.dispatch", "request_id": x, "span_id": sid(), "parent_span_id": root,
                           "start_ns": t, "end_ns": t + 1 * MS, "attrs": {"router.leg": "decode"}})
            t += 1 * MS
            dec.append({"name": "decode.frontend", "request_id": x, "span_id": sid(), "start_ns": t,
                        "end_ns": t + 1 * MS, "thread": "MainThread"})
            t += 1 * MS
            dec.append({"name": "decode.queue", "request_id": x, "span_id": sid(), "start_ns": t,
                        "end_ns": t + int(0.5 * MS), "thread": "EngineCore"})
            t += int(0.5 * MS)
            prep = sid()
            prep_ms = 900.0 if first_contact else rng.uniform(3, 12)
            dec.append({"name": "handoff.prep", "request_id": x, "span_id": prep, "start_ns": t,
                        "end_ns": t + int(prep_ms * MS), "thread": "EngineCore",
                        "attrs": {"kv.first_contact": int(first_contact), "peer.engine_id": "p0"}})
            if first_contact:
                dec.append({"name": "handoff.handshake", "request_id": x, "span_id": sid(), "parent_span_id": prep,
                            "start_ns": t + 1 * MS, "end_ns": t + 880 * MS, "thread": "nixl-handshake",
                            "attrs": {"peer.engine_id": "p0"}})
            connector_work.append((t + int((prep_ms - 2) * MS), t + int(prep_ms * MS), x))
            t += int(prep_ms * MS)
            if incomplete:
                dec.append({"record": "event", "name": "kv.post_failed", "request_id": x, "start_ns": t,
                            "attrs": {"lifecycle.cause": "post_failure", "error.type": "nixlBackendError"}})
                router.append({"name": "router.request", "request_id": x, "span_id": root, "start_ns": a,
                               "end_ns": t + 5_000 * MS, "status_code": 2, "status_message": "TimeoutError",
                               "attrs": r_attrs})
                router.append({"record": "event", "name": "router.leg_failed", "request_id": x, "span_id": root,
                               "start_ns": t + 5_000 * MS, "attrs": {"router.leg": "decode", "error.type": "TimeoutError"}})
                continue
            dec.append({"name": "kv.transfer", "request_id": x, "span_id": sid(), "start_ns": t,
                        "end_ns": t + int(xfer_ms * MS), "thread": "EngineCore",
                        "attrs": {"kv.op": "READ", "kv.backend": "UCX", "kv.bytes": nbytes, "kv.descriptors": ndesc,
                                  "kv.post_ns": int(post_ms * MS), "kv.xfer_ns": int(xfer_ms * MS),
                                  "kv.blocks": prompt // 16, "peer.engine_id": "p0"}})
            t += int(xfer_ms * MS)
        else:  # push: D registers while P computes; P's writer posts the WRITE
            dt = a + 2 * MS
            dec.append({"name": "decode.frontend", "request_id": x, "span_id": sid(), "start_ns": dt,
                        "end_ns": dt + 1 * MS, "thread": "MainThread"})
            dt += 1 * MS
            dec.append({"name": "decode.queue", "request_id": x, "span_id": sid(), "start_ns": dt,
                        "end_ns": dt + int(0.5 * MS), "thread": "EngineCore"})
            dt += int(0.5 * MS)
            reg_ms = (pq_ms + pc_ms + 400.0) if in_incident else rng.uniform(1, 3)
            dec.append({"name": "dest.register", "request_id": x, "span_id": sid(), "start_ns": dt,
                        "end_ns": dt + int(reg_ms * MS), "thread": "nixl-push-writer",
                        "attrs": {"kv.blocks": prompt // 16, "peer.engine_id": "p0"}})
            dec.append({"record": "event", "name": "registration.sent", "request_id": x, "start_ns": dt + MS,
                        "thread": "nixl-push-writer", "attrs": {"kv.notif_kind": "push_reg"}})
            reg_done = dt + int(reg_ms * MS)
            pre.append({"record": "event", "name": "registration.received", "request_id": x,
                        "start_ns": reg_done, "thread": "nixl-push-writer", "attrs": {"kv.notif_kind": "push_reg"}})
            t = max(kv_ready, reg_done)
            prep = sid()
            pre.append({"name": "handoff.prep", "request_id": x, "span_id": prep, "start_ns": t,
                        "end_ns": t + int(0.6 * MS), "thread": "nixl-push-writer",
                        "attrs": {"kv.first_contact": 0, "peer.engine_id": "d0"}})
            pre.append({"name": "handoff.writer_queue", "request_id": x, "span_id": sid(), "parent_span_id": prep,
                        "start_ns": t, "end_ns": t + int(0.3 * MS), "thread": "nixl-push-writer"})
            t += int(0.6 * MS)
            if incomplete:
                for rk in (0, 1, 3):
                    pre.append({"name": "kv.transfer", "request_id": x, "span_id": sid(), "start_ns": t,
                                "end_ns": t + int(xfer_ms * MS), "thread": "nixl-push-writer", "tp_rank": rk,
                                "attrs": {"kv.op": "WRITE", "kv.bytes": nbytes // 4, "kv.descriptors": ndesc // 4}})
                pre.append({"record": "event", "name": "kv.post_failed", "request_id": x, "start_ns": t,
                            "tp_rank": 2, "attrs": {"lifecycle.cause": "post_failure", "error.type": "nixlBackendError"}})
                dec.append({"record": "event", "name": "kv.ttl_expired", "request_id": x, "start_ns": t + 30_000 * MS,
                            "attrs": {"lifecycle.cause": "ttl_expired", "lifecycle.expected": 4,
                                      "lifecycle.received": 3, "kv.ranks_missing": "2"}})
                router.append({"name": "router.request", "request_id": x, "span_id": root, "start_ns": a,
                               "end_ns": t + 30_000 * MS, "status_code": 2, "status_message": "TimeoutError",
                               "attrs": r_attrs})
                continue
            pre.append({"name": "kv.transfer", "request_id": x, "span_id": sid(), "start_ns": t,
                        "end_ns": t + int(xfer_ms * MS), "thread": "nixl-push-writer",
                        "attrs": {"kv.op": "WRITE", "kv.backend": "UCX", "kv.bytes": nbytes, "kv.descriptors": ndesc,
                                  "kv.post_ns": int(post_ms * MS), "kv.xfer_ns": int(xfer_ms * MS),
                                  "kv.blocks": prompt // 16, "peer.engine_id": "d0"}})
            t += int(xfer_ms * MS)
            connector_work.append((t, t + int(1.5 * MS), x))
            router.append({"name": "router.wait", "request_id": x, "span_id": sid(), "parent_span_id": root,
                           "start_ns": a + 2 * MS, "end_ns": t, "attrs": {"router.leg": "prefill"}})
        ready_ms = rng.uniform(0.5, 3.0)
        dec.append({"name": "kv.ready", "request_id": x, "span_id": sid(), "start_ns": t,
                    "end_ns": t + int(ready_ms * MS), "thread": "EngineCore",
                    "attrs": {"kv.ranks_expected": 1, "kv.ranks_received": 1}})
        t += int(ready_ms * MS)
        fs_ms = rng.uniform(15, 30)
        dec.append({"name": "decode.first_step", "request_id": x, "span_id": sid(), "start_ns": t,
                    "end_ns": t + int(fs_ms * MS), "thread": "EngineCore"})
        t += int(fs_ms * MS)
        dec.append({"name": "decode.frontend", "request_id": x, "span_id": sid(), "start_ns": t,
                    "end_ns": t + int(0.5 * MS), "thread": "MainThread"})
        t += int(0.5 * MS)
        first = t
        tpot_ms = 20.0
        last = first + int((out_tokens - 1) * tpot_ms * MS)
        decoding.append((x, first, last))
        router.append({"record": "event", "name": "router.first_token", "request_id": x, "span_id": root,
                       "start_ns": first})
        router.append({"record": "event", "name": "router.last_token", "request_id": x, "span_id": root,
                       "start_ns": last})
        router.append({"name": "router.request", "request_id": x, "span_id": root, "start_ns": a,
                       "end_ns": last + 1 * MS, "status_code": 1,
                       "attrs": dict(r_attrs, **{"gen_ai.usage.output_tokens": out_tokens,
                                                 "http.response.status_code": 200})})
    # --- D's engine steps: 20 ms decode steps while anything decodes; connector work stretches a step ---
    if decoding:
        t_lo = min(f for _, f, _ in decoding) - 20 * MS
        t_hi = max(last for _, _, last in decoding)
        t, step = t_lo, 0
        while t < t_hi:
            batch = [x for x, f, last in decoding if f <= t < last]
            work = [(s, e, x) for s, e, x in connector_work if t <= s < t + 20 * MS]
            extra = sum(e - s for s, e, _ in work)
            end = t + 20 * MS + extra
            if batch or work:
                st = sid()
                dec.append({"name": "decode.step", "span_id": st, "start_ns": t, "end_ns": end,
                            "thread": "EngineCore",
                            "attrs": {"step.id": step, "step.num_reqs": len(batch), "step.decode_tokens": len(batch),
                                      "step.prefill_tokens": 0, "step.batch": ";".join(f"{x}:d1" for x in batch)}})
                for s, e, x in work:
                    dec.append({"name": "connector.load", "span_id": sid(), "parent_span_id": st,
                                "start_ns": t, "end_ns": t + (e - s), "thread": "EngineCore",
                                "attrs": {"vllm.method": "start_load_kv", "connector.request_ids": x}})
            t, step = end, step + 1
    t_first, t_last = start_ns, start_ns + int(n_requests * gap_ms * MS) + 40_000 * MS
    for r in router:
        r.setdefault("thread", "MainThread")
    p_skew = int(round((p_clock_ahead_ms or 0.0) * MS))
    if p_clock_ahead_ms is not None:
        for r in pre:  # P writes its own clock's readings
            r["start_ns"] += p_skew
            if "end_ns" in r:
                r["end_ns"] += p_skew
        first_d = min(r["start_ns"] for r in dec if r.get("request_id"))
        dec.append({"record": "event", "name": "clock.sample", "start_ns": first_d,
                    "thread": "vllm-nixl-handshake-initiator_0",
                    "attrs": {"clock.offset_ns": 0, "clock.rtt_bound_ns": 2 * MS, "clock.domain": "monotonic",
                              "clock.source": "nixl_handshake", "clock.peer_engine_id": "p0",
                              "peer.engine_id": "p0"}})
    write_rows(d, router + _anchors(t_first, t_last), resource=_res("router", None, 100 + seed, mode, run_id),
               name=f"router-{run_id}.parquet")
    write_rows(d, pre + _anchors(t_first, t_last, p_skew), resource=_res("prefill", "p0", 200 + seed, mode, run_id),
               name=f"prefill-{run_id}.parquet")
    write_rows(d, dec + _anchors(t_first, t_last), resource=_res("decode", "d0", 300 + seed, mode, run_id),
               name=f"decode-{run_id}.parquet")
    return d


def write_corrupt(directory: str | Path) -> list[Path]:
    """Write three files a reader must skip: an empty one, a truncated one, a foreign text file named .parquet."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    empty = d / "empty.parquet"
    empty.write_bytes(b"")
    trunc = d / "truncated.parquet"
    trunc.write_bytes(b"PAR1" + b"\x00" * 100)
    foreign = d / "foreign.parquet"
    foreign.write_text("this is not parquet\n")
    return [empty, trunc, foreign]
