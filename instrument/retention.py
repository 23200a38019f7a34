"""Tail-based retention in the host's sink: keep every slow, failed or marked request in full, a head-sampled
fraction of the rest, and nothing of the others (``PDTRACE_RETAIN=tail``; issue 18, item 4).

(Over 400 lines on purpose: most of it is this design and one class, :class:`TailRetention`, whose intake,
verdicts, memory bound and cross-host lists share one state -- the held groups and the decisions -- and
the accounting ``recorded = dropped + written + tail_dropped + pending`` that all of them keep.)

Why. ``PDTRACE_SAMPLE`` decides at the source, before anything is known about the request, so a sample of
a tenth keeps a tenth of the slow requests too. Here the decision waits until the request has ended, in the
sink (:mod:`pdtrace.instrument.sink`), which sees the records of every traced process of the host.

Design (single host; the cross-host part is at the end).

* **Hold.** A record that carries a ``request_id`` (spans, events, ``open`` rows of a request) is held in
  the request's *group* (records of every client of the host, with the client they came from: they are
  converted with that client's resource and clock anchor when they are written). Nothing is held on the
  traced process's side and nothing here waits on a socket: a writer is never blocked.
* **End.** A request has *ended* when its ``router.request`` span arrives (pdtrace's router: the root
  ends when the last byte was written) or, for a request no router of this host recorded, D's
  ``decode.frontend`` span (``frontend.part`` ``out`` or ``whole``: D's API server wrote its last chunk).
  It is decided :attr:`TailRetention.grace_ns` after that (2 flush intervals + 0.25 s: the other
  processes' records of the request, flushed every interval, arrive meanwhile), or when it has been
  held ``PDTRACE_TAIL_HOLD_S`` without ending (then it is **kept**: a request that never ends is a
  failure to show).
* **Rule** (:meth:`TailRetention.verdict`), in this order: kept if it *failed* (a record with error
  status, or a failure event of :data:`FAILURE_EVENTS`, the events ``analysis/sql/incomplete.sql`` reads),
  if its records overlap a *marked window*, if TTFT >= ``PDTRACE_TAIL_TTFT_MS``, if its router root has
  no ``router.first_token`` (no first token: incomplete), if TPOT >= ``PDTRACE_TAIL_TPOT_MS``, or if it is
  *head-sampled*: ``sha256("pdtrace-tail-head\\0" + request id)`` read as an integer is below
  ``PDTRACE_TAIL_HEAD · 2^256`` (the same on every host; independent of ``PDTRACE_SAMPLE``'s hash, so
  both can be used together). Otherwise it is dropped and its records counted
  (``recorder.tail_dropped`` of the process that recorded them).

  TTFT (DESIGN.md §3): ``router.first_token`` - ``router.request`` start, on the router's clock; without a
  router record, the engine-clock TTFT: D's API-server ``token`` event (its first chunk) - P's
  ``prefill.frontend`` start. TPOT: (``router.last_token`` - ``router.first_token``) / (output tokens - 1),
  the tokens from the largest ``gen_ai.usage.output_tokens`` on the request's records (the router's or
  D's ``request.finished``). All times are the records' monotonic ns: every process of a host reads the
  same ``CLOCK_MONOTONIC``, so no anchor is needed to compare them. Unknown TTFT (no router record and no
  P/D pair on this host) does not keep a request by itself.
* **After the decision** the request's id stays in a bounded table of decisions (:data:`DECISIONS`
  ids, oldest forgotten first): a record arriving later (a process flushed late) follows the decision
  (written if kept, dropped and counted if not).
* **Engine-wide records** (no ``request_id``: clock anchors, stats, connector work spans, ``open`` rows of a
  step, engine events) are always written at once. Engine **step spans** (``decode.step``,
  ``prefill.step``) are written when (a) the step *stalled*: it lasted ``PDTRACE_TAIL_STEP_MS`` or, that
  unset, more than :data:`STALL_FACTOR` x the median of its process's last :data:`STALL_WINDOW` steps of
  the same name (and every step while fewer than :data:`STALL_MIN` are known: no baseline yet). This
  baseline is coarser than ``decode_stalls``' (the median of recent steps of the same batch shape): a
  step of a small batch can stall against its own shape and still be under 2x the overall median, and
  is then not kept by this rule (set ``PDTRACE_TAIL_STEP_MS`` for a fixed threshold); or (b) it overlaps
  a marked window; or (c) a request of its batch
  (``step.batch``) is kept: held with those requests until they are decided, written with the first
  kept, dropped (and counted) when all are dropped. A kept request thus has every step it was in (its
  TPOT and stall share stay computable); a step of only unknown requests (untraced, or decided and
  forgotten) that did not stall is dropped.
* **Marked windows.** ``pdtrace mark [--seconds N] [--before S] DIR`` (:mod:`pdtrace.instrument.tailmark`)
  appends a window ``[now - S, now + N]`` (wall ns) to :data:`MARKS_FILE` in the trace directory; the
  sink re-reads the file when it changes (checked every :data:`MARK_POLL_S`); SIGUSR1 to the sink marks
  ``[now - 30 s, now + 60 s]`` the same way (written to the file too). Every request whose records overlap a
  window, and every step in it, is kept. A request already decided and dropped before the mark cannot be
  recovered: ``--before`` reaches back at most ``PDTRACE_TAIL_HOLD_S``.
* **Memory bound.** Each held record counts :func:`held_bytes` (an estimate of the tuple and the objects
  it holds, calibrated against tracemalloc by ``benchmarks/tail_retention.py``), each group
  :data:`GROUP_BYTES`. When the total exceeds ``PDTRACE_TAIL_MEMORY_MB``, the oldest undecided groups are
  decided *early* until it is under 90 % of it: kept if already failed, marked, head-sampled, over the
  TTFT threshold (its first token came late, or none yet and it is older than the threshold) or over
  the TPOT threshold; otherwise dropped and counted (``evicted``: a request that might have turned slow
  later). The decisions table adds at most :data:`DECISIONS` x ~160 bytes (~10 MiB), outside the
  bound. The bound, the peak
  and the counts are logged by the sink at start and exit and written to :func:`summary_path`.
* **Flush, sync, exit.** A client's flush tick writes what was decided; undecided records stay held (a
  client that ends leaves them held; they are written with its resource when decided). ``hostsink.sync``,
  the last client leaving, and SIGTERM decide every group at once (by the rule if ended, kept if not).

Accounting per process: ``recorded = dropped + written + tail_dropped + pending`` (held records are
pending; ``recorder.tail_dropped`` on its stats rows).

Cross-host. A request's records are on several hosts (router, P, D), one sink each. One sink can decide
only from what it holds: the router's host has TTFT and TPOT (router events) and the router's failures;
an engine host has the engine-clock TTFT only when it holds both P's and D's records, and a failure seen
there. The decisions reach the others through the trace directory (shared, e.g. NFS): every sink appends
its verdicts to ``tail-keep/<host>-<sink pid>.ids`` (:func:`keep_list_path`), one line each,
``<id> TAB 1|0 TAB R|E``: every keep, and the drops it made *with* the request's router root (``R``:
authoritative; ``E``: decided without one). Each sink reads the lines the others appended since its last
look (every :data:`MARK_POLL_S`, :meth:`TailRetention.remote_keeps`). Then:

* a request another sink kept is kept here too (reason ``remote``), whatever the local rule says;
* a sink that holds no router record of an ended request, while other sinks' lists exist, *waits* for an
  ``R`` verdict (up to ``PDTRACE_TAIL_HOLD_S`` from its first record) instead of applying its own rule,
  and follows it when it comes (kept, or dropped as ``remote_drop``, unless something local keeps it: a
  failure seen here, a mark); at the hold time it applies its own rule.

So a request is kept whole on every host when the router's host keeps it, or when any host saw a
failure (provided its line is read before the others decide: the router's host decides at its end plus
grace; a later keep from an engine host keeps the engine side only). Built and tested on one host with a
second host's list written into the directory (no second host here). Not built: rotation of the lists
(about 20 bytes per request and host), and lists in per-host directories that are not shared (they
would need copying between hosts within the hold time).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import socket
import time
from collections import OrderedDict, deque

from .recorder import R_EVENT, R_SPAN
from .schema import STATUS_ERROR

log = logging.getLogger("pdtrace")

N_FIXED = 15  # fixed slots of a record tuple (recorder.py layout; convert.N_FIXED)
_NAME, _START, _END, _STATUS, _RID = 4, 6, 7, 8, 10

#: Step spans that follow the step rule (module doc); other request-less records are written at once.
STEP_NAMES = frozenset(("decode.step", "prefill.step"))
#: Failure events (stages.EVENTS; the events analysis/sql/incomplete.sql reads as failures).
FAILURE_EVENTS = frozenset((
    "request.abort", "request.timeout", "kv.lease_expired", "kv.ttl_expired", "kv.post_failed",
    "kv.transfer_failed", "kv.load_failed", "registration.timeout", "handshake.failed", "router.leg_failed",
    "notification.unmatched"))
#: A step longer than this many times its baseline (median of recent steps) is a stall.
STALL_FACTOR = 2.0
#: Steps of one process and name in the stall baseline; below STALL_MIN known steps every step is kept.
STALL_WINDOW, STALL_MIN = 255, 16
#: Decisions remembered (request ids), oldest forgotten first.
DECISIONS = 1 << 16
#: Bytes counted per group (the group object, its lists, its dict entries).
GROUP_BYTES = 600
#: Seconds between looks at the marks file and the other hosts' keep-lists.
MARK_POLL_S = 0.5
#: The marks file in the trace directory (one JSON object a line: start_ns, end_ns wall, by).
MARKS_FILE = "tail-marks.jsonl"
#: Window of a SIGUSR1 mark: (seconds before, seconds after) the signal.
SIGNAL_WINDOW_S = (30.0, 60.0)
#: Memory shed when over the bound: down to this fraction of it.
SHED_TO = 0.9
_HEAD_SALT = b"pdtrace-tail-head\0"


def held_bytes(rec: tuple) -> int:
    """Estimated memory (bytes) a held record costs: its tuple (40 + 8 per slot), the (client, record)
    pair and its list slot (72), and about 24 bytes per slot for the objects the slots hold (ints, times,
    ids; names and keys are shared by the records of one message). ``benchmarks/tail_retention.py``
    compares it with tracemalloc (records unpickled a request and role per message: fewer shared
    objects than the sink's 32-512-record messages): the estimate is the larger."""
    return 112 + 32 * len(rec)


def head_sampled(rid: str, fraction: float) -> bool:
    """True iff request ``rid`` is in the head-sampled fraction: sha256(salt + id) < fraction · 2^256."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(_HEAD_SALT + rid.encode("utf-8", "surrogatepass")).digest(), "big")
    return h < int(fraction * (1 << 256))


def marks_path(trace_dir: str) -> str:
    """The marks file of ``trace_dir``."""
    return os.path.join(trace_dir, MARKS_FILE)


def keep_list_path(trace_dir: str, host: str, pid: int) -> str:
    """The keep-list this sink appends kept request ids to."""
    return os.path.join(trace_dir, "tail-keep", f"{host}-{pid}.ids")


def summary_path(trace_dir: str, host: str) -> str:
    """The JSON summary (bound, peak, counts) the sink of ``host`` writes at each merge and at exit."""
    return os.path.join(trace_dir, f"tail-retention-{host}.json")


def add_mark(trace_dir: str, start_wall_ns: int, end_wall_ns: int, by: str) -> None:
    """Append a marked window [start, end] (wall ns) to the marks file of ``trace_dir`` (one line, one
    ``write`` call in append mode: lines of concurrent markers do not interleave). Raises OSError."""
    line = json.dumps({"start_ns": int(start_wall_ns), "end_ns": int(end_wall_ns), "by": by}) + "\n"
    fd = os.open(marks_path(trace_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _attr(rec: tuple, key: str):
    """Value of attribute ``key`` of a record (keys then values after the fixed slots), None if absent."""
    k = (len(rec) - N_FIXED) // 2
    for i in range(N_FIXED, N_FIXED + k):
        if rec[i] == key:
            return rec[i + k]
    return None


class _Group:
    """One request's held records and what is known about it so far (monotonic ns)."""

    __slots__ = ("rid", "recs", "steps", "nbytes", "created", "ended", "root_start", "first_tok", "last_tok",
                 "eng_first", "p_start", "out_tokens", "failed", "t_min", "t_max")

    def __init__(self, rid: str, now: int) -> None:
        self.rid = rid
        self.recs: list = []  # (sink, record)
        self.steps: list = []  # held step entries [sink, record, groups pending, done]
        self.nbytes = GROUP_BYTES
        self.created = now
        self.ended = False
        self.root_start = self.first_tok = self.last_tok = self.eng_first = self.p_start = None
        self.out_tokens = 0
        self.failed = False
        self.t_min = self.t_max = None


class TailRetention:
    """The sink's tail-retention state (module doc). Not thread-safe: the sink's one thread calls it.

    ``cfg``: the sink's :class:`~pdtrace.instrument.config.Config` (``tail_*`` settings, flush interval);
    ``trace_dir``: where the marks file, the keep-lists and the summary are.
    """

    def __init__(self, cfg, trace_dir: str, host: str | None = None) -> None:
        self.dir = trace_dir
        self.host = host or socket.gethostname().replace("-", "_")
        self.ttft_ns = int(cfg.tail_ttft_ms * 1e6) or None
        self.tpot_ns = int(cfg.tail_tpot_ms * 1e6) or None
        self.head = cfg.tail_head
        self.hold_ns = int(cfg.tail_hold_s * 1e9)
        self.bound = int(cfg.tail_memory_mb * (1 << 20))
        self.step_ns = int(cfg.tail_step_ms * 1e6) or None
        self.grace_ns = int((2 * cfg.flush_interval_s + 0.25) * 1e9)
        self.groups: dict[str, _Group] = {}  # undecided, oldest first
        self.ending: deque = deque()  # (due ns, rid) of ended groups, in order of due
        self.decided: OrderedDict[str, bool] = OrderedDict()
        self.held = 0  # bytes held (estimate)
        self.peak = 0
        self.held_records = 0
        self.counts = {"kept": 0, "dropped": 0, "evicted": 0, "steps_kept": 0, "steps_dropped": 0,
                       "records_dropped": 0, "marks": 0}
        self.reasons: dict[str, int] = {}
        self._base: dict = {}  # (sink id, step name) -> (deque of durations, sorted list)
        self._marks: list[tuple[int, int]] = []  # monotonic ns windows
        self._marks_stat = None
        self._mark_keys: set[tuple[int, int]] = set()  # windows in force, as written (wall ns)
        self._next_poll = 0
        self._keep_fd = -1
        self._keep_path = keep_list_path(trace_dir, self.host, os.getpid())
        self._remote: dict[str, tuple[bool, bool]] = {}  # id -> (kept, authoritative) by other sinks
        self._remote_pos: dict[str, int] = {}
        self._waiting: set[str] = set()  # ended here without a router record: waiting for an R verdict
        self._open_list()  # at once, empty: the other sinks know this one decides too (they write drops)
        self.poll_files(force=True)

    # --------------------------------------------------------------- intake
    def admit(self, sink, recs: list) -> list:
        """Take one batch of a client's records: returns those to write now (engine-wide, or of a request
        already decided kept); holds the others; drops (and counts on ``sink.tail_dropped``) those of a
        request decided dropped and steps no kept request needs. Never raises on a malformed record (it is
        passed through: the converter counts it)."""
        out = []
        now = time.monotonic_ns()
        groups, decided = self.groups, self.decided
        for r in recs:
            try:
                rid = r[_RID]
                if rid is None:
                    if r[0] == R_SPAN and r[_NAME] in STEP_NAMES:
                        self._admit_step(sink, r, out)
                    else:
                        out.append(r)
                    continue
                d = decided.get(rid)
                if d is not None:
                    if d:
                        out.append(r)
                    else:
                        sink.tail_dropped += 1
                        self.counts["records_dropped"] += 1
                    continue
                g = groups.get(rid)
                if g is None:
                    g = groups[rid] = _Group(rid, now)
                    self.held += GROUP_BYTES
                g.recs.append((sink, r))
                b = held_bytes(r)
                g.nbytes += b
                self.held += b
                self.held_records += 1
                sink.tail_held += 1
                self._note(g, r, now)
                if self.held > self.bound:
                    self._shed(now)
            except (IndexError, TypeError, AttributeError):
                out.append(r)
        if self.held > self.peak:
            self.peak = self.held
        return out

    def _note(self, g: _Group, r: tuple, now: int) -> None:
        """Update what is known of the request from one of its records."""
        name, t0, t1, rtype = r[_NAME], r[_START], r[_END], r[0]
        if t0 is not None:
            if g.t_min is None or t0 < g.t_min:
                g.t_min = t0
            te = t1 if t1 is not None else t0
            if g.t_max is None or te > g.t_max:
                g.t_max = te
        if r[_STATUS] == STATUS_ERROR:
            g.failed = True
        if rtype == R_EVENT:
            if name == "router.first_token":
                g.first_tok = t0 if g.first_tok is None else min(g.first_tok, t0)
            elif name == "router.last_token":
                g.last_tok = t0 if g.last_tok is None else max(g.last_tok, t0)
            elif name == "token":
                g.eng_first = t0 if g.eng_first is None else min(g.eng_first, t0)
            elif name in FAILURE_EVENTS:
                g.failed = True
            if name in ("request.finished", "router.last_token"):
                n = _attr(r, "gen_ai.usage.output_tokens")
                if isinstance(n, int) and n > g.out_tokens:
                    g.out_tokens = n
        elif rtype == R_SPAN:
            if name == "router.request":
                g.root_start = t0
                n = _attr(r, "gen_ai.usage.output_tokens")
                if isinstance(n, int) and n > g.out_tokens:
                    g.out_tokens = n
                self._end(g, now)
            elif name == "prefill.frontend":
                g.p_start = t0 if g.p_start is None else min(g.p_start, t0)
            elif name == "decode.frontend" and _attr(r, "frontend.part") in ("out", "whole"):
                self._end(g, now)

    def _end(self, g: _Group, now: int) -> None:
        if not g.ended:
            g.ended = True
            self.ending.append((now + self.grace_ns, g.rid))

    def _admit_step(self, sink, r: tuple, out: list) -> None:
        t0, t1 = r[_START], r[_END]
        dur = (t1 - t0) if (t0 is not None and t1 is not None) else 0
        if self._stalled(sink, r[_NAME], dur) or self._marked(t0, t1):
            self.counts["steps_kept"] += 1
            out.append(r)
            return
        batch = _attr(r, "step.batch") or ""
        pend = []
        for part in batch.split(";"):
            if not part:
                continue
            rid = part.rpartition(":")[0]
            d = self.decided.get(rid)
            if d:
                self.counts["steps_kept"] += 1
                out.append(r)
                return
            if d is None:
                g = self.groups.get(rid)
                if g is not None:
                    pend.append(g)
        if not pend:
            sink.tail_dropped += 1
            self.counts["steps_dropped"] += 1
            self.counts["records_dropped"] += 1
            return
        entry = [sink, r, len(pend), False]
        b = held_bytes(r)
        self.held += b
        self.held_records += 1
        sink.tail_held += 1
        for g in pend:
            g.steps.append(entry)
        if self.held > self.bound:
            self._shed(time.monotonic_ns())

    def _stalled(self, sink, name: str, dur: int) -> bool:
        """Whether a step of ``dur`` ns is a stall (module doc); adds it to its process's baseline."""
        if self.step_ns is not None:
            return dur >= self.step_ns
        key = (id(sink), name)
        b = self._base.get(key)
        if b is None:
            b = self._base[key] = (deque(), [])
        win, srt = b
        n = len(srt)
        stalled = n < STALL_MIN or dur > STALL_FACTOR * srt[n // 2]
        win.append(dur)
        bisect.insort(srt, dur)
        if len(win) > STALL_WINDOW:
            old = win.popleft()
            del srt[bisect.bisect_left(srt, old)]
        return stalled

    def _marked(self, t0, t1) -> bool:
        if not self._marks or t0 is None:
            return False
        t1 = t0 if t1 is None else t1
        return any(lo <= t1 and t0 <= hi for lo, hi in self._marks)

    # -------------------------------------------------------------- verdicts
    def ttft(self, g: _Group) -> int | None:
        """The request's TTFT (ns): the router's, else the engine-clock one; None when not known."""
        if g.root_start is not None and g.first_tok is not None:
            return g.first_tok - g.root_start
        if g.eng_first is not None and g.p_start is not None:
            return g.eng_first - g.p_start
        return None

    def verdict(self, g: _Group, now: int, early: bool = False) -> tuple[bool, str]:
        """(keep, reason) for a group: the rule of the module doc. ``early``: decided before it ended
        (memory bound, or at a sync/exit): kept only if already over a threshold (or failed, marked,
        head-sampled); a group whose hold time passed unended is kept (``unended``)."""
        if g.failed:
            return True, "failed"
        if self._marked(g.t_min, g.t_max):
            return True, "marked"
        ttft = self.ttft(g)
        if self.ttft_ns is not None:
            if ttft is not None and ttft >= self.ttft_ns:
                return True, "ttft"
            if g.root_start is not None and g.first_tok is None:
                return True, "no_first_token"
            if early and ttft is None and g.t_min is not None:
                # not ended: the router's root (its start) not here yet; from the request's earliest record
                # (>= the router's receive time: an under-estimate) to its first token, or to now without one
                t = (g.first_tok if g.first_tok is not None else g.eng_first if g.eng_first is not None
                     else now) - g.t_min
                if t >= self.ttft_ns:
                    return True, "ttft"
        if self.tpot_ns is not None and g.out_tokens > 1:
            first = g.first_tok
            if first is not None and g.last_tok is not None:
                if (g.last_tok - first) / (g.out_tokens - 1) >= self.tpot_ns:
                    return True, "tpot"
        if head_sampled(g.rid, self.head):
            return True, "head"
        rv = self._remote.get(g.rid)
        if rv is not None and rv[0]:
            return True, "remote"
        if rv is not None and rv[1] and g.root_start is None:
            return False, "remote_drop"
        if not g.ended and not early:
            return True, "unended"
        return False, "fast"

    def tick(self, now: int | None = None) -> None:
        """Decide what is due: ended groups past their grace, groups held past the hold time; re-read
        the marks file and keep-lists every :data:`MARK_POLL_S`. Called by the sink's loop."""
        now = time.monotonic_ns() if now is None else now
        if now >= self._next_poll:
            self.poll_files()
        ending, groups = self.ending, self.groups
        while ending and ending[0][0] <= now:
            _, rid = ending.popleft()
            g = groups.get(rid)
            if g is not None:
                if g.root_start is None and self._remote_pos and rid not in self._remote:
                    self._waiting.add(rid)  # another host may hold its router: wait for its verdict (hold)
                    continue
                self._decide(g, *self.verdict(g, now))
        while groups:
            g = next(iter(groups.values()))
            if now - g.created < self.hold_ns:
                break
            self._decide(g, *self.verdict(g, now))

    def next_due_s(self) -> float | None:
        """Seconds until the next decision is due (None: nothing held)."""
        if not self.groups:
            return None
        now = time.monotonic_ns()
        due = next(iter(self.groups.values())).created + self.hold_ns
        if self.ending:
            due = min(due, self.ending[0][0])
        return max(0.0, (due - now) / 1e9)

    def decide_all(self) -> None:
        """Decide every held group now (sync, last client gone, SIGTERM): by the rule if ended, else early."""
        now = time.monotonic_ns()
        self.poll_files(force=True)
        for g in list(self.groups.values()):
            keep, why = self.verdict(g, now, early=not g.ended)
            if not keep and not g.ended:
                keep, why = True, "unended"  # in flight at a sync or exit: may be hung, shown
            self._decide(g, keep, why)
        self.ending.clear()

    def _shed(self, now: int) -> None:
        """Over the memory bound: decide the oldest groups early until under SHED_TO of the bound."""
        target = int(self.bound * SHED_TO)
        groups = self.groups
        while groups and self.held > target:
            g = next(iter(groups.values()))
            keep, why = self.verdict(g, now, early=True)
            self._decide(g, keep, why if keep else "evicted")

    def _decide(self, g: _Group, keep: bool, why: str) -> None:
        del self.groups[g.rid]
        self._waiting.discard(g.rid)
        self.decided[g.rid] = keep
        if len(self.decided) > DECISIONS:
            self.decided.popitem(last=False)
        self.reasons[why] = self.reasons.get(why, 0) + 1
        self.held -= g.nbytes
        by_sink: dict = {}
        for sink, r in g.recs:
            sink.tail_held -= 1
            by_sink.setdefault(sink, []).append(r)
        self.held_records -= len(g.recs)
        if keep:
            self.counts["kept"] += 1
            for sink, rs in by_sink.items():
                sink.add(rs)
            self._keep_line(g.rid, True, g.root_start is not None)
        else:
            self.counts["evicted" if why == "evicted" else "dropped"] += 1
            if g.root_start is not None and self._remote_pos:  # others wait for a router host's verdict
                self._keep_line(g.rid, False, True)
            for sink, rs in by_sink.items():
                sink.tail_dropped += len(rs)
            self.counts["records_dropped"] += len(g.recs)
        for e in g.steps:
            if e[3]:
                continue
            e[2] -= 1
            if keep or e[2] <= 0:
                e[3] = True
                sink, r = e[0], e[1]
                sink.tail_held -= 1
                self.held_records -= 1
                b = held_bytes(r)
                self.held -= b
                if keep:
                    self.counts["steps_kept"] += 1
                    sink.add([r])
                else:
                    self.counts["steps_dropped"] += 1
                    self.counts["records_dropped"] += 1
                    sink.tail_dropped += 1
        g.recs = g.steps = None

    # ------------------------------------------------------ marks, keep-lists
    def mark(self, start_wall_ns: int, end_wall_ns: int, by: str = "signal") -> None:
        """Mark a window (wall ns): appended to the marks file (for the other sinks) and in force here now."""
        try:
            add_mark(self.dir, start_wall_ns, end_wall_ns, by)
        except OSError as exc:
            log.warning("pdtrace: cannot write the marks file in %s (%s)", self.dir, exc.strerror or exc)
        self._add_window(start_wall_ns, end_wall_ns)

    def _add_window(self, start_wall_ns: int, end_wall_ns: int) -> None:
        key = (int(start_wall_ns), int(end_wall_ns))
        if key in self._mark_keys:
            return
        self._mark_keys.add(key)
        off = time.time_ns() - time.monotonic_ns()  # wall - monotonic on this host now
        self._marks.append((key[0] - off, key[1] - off))
        self.counts["marks"] += 1

    def poll_files(self, force: bool = False) -> None:
        """Re-read the marks file if it changed, and the lines other sinks added to their keep-lists."""
        self._next_poll = time.monotonic_ns() + int(MARK_POLL_S * 1e9)
        try:
            st = os.stat(marks_path(self.dir))
            key = (st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key is not None and (force or key != self._marks_stat):
            self._marks_stat = key
            try:
                with open(marks_path(self.dir)) as f:
                    for line in f:
                        try:
                            m = json.loads(line)
                            self._add_window(int(m["start_ns"]), int(m["end_ns"]))
                        except (ValueError, KeyError, TypeError):
                            continue
            except OSError:
                pass
        self.remote_keeps()

    def remote_keeps(self) -> None:
        """Read the verdicts other sinks appended to their lists since the last read (cross-host; lines
        ``id TAB 1|0 TAB R|E``, a bare ``id`` is a keep); decide at once the groups waiting for one."""
        d = os.path.join(self.dir, "tail-keep")
        try:
            names = os.listdir(d)
        except OSError:
            return
        mine = os.path.basename(self._keep_path)
        for n in names:
            if n == mine or not n.endswith(".ids"):
                continue
            p = os.path.join(d, n)
            pos = self._remote_pos.get(n, 0)
            try:
                with open(p, "rb") as f:
                    f.seek(pos)
                    data = f.read()
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1  # whole lines only
            self._remote_pos[n] = pos + cut
            for line in data[:cut].split(b"\n"):
                if not line:
                    continue
                f = line.decode("utf-8", "replace").split("\t")
                keep, auth = (len(f) < 2 or f[1] == "1"), (len(f) > 2 and f[2] == "R")
                old = self._remote.get(f[0], (False, False))
                self._remote[f[0]] = (keep or old[0], auth or old[1])  # any host's keep wins
        if self._waiting:
            now = time.monotonic_ns()
            for rid in [r for r in self._waiting if r in self._remote]:
                g = self.groups.get(rid)
                self._waiting.discard(rid)
                if g is not None:
                    self._decide(g, *self.verdict(g, now))

    def _open_list(self) -> None:
        """Create (or reopen) this sink's verdict list; not writable: the local decisions stand alone."""
        try:
            os.makedirs(os.path.dirname(self._keep_path), exist_ok=True)
            self._keep_fd = os.open(self._keep_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            self._keep_fd = -2

    def _keep_line(self, rid: str, keep: bool, authoritative: bool) -> None:
        if self._keep_fd >= 0 and "\n" not in rid and "\t" not in rid:
            try:
                os.write(self._keep_fd, rid.encode("utf-8", "surrogatepass")
                         + (b"\t1" if keep else b"\t0") + (b"\tR\n" if authoritative else b"\tE\n"))
            except OSError:
                pass

    # ---------------------------------------------------------------- report
    def summary(self) -> dict:
        """Bound, held and peak bytes (estimate), records held, counts and reasons."""
        return {"bound_bytes": self.bound, "held_bytes": self.held, "peak_bytes": self.peak,
                "held_records": self.held_records, "held_requests": len(self.groups), **self.counts,
                "reasons": dict(self.reasons), "ttft_ms": (self.ttft_ns or 0) / 1e6,
                "tpot_ms": (self.tpot_ns or 0) / 1e6, "head": self.head, "hold_s": self.hold_ns / 1e9}

    def write_summary(self) -> None:
        """Write :meth:`summary` to :func:`summary_path` (temporary name, rename). Never raises."""
        p = summary_path(self.dir, self.host)
        try:
            tmp = p + f".tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.summary(), f)
            os.replace(tmp, p)
        except OSError:
            pass

    def close(self) -> None:
        if self._keep_fd >= 0:
            os.close(self._keep_fd)
        self._keep_fd = -1
