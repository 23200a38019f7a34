"""Traced push connector (``NixlPushConnector``: the prefill engine WRITEs).

Select it with::

    {"kv_connector": "TracedNixlPushConnector",
     "kv_connector_module_path": "pdtrace.connector.traced", ...}

Push-only hooks:

================================  =====================  ==============================================
hook                              side / thread          records
================================  =====================  ==============================================
scheduler ``update_state_after_   D / engine core        stamps D's allocation wall time into the
alloc``                                                  registration payload (``_pdt_alloc_wall_ns``)
scheduler ``build_connector_meta``  D / engine core      ``registration.timeout`` (vLLM's watchdog fired)
``_do_send_reg_notif``            D / nixl-push-writer   ``registration.sent`` (+ send wall time in the
                                                         payload: ``_pdt_sent_wall_ns``)
``_handle_push_reg_notif``        P / nixl-push-writer   ``registration.received`` (``clock.send_ns``),
                                                         ``dest.register`` [D alloc → arrival on P,
                                                         see :func:`reg_arrival`]
``_pop_matching_registration``    P / nixl-push-writer   KV blocks dequeued from the writer inbox
``_pop_matching_finished_blocks`` P / nixl-push-writer   a registration matched waiting blocks
``_do_start_push_kv``             P / nixl-push-writer   first contact (handshake deferral)
``_xfer_blocks_for_req``          P / nixl-push-writer   descriptor build start; the agent proxy's
                                                         post closes ``handoff.prep`` [max(KV ready,
                                                         registration arrived) → WRITE posted] with
                                                         ``handoff.step_wait``, ``handoff.writer_queue``,
                                                         ``handoff.handshake``, ``handoff.descriptors``
agent proxy                       P main / D writer      ``kv.transfer`` per handle on P; ``write_done``
                                                         notifications on D (its transfer-end time for
                                                         ``kv.ready``)
================================  =====================  ==============================================

The two payload keys are ignored by vLLM (it reads named keys only); they add
~40 bytes to each registration and are only added while tracing is on.
"""
from __future__ import annotations

import time

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPushConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from pdtrace.instrument import clock, tracer

from .common import PUSH_REG_PREFIX, split_id
from .facade import TracedFacadeMixin
from .safety import safe
from .scheduler import TracedSchedulerMixin
from .worker import Ctx, TracedWorkerMixin

ALLOC_KEY = "_pdt_alloc_wall_ns"
#: How far ahead of now (s) a registration deadline counts as due in the scheduler's step hook.
_REG_SLACK_S = 1.0
SENT_KEY = "_pdt_sent_wall_ns"


def reg_arrival(read_ns: int, prev_drain_ns: int, sent_ns: int | None) -> int:
    """When a registration reached P (monotonic ns, P's clock), as far as P can tell.

    P's writer thread reads notifications (``get_new_notifs``) only when it runs,
    and vLLM's writer sleeps until P hands it finished blocks (it self-polls at
    ~1 ms only while blocks wait for a registration). So a registration that
    arrived while P was still computing is *read* only after P's KV is ready:
    the read time would make the registration look like the later input of the
    join and charge P's own step/writer wake-up to ``dest.register``. What is
    known: it arrived after the previous drain started (``prev_drain_ns``) and
    after D sent it (``sent_ns``, D's wall clock converted; same host: exact,
    other hosts: raw, corrected by the analysis), and before it was read
    (``read_ns``). The earliest time consistent with all three is returned;
    the uncertainty is the writer's poll interval while it polls (~1 ms), or
    the loopback/network latency after D's send while it slept.
    """
    lo = max(prev_drain_ns or 0, sent_ns or 0)
    return min(read_ns, lo) if lo else read_ns


