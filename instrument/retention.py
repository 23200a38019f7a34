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
  traced process's side and nothing here waits on a socket: a writer is never blocked. A record whose
  times are not ints or whose name is not a str is written at once (the converter counts it), never held.
* **End.** A request has *ended* here when its ``router.request`` span arrives (pdtrace's router: the root
  ends when the last byte was written). A request with no router record on this host, while no client
  of this host has the role ``router``, ends with D's ``decode.frontend`` span (``frontend.part`` ``out``
  or ``whole``: D's API server wrote its last chunk), or on a host with no ``decode`` client with P's
  ``prefill.frontend`` (``out``/``whole``: P answered; all this host sees of it). A request with router
  records here ends only with its root (an engine's end does not start its grace). It is decided
  :attr:`TailRetention.grace_ns` after its end (2 flush intervals of the slowest current client + 0.25 s:
  the other processes' records of the request, flushed every interval, arrive meanwhile).
* **Overdue.** With a TTFT threshold, a request whose router records are here (so its first token will
  be too) and that is not yet being decided (its root not here) is decided early, *kept* (reason
  ``overdue``), once it is known to be over the threshold: its first token came at least
  ``PDTRACE_TAIL_TTFT_MS`` after its earliest record, or it has none
  ``PDTRACE_TAIL_TTFT_MS`` + the grace after its first record reached this sink (the grace: a first
  token within the threshold would have been flushed here by then; a router later than that -- stalled
  -- makes a request with a quick first token kept, never a slow one dropped). Checked at its first
  record + threshold + grace (again later if the grace has grown meanwhile). Its held records (its
  ``open`` rows among them) are written then and its later ones as they come, so a request stuck
  before its first token is in the ``in_flight`` view during the incident, not only when it ends. A
  host without the request's router records (an engine host of a multi-host deployment, or any host
  without pdtrace's router) cannot tell a stuck request from one whose first token is written
  elsewhere, and does not decide it early: it is shown when decided (at its end, by another host's
  verdict, or idle for the hold time: kept, ``unended``); so is every in-flight request without a TTFT
  threshold.
* **Hold time.** A request that has received no record for ``PDTRACE_TAIL_HOLD_S`` (idle), or has been
  held ``PDTRACE_TAIL_MAX_HOLD_S`` since its first record (however busy), is decided then: by the rule
  if it ended, else **kept** (``unended``: a request that never ends is a failure to show). A long
  generation that keeps producing records is thus held until it ends or reaches the absolute cap.
* **Rule** (:meth:`TailRetention.verdict`), in this order: kept if it *failed* (a record with error
  status, or an event of :data:`pdtrace.instrument.stages.FAILURE_EVENTS`, the ``is_failure`` list of
  ``analysis/sql/incomplete.sql``), if its records overlap a *marked window*, if its router root has no
  ``router.first_token`` (no first token: incomplete; with or without a TTFT threshold), if TTFT >=
  ``PDTRACE_TAIL_TTFT_MS``, if TPOT >= ``PDTRACE_TAIL_TPOT_MS``, if it is *head-sampled*:
  ``sha256("pdtrace-tail-head\\0" + request id)`` read as an integer is below
  ``ids.sample_threshold(PDTRACE_TAIL_HEAD)`` (exactly ``PDTRACE_TAIL_HEAD · 2^256`` for the float given;
  the same on every host; independent of ``PDTRACE_SAMPLE``'s hash, so both can be used together), or if
  another host's sink kept it (``remote``); dropped (``remote_drop``) if another host decided it with the
  router root and dropped it while no root is here; otherwise dropped (``fast``) and its records counted
  (``recorder.tail_dropped`` of the process that recorded them).

  TTFT (DESIGN.md §3): ``router.first_token`` - ``router.request`` start, on the router's clock; without a
  router record, the engine-clock TTFT: D's API-server ``token`` event (its first token chunk: a ``token`` event
  with a span id from a client whose resource role is ``decode``, the one ``request_base.sql`` reads;
  not P's ``token``, written when P answers the router, nor EngineCore's, which has no span id) - P's
  ``prefill.frontend`` start. TPOT: (``router.last_token`` - ``router.first_token``) / (output tokens -
  1), the tokens from the largest ``gen_ai.usage.output_tokens`` on the request's records (the router's or
  D's ``request.finished``). All times are the records' monotonic ns: every process of a host reads the
  same ``CLOCK_MONOTONIC``, so no anchor is needed to compare them. Without either (no router record, P
  and D on different hosts: a router other than pdtrace's), a host keeps a request (reason ``ttft_side``)
  when its own side alone is over the threshold -- a lower bound of the engine-clock TTFT: on P's host,
  P's API server receiving it (``prefill.frontend`` start) to the end of P's last ``prefill.compute``
  (D's first token needs that KV); on D's host, D's API server receiving it (``decode.frontend`` start,
  part ``in`` or ``whole``, or none recorded) to its first chunk (under push, D's leg can be sent a few
  ms before P's: a request that close under the threshold may be kept). Its keep line makes the other side kept too when
  read before that host decides (it waits for a verdict while another host's sink is live, up to the
  hold time). A request over the threshold whose two sides are each under it is not kept this way.
* **After the decision** the request's id stays in a table of decisions for :attr:`TailRetention.keep_ns`
  (hold time + grace) after its last use (a record following it renews it; capped at max(16 MiB,
  bound / 4) estimated bytes, :data:`DECISION_BYTES` + the id's length each, oldest forgotten first;
  outside the bound, reported as ``decisions_bytes`` in the summary): a record arriving later (a process
  flushed late, a long request evicted under the bound) follows the decision (written if kept, dropped
  and counted if not).
* **Engine-wide records** (no ``request_id``: clock anchors, stats, connector work spans, ``open`` rows of a
  step, engine events) are always written at once. Engine **step spans** (``decode.step``,
  ``prefill.step``) are written when (a) the step *stalled*: it lasted ``PDTRACE_TAIL_STEP_MS`` or, that
  unset, more than :data:`STALL_FACTOR` x the median of its process's last :data:`STALL_WINDOW` steps of
  the same name (and every step while fewer than :data:`STALL_MIN` are known: no baseline yet). This
  baseline is coarser than ``decode_stalls``' (the median of recent steps of the same batch shape): a
  step of a small batch can stall against its own shape and still be under 2x the overall median, and
  is then not kept by this rule (set ``PDTRACE_TAIL_STEP_MS`` for a fixed threshold); or (b) it overlaps
  a marked window; or (c) a request of its batch (``step.batch``) is kept: held with those requests
  until they are decided, written with the first kept, dropped (and counted) when all are dropped. A
  kept request thus has every step it was in (its TPOT and stall share stay computable); a step of only
  unknown requests (untraced, or decided and forgotten) that did not stall is dropped.
* **Marked windows.** ``pdtrace mark [--seconds N] [--before S] DIR`` (:mod:`pdtrace.instrument.tailmark`)
  appends a window ``[now - S, now + N]`` (wall ns) to :data:`MARKS_FILE` in the trace directory; the
  sink reads the lines appended since its last look every :data:`MARK_POLL_S` (a line that is not a mark
  -- not JSON, a bound not an integer in [0, 2^63), start > end -- is skipped and counted,
  ``bad_marks``); SIGUSR1 to the sink marks ``[now - 30 s, now + 60 s]`` the same way (written to the
  file too). Every request whose records overlap a window, and every step in it, is kept. A request
  already decided and dropped before the mark cannot be recovered: ``--before`` reaches back only over
  the requests still held -- those not ended (up to ``PDTRACE_TAIL_HOLD_S`` idle) and, for ended ones,
  about the grace after their end. A window is forgotten once it ended before every held record and
  more than ``keep_ns`` ago.
* **Memory bound.** Each held record counts :func:`held_bytes` (an estimate of the tuple, the objects it
  holds and its long strings, calibrated against tracemalloc by ``benchmarks/tail_retention.py``), each
  held step its entry and 8 bytes per request that refers to it, each group :data:`GROUP_BYTES`. When
  the total exceeds ``PDTRACE_TAIL_MEMORY_MB``, the least recently fed undecided groups are decided
  *early* until it is under 90 % of it: kept if already failed, marked, head-sampled, over the TTFT
  threshold (its first token came late, or none yet and it is older than the threshold) or over the TPOT
  threshold; otherwise dropped and counted (``evicted``: a request that might have turned slow later).
  Each host sheds on its own: under a burst one host can evict a request that another keeps (the
  request is then in the store in part). The decisions table and the other hosts' verdicts are outside
  the bound (each capped, above). The bound, the peak and the counts are logged by the sink at start and
  exit and written to :func:`summary_path`.
* **Flush, sync, exit.** A client's flush tick writes what was decided; undecided records stay held (a
  client that ends leaves them held; they are written or counted with its resource when decided, and
  its stats row is written again only then: when it has records to write or its ``tail_dropped``
  changed; its OTLP export stays open until then). ``hostsink.sync``, the last client leaving, and
  SIGTERM decide every group at once (by the rule if ended, kept if not). A flush therefore no longer
  means the records are in the store: held ones are written at their decision.
* **What is lost, and not seen.** Held records live only in the sink's memory: a sink that is killed
  (SIGKILL, OOM) loses every held record (up to the hold time's worth, at most the bound) and counts them
  nowhere (the recorder counted them as sent; pending on its stats). A request's ``open`` rows are held
  with it, so an in-flight request is not in the ``in_flight`` view until it is decided (kept): on the
  router's host, at its first record + TTFT threshold + grace when it has no first token by then or its
  first token came late (``overdue``); otherwise at its end, another host's verdict or the hold time.

Accounting per process: ``recorded = dropped + written + tail_dropped + pending`` (held records are
pending; ``recorder.tail_dropped`` on its stats rows).

Cross-host. A request's records are on several hosts (router, P, D), one sink each. One sink can decide
only from what it holds: the router's host has TTFT and TPOT (router events) and the router's failures;
an engine host has the engine-clock TTFT only when it holds both P's and D's records, and a failure seen
there. The decisions reach the others through the trace directory (shared, e.g. NFS): every sink appends
its verdicts to ``tail-keep/<host>-<sink pid>.ids`` (:func:`keep_list_path`), one line each,
``<id> TAB 1|0 TAB R|E``: every keep, and -- while another host's sink is live -- the drops it made
*with* the request's router root (``R``: authoritative; ``E``: decided without one). Each sink touches
its list every :data:`HEARTBEAT_S`; a list not modified for :data:`LIVE_S` (its mtime against this
host's wall clock) is not a live sink's. Each sink reads the lines the other hosts' sinks appended
since its last look (every :data:`MARK_POLL_S`, :meth:`TailRetention.remote_keeps`): not its own, nor
those of earlier sinks of its own host (``<host>-<other pid>.ids``), and the lists present when it
started only from their end then. A verdict read is remembered for ``keep_ns`` (capped like the
decisions). Then:

* a request another sink kept is kept here too (reason ``remote``), whatever the local rule says; a
  held request is decided at once when a keep, or an ``R`` drop while no root is here, is read;
* a sink that holds no router record of an ended request, while another host's sink is live, keeps it
  at once when its own rule keeps it (a failure seen here, a mark, a TTFT -- or one side's bound -- over
  the threshold computed here, the head sample: nothing read later could drop it), and its keep line goes
  out then -- a D side over the threshold as soon as its first chunk is here, not at its end, which a long
  generation would put after the other host's hold time; otherwise it *waits* for a verdict (until the
  request has been idle ``PDTRACE_TAIL_HOLD_S``: its end is its last record, as a rule) and follows it
  when it comes (kept, or dropped as ``remote_drop`` on an ``R`` drop); at the hold time it applies its
  own rule.

So a request is kept whole on every host when the router's host keeps it, or when any host saw a
failure (provided its line is read before the others decide: the router's host decides at its end plus
grace; a later keep from an engine host keeps the engine side only). Tail retention across hosts needs
pdtrace's router (traced): without one, no sink writes an authoritative verdict; each engine host then
decides by its own rule -- with P and D on different hosts neither has the engine-clock TTFT, so each
keeps a request whose own side is over the threshold (``ttft_side``) and the other follows its keep line,
a failure seen on either side, a mark and the head sample; a request whose sides are each under the
threshold, however slow in sum, is dropped on both (at the hold time). Built and tested on one host with
a second host's list written into the directory (no second host here). A list is rotated every
:data:`KEEP_LIST_BYTES` (a line is the id plus 5 bytes, per request and host: ids of vLLM's form are
40-100+ characters) and a segment is deleted by its host's sink (this one or a later one) once
unmodified for keep_ns + :data:`LIVE_S` (no live reader needs it then), and by any sink once every
segment of that sink process has been unmodified for :data:`FOREIGN_LIST_S` too (a host that never runs
a sink again: a pod's or container's host name); a sink whose current segment was deleted continues in
the next one. The next segment is created when the current one is half full, so that readers whose
directory listing is cached (NFS) see it before lines go to it. Not built: lists in per-host directories
that are not shared (they would need copying between hosts within the hold time).
"""
from __future__ import annotations

import bisect
import errno
import hashlib
import heapq
import json
import logging
import os
import socket
import time
from collections import OrderedDict, deque

from .ids import sample_threshold
from .recorder import R_EVENT, R_SPAN
from .schema import STATUS_ERROR
from .stages import FAILURE_EVENTS

log = logging.getLogger("pdtrace")

N_FIXED = 15  # fixed slots of a record tuple (recorder.py layout; convert.N_FIXED)
_SID, _NAME, _START, _END, _STATUS, _RID = 2, 4, 6, 7, 8, 10

#: Step spans that follow the step rule (module doc); other request-less records are written at once.
STEP_NAMES = frozenset(("decode.step", "prefill.step"))
#: A step longer than this many times its baseline (median of recent steps) is a stall.
STALL_FACTOR = 2.0
#: Steps of one process and name in the stall baseline; below STALL_MIN known steps every step is kept.
STALL_WINDOW, STALL_MIN = 255, 16
#: Bytes counted per decision remembered (OrderedDict entry, (keep, time) tuple, the id's str object
#: without its characters: CPython 3.10-3.12, 64-bit); the id's length is added.
DECISION_BYTES = 200
#: Cap of the decisions table and of the other sinks' verdicts (bytes, each): max(this, bound / 4).
DECISIONS_MIN_CAP = 16 << 20
#: Bytes counted per group (the group object, its lists, its dict entries; 600 measured with 18 slots, + 8
#: for each of the 2 slots added since).
GROUP_BYTES = 616
#: Bytes a held step entry costs besides its record: the [sink, record, pending, done, bytes] list (88);
#: plus 8 per group that refers to it (a slot in the group's step list).
STEP_ENTRY_BYTES, STEP_REF_BYTES = 88, 8
#: Strings longer than this are counted with their characters in held_bytes (shorter ones -- names,
#: keys, ids -- are mostly shared by the records of one message).
LONG_STR = 64
#: Seconds between looks at the marks file and the other hosts' keep-lists.
MARK_POLL_S = 0.5
#: Seconds between touches of this sink's own list (its heartbeat: the others see it live).
HEARTBEAT_S = 2.0
#: A list not modified for this long (s, the file's mtime against this host's wall clock) is not a live
#: sink's: its host does not count as one to wait for.
LIVE_S = 15.0
#: A sink's verdict list is rotated (a new segment, ``keep_list_path``) once its segment holds this many
#: bytes; a segment it no longer writes is deleted once unmodified for keep_ns + LIVE_S (every live reader
#: has read it: they read every MARK_POLL_S, and a verdict older than keep_ns is forgotten anyway), and so are
#: the segments of another sink process of this host name once none of them has been modified that long (it
#: is gone: a live sink touches its current segment every HEARTBEAT_S; two live sinks can share a host name,
#: e.g. two users' sinks on one host, or containers with one host name, and neither deletes the other's).
#: At ~60 bytes a verdict, 16 MiB is ~280,000 verdicts: a few minutes of a busy host.
KEEP_LIST_BYTES = 16 << 20
#: Seconds after which any sink deletes the segments of another host's sink process none of whose segments
#: has been modified for that long (nor for keep_ns + LIVE_S): it is gone (a live sink touches its current
#: segment every HEARTBEAT_S), e.g. a pod's host name that never returns. An hour leaves room for clocks
#: that disagree (mtimes are the file server's, compared with this host's clock) and a sink stalled for
#: minutes, which continues in a new segment when it finds its current one deleted (:meth:`poll_files`).
FOREIGN_LIST_S = 3600.0
#: Seconds between prunings of the marked windows and the stall baselines of gone clients.
PRUNE_S = 10.0
#: The marks file in the trace directory (one JSON object a line: start_ns, end_ns wall, by).
MARKS_FILE = "tail-marks.jsonl"
#: Window of a SIGUSR1 mark: (seconds before, seconds after) the signal.
SIGNAL_WINDOW_S = (30.0, 60.0)
#: Memory shed when over the bound: down to this fraction of it.
SHED_TO = 0.9
_HEAD_SALT = b"pdtrace-tail-head\0"
_MAX_NS = 1 << 63  # a mark's bounds: non-negative int64 wall ns


def held_bytes(rec: tuple) -> int:
    """Estimated memory (bytes) a held record costs: its tuple (40 + 8 per slot), the (client, record)
    pair and its list slot (72), about 24 bytes per slot for the objects the slots hold (ints, times,
    ids; names and keys are shared by the records of one message), and the characters (+ 49 bytes of
    str header) of the status message and each attribute value that is a string longer than
    :data:`LONG_STR` (a step's ``step.batch``: one id per request of the batch). IndexError for a
    tuple shorter than 10 slots. ``benchmarks/tail_retention.py`` compares it with tracemalloc."""
    ln = len(rec)
    n = 112 + 32 * ln
    m = rec[9]  # the status message
    if type(m) is str and len(m) > LONG_STR:
        n += 49 + len(m)
    if ln > N_FIXED:  # the attribute values (the keys are shared names)
        for x in rec[N_FIXED + (ln - N_FIXED) // 2:]:
            if type(x) is str and len(x) > LONG_STR:
                n += 49 + len(x)
    return n


def head_hash(rid: str) -> int:
    """sha256(salt + request id) as a big-endian integer (the head-sampling draw, 0 <= h < 2^256)."""
    return int.from_bytes(hashlib.sha256(_HEAD_SALT + rid.encode("utf-8", "surrogatepass")).digest(), "big")


def head_sampled(rid: str, fraction: float) -> bool:
    """True iff request ``rid`` is in the head-sampled fraction: :func:`head_hash` < ``fraction`` · 2^256,
    the bound exact for the float given (:func:`pdtrace.instrument.ids.sample_threshold`; ValueError
    outside [0, 1])."""
    return head_hash(rid) < sample_threshold(fraction)


def marks_path(trace_dir: str) -> str:
    """The marks file of ``trace_dir``."""
    return os.path.join(trace_dir, MARKS_FILE)


def keep_list_path(trace_dir: str, host: str, pid: int, seq: int = 0) -> str:
    """Segment ``seq`` of the verdict list the sink of ``host`` (process ``pid``) appends to: ``<host>-<pid>.ids``,
    then ``<host>-<pid>.<seq>.ids`` after each rotation (:data:`KEEP_LIST_BYTES`)."""
    return os.path.join(trace_dir, "tail-keep", f"{host}-{pid}.ids" if seq == 0 else f"{host}-{pid}.{seq}.ids")


def summary_path(trace_dir: str, host: str) -> str:
    """The JSON summary (bound, peak, counts) the sink of ``host`` writes at each merge and at exit."""
    return os.path.join(trace_dir, f"tail-retention-{host}.json")


def add_mark(trace_dir: str, start_wall_ns: int, end_wall_ns: int, by: str) -> None:
    """Append a marked window [start, end] (wall ns) to the marks file of ``trace_dir`` (one line, one
    ``write`` call in append mode: on a local file system the lines of concurrent markers do not
    interleave; over NFS, O_APPEND is not atomic between hosts and two markers writing at the same
    moment can garble a line -- the sinks skip a line they cannot read). Raises OSError."""
    line = json.dumps({"start_ns": int(start_wall_ns), "end_ns": int(end_wall_ns), "by": by}) + "\n"
    fd = os.open(marks_path(trace_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def parse_mark(line: bytes) -> tuple[int, int] | None:
    """(start, end) wall ns of one line of the marks file; None for a line that is not a mark: not
    UTF-8 JSON, no integer ``start_ns``/``end_ns`` (a float only when it is integral and finite), a
    bound outside [0, 2^63), or start > end. Never raises."""
    try:
        m = json.loads(line.decode("utf-8", "replace"))
        out = []
        for k in ("start_ns", "end_ns"):
            v = m[k]
            if type(v) is float and v.is_integer():
                v = int(v)
            if type(v) is not int or not 0 <= v < _MAX_NS:
                return None
            out.append(v)
        return (out[0], out[1]) if out[0] <= out[1] else None
    except Exception:  # noqa: BLE001 - any malformed line (not JSON, not an object, ...) is skipped
        return None


def _attr(rec: tuple, key: str):
    """Value of attribute ``key`` of a record (keys then values after the fixed slots), None if absent."""
    k = (len(rec) - N_FIXED) // 2
    for i in range(N_FIXED, N_FIXED + k):
        if rec[i] == key:
            return rec[i + k]
    return None


def _role(sink) -> str | None:
    res = getattr(sink, "resource", None)
    return res.get("role") if isinstance(res, dict) else None


class _Group:
    """One request's held records and what is known about it so far (monotonic ns)."""

    __slots__ = ("rid", "recs", "steps", "nbytes", "created", "last", "ended", "closing", "routed", "root_start",
                 "first_tok", "last_tok", "eng_first", "p_start", "p_comp_end", "d_start", "out_tokens", "failed",
                 "t_min", "t_max")

    def __init__(self, rid: str, now: int) -> None:
        self.rid = rid
        self.recs: list = []  # (sink, record)
        self.steps: list = []  # held step entries [sink, record, groups pending, done, bytes]
        self.nbytes = GROUP_BYTES
        self.created = self.last = now  # first and latest record received (sink's monotonic ns)
        self.ended = False
        self.closing = False  # it has ended for the rule: its decision is due after the grace (TailRetention.ending)
        self.routed = False  # a router.* record of it is here: only its router.request ends it
        self.root_start = self.first_tok = self.last_tok = self.eng_first = self.p_start = None
        self.p_comp_end = self.d_start = None  # P's last prefill.compute end, D's API server's receipt
        self.out_tokens = 0
        self.failed = False
        self.t_min = self.t_max = None

    def first_token(self) -> int | None:
        """The first token's time known here (monotonic ns): the router's, else D's API server's; None."""
        return self.first_tok if self.first_tok is not None else self.eng_first


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
        self._head_thr = sample_threshold(min(1.0, max(0.0, cfg.tail_head)))
        self.hold_ns = int(cfg.tail_hold_s * 1e9)
        self.max_hold_ns = max(self.hold_ns, int(getattr(cfg, "tail_max_hold_s", 600.0) * 1e9))
        self.bound = int(cfg.tail_memory_mb * (1 << 20))
        self.step_ns = int(cfg.tail_step_ms * 1e6) or None
        self._own_flush = cfg.flush_interval_s
        self._clients: dict = {}  # sink -> its flush interval (s): the clients whose records are here
        self._max_flush = cfg.flush_interval_s
        self.groups: dict[str, _Group] = {}  # undecided, least recently fed first
        self.ending: list = []  # heap of (due ns, rid) of ended groups
        self._capq: deque = deque()  # (created + max hold, rid, created), oldest first: the absolute cap
        self._dueq: list = []  # heap of (created + TTFT threshold + grace, rid, created): the overdue check
        self.decided: OrderedDict[str, tuple[bool, int]] = OrderedDict()  # id -> (kept, last used ns)
        self.decided_bytes = 0
        self._cap_bytes = max(DECISIONS_MIN_CAP, self.bound // 4)
        self.held = 0  # bytes held (estimate)
        self.peak = 0
        self.held_records = 0
        self.counts = {"kept": 0, "dropped": 0, "evicted": 0, "steps_kept": 0, "steps_dropped": 0,
                       "records_dropped": 0, "marks": 0, "bad_marks": 0, "decisions_forgotten": 0,
                       "lists_pruned": 0, "lists_reopened": 0}
        self.reasons: dict[str, int] = {}
        self._base: dict = {}  # (sink, step name) -> (deque of durations, sorted list)
        self._marks: dict[tuple[int, int], tuple[int, int]] = {}  # wall-ns key -> monotonic ns window
        self._marks_off = 0  # bytes of the marks file read
        self._marks_ino = None
        self._next_poll = self._next_prune = self._next_beat = 0
        self._keep_fd = -1
        self._keep_seq = 0
        self._keep_bytes = 0  # bytes in the current segment
        self._next_created = False  # the next segment exists already (created at half of KEEP_LIST_BYTES)
        self._keep_path = keep_list_path(trace_dir, self.host, os.getpid())
        self._remote: OrderedDict[str, tuple[bool, bool, int]] = OrderedDict()  # id -> (kept, R, read ns)
        self._remote_bytes = 0
        self._remote_pos: dict[str, int] = {}
        self._live: dict[str, float] = {}  # other sinks' lists -> mtime (wall s) at the last look
        self._waiting: set[str] = set()  # ended here without a router record: waiting for an R verdict
        self._open_list()  # at once, empty: the other sinks know this one decides too (they write drops)
        self._starting = True
        self._poll_safe(force=True)  # existing lists: from their end (verdicts of requests gone by)
        self._starting = False

    # ------------------------------------------------------------- settings
    @property
    def grace_ns(self) -> int:
        """ns an ended request is held before its decision: 2 flush intervals of the slowest current
        client (the sink's own interval without clients) + 0.25 s."""
        return int((2 * self._max_flush + 0.25) * 1e9)

    @property
    def keep_ns(self) -> int:
        """How long a decision and another sink's verdict are remembered after their last use."""
        return self.hold_ns + self.grace_ns

    def add_client(self, sink) -> None:
        """A client connected (or sent records): its flush interval counts in the grace, its role (its
        resource's, read when needed) in which records end a request here."""
        fl = getattr(getattr(sink, "cfg", None), "flush_interval_s", self._own_flush)
        self._clients[sink] = fl
        if fl > self._max_flush:
            self._max_flush = fl

    def forget(self, sink) -> None:
        """A client has gone for good (no record of it held): drop its stall baselines and flush interval."""
        self._clients.pop(sink, None)
        self._max_flush = max(self._clients.values(), default=self._own_flush)
        for k in [k for k in self._base if k[0] is sink]:
            del self._base[k]

    def _has_role(self, role: str) -> bool:
        return any(_role(s) == role for s in self._clients)

    # --------------------------------------------------------------- intake
    def admit(self, sink, recs: list) -> list:
        """Take one batch of a client's records: returns those to write now (engine-wide, or of a request
        already decided kept); holds the others; drops (and counts on ``sink.tail_dropped``) those of a
        request decided dropped and steps no kept request needs. A malformed record (times not int, name
        not str, no request id slot) is passed through (the converter counts it), never held: each record is
        either returned or held or counted, never two of them. Never raises."""
        out = []
        now = time.monotonic_ns()
        if sink not in self._clients:
            self.add_client(sink)
        groups, decided = self.groups, self.decided
        for r in recs:
            try:
                rid = r[_RID]
                t0, t1, name = r[_START], r[_END], r[_NAME]
                if (type(t0) is not int and t0 is not None) or (type(t1) is not int and t1 is not None) \
                        or type(name) is not str:
                    out.append(r)
                    continue
                if rid is None:
                    if r[0] == R_SPAN and name in STEP_NAMES:
                        self._admit_step(sink, r, out)
                    else:
                        out.append(r)
                    continue
                if type(rid) is not str:
                    out.append(r)
                    continue
                d = decided.get(rid)
                if d is not None:
                    decided[rid] = (d[0], now)  # in use: remembered from now on
                    decided.move_to_end(rid)
                    if d[0]:
                        out.append(r)
                    else:
                        sink.tail_dropped += 1
                        self.counts["records_dropped"] += 1
                    continue
                g = groups.get(rid)
                new = g is None
                if new:
                    g = _Group(rid, now)
                self._note(g, r, sink, now)  # before it is held: a failure here leaves it passed through
                b = held_bytes(r)
                g.recs.append((sink, r))
                if new:
                    groups[rid] = g
                    self.held += GROUP_BYTES
                    self._capq.append((now + self.max_hold_ns, rid, now))
                elif g.last != now:  # fed now: to the end of the idle order
                    del groups[rid]
                    groups[rid] = g
                g.last = now
                g.nbytes += b
                self.held += b
                self.held_records += 1
                sink.tail_held += 1
                if self.held > self.bound:
                    self._shed(now)
            except Exception:  # noqa: BLE001 - a malformed record is written (and counted there), not held
                out.append(r)
        if self.held > self.peak:
            self.peak = self.held
        return out

    def _note(self, g: _Group, r: tuple, sink, now: int) -> None:
        """Update what is known of the request from one of its records (times already checked int/None)."""
        name, t0, t1, rtype = r[_NAME], r[_START], r[_END], r[0]
        if t0 is not None:
            if g.t_min is None or t0 < g.t_min:
                g.t_min = t0
            te = t1 if t1 is not None else t0
            if g.t_max is None or te > g.t_max:
                g.t_max = te
        if r[_STATUS] == STATUS_ERROR:
            g.failed = True
        if not g.routed and name.startswith("router."):
            g.routed = True
            if g.root_start is None:
                g.closing = False  # an engine's end no longer ends it: only its root does (module doc)
            if self.ttft_ns is not None:  # its first token will be here: the overdue check (module doc)
                heapq.heappush(self._dueq, (g.created + self.ttft_ns + self.grace_ns, g.rid, g.created))
        if rtype == R_EVENT:
            if t0 is None:
                pass
            elif name == "router.first_token":
                g.first_tok = t0 if g.first_tok is None else min(g.first_tok, t0)
            elif name == "router.last_token":
                g.last_tok = t0 if g.last_tok is None else max(g.last_tok, t0)
            elif name == "token" and r[_SID] is not None and _role(sink) == "decode":
                # D's API server's first token chunk (on its decode.frontend span), as request_base.sql reads it;
                # not P's (its answer to the router) nor EngineCore's (no span id)
                g.eng_first = t0 if g.eng_first is None else min(g.eng_first, t0)
                self._side_due(g, now)
            if name in FAILURE_EVENTS:
                g.failed = True
            if name in ("request.finished", "router.last_token"):
                n = _attr(r, "gen_ai.usage.output_tokens")
                if type(n) is int and n > g.out_tokens:
                    g.out_tokens = n
        elif rtype == R_SPAN:
            if name == "router.request":
                if t0 is not None:
                    g.root_start = t0
                n = _attr(r, "gen_ai.usage.output_tokens")
                if type(n) is int and n > g.out_tokens:
                    g.out_tokens = n
                self._end(g, now, True)  # the root: the grace counts from it, whatever ended it before
            elif name == "prefill.frontend":
                if t0 is not None:
                    g.p_start = t0 if g.p_start is None else min(g.p_start, t0)
                if _attr(r, "frontend.part") in ("out", "whole") and not self._has_role("decode"):
                    self._end(g, now)  # P answered: all this host (no D here) will see of it
            elif name == "decode.frontend":
                part = _attr(r, "frontend.part")
                if t0 is not None and part in (None, "in", "whole") and _role(sink) == "decode":
                    g.d_start = t0 if g.d_start is None else min(g.d_start, t0)
                    self._side_due(g, now)
                if part in ("out", "whole"):
                    self._end(g, now)
            elif name == "prefill.compute" and t1 is not None and _role(sink) == "prefill":
                g.p_comp_end = t1 if g.p_comp_end is None else max(g.p_comp_end, t1)

    def _side_due(self, g: _Group, now: int) -> None:
        """D's side of a request with no router record here is known over the TTFT threshold: decide it
        (kept, ``ttft_side``) at the next tick, not at its end, which a long generation puts after the
        other host's hold time (its keep line would come too late there)."""
        if self.ttft_ns is not None and not g.routed and not g.closing:
            d = self._d_side(g)
            if d is not None and d >= self.ttft_ns:
                heapq.heappush(self._dueq, (now, g.rid, g.created))

    def _end(self, g: _Group, now: int, root: bool = False) -> None:
        """The request ended here (its root, or an engine's frontend). Its decision is due after the
        grace -- unless this is an engine's end while a router of this host has its records or runs
        (only its root ends the request then; the hold time otherwise)."""
        if root or not g.ended:
            g.ended = True
            if root or not (g.routed or self._has_role("router")):
                g.closing = True
                heapq.heappush(self.ending, (now + self.grace_ns, g.rid))

    def _admit_step(self, sink, r: tuple, out: list) -> None:
        t0, t1 = r[_START], r[_END]
        dur = (t1 - t0) if (t0 is not None and t1 is not None) else 0
        if self._stalled(sink, r[_NAME], dur) or self._marked(t0, t1):
            self.counts["steps_kept"] += 1
            out.append(r)
            return
        batch = _attr(r, "step.batch")
        pend = []
        for part in (batch.split(";") if type(batch) is str else ()):
            if not part:
                continue
            rid = part.rpartition(":")[0]
            d = self.decided.get(rid)
            if d is not None and d[0]:
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
        b = held_bytes(r) + STEP_ENTRY_BYTES + STEP_REF_BYTES * len(pend)
        entry = [sink, r, len(pend), False, b]
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
        key = (sink, name)
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
        return any(lo <= t1 and t0 <= hi for lo, hi in self._marks.values())

    # -------------------------------------------------------------- verdicts
    def ttft(self, g: _Group) -> int | None:
        """The request's TTFT (ns): the router's, else the engine-clock one; None when not known."""
        if g.root_start is not None and g.first_tok is not None:
            return g.first_tok - g.root_start
        if g.eng_first is not None and g.p_start is not None:
            return g.eng_first - g.p_start
        return None

    def ttft_side(self, g: _Group) -> int | None:
        """A lower bound of the engine-clock TTFT (ns) from one side seen here (module doc, TTFT): P's
        frontend start to P's last prefill.compute end, or D's frontend start to D's first chunk, the
        larger of those known; None when neither is."""
        p = g.p_comp_end - g.p_start if g.p_comp_end is not None and g.p_start is not None else None
        d = self._d_side(g)
        return d if p is None else p if d is None else max(p, d)

    @staticmethod
    def _d_side(g: _Group) -> int | None:
        """D's side (ns): its API server's receipt to its first chunk; None until both are here."""
        return g.eng_first - g.d_start if g.eng_first is not None and g.d_start is not None else None

    def overdue(self, g: _Group, now: int) -> bool | None:
        """Whether a request in flight whose router records are here is known to be over the TTFT
        threshold (module doc, "Overdue"): True, False (its first token came within it), None (no first
        token yet, not over threshold + grace yet). TTFT: from its earliest record (>= the router's
        receive time: an under-estimate) to its first token (the router's, else D's API server's). Without
        a first token, the age counts from the first record's arrival here (``created``, after the request
        began: an under-estimate too), not from its time, so that records stamped before they reach the
        sink (a late client, a back-dated replay) do not make a request look old."""
        ft = g.first_token()
        if ft is not None:
            return ft - (g.t_min if g.t_min is not None else g.created) >= self.ttft_ns
        return True if now - g.created >= self.ttft_ns + self.grace_ns else None

    def verdict(self, g: _Group, now: int, early: bool = False) -> tuple[bool, str]:
        """(keep, reason) for a group: the rule of the module doc. ``early``: decided before it ended
        (memory bound, or at a sync/exit): kept only if already over a threshold (or failed, marked,
        head-sampled); a group whose hold time passed unended is kept (``unended``)."""
        if g.failed:
            return True, "failed"
        if self._marked(g.t_min, g.t_max):
            return True, "marked"
        if g.root_start is not None and g.first_tok is None:
            return True, "no_first_token"
        ttft = self.ttft(g)
        if self.ttft_ns is not None:
            if ttft is not None and ttft >= self.ttft_ns:
                return True, "ttft"
            if early and ttft is None and g.t_min is not None:
                # not ended: the router's root (its start) not here yet; from the request's earliest record
                # (>= the router's receive time: an under-estimate) to its first token, or to now without one
                ft = g.first_token()
                t = (ft if ft is not None else now) - g.t_min
                if t >= self.ttft_ns:
                    return True, "ttft"
            if ttft is None:
                side = self.ttft_side(g)
                if side is not None and side >= self.ttft_ns:
                    return True, "ttft_side"
        if self.tpot_ns is not None and g.out_tokens > 1:
            first = g.first_tok
            if first is not None and g.last_tok is not None:
                if (g.last_tok - first) / (g.out_tokens - 1) >= self.tpot_ns:
                    return True, "tpot"
        if self._head_thr and head_hash(g.rid) < self._head_thr:
            return True, "head"
        rv = self._remote.get(g.rid)
        if rv is not None and rv[0]:
            return True, "remote"
        if rv is not None and rv[1] and g.root_start is None:
            return False, "remote_drop"
        if not g.closing and not early:  # (a routed request ends only with its root)
            return True, "unended"
        return False, "fast"

    def tick(self, now: int | None = None) -> None:
        """Decide what is due: ended groups past their grace, requests in flight over the TTFT threshold
        (``overdue``), groups idle for the hold time or held for the absolute cap; re-read the marks file
        and keep-lists every :data:`MARK_POLL_S`; forget old decisions and verdicts. Called by the sink's
        loop (which catches what it raises)."""
        now = time.monotonic_ns() if now is None else now
        if now >= self._next_poll:
            self._poll_safe()
        ending, groups = self.ending, self.groups
        while ending and ending[0][0] <= now:
            _, rid = heapq.heappop(ending)
            g = groups.get(rid)
            if g is None:
                continue
            if g.root_start is None and g.routed:
                continue  # its router's root is still to come (hold time otherwise)
            keep, why = self.verdict(g, now)
            if not keep and g.root_start is None and rid not in self._remote and self._others_live():
                self._waiting.add(rid)  # another host may hold its router or a keep: wait for its verdict (hold)
                continue
            self._decide(g, keep, why)
        dueq = self._dueq
        while dueq and dueq[0][0] <= now:  # in flight and over the TTFT threshold: kept now, shown
            _, rid, created = heapq.heappop(dueq)
            g = groups.get(rid)
            if g is None or g.created != created or g.closing:
                continue
            if not g.routed:  # (_side_due) one side's bound over the threshold: kept now
                side = self.ttft_side(g)
                if side is not None and side >= self.ttft_ns:
                    self._decide(g, True, "ttft_side")
                continue
            late = self.overdue(g, now)
            if late:
                self._decide(g, True, "overdue")
            elif late is None:  # not over threshold + grace yet (the grace grew: a slower client came): again then
                heapq.heappush(dueq, (max(now + 1, created + self.ttft_ns + self.grace_ns), rid, created))
        while groups:  # least recently fed first: idle for the hold time
            g = next(iter(groups.values()))
            if now - g.last < self.hold_ns:
                break
            self._decide(g, *self.verdict(g, now))
        capq = self._capq
        while capq and capq[0][0] <= now:
            _, rid, created = capq.popleft()
            g = groups.get(rid)
            if g is not None and g.created == created:
                self._decide(g, *self.verdict(g, now))
        self._forget_old(now)
        if now >= self._next_prune:
            self._next_prune = now + int(PRUNE_S * 1e9)
            self._prune_marks(now)
            self._prune_lists()

    def _forget_old(self, now: int) -> None:
        """Forget decisions and other sinks' verdicts unused for :attr:`keep_ns` (and the oldest beyond
        the byte cap)."""
        dec, keep = self.decided, self.keep_ns
        while dec:
            rid, (_, t) = next(iter(dec.items()))
            if now - t < keep and self.decided_bytes <= self._cap_bytes:
                break
            dec.popitem(last=False)
            self.decided_bytes -= DECISION_BYTES + len(rid)
            self.counts["decisions_forgotten"] += 1
        rem = self._remote
        while rem:
            rid, v = next(iter(rem.items()))
            if now - v[2] < keep and self._remote_bytes <= self._cap_bytes:
                break
            rem.popitem(last=False)
            self._remote_bytes -= DECISION_BYTES + len(rid)

    def _prune_marks(self, now: int) -> None:
        """Drop marked windows that ended before every held record and more than keep_ns ago."""
        if not self._marks:
            return
        oldest = min((g.t_min for g in self.groups.values() if g.t_min is not None), default=now)
        limit = min(oldest, now - self.keep_ns)
        for k in [k for k, (lo, hi) in self._marks.items() if hi < limit]:
            del self._marks[k]

    def next_due_s(self) -> float | None:
        """Seconds until the next decision is due (None: nothing held)."""
        if not self.groups:
            return None
        now = time.monotonic_ns()
        due = next(iter(self.groups.values())).last + self.hold_ns
        if self.ending:
            due = min(due, self.ending[0][0])
        if self._capq:
            due = min(due, self._capq[0][0])
        if self._dueq:
            due = min(due, self._dueq[0][0])
        return max(0.0, (due - now) / 1e9)

    def decide_all(self) -> None:
        """Decide every held group now (sync, last client gone, SIGTERM): by the rule if ended, else early."""
        now = time.monotonic_ns()
        self._poll_safe(force=True)
        for g in list(self.groups.values()):
            keep, why = self.verdict(g, now, early=not g.closing)
            if not keep and not g.closing:
                keep, why = True, "unended"  # in flight at a sync or exit: may be hung, shown
            self._decide(g, keep, why)
        self.ending.clear()
        self._capq.clear()
        self._dueq.clear()

    def _shed(self, now: int) -> None:
        """Over the memory bound: decide the least recently fed groups early until under SHED_TO of it."""
        target = int(self.bound * SHED_TO)
        groups = self.groups
        while groups and self.held > target:
            g = next(iter(groups.values()))
            keep, why = self.verdict(g, now, early=True)
            self._decide(g, keep, why if keep else "evicted")

    def _decide(self, g: _Group, keep: bool, why: str) -> None:
        del self.groups[g.rid]
        self._waiting.discard(g.rid)
        if g.rid not in self.decided:
            self.decided_bytes += DECISION_BYTES + len(g.rid)
        self.decided[g.rid] = (keep, time.monotonic_ns())
        self.decided.move_to_end(g.rid)
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
            if g.root_start is not None and self._others_live():  # others wait for a router host's verdict
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
                self.held -= e[4]
                if keep:
                    self.counts["steps_kept"] += 1
                    sink.add([r])
                else:
                    self.counts["steps_dropped"] += 1
                    self.counts["records_dropped"] += 1
                    sink.tail_dropped += 1
        g.recs = g.steps = None
        if len(self.decided) > 1 and self.decided_bytes > self._cap_bytes:
            self._forget_old(time.monotonic_ns())

    # ------------------------------------------------------ marks, keep-lists
    def mark(self, start_wall_ns: int, end_wall_ns: int, by: str = "signal") -> None:
        """Mark a window (wall ns): appended to the marks file (for the other sinks) and in force here now."""
        try:
            add_mark(self.dir, start_wall_ns, end_wall_ns, by)
        except OSError as exc:
            log.warning("pdtrace: cannot write the marks file in %s (%s)", self.dir, exc.strerror or exc)
        self._add_window(int(start_wall_ns), int(end_wall_ns))

    def _add_window(self, start_wall_ns: int, end_wall_ns: int) -> None:
        key = (start_wall_ns, end_wall_ns)
        if key in self._marks:
            return
        off = time.time_ns() - time.monotonic_ns()  # wall - monotonic on this host now
        self._marks[key] = (key[0] - off, key[1] - off)
        self.counts["marks"] += 1

    def _poll_safe(self, force: bool = False) -> None:
        try:
            self.poll_files(force)
        except Exception as exc:  # noqa: BLE001 - a file of the trace directory must not stop the sink
            self._next_poll = time.monotonic_ns() + int(MARK_POLL_S * 1e9)
            log.warning("pdtrace: tail retention: reading the marks file or keep-lists failed (%s: %s)",
                        type(exc).__name__, exc)

    def poll_files(self, force: bool = False) -> None:
        """Read the lines appended to the marks file since the last look (from the start when it was
        replaced or truncated), and the lines other sinks added to their keep-lists; touch this sink's
        own list every :data:`HEARTBEAT_S`. A line that is not a mark is skipped and counted
        (``bad_marks``). Raises nothing but what the file system raises outside OSError."""
        now = time.monotonic_ns()
        self._next_poll = now + int(MARK_POLL_S * 1e9)
        self._read_marks()
        if now >= self._next_beat and self._keep_fd == -3:  # the list could not be opened: again
            self._next_beat = now + int(HEARTBEAT_S * 1e9)
            self._open_list()
        if now >= self._next_beat and self._keep_fd >= 0:
            self._next_beat = now + int(HEARTBEAT_S * 1e9)
            try:
                os.utime(self._keep_fd)
            except OSError:
                pass
            try:
                a, b = os.stat(self._keep_path), os.fstat(self._keep_fd)
                gone = (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)
            except OSError as exc:  # deleted here (ENOENT), or by another NFS client (ESTALE on the fd)
                gone = exc.errno in (errno.ENOENT, errno.ESTALE)
            if gone:  # deleted under this sink (pruned while it stalled): readers would never see its lines
                self.counts["lists_reopened"] += 1
                self._rotate_list()
        self.remote_keeps()

    def _read_marks(self) -> None:
        try:
            with open(marks_path(self.dir), "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._marks_ino or st.st_size < self._marks_off:
                    self._marks_ino, self._marks_off = st.st_ino, 0  # a new or truncated file
                if st.st_size == self._marks_off:
                    return
                f.seek(self._marks_off)
                data = f.read()
        except OSError:
            return
        cut = data.rfind(b"\n") + 1  # whole lines only
        self._marks_off += cut
        for line in data[:cut].split(b"\n"):
            if not line.strip():
                continue
            m = parse_mark(line)
            if m is None:
                self.counts["bad_marks"] += 1
            else:
                self._add_window(*m)

    def _others_live(self) -> bool:
        """Whether another host's sink wrote or touched its list within :data:`LIVE_S`."""
        if not self._live:
            return False
        t = time.time() - LIVE_S
        return any(m >= t for m in self._live.values())

    def _lists(self) -> tuple[str, list[str] | None]:
        """The verdict-list directory (``<trace dir>/tail-keep``) and the names in it; None when it cannot
        be listed (not made yet, or the file system failed)."""
        d = os.path.join(self.dir, "tail-keep")
        try:
            return d, os.listdir(d)
        except OSError:
            return d, None

    def remote_keeps(self) -> None:
        """Read the verdicts other hosts' sinks appended to their lists since the last read (cross-host;
        lines ``id TAB 1|0 TAB R|E``, a bare ``id`` is a keep; this host's own lists -- of this sink and
        of its earlier sinks -- are not read; lists present when this sink started are read from their
        end); decide at once every held group a keep or an authoritative drop names."""
        d, names = self._lists()
        if names is None:
            return
        now = time.monotonic_ns()
        got = []
        listed = set(names)
        for gone in [n for n in (*self._remote_pos, *self._live) if n not in listed]:  # deleted (pruned)
            self._remote_pos.pop(gone, None)
            self._live.pop(gone, None)
        for n in names:
            if not n.endswith(".ids") or n[:-4].rpartition("-")[0] == self.host:
                continue
            p = os.path.join(d, n)
            pos = self._remote_pos.get(n)
            try:
                with open(p, "rb") as f:
                    st = os.fstat(f.fileno())
                    self._live[n] = st.st_mtime
                    if pos is None and self._starting:
                        self._remote_pos[n] = st.st_size
                        continue
                    pos = pos or 0
                    if st.st_size < pos:
                        pos = 0  # replaced or truncated
                    if st.st_size == pos:
                        continue
                    f.seek(pos)
                    data = f.read()
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1  # whole lines only
            self._remote_pos[n] = pos + cut
            rem = self._remote
            for line in data[:cut].split(b"\n"):
                if not line:
                    continue
                f = line.decode("utf-8", "replace").split("\t")
                rid = f[0]
                if not rid:
                    continue
                keep, auth = (len(f) < 2 or f[1] == "1"), (len(f) > 2 and f[2] == "R")
                old = rem.pop(rid, None)
                if old is None:
                    self._remote_bytes += DECISION_BYTES + len(rid)
                else:
                    keep, auth = keep or old[0], auth or old[1]  # any host's keep wins
                rem[rid] = (keep, auth, now)
                got.append(rid)
        if got:
            self._forget_old(now)
        for rid in got:
            g = self.groups.get(rid)
            rv = self._remote.get(rid)
            if g is not None and rv is not None and (rv[0] or (rv[1] and g.root_start is None)):
                self._decide(g, *self.verdict(g, now))

    def _open_list(self) -> None:
        """Create (or reopen: a sink of a reused pid appends) this sink's verdict-list segment. Not writable:
        ``_keep_fd`` -3, the local decisions stand alone and every verdict made meanwhile is not written (a
        warning, once per failure spell); a heartbeat (every :data:`HEARTBEAT_S`, :meth:`poll_files`) tries
        again."""
        try:
            os.makedirs(os.path.dirname(self._keep_path), exist_ok=True)
            fd = os.open(self._keep_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            if self._keep_fd != -3:
                log.warning("pdtrace: tail retention: cannot open the verdict list %s (%s); verdicts of this "
                            "host are not shared until it opens (retried every %.0f s)", self._keep_path, exc,
                            HEARTBEAT_S)
            self._keep_fd = -3
            return
        self._keep_fd = fd
        try:
            self._keep_bytes = os.fstat(fd).st_size
        except OSError:
            self._keep_bytes = 0
        self._next_created = False

    def _keep_line(self, rid: str, keep: bool, authoritative: bool) -> None:
        if self._keep_fd >= 0 and "\n" not in rid and "\t" not in rid:
            try:
                line = (rid.encode("utf-8", "surrogatepass") + (b"\t1" if keep else b"\t0")
                        + (b"\tR\n" if authoritative else b"\tE\n"))
                os.write(self._keep_fd, line)
            except (OSError, UnicodeError):
                return
            self._keep_bytes += len(line)
            if self._keep_bytes >= KEEP_LIST_BYTES:
                self._rotate_list()
            elif not self._next_created and self._keep_bytes >= KEEP_LIST_BYTES // 2:
                self._precreate_next()

    def _rotate_list(self) -> None:
        """Continue the verdict list in the next segment (:data:`KEEP_LIST_BYTES`); the old one stays for
        the readers until :meth:`_prune_lists` deletes it. Never raises: a segment that cannot be opened
        leaves the list closed (``_keep_fd`` -3) until a heartbeat's retry (:meth:`poll_files`)."""
        fd, self._keep_fd = self._keep_fd, -1
        try:
            os.close(fd)
        except OSError:  # a deferred write error (NFS): the lines are written or lost, the fd is gone
            pass
        self._keep_seq += 1
        self._keep_path = keep_list_path(self.dir, self.host, os.getpid(), self._keep_seq)
        self._open_list()

    def _precreate_next(self) -> None:
        """Create the next segment empty (half of :data:`KEEP_LIST_BYTES` reached): readers whose directory
        listing is cached see it before verdicts go to it. Errors are ignored (it is created at rotation)."""
        self._next_created = True
        try:
            os.close(os.open(keep_list_path(self.dir, self.host, os.getpid(), self._keep_seq + 1),
                             os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError:
            pass

    def _prune_lists(self) -> None:
        """Delete verdict-list segments nobody needs (:data:`KEEP_LIST_BYTES`): this sink's segments before
        the current one (not the current one nor the pre-created next) unmodified for keep_ns + LIVE_S;
        every segment of another sink process of this host name once none of its segments has been
        modified for that long (one still modified is a live sink's: it keeps all of its segments, its
        pre-created next one among them); and every segment of another host's sink process once none of
        them has been modified for :data:`FOREIGN_LIST_S` either (a host that never returns)."""
        d, names = self._lists()
        if names is None:
            return
        now = time.time()
        cut = now - self.keep_ns / 1e9 - LIVE_S
        foreign_cut = min(cut, now - FOREIGN_LIST_S)
        mine = (os.path.basename(self._keep_path),  # the current segment and the next (pre-created)
                os.path.basename(keep_list_path(self.dir, self.host, os.getpid(), self._keep_seq + 1)))
        # (host, "<pid>") -> [(path, mtime)]: the segments of one sink process (keep_list_path's names)
        by_sink: dict[tuple[str, str], list[tuple[str, float]]] = {}
        for n in names:
            host, _, rest = n[:-4].rpartition("-")
            if not n.endswith(".ids") or n in mine or not host:
                continue
            p = os.path.join(d, n)
            try:
                by_sink.setdefault((host, rest.partition(".")[0]), []).append((p, os.stat(p).st_mtime))
            except OSError:
                pass
        own = (self.host, str(os.getpid()))
        for key, segs in by_sink.items():
            if key == own:
                old = [p for p, m in segs if m < cut]
            else:  # another sink process: all of its segments once none is recent (else it is live)
                limit = cut if key[0] == self.host else foreign_cut
                old = [p for p, _ in segs] if max(m for _, m in segs) < limit else []
            for p in old:
                try:
                    os.unlink(p)
                    self.counts["lists_pruned"] += 1
                except OSError:
                    pass

    # ---------------------------------------------------------------- report
    def summary(self) -> dict:
        """Bound, held and peak bytes (estimate), records held, counts and reasons; the decisions table and
        the other sinks' verdicts (entries, estimated bytes: outside the bound, capped at max(16 MiB,
        bound / 4) each); the pending checks outside the bound (entries: a tuple of the due time, the id
        and its start): the absolute cap's queue (one per request held, until it is decided and the cap
        passes) and the in-flight checks' (``overdue``: one per routed request, until its first record + TTFT
        threshold + grace; ``ttft_side``: one per request whose D side is known over the threshold, until
        the next tick)."""
        return {"bound_bytes": self.bound, "held_bytes": self.held, "peak_bytes": self.peak,
                "held_records": self.held_records, "held_requests": len(self.groups), **self.counts,
                "decisions": len(self.decided), "decisions_bytes": self.decided_bytes,
                "remote_verdicts": len(self._remote), "remote_bytes": self._remote_bytes,
                "cap_checks": len(self._capq), "overdue_checks": len(self._dueq),
                "reasons": dict(self.reasons), "ttft_ms": (self.ttft_ns or 0) / 1e6,
                "tpot_ms": (self.tpot_ns or 0) / 1e6, "head": self.head, "hold_s": self.hold_ns / 1e9,
                "max_hold_s": self.max_hold_ns / 1e9}

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
        """Close this sink's verdict list (never raises: a deferred write error at close is ignored)."""
        fd, self._keep_fd = self._keep_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
