"""Hand-built span stores for the analysis tests, in ms from a base instant.

A :class:`Case` collects spans and events as the real recorders would write
them (router / prefill / decode processes, one file each), with times given in
ms from ``T0`` on the *true* clock; ``clock_shift_ms`` shifts an engine's
recorded (raw) times, as a skewed host clock would.
"""
from __future__ import annotations

import itertools
from collections import defaultdict

from pdtrace.instrument import store

T0 = 1_750_000_000_000_000_000  # ns since the epoch; every case starts here
RUN = "run-test"

_ids = itertools.count(1000)


def ns(ms: float) -> int:
    """ms from T0 -> absolute ns (exact for ms with up to 6 decimals)."""
    return T0 + round(ms * 1_000_000)


class Case:
    """Rows of one store; ``write(dir)`` writes one file per (role, engine)."""

    def __init__(self, clock_shift_ms: dict[str, float] | None = None, connector: str | None = None):
        self.rows: dict[tuple, list] = defaultdict(list)
        self.shift = clock_shift_ms or {}
        self.connector = connector      # engines' resource `connector` (KV connector class), if given

    def _key(self, role, engine):
        return (role, engine)

    def _t(self, engine_or_role, ms):
        return ns(ms + self.shift.get(engine_or_role, 0.0))

    def span(self, role, name, start_ms, end_ms, rid=None, engine=None, rank=None, parent=None,
             attrs=None, attempt=0, thread=None, span_id=None, status=0):
        sid = span_id if span_id is not None else next(_ids)
        clock = engine or role
        self.rows[self._key(role, engine)].append({
            "record": "span", "name": name, "span_id": sid, "parent_span_id": parent,
            "start_ns": self._t(clock, start_ms), "end_ns": self._t(clock, end_ms),
            "request_id": rid, "attempt": attempt, "tp_rank": rank, "thread": thread,
            "status_code": status, "attrs": dict(attrs or {}),
        })
        return sid

    def event(self, role, name, at_ms, rid=None, engine=None, rank=None, attrs=None, span=None, attempt=0):
        clock = engine or role
        self.rows[self._key(role, engine)].append({
            "record": "event", "name": name, "span_id": span, "start_ns": self._t(clock, at_ms),
            "request_id": rid, "tp_rank": rank, "attempt": attempt, "attrs": dict(attrs or {}),
        })

    # -- common shapes -----------------------------------------------------------------
    def router_request(self, rid, arrival_ms, end_ms, mode, first_token_ms=None, last_token_ms=None,
                       prompt_tokens=100, output_tokens=10, cached_tokens=None, attrs=None):
        a = {"request.mode": mode, "gen_ai.usage.input_tokens": prompt_tokens,
             "gen_ai.usage.output_tokens": output_tokens}
        if cached_tokens is not None:
            a["request.num_cached_tokens"] = cached_tokens
        a.update(attrs or {})
        root = self.span("router", "router.request", arrival_ms, end_ms, rid=rid, attrs=a, thread="MainThread")
        if first_token_ms is not None:
            self.event("router", "router.first_token", first_token_ms, rid=rid, span=root)
        if last_token_ms is not None:
            self.event("router", "router.last_token", last_token_ms, rid=rid, span=root)
        return root

    def pull_requests(self, n, gap_ms=10.0, t0_ms=0.0, prefix=""):
        """n complete pull requests ``<prefix>r<i>`` arriving every ``gap_ms`` from ``t0_ms``: router root
        (TTFT 40 ms), prefill.queue and prefill.compute on p0, kv.transfer and decode.first_step on d0."""
        for i in range(n):
            t = t0_ms + gap_ms * i
            rid = f"{prefix}r{i}"
            self.router_request(rid, t, t + 60, "pull", first_token_ms=t + 40, last_token_ms=t + 58)
            self.span("prefill", "prefill.queue", t + 1, t + 5, rid=rid, engine="p0")
            self.span("prefill", "prefill.compute", t + 5, t + 20, rid=rid, engine="p0")
            self.span("decode", "kv.transfer", t + 21, t + 30, rid=rid, engine="d0", attrs={"kv.bytes": 4096})
            self.span("decode", "decode.first_step", t + 31, t + 39, rid=rid, engine="d0")
        return self

    def write(self, directory, prefix=""):
        paths = []
        for (role, engine), rows in sorted(self.rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            res = {"run_id": RUN, "role": role, "engine_id": engine, "host": "h", "pid": hash((role, engine)) % 30000,
                   "service_name": f"pdtrace-{role}"}
            if self.connector and role != "router":
                res["connector"] = self.connector
            name = f"{prefix}{role}-{engine or 'router'}.parquet"
            paths.append(store.write_rows(directory, rows, resource=res, name=name))
        return paths


def one(trace, sql, params=None):
    """The single row of ``sql`` on ``trace`` (a dict); fails the test unless exactly one row comes back."""
    rows = trace.query(sql, params)
    assert len(rows) == 1, rows
    return rows[0]


def tiles(trace, rid):
    """Assert that the request's ttft_segments tile [arrival, first token] exactly (to the ns) and that
    its categories add up to TTFT; return its ttft_breakdown row (a dict)."""
    b = one(trace, "SELECT * FROM ttft_breakdown WHERE request_id = ?", [rid])
    segs = trace.query("SELECT start_ns, end_ns, dur_ns FROM ttft_segments WHERE request_id = ? ORDER BY seq", [rid])
    assert segs[0]["start_ns"] == b["arrival_ns"] and segs[-1]["end_ns"] == b["first_token_ns"]
    for a, c in zip(segs, segs[1:]):
        assert a["end_ns"] == c["start_ns"]
    assert b["queue_ns"] + b["compute_ns"] + b["transfer_ns"] + b["coordination_ns"] == b["ttft_ns"]
    assert sum(s["dur_ns"] for s in segs) == b["ttft_ns"]
    return b