class TracedNixlPushConnectorScheduler(TracedSchedulerMixin, NixlPushConnectorScheduler):
    """Scheduler side of the traced push connector."""

    _pdt_mode = "push"

    def _pdt_alloc(self, request, num_external_tokens, t) -> None:
        super()._pdt_alloc(request, num_external_tokens, t)
        reg = self._push_pending_registrations.get(request.request_id)
        if reg is not None:
            reg[ALLOC_KEY] = clock.mono_to_wall(t)

    def build_connector_meta(self, scheduler_output):
        d = self._push_registration_deadlines
        # vLLM's build_connector_meta expires a prefix of these (perf_counter s, in insertion order) whose
        # deadline passed at its clock read; a first deadline more than _REG_SLACK_S ahead of ours expires
        # nothing in this call (unless the call itself takes that long), so the common step copies no set
        if not tracer.on or not d or next(iter(d.values())) > time.perf_counter() + _REG_SLACK_S:
            return super().build_connector_meta(scheduler_output)
        before = set(d)
        meta = super().build_connector_meta(scheduler_output)
        safe(self._pdt_reg_timeouts, before)
        return meta

    def _pdt_reg_timeouts(self, before) -> None:
        for rid in before - set(self._push_registration_deadlines):
            st = self._pdt_reqs.get(rid)
            if st is None or st.promoted or not st.sampled:
                continue
            tracer.event("registration.timeout", st.x, prompt_index=st.pidx, attempt=st.attempt,
                         attrs={"request.internal_id": rid, "lifecycle.cause": "registration_timeout",
                                "lifecycle.expected": 1, "lifecycle.received": 0, "request.mode": "push"})


