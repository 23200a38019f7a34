"""Scheduler-side tracing shared by pull and push (mixed into vLLM's scheduler classes).

(Over 400 lines on purpose: one mixin, the scheduler side of both handoff modes, whose hooks share one
per-request state (``SReq``) and one per-step state; the stage rules that read them are kept side by side.)

Side: EngineCore process, the engine-core thread (the one running
``schedule()`` → ``execute_model`` → ``update_from_output``). Every hook calls
``super()`` first or last unchanged and does its own work through
:func:`~pdtrace.connector.traced.safety.safe`.

==============================  ==============================================================
hook (vLLM contract)            records
==============================  ==============================================================
``on_new_request``              request queued in EngineCore (start of ``*.queue``: vLLM's
(``add_request``)               ``arrival_time``, when the API server handed it over)
``get_num_new_matched_tokens``  ``num_cached_tokens`` (local prefix hit) on first call
``update_state_after_alloc``    D: blocks allocated → ``decode.queue`` ends, ``handoff.prep``
(after block allocation)        (pull) / ``dest.register`` (push) start; the alloc time goes
                                to the worker on the metadata
``build_connector_meta``        end of ``schedule()``: a step starts. Step id and the step
(end of every ``schedule()``)   span's id ride on the metadata (``meta._pdtrace``) so the
                                worker's ``connector.*`` spans are its children. P: prefill
                                chunk starts / ``prefill.queue`` ends; D: promotion (end of
                                ``kv.ready``, start of ``decode.first_step``); preemptions
``update_connector_output``     the step's outputs are processed: ``decode.step`` /
(in ``update_from_output``)     ``prefill.step`` ends, chunks end, ``decode.first_step`` ends
                                (first token sampled), per-rank transfer-end times arrive
                                from the workers (``StepReport``), P's blocks released
``request_finished``            P: KV ready (start of ``prefill.block_hold``); abort events
(request freed)
==============================  ==============================================================

Step spans are kept for every step (``PDTRACE_STEP_SAMPLE``), request spans
and events only for sampled requests (``PDTRACE_SAMPLE``; ``SReq.sampled``,
decided once per request). A kept step span of a step with something
scheduled is open from
``build_connector_meta`` to ``update_connector_output`` (``tracer.start``), so a
step that never returns is written as ``open`` rows at each flush (schema 1.1)
and the analysis reports it as an engine stall (view ``engine_stalls``); an
idle or never-paired step is abandoned. A step with nothing scheduled (no
forward pass) is never open: a hang in its connector calls shows as the
waiting requests' open stages (view ``in_flight``), not in ``engine_stalls``.

Stages that can hang are *open* while they wait (``tracer.start``; the
recorder writes them as ``open`` rows while they last, view ``in_flight``),
with what they wait for in ``wait.for``; each is still recorded once, after
the fact, with the same times as before (``record(..., span_id=...)`` then
``tracer.close``), or dropped with ``tracer.abandon`` when no row of its own
follows:

========================  =====================================  ===========================================
open stage                from → until                           ``wait.for``
========================  =====================================  ===========================================
``prefill.queue`` (P)     queued / chunk ended / preempted →     ``schedule`` (a batch slot)
                          next chunk scheduled
``decode.queue`` (D)      queued → blocks allocated              ``blocks``
``dest.register`` (D,     blocks allocated → promoted (P's row   ``registration``
push)                     ends the stage when it matched)
``handoff.prep`` (D,      blocks allocated → promoted (the       ``read_post``
pull)                     worker's row ends it at the post)
``kv.ready`` (D)          blocks allocated → promoted            ``write_done`` (push) / ``read_done`` (pull)
``prefill.block_hold``    KV ready → blocks released             ``registration`` (push) / ``read_done`` (pull)
(P)
========================  =====================================  ===========================================
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pdtrace.instrument import clock, selfcpu, stages, tracer
from pdtrace.instrument.clock import now_ns as _now

from .common import split_id
from .messages import StepInfo, StepReport
from .safety import count_error, safe


#: Shared empty mapping for the common case (no receive, no hold this step): never written to.
_NONE: dict = {}
#: StepInfo(...) without the NamedTuple's Python-level ``__new__`` frame (what that ``__new__`` does).
_tuple_new = tuple.__new__
_thread_time = selfcpu.thread_time_ns
#: The attributes a step span's row adds to its open span's (:func:`_step_attrs`), in this order.
_K_IDLE = ("step.idle_before",)
_K_IDLE_CPU = ("step.idle_before", "step.pdtrace_cpu_ns", "step.thread_cpu_ns")


_FINISHED_OK: tuple = ()


def _finished_ok() -> tuple:
    """vLLM's RequestStatus values of a request that finished normally (imported once, on first use:
    the module imports without vLLM's request module)."""
    global _FINISHED_OK
    if not _FINISHED_OK:
        from vllm.v1.request import RequestStatus

        _FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
    return _FINISHED_OK


