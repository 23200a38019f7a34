"""Traced pull connector (``NixlPullConnector``: the decode engine READs).

Select it with::

    {"kv_connector": "TracedNixlPullConnector",
     "kv_connector_module_path": "pdtrace.connector.traced", ...}

Pull-only worker hooks (D's forward thread unless noted):

===========================  ==========================================================
hook                         records
===========================  ==========================================================
``_read_blocks_for_req``     entry of a request's READ preparation; first contact
(D, forward thread)          (engine not yet known → background handshake) marks the
                             request; the agent proxy's post closes ``handoff.prep``
                             with children ``handoff.step_wait`` (alloc → the step
                             that serves it), ``handoff.handshake`` (+ ``handoff.agent_load``)
                             on first contact, a second ``handoff.step_wait`` (handshake
                             done → next step), ``handoff.descriptors`` (entry → post)
agent proxy                  ``kv.transfer`` per handle on D (NIXL telemetry), the
                             ``read_done`` notification events on P, unmatched
                             notifications on P (``notification.unmatched``)
===========================  ==========================================================
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from pdtrace.instrument import tracer

from .common import split_id
from .facade import TracedFacadeMixin
from .safety import safe
from .scheduler import TracedSchedulerMixin
from .worker import Ctx, TracedWorkerMixin


class TracedNixlPullConnectorScheduler(TracedSchedulerMixin, NixlPullConnectorScheduler):
    """Scheduler side of the traced pull connector (see pdtrace.connector.traced.scheduler)."""

    _pdt_mode = "pull"


class TracedNixlPullConnectorWorker(TracedWorkerMixin, NixlPullConnectorWorker):
    """Worker side of the traced pull connector."""

    _pdt_mode = "pull"

    def _pdt_before_load(self, metadata, t0):
        info = getattr(metadata, "_pdtrace", None)  # pdtrace's own StepInfo (messages.py), or None
        if info is not None and info.recv_alloc:
            for rid, t_alloc in info.recv_alloc.items():
                self._pdt_state(rid).t_alloc = t_alloc
        to_recv = metadata.reqs_to_recv
        # requests whose background handshake finished, read this step: vLLM's queue.Queue of
        # (request id, ReqMeta); ``.queue`` is the standard library's deque under it
        ready = self._ready_requests.queue
        if not to_recv and not ready:
            return ()  # the common step: nothing to read
        rids = [split_id(r)[0] for r in to_recv]
        try:
            rids += [split_id(r)[0] for r, _ in list(ready)]
        except RuntimeError:  # the handshake thread put a request while the deque was copied
            pass
        return rids

    def _read_blocks_for_req(self, req_id, meta):
        if not tracer.on:
            return super()._read_blocks_for_req(req_id, meta)
        safe(self._pdt_enter, req_id, meta)
        try:
            return super()._read_blocks_for_req(req_id, meta)
        finally:
            self._pdt_tls.ctx = None

    def _pdt_enter(self, req_id, meta) -> None:
        t = tracer.now()
        st = self._pdt_state(req_id)
        engine = meta.remote.engine_id if meta.remote is not None else None
        st.peer = engine
        # blocks this READ fills: the local blocks (per KV cache group) minus those the rank already holds
        local, computed = meta.local_block_ids, meta.local_num_computed_blocks
        try:
            st.blocks = sum(len(g) for g in local) - sum(computed or ())
        except TypeError:  # not one list per group: the attribute is left out
            st.blocks = 0
        if not st.t_enter:
            st.t_enter = t
        else:
            st.t_enter2 = t
        self._pdt_tls.ctx = Ctx(req_id, engine)

    def _background_nixl_handshake(self, req_id, remote_engine_id, meta):
        # The request waits for a handshake (first contact, or a re-handshake in 0.33
        # after the peer re-registered): mark it here rather than guessing from state.
        if tracer.on:
            safe(self._pdt_hs_wait, req_id, remote_engine_id)
        return super()._background_nixl_handshake(req_id, remote_engine_id, meta)

    def _pdt_hs_wait(self, req_id, engine) -> None:
        st = self._pdt_state(req_id)
        if not st.hs_engine:
            st.hs_engine = engine
            st.t_hs_wait = st.t_enter or tracer.now()
            st.first_contact = 1

    def _pdt_on_post(self, info) -> None:
        rid = info.rid
        st = self._pdt_req.get(rid) if rid else None
        if st is None or st.prep_done:
            return
        st.prep_done = True
        if not tracer.sampled(st.x):
            return
        post = info.post_ns
        t_alloc = st.t_alloc or st.t_enter
        prep = tracer.new_id()
        kw = {"prompt_index": st.pidx, "tp_rank": self._pdt_rank}
        t_enter = st.t_enter
        tracer.record("handoff.step_wait", st.x, t_alloc, max(t_alloc, t_enter), parent=prep, **kw)
        t_last = t_enter
        if st.hs_engine:
            t_hs = self._pdt_record_handshake(st, prep, t_enter)
            t_next = st.t_enter2 or t_hs
            tracer.record("handoff.step_wait", st.x, t_hs, max(t_hs, t_next), parent=prep, **kw)
            t_last = max(t_hs, t_next)
        tracer.record("handoff.descriptors", st.x, t_last, max(t_last, post), parent=prep,
                      attrs={"kv.descriptors": info.ndesc}, **kw)
        attrs = {"request.internal_id": rid, "request.mode": "pull", "kv.op": info.op,
                 "kv.first_contact": st.first_contact}
        if st.peer is not None:
            attrs["peer.engine_id"] = str(st.peer)
        tracer.record("handoff.prep", st.x, t_alloc, post, attrs, span_id=prep, **kw)

    def _pdt_on_notif(self, kind, rid, t) -> None:
        # P side: a read_done for a request P no longer tracks is unmatched (vLLM drops it).
        if kind == "read_done" and rid and rid not in self._reqs_to_send and rid not in self._reqs_to_process:
            x, pidx = split_id(rid)
            if not tracer.sampled(x):
                return
            tracer.event("notification.unmatched", x, time_ns=t, prompt_index=pidx, tp_rank=self._pdt_rank,
                         attrs={"request.internal_id": rid, "kv.notif_kind": kind,
                                "lifecycle.cause": "unrecognized_or_expired"})


class TracedNixlPullConnector(TracedFacadeMixin, NixlPullConnector):
    """``NixlPullConnector`` with pdtrace spans; identical behaviour with tracing off."""

    _pdt_mode = "pull"
    _pdt_sched_cls = TracedNixlPullConnectorScheduler
    _pdt_work_cls = TracedNixlPullConnectorWorker
    _pdt_stock_sched_cls = NixlPullConnectorScheduler
    _pdt_stock_work_cls = NixlPullConnectorWorker

    def __init__(self, vllm_config, role, kv_cache_config):
        # The base facade only validates and stores config; NixlPullConnector.__init__
        # would build the stock scheduler/worker, so it is skipped on purpose.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self._pdt_build(vllm_config, role, kv_cache_config)