class TracedNixlPushConnectorWorker(TracedWorkerMixin, NixlPushConnectorWorker):
    """Worker side of the traced push connector."""

    _pdt_mode = "push"

    def __init__(self, vllm_config, engine_id, kv_cache_config):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._pdt_regs: dict[str, int] = {}

    def _pdt_before_load(self, metadata, t0):
        info = getattr(metadata, "_pdtrace", None)  # pdtrace's own StepInfo (messages.py), or None
        alloc = info.recv_alloc if info is not None else {}
        ready = info.kv_ready if info is not None else {}
        rids = []
        for rid in metadata.reqs_to_recv:
            st = self._pdt_state(rid)
            st.t_alloc = alloc.get(rid, st.t_alloc)
            rids.append(st.x)
        for rid in metadata.push_registrations:
            rids.append(split_id(rid)[0])
        for rid in metadata.push_finished_blocks:
            st = self._pdt_state(rid)
            st.t_enq = t0
            st.t_kv_ready = ready.get(rid, t0)
            rids.append(st.x)
        return rids

    # ---------------------------------------------------------- D: registration
    def _do_send_reg_notif(self, req_id, reg_data):
        if not tracer.on:
            return super()._do_send_reg_notif(req_id, reg_data)
        sent = time.time_ns()
        try:
            reg_data[SENT_KEY] = sent
        except Exception:  # noqa: BLE001
            pass
        r = super()._do_send_reg_notif(req_id, reg_data)
        safe(self._pdt_reg_sent, req_id, reg_data, sent)
        return r

    def _pdt_reg_sent(self, req_id, reg_data, sent) -> None:
        x, pidx = split_id(req_id)
        if not tracer.sampled(x):
            return
        tracer.event("registration.sent", x, prompt_index=pidx, tp_rank=self._pdt_rank,
                     attrs={"request.internal_id": req_id, "kv.notif_kind": "push_reg", "clock.send_ns": sent,
                            "peer.engine_id": str(reg_data["remote_engine_id"])})

    # ---------------------------------------------------------- P: registration
    def _handle_push_reg_notif(self, notif):
        if tracer.on:
            safe(self._pdt_reg_received, notif, tracer.now())
        return super()._handle_push_reg_notif(notif)

    def _pdt_reg_received(self, notif, t) -> None:
        reg = msgspec.msgpack.decode(bytes(notif)[len(PUSH_REG_PREFIX):])
        # a payload that is not a dict or has no request id is malformed: vLLM logs and drops it too
        rid = reg.get("request_id") if isinstance(reg, dict) else None
        if not isinstance(rid, str):
            return
        x, pidx = split_id(rid)
        keep = tracer.sampled(x)
        peer = str(reg["decode_engine_id"])
        a = {"request.internal_id": rid, "kv.notif_kind": "push_reg", "peer.engine_id": peer,
             "clock.peer_engine_id": peer}
        sent = reg.get(SENT_KEY)
        if isinstance(sent, int):
            a["clock.send_ns"] = sent
        if keep:
            # the event keeps the read time (a causal upper bound for the clock analysis)
            tracer.event("registration.received", x, time_ns=t, prompt_index=pidx, tp_rank=self._pdt_rank,
                         attrs=a)
        # t (just after the drain that returned it) bounds the arrival from above
        # nixl_wrapper is pdtrace's TracedAgent here (installed with tracing on); drain_lo its own attribute
        arrived = reg_arrival(t, self.nixl_wrapper.drain_lo,
                              clock.wall_to_mono(sent) if isinstance(sent, int) else None)
        self._pdt_regs[f"{x}\x00{pidx}"] = arrived
        if len(self._pdt_regs) > 50_000:
            self._pdt_regs.clear()
        alloc = reg.get(ALLOC_KEY)
        if isinstance(alloc, int) and keep:
            # Start is D's wall clock (raw, another process/host); the analysis corrects skew.
            tracer.record("dest.register", x, min(clock.wall_to_mono(alloc), arrived), arrived,
                          {"request.internal_id": rid, "peer.engine_id": peer, "request.mode": "push",
                           "clock.send_ns": alloc},
                          prompt_index=pidx, tp_rank=self._pdt_rank)

    def _pdt_reg_time(self, rid) -> int:
        x, pidx = split_id(rid)
        return self._pdt_regs.pop(f"{x}\x00{pidx}", 0)

    def _pop_matching_registration(self, request_id):
        if not tracer.on:
            return super()._pop_matching_registration(request_id)
        t = tracer.now()
        r = super()._pop_matching_registration(request_id)
        safe(self._pdt_dequeued, request_id, t, r is not None)
        return r

    def _pdt_dequeued(self, rid, t, matched) -> None:
        st = self._pdt_state(rid)
        st.t_deq = t
        if matched:
            st.t_reg = self._pdt_reg_time(rid) or t
            st.t_match = t

    def _pop_matching_finished_blocks(self, request_id):
        r = super()._pop_matching_finished_blocks(request_id)
        if tracer.on and r is not None:
            safe(self._pdt_matched_late, r[0])
        return r

    def _pdt_matched_late(self, fin_id) -> None:
        st = self._pdt_state(fin_id)
        t = tracer.now()
        st.t_reg = self._pdt_reg_time(fin_id) or t
        st.t_match = t

    def _do_start_push_kv(self, request_id, local_block_ids, registration_data):
        if tracer.on:
            safe(self._pdt_start_push, request_id, registration_data)
        return super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _pdt_start_push(self, rid, reg) -> None:
        st = self._pdt_state(rid)
        engine = reg["decode_engine_id"]
        st.peer = engine
        t = tracer.now()
        if st.hs_engine:
            st.t_enter2 = t            # re-driven after the handshake
        elif engine is not None and engine not in self._remote_agents:
            st.hs_engine = engine
            st.t_hs_wait = t
            st.first_contact = 1

    def _xfer_blocks_for_req(self, req_id, meta):
        if not tracer.on:
            return super()._xfer_blocks_for_req(req_id, meta)
        st = self._pdt_state(req_id)
        st.t_enter = tracer.now()
        safe(self._pdt_blocks, st, meta)
        self._pdt_tls.ctx = Ctx(req_id, meta.remote.engine_id if meta.remote is not None else None)
        try:
            return super()._xfer_blocks_for_req(req_id, meta)
        finally:
            self._pdt_tls.ctx = None

    @staticmethod
    def _pdt_blocks(st, meta) -> None:
        """KV blocks this WRITE fills (``kv.blocks``): per cache group, D's registered blocks (D
        registers only the blocks it must receive), at most P's own; logical blocks, like pull's."""
        local = meta.local_block_ids or ()
        remote = meta.remote.block_ids if meta.remote is not None else ()
        if local and not isinstance(local[0], (list, tuple)):
            local = [local]
        if remote and not isinstance(remote[0], (list, tuple)):
            remote = [remote]
        st.blocks = sum(min(len(lo), len(re)) for lo, re in zip(local, remote))

    def _pdt_on_post(self, info) -> None:
        rid = info.rid
        st = self._pdt_req.get(rid) if rid else None
        if st is None or st.prep_done or self._pdt_role != "prefill":
            return
        info.blocks = st.blocks  # the state is dropped below, before the telemetry arrives
        st.prep_done = True
        if not tracer.sampled(st.x):
            self._pdt_req.pop(rid, None)
            return
        post = info.post_ns
        kv_ready = st.t_kv_ready or st.t_enq or st.t_match
        reg = st.t_reg or st.t_match
        start = max(kv_ready, reg)
        prep = tracer.new_id()
        kw = {"prompt_index": st.pidx, "tp_rank": self._pdt_rank}
        t = start
        if kv_ready >= reg and st.t_enq:
            # KV was the later input: wait for the engine step that hands it to the writer, then the queue
            e = max(t, st.t_enq)
            tracer.record("handoff.step_wait", st.x, t, e, parent=prep, **kw)
            t = e
            e = max(t, st.t_deq or st.t_match)
            tracer.record("handoff.writer_queue", st.x, t, e, parent=prep, **kw)
            t = e
        else:
            e = max(t, st.t_match)
            tracer.record("handoff.writer_queue", st.x, t, e, parent=prep, **kw)
            t = e
        if st.hs_engine:
            t_hs = self._pdt_record_handshake(st, prep, t)
            e = max(t_hs, st.t_enter2 or t_hs)
            tracer.record("handoff.writer_queue", st.x, t_hs, e, parent=prep, **kw)
            t = e
        e = max(t, st.t_enter or t)
        if e > t:
            tracer.record("handoff.writer_queue", st.x, t, e, parent=prep, **kw)
            t = e
        tracer.record("handoff.descriptors", st.x, t, max(t, post), parent=prep,
                      attrs={"kv.descriptors": info.ndesc}, **kw)
        attrs = {"request.internal_id": rid, "request.mode": "push", "kv.op": info.op,
                 "kv.first_contact": st.first_contact}
        if st.peer is not None:
            attrs["peer.engine_id"] = str(st.peer)
        tracer.record("handoff.prep", st.x, start, post, attrs, span_id=prep, **kw)
        self._pdt_req.pop(rid, None)

    def _pdt_on_notif(self, kind, rid, t) -> None:
        # D side: a write-done notification is this rank's "transfer finished" instant.
        if kind == "write_done" and rid and self._pdt_role == "decode":
            st = self._pdt_req.get(rid)
            if st is not None:
                st.xfer_end = max(st.xfer_end, t)


class TracedNixlPushConnector(TracedFacadeMixin, NixlPushConnector):
    """``NixlPushConnector`` with pdtrace spans; identical behaviour with tracing off."""

    _pdt_mode = "push"
    _pdt_sched_cls = TracedNixlPushConnectorScheduler
    _pdt_work_cls = TracedNixlPushConnectorWorker
    _pdt_stock_sched_cls = NixlPushConnectorScheduler
    _pdt_stock_work_cls = NixlPushConnectorWorker

    def __init__(self, vllm_config, role, kv_cache_config):
        # Skips NixlPushConnector.__init__ (it builds the stock objects); its one
        # check is repeated here in our own words.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("TracedNixlPushConnector (like NixlPushConnector) does not support "
                             "decode_context_parallel_size > 1.")
        self._pdt_build(vllm_config, role, kv_cache_config)