def _step_attrs(step: int, n_reqs: int, n_p: int, n_d: int, n_r: int, batch: str) -> dict:
    """A step span's attributes: step id, requests in the batch, their scheduled prefill / decode /
    recompute tokens, and the batch (``<id>:<kind><tokens>;...``)."""
    return {"step.id": step, "step.num_reqs": n_reqs, "step.prefill_tokens": n_p, "step.decode_tokens": n_d,
            "step.recompute_tokens": n_r, "step.batch": batch}


class SReq:
    """Per-request scheduler-side state (monotonic ns)."""

    __slots__ = ("req", "x", "pidx", "role", "sampled", "t_queued", "t_alloc", "attempt", "cached",
                 "compute_sid", "t_compute0", "last_end", "chunks", "awaiting", "promoted", "t_promoted",
                 "ranks", "t_kv_ready", "first_step_sid", "queue_open", "prefill_done", "failed", "q_sid",
                 "w_sids", "h_sid", "dtag")

    def __init__(self, req, role):
        self.req = req
        self.x, self.pidx = split_id(req.request_id)
        self.role = role
        self.sampled = tracer.sampled(self.x)
        self.t_queued = tracer.now()
        self.t_alloc = 0
        self.attempt = 0
        self.cached = None
        self.compute_sid = 0
        self.t_compute0 = 0
        self.last_end = 0
        self.chunks = 0
        self.awaiting = False
        self.promoted = False
        self.t_promoted = 0
        self.ranks = None
        self.t_kv_ready = 0
        self.first_step_sid = 0
        self.queue_open = True
        self.prefill_done = False
        self.failed = False  # aborted or its KV load failed: no first step, no token
        self.q_sid = 0  # the open queue span (prefill.queue / decode.queue)
        self.w_sids = ()  # D's open waits for its KV (dest.register / handoff.prep, kv.ready)
        self.h_sid = 0  # P's open prefill.block_hold
        # its step.batch entry "<X>:d1", built the first time it decodes one token a step and reused by later
        # decode steps; never reset: it is used only for a step that schedules 1 token of a request already
        # past its prompt, whose kind is d1 whatever happened before (a preempted request recomputing its
        # prompt is below it and gets its kind built afresh)
        self.dtag = None


class PendingStep(NamedTuple):
    """One engine step from ``build_connector_meta`` until its output is processed (built with
    ``_tuple_new(PendingStep, (...))``: no Python-level ``__new__`` frame on the EngineCore thread).

    ``attrs``: the kept step span's attributes (None: not kept, or nothing scheduled); ``chunks``:
    (SReq, tokens, chunk_index, last) of the sampled requests' prefill chunks; ``promoted``: the
    sampled requests promoted in it (D); both the shared empty tuple when the step has none.
    """

    step: int
    sid: int
    t0: int
    empty: bool
    attrs: dict | None
    chunks: list | tuple
    promoted: list | tuple


class TracedSchedulerMixin:
    """Adds pdtrace hooks to a NIXL scheduler class (put before the vLLM class in the bases)."""

    _pdt_mode = "pull"

    def __init__(self, vllm_config, engine_id, kv_cache_config):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._pdt_role = stages.role_of_kv_role(vllm_config.kv_transfer_config.kv_role, stages.DECODE)
        self._pdt_step_name = f"{self._pdt_role}.step"
        # ranks whose receive report a request waits for (one per TP worker of this engine)
        self._pdt_tp = max(1, int(vllm_config.parallel_config.tensor_parallel_size))
        self._pdt_reqs: dict[str, SReq] = {}
        self._pdt_pending: deque[PendingStep] = deque()
        self._pdt_step_id = 0
        self._pdt_holds: dict[str, tuple[int, SReq]] = {}
        self._pdt_expired: set[str] = set()  # P: held requests whose lease a worker reported expired
        self._pdt_idle = 0
        self._pdt_cpu_mark = None  # (pdtrace ns, thread ns) of this thread when the last step span was written

    # ------------------------------------------------------------ arrivals
    def on_new_request(self, request):
        r = super().on_new_request(request)
        if tracer.on:
            safe(self._pdt_new, request)
        return r

    def _pdt_new(self, request) -> None:
        if len(self._pdt_reqs) > 100_000:
            self._pdt_reqs.clear()
        st = SReq(request, self._pdt_role)
        # The queue starts when the API server handed the request over (vLLM's own arrival_time,
        # wall clock of the same host): EngineCore's loop adds new requests only between steps,
        # so a request that arrives during a long step waits in the input queue before
        # on_new_request runs. That wait is queue time, not an unattributed gap.
        arr = request.arrival_time
        if arr:
            a = clock.wall_to_mono(int(arr * 1e9))
            if st.t_queued - 60_000_000_000 < a < st.t_queued:
                st.t_queued = a
        self._pdt_reqs[request.request_id] = st
        if st.sampled:
            self._pdt_open_queue(st, st.t_queued)

    def _pdt_open(self, st: SReq, name: str, t: int, wait_for: str) -> int:
        """Open ``name`` for ``st`` from ``t`` (monotonic ns), waiting for ``wait_for``; its span id (0: not open)."""
        return tracer.start(name, st.x, start_ns=t, prompt_index=st.pidx, attempt=st.attempt,
                            attrs={"wait.for": wait_for, "request.mode": self._pdt_mode,
                                   "request.internal_id": st.req.request_id})

    def _pdt_open_queue(self, st: SReq, t: int) -> None:
        tracer.abandon(st.q_sid, t)
        if self._pdt_role == "decode" and not st.t_alloc:
            st.q_sid = self._pdt_open(st, "decode.queue", t, "blocks")
        else:
            st.q_sid = self._pdt_open(st, "prefill.queue", t, "schedule")

    def _pdt_drop_open(self, st: SReq, t: int | None = None) -> None:
        """Abandon ``st``'s open queue and KV waits (promoted, freed or failed)."""
        tracer.abandon(st.q_sid, t)
        for sid in st.w_sids:
            tracer.abandon(sid, t)
        st.q_sid, st.w_sids = 0, ()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        r = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tracer.on:
            st = self._pdt_reqs.get(request.request_id)
            if st is not None and st.cached is None:
                st.cached = int(num_computed_tokens)
        return r

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        # P records nothing here (its blocks are allocated for its own prefill: no KV to receive, no
        # decode.queue): no hook there, one measured call less per request on P's EngineCore thread
        if not tracer.on or self._pdt_role != stages.DECODE:
            return super().update_state_after_alloc(request, blocks, num_external_tokens)
        t = tracer.now()
        r = super().update_state_after_alloc(request, blocks, num_external_tokens)
        safe(self._pdt_alloc, request, num_external_tokens, t)
        return r

    def _pdt_alloc(self, request, num_external_tokens, t) -> None:
        st = self._pdt_reqs.get(request.request_id)
        if st is None or st.t_alloc:
            return
        st.t_alloc = t
        if self._pdt_role == "decode" and num_external_tokens > 0:
            st.awaiting = True
            st.queue_open = False
            if st.sampled:
                tracer.record("decode.queue", st.x, st.t_queued, t, self._pdt_req_attrs(st),
                              prompt_index=st.pidx, attempt=st.attempt, span_id=st.q_sid or None)
                tracer.close(st.q_sid)
                st.q_sid = 0
                push = self._pdt_mode == "push"
                st.w_sids = (self._pdt_open(st, "dest.register" if push else "handoff.prep", t,
                                            "registration" if push else "read_post"),
                             self._pdt_open(st, "kv.ready", t, "write_done" if push else "read_done"))
        elif st.q_sid and self._pdt_role == "decode":
            tracer.abandon(st.q_sid, t)  # no KV to receive: D prefills itself (prefill.queue from here)
            st.q_sid = self._pdt_open(st, "prefill.queue", t, "schedule") if st.queue_open else 0

    def _pdt_req_attrs(self, st: SReq) -> dict:
        req = st.req
        a = {"request.internal_id": req.request_id, "request.mode": self._pdt_mode,
             "gen_ai.usage.input_tokens": int(req.num_prompt_tokens)}
        if st.cached is not None:
            a["request.num_cached_tokens"] = st.cached
            a["request.uncached_tokens"] = max(0, int(req.num_prompt_tokens) - st.cached)
        return a

    # ------------------------------------------------------------ steps
    def build_connector_meta(self, scheduler_output):
        if not tracer.on:
            return super().build_connector_meta(scheduler_output)
        t0 = _now()
        meta = super().build_connector_meta(scheduler_output)
        # safe() written out (one frame less per engine step; same counting and self-measurement)
        c0 = _thread_time() if selfcpu.enabled else None
        try:
            self._pdt_step_start(scheduler_output, meta, t0)
        except Exception as exc:  # noqa: BLE001 - tracing never breaks the engine
            count_error(exc, "TracedSchedulerMixin._pdt_step_start")
        if c0 is not None:
            selfcpu.add(c0)
        return meta

    def _pdt_step_start(self, so, meta, t0) -> None:
        # Per engine step on the EngineCore thread, so kept short (issue 18: <= 1 % of the thread's CPU):
        # an idle step allocates one PendingStep and one StepInfo and loops over nothing; a decode
        # request already in decode adds its cached batch entry (SReq.dtag) and two attribute reads.
        step = self._pdt_step_id
        self._pdt_step_id = step + 1
        sid = tracer.step_span_id(step)
        # metadata -> worker: step id, step span id, per-request times the worker needs
        reqs = self._pdt_reqs
        recv_alloc = _NONE
        to_recv = meta.reqs_to_recv
        if to_recv:
            recv_alloc = {}
            for rid in to_recv:
                st = reqs.get(rid)
                if st is not None and st.t_alloc:
                    recv_alloc[rid] = st.t_alloc
        kv_ready = _NONE
        holds = self._pdt_holds
        if holds:
            for d in (meta.push_finished_blocks, meta.reqs_to_send):
                for rid in d:
                    h = holds.get(rid)
                    if h is not None:
                        if kv_ready is _NONE:
                            kv_ready = {}
                        kv_ready[rid] = h[0]
        sched = so.num_scheduled_tokens
        meta._pdtrace = _tuple_new(StepInfo, (step, sid, recv_alloc, kv_ready, not sched))
        pre = so.preempted_req_ids  # None: vLLM's default when nothing was preempted
        if pre:
            self._pdt_preempted(pre, step, t0)

        if not sched:
            # nothing scheduled (P stepping while D reads its held blocks, D polling its receives): no
            # batch to describe and no open span (a hang in its connector calls shows as the waiting
            # requests' open stages); if the step turns out busy, _pdt_step_end writes its row with
            # the same attributes a kept step with an empty batch has
            ps = _tuple_new(PendingStep, (step, sid, t0, True, None, (), ()))
        else:
            chunks = promoted = ()
            attrs = None
            parts = []
            n_p = n_d = n_r = 0
            for rid, n in sched.items():
                st = reqs.get(rid)
                if st is None:
                    parts.append(f"{rid}:d{n}")
                    n_d += n
                    continue
                req = st.req
                tag = st.dtag
                if tag is not None and n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                    # decoding one token, as in its previous decode step (dtag is set only there; a
                    # request past its prompt is neither a chunk nor, once decoding, a promotion)
                    parts.append(tag)
                    n_d += 1
                    continue
                if st.awaiting and not st.promoted:
                    # D's first forward after the KV arrived (it recomputes the last prompt token):
                    # charged to decode.first_step, not prefill.compute
                    st.promoted = True
                    st.t_promoted = t0
                    if st.sampled:
                        self._pdt_promote(st, t0)
                        if not promoted:
                            promoted = []
                        promoted.append(st)
                    kind = "p"
                    n_p += n
                elif not st.awaiting and req.num_computed_tokens < req.num_prompt_tokens:
                    kind = "r" if st.attempt > 0 else "p"
                    if kind == "r":
                        n_r += n
                    else:
                        n_p += n
                    last = req.num_computed_tokens + n >= req.num_prompt_tokens
                    if st.sampled:
                        self._pdt_chunk_start(st, t0)
                        if not chunks:
                            chunks = []
                        chunks.append((st, n, st.chunks, last))
                    st.chunks += 1
                else:
                    n_d += n
                    if n == 1:
                        st.dtag = tag = f"{st.x}:d1"
                        parts.append(tag)
                        continue
                    kind = "d"
                parts.append(f"{st.x}:{kind}{n}")
            if sid:
                # built once: the open span holds this dict (never changed afterwards: the writer thread may
                # be reading it for an `open` row), and the step's row reads it once more at the end
                attrs = {"step.id": step, "step.num_reqs": len(parts), "step.prefill_tokens": n_p,  # _step_attrs
                         "step.decode_tokens": n_d, "step.recompute_tokens": n_r, "step.batch": ";".join(parts)}
                # open while it runs: a step that never returns (a hung forward, a stuck collective) is
                # written as `open` rows at each flush and read as an engine stall (analysis engine_stalls)
                tracer.start(self._pdt_step_name, None, t0, attrs=attrs, span_id=sid)
            ps = _tuple_new(PendingStep, (step, sid, t0, False, attrs, chunks, promoted))
        pend = self._pdt_pending
        pend.append(ps)
        if len(pend) > 64:  # a step never paired: do not grow without bound
            tracer.abandon(pend.popleft()[1])

    def _pdt_preempted(self, rids, step: int, t0: int) -> None:
        """The requests vLLM preempted in this schedule(): back to the queue, next attempt."""
        for rid in rids:
            st = self._pdt_reqs.get(rid)
            if st is not None:
                if st.sampled:
                    tracer.event("request.preempted", st.x, time_ns=t0, prompt_index=st.pidx, attempt=st.attempt,
                                 attrs={"request.internal_id": rid, "step.id": step})
                st.attempt += 1
                st.queue_open = True
                st.last_end = t0
                st.prefill_done = False
                st.compute_sid = 0
                if st.sampled:
                    self._pdt_drop_open(st, t0)
                    self._pdt_open_queue(st, t0)


    def _pdt_chunk_start(self, st: SReq, t0: int) -> None:
        if st.queue_open:
            q0 = st.last_end or st.t_queued
            tracer.record("prefill.queue", st.x, q0, t0, self._pdt_req_attrs(st) if st.chunks == 0 else
                          {"request.internal_id": st.req.request_id}, prompt_index=st.pidx, attempt=st.attempt,
                          span_id=st.q_sid or None)
            tracer.close(st.q_sid)
            st.q_sid = 0
            st.queue_open = False
        if not st.compute_sid:
            st.compute_sid = tracer.new_id()
            st.t_compute0 = t0

    def _pdt_promote(self, st: SReq, t0: int) -> None:
        """D: the scheduler picked the request up after its KV arrived: kv.ready ends (per rank)."""
        self._pdt_drop_open(st, t0)
        ranks = st.ranks or {}
        a = {"request.internal_id": st.req.request_id, "request.mode": self._pdt_mode,
             "kv.ranks_expected": self._pdt_tp, "kv.ranks_received": len(ranks)}
        if ranks:
            for rank, (xfer_end, seen) in ranks.items():
                tracer.record("kv.ready", st.x, min(xfer_end, t0), t0, {**a, "step.id": self._pdt_step_id - 1},
                              prompt_index=st.pidx, attempt=st.attempt, tp_rank=rank)
        if st.t_alloc:
            tracer.record("decode.block_reserve", st.x, st.t_alloc, t0,
                          {"request.internal_id": st.req.request_id, "request.mode": self._pdt_mode},
                          prompt_index=st.pidx, attempt=st.attempt)

    def update_connector_output(self, connector_output):
        if not tracer.on:
            return super().update_connector_output(connector_output)
        t1 = _now()
        r = super().update_connector_output(connector_output)
        # safe() written out, as in build_connector_meta
        c0 = _thread_time() if selfcpu.enabled else None
        try:
            self._pdt_step_end(connector_output, t1, c0)
        except Exception as exc:  # noqa: BLE001 - tracing never breaks the engine
            count_error(exc, "TracedSchedulerMixin._pdt_step_end")
        if c0 is not None:
            selfcpu.add(c0)
        return r

    def _pdt_step_end(self, out, t1, c0=None) -> None:
        """``out``: vLLM's KVConnectorOutput; ``t1``: monotonic ns before vLLM's update_connector_output;
        ``c0``: with PDTRACE_SELF_CPU=1, this thread's CPU clock (ns) when this hook's measured window
        began (the end of the thread's CPU since the previous recorded step: no extra clock read)."""
        rep = out.kv_connector_worker_meta  # None: no worker report reached this step's output
        if type(rep) is not StepReport:  # not isinstance: StepReport is an ABC (slow __instancecheck__)
            rep = None
        pend = self._pdt_pending
        ps = None
        if rep is not None and rep.step is not None:
            step = rep.step
            while pend and pend[0][0] <= step:  # [0]: PendingStep.step
                cand = pend.popleft()
                if cand[0] == step:
                    ps = cand
                    break
                tracer.abandon(cand[1], t1)  # never paired: no span row will come
        elif pend:
            ps = pend.popleft()
        fin_recv = out.finished_recving
        fin_send = out.finished_sending
        if ps is not None:
            if ps[3] and not (rep is not None and rep.busy) and not fin_recv and not fin_send:  # [3]: empty
                # an idle step (nothing scheduled, no connector work): counted, not recorded
                self._pdt_idle += 1
            else:
                sid = ps[1]
                if sid:
                    # the step's row: its open span's attributes, then the idle steps before it and, with
                    # PDTRACE_SELF_CPU=1, this (EngineCore) thread's pdtrace CPU and whole CPU since the
                    # previous recorded step span (this hook is charged to the next one: it is still running)
                    idle = self._pdt_idle
                    self._pdt_idle = 0
                    keys, vals = _K_IDLE, (idle,)
                    if selfcpu.enabled:
                        mark = self._pdt_cpu_mark
                        pd, th = self._pdt_cpu_mark = (selfcpu.thread_pair() if c0 is None
                                                       else selfcpu.thread_pair_at(c0))
                        if mark is not None:
                            keys, vals = _K_IDLE_CPU, (idle, pd - mark[0], th - mark[1])
                    if ps[4] is None or not tracer.end_extra(sid, t1, keys, vals):  # [4]: attrs
                        # no open span: nothing scheduled but busy, or the open-span cap was reached
                        a = dict(ps[4]) if ps[4] else _step_attrs(ps[0], 0, 0, 0, 0, "")
                        a.update(zip(keys, vals))
                        tracer.close(sid)
                        tracer.record(self._pdt_step_name, None, ps[2], t1, a, span_id=sid)
                if ps[5] or ps[6]:  # chunks, promoted
                    self._pdt_step_reqs(ps, t1)
        # per-rank completion times of receives (D). A rank's report reaches the scheduler in the step in
        # which that worker saw its receive done; vLLM reports the request in finished_recving later when
        # other ranks are slower (TP > 1: only once all of them are done) or when the id is held back, so
        # each rank's (transfer end, seen) is kept on the request as it arrives and read at promotion
        if rep is not None:
            recv = rep.recv
            if recv:
                reqs = self._pdt_reqs
                for rid, ranks in recv.items():
                    st = reqs.get(rid)
                    if st is not None:
                        if st.ranks is None:
                            st.ranks = {}
                        st.ranks.update(ranks)
            # P: a rank's lease expiry, like a receive, can be reported steps before the request is in
            # finished_sending (TP > 1): kept until its hold is closed
            exp = rep.expired
            if exp:
                self._pdt_expired.update(r for r in exp if r in self._pdt_holds)
        if fin_recv:
            for rid in fin_recv:
                st = self._pdt_reqs.get(rid)
                if st is not None and not st.ranks:
                    st.ranks = {0: (t1, t1)}  # no worker report: seen at this step's end
        if out.failed_recving:
            self._pdt_failed_recv(out.failed_recving, t1)
        if fin_send:
            self._pdt_released(fin_send, t1)

    def _pdt_failed_recv(self, rids, t1: int) -> None:
        """D: KV loads that failed this step (vLLM recomputes the request): an event, the next attempt."""
        for rid in rids:
            st = self._pdt_reqs.get(rid)
            x, pidx = (st.x, st.pidx) if st else split_id(rid)
            if st.sampled if st else tracer.sampled(x):
                tracer.event("kv.load_failed", x, time_ns=t1, prompt_index=pidx, attempt=st.attempt if st else 0,
                             attrs={"request.internal_id": rid, "lifecycle.cause": "load_failed_recompute",
                                    "request.mode": self._pdt_mode})
            if st is not None:
                st.attempt += 1
                st.awaiting = False
                st.failed = True

    def _pdt_released(self, rids, t1: int) -> None:
        """P: the held blocks of ``rids`` were released (vLLM's finished_sending): prefill.block_hold ends."""
        for rid in rids:
            h = self._pdt_holds.pop(rid, None)
            if h is None:
                continue
            t_ready, st = h
            cause = "notification"
            if rid in self._pdt_expired:
                self._pdt_expired.discard(rid)
                cause = "expiry"
            if st.sampled:
                tracer.record("prefill.block_hold", st.x, t_ready, t1,
                              {"request.internal_id": rid, "request.mode": self._pdt_mode,
                               "kv.release_cause": cause},
                              prompt_index=st.pidx, attempt=st.attempt, span_id=st.h_sid or None)
                tracer.close(st.h_sid)
                st.h_sid = 0

    def _pdt_step_reqs(self, ps: PendingStep, t1: int) -> None:
        """The step's sampled prefill chunks end (prefill.compute), and its promoted requests' first step."""
        for st, n, idx, last in ps.chunks:
            end = t1
            if st.t_kv_ready and st.t_kv_ready >= ps.t0:
                end = min(end, st.t_kv_ready)
            tracer.record("prefill.compute", st.x, ps.t0, end,
                          {"step.id": ps.step, "step.chunk_index": idx, "step.tokens": n,
                           "request.internal_id": st.req.request_id},
                          parent=st.compute_sid, prompt_index=st.pidx, attempt=st.attempt)
            st.last_end = end
            if last:
                a = self._pdt_req_attrs(st)
                a["step.id"] = ps.step
                tracer.record("prefill.compute", st.x, st.t_compute0, end, a, span_id=st.compute_sid,
                              prompt_index=st.pidx, attempt=st.attempt)
                st.compute_sid = 0
                st.prefill_done = True
            else:
                st.queue_open = True
                self._pdt_open_queue(st, end)  # waits for its next chunk
        for st in ps.promoted:
            if st.failed:
                continue  # freed (abort, failed KV load) during the step: it sampled no token
            a = self._pdt_req_attrs(st)
            a["step.id"] = ps.step
            tracer.record("decode.first_step", st.x, st.t_promoted, t1, a, prompt_index=st.pidx,
                          attempt=st.attempt, parent=None)
            tracer.event("token", st.x, time_ns=t1, prompt_index=st.pidx, attempt=st.attempt,
                         attrs={"gen_ai.usage.output_tokens": 1, "request.internal_id": st.req.request_id})


    # ------------------------------------------------------------ finish
    def request_finished(self, request, block_ids):
        if not tracer.on:
            return super().request_finished(request, block_ids)
        t = tracer.now()
        delay, params = super().request_finished(request, block_ids)
        safe(self._pdt_finished, request, delay, t)
        return delay, params

    def _pdt_finished(self, request, delay, t) -> None:
        rid = request.request_id
        st = self._pdt_reqs.pop(rid, None)
        if st is None:
            return
        self._pdt_drop_open(st, t)
        status = request.status
        if status not in _finished_ok():
            st.failed = True
            a = {"request.internal_id": rid, "lifecycle.cause": status.name[:64],
                 "request.mode": self._pdt_mode}
            if st.awaiting and not st.promoted:
                # aborted while waiting for its KV: say how many ranks had reported
                a["lifecycle.cause"] = "aborted_waiting_for_kv"
                a["lifecycle.expected"] = self._pdt_tp
                a["lifecycle.received"] = len(st.ranks or {})
            if st.sampled:
                tracer.event("request.abort", st.x, time_ns=t, prompt_index=st.pidx, attempt=st.attempt, attrs=a)
        elif self._pdt_role == "decode" and st.sampled:
            # the output length for TPOT (the router sees chunks, not tokens)
            tracer.event("request.finished", st.x, time_ns=t, prompt_index=st.pidx, attempt=st.attempt,
                         attrs={"request.internal_id": rid, "request.mode": self._pdt_mode,
                                "gen_ai.usage.output_tokens": int(request.num_output_tokens)})
        if delay:
            st.t_kv_ready = t
            self._pdt_holds[rid] = (t, st)
            if st.sampled and self._pdt_role == "prefill":
                st.h_sid = self._pdt_open(st, "prefill.block_hold", t,
                                          "registration" if self._pdt_mode == "push" else "read_done")
            if len(self._pdt_holds) > 100_000:
                self._pdt_holds.clear()
                self._pdt_expired.clear()
