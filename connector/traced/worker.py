"""Worker-side tracing shared by pull and push (mixed into vLLM's worker classes).

Side: the model runner's process, one object per TP rank. Threads: the
forward thread (the facade's worker calls), the handshake executor
(``vllm-nixl-handshake-initiator``), and in push the ``nixl-push-writer``.

Hooks (all call ``super()`` unchanged; pdtrace work goes through
:func:`~pdtrace.connector.traced.safety.safe`):

==============================  ==================  =========================================
hook                            thread              records
==============================  ==================  =========================================
``__init__``                    main                installs the NIXL agent proxy (tracing on)
``_nixl_handshake``             handshake executor  per-peer handshake times, ``clock.sample``
``add_remote_agent`` /          handshake executor  remote-agent load time (``handoff.agent_load``)
``_add_notif_only_remote_agent``
``_log_failure``                any                 failure events (handshake, post, transfer,
                                                    notification), never the message text
``_reap_expired_send_leases``   forward             ``kv.lease_expired`` (P's lease ran out)
==============================  ==================  =========================================

The facade (``pdtrace.connector.traced.facade``) times the forward-thread
calls (``connector.load`` / ``connector.poll`` / ``connector.save``) and binds
the step id the scheduler put on the metadata.
"""
from __future__ import annotations

import threading

from pdtrace.instrument import attributes as _attrs
from pdtrace.instrument import stages, tracer

from .agent import TracedAgent
from .common import split_id
from .safety import safe
from .messages import StepReport

_FAILURES = {
    # vLLM failure_type -> (pdtrace event, lifecycle.cause, lifecycle.phase)
    "handshake_setup_failed": ("handshake.failed", "handshake_setup_failed", "handshake"),
    "handshake_failed": ("handshake.failed", "handshake_failed", "handshake"),
    "push_reg_handshake_failed": ("handshake.failed", "push_reg_handshake_failed", "handshake"),
    "push_handshake_failed": ("handshake.failed", "push_handshake_failed", "handshake"),
    "transfer_setup_failed": ("kv.post_failed", "post_failure", "post"),
    "transfer_failed": ("kv.transfer_failed", "transfer_failed", "transfer"),
    "transfer_exception": ("kv.transfer_failed", "transfer_exception", "transfer"),
    "transfer_release_failed": ("kv.transfer_failed", "release_failed", "release"),
    "notification_failed": ("kv.post_failed", "notification_failed", "notification"),
    "push_reg_notif_failed": ("kv.post_failed", "registration_send_failed", "registration"),
}


class Ctx:
    """What the current thread is doing for which request (read by the agent proxy)."""

    __slots__ = ("rid", "peer", "peer_rank")

    def __init__(self, rid, peer=None, peer_rank=None):
        self.rid, self.peer, self.peer_rank = rid, peer, peer_rank


class ReqState:
    """Per-request worker-side timestamps (monotonic ns) for one attempt on this rank."""

    __slots__ = ("x", "pidx", "t_alloc", "t_enter", "t_enter2", "t_hs_wait", "hs_engine", "prep_done",
                 "xfer_end", "first_contact", "t_kv_ready", "t_enq", "t_deq", "t_reg", "t_match",
                 "t_hs_done", "peer", "blocks")

    def __init__(self, x, pidx):
        self.x, self.pidx = x, pidx
        self.t_alloc = self.t_enter = self.t_enter2 = self.t_hs_wait = 0
        self.hs_engine = None
        self.prep_done = False
        self.xfer_end = 0
        self.first_contact = 0
        self.t_kv_ready = self.t_enq = self.t_deq = self.t_reg = self.t_match = self.t_hs_done = 0
        self.peer = None
        self.blocks = 0


class TracedWorkerMixin:
    """Adds pdtrace hooks to a NIXL worker class (put before the vLLM class in the bases)."""

    _pdt_mode = "pull"

    def __init__(self, vllm_config, engine_id, kv_cache_config):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._pdt_role = stages.role_of_kv_role(vllm_config.kv_transfer_config.kv_role, stages.DECODE)
        self._pdt_rank = self.tp_rank
        self._pdt_tls = threading.local()
        self._pdt_req: dict[str, ReqState] = {}
        self._pdt_hs: dict[str, tuple] = {}
        self._pdt_report = None
        self._pdt_step = None
        self._pdt_lock = threading.Lock()
        self._pdt_cpu_mark = None  # (pdtrace ns, thread ns) of the forward thread at the last connector.load
        self._pdt_backend = (list(self.nixl_backends) or ["UCX"])[0]
        if tracer.on:
            self.nixl_wrapper = TracedAgent(self.nixl_wrapper, self)

    # ------------------------------------------------------------ helpers
    def _pdt_ctx(self):
        return getattr(self._pdt_tls, "ctx", None)

    @staticmethod
    def _pdt_x(rid: str) -> str:
        return split_id(rid)[0]

    def _pdt_before_load(self, metadata, t0):
        """Forward thread, before start_load_kv: note alloc times; return the request ids served."""
        return []

    def _pdt_state(self, rid: str) -> ReqState:
        st = self._pdt_req.get(rid)
        if st is None:
            x, pidx = split_id(rid)
            st = ReqState(x, pidx)
            if len(self._pdt_req) > 50_000:
                self._pdt_req.clear()
            self._pdt_req[rid] = st
        return st

    def _pdt_take_report(self):
        r = self._pdt_report
        step = self._pdt_step.step if self._pdt_step is not None else None
        if r is None:
            r = StepReport(step)
        else:
            r.step = step
        self._pdt_report = None
        return r

    def _pdt_report_obj(self) -> StepReport:
        if self._pdt_report is None:
            self._pdt_report = StepReport()
        return self._pdt_report

    # ------------------------------------------------------------ handshake
    def _nixl_handshake(self, host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        if not tracer.on:
            return super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs)
        t0 = tracer.now()
        self._pdt_tls.agent_loads = []
        try:
            res = super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs)
        except BaseException:
            safe(self._pdt_hs_done, expected_engine_id, t0, tracer.now(), None, False)
            raise
        safe(self._pdt_hs_done, expected_engine_id, t0, tracer.now(), res, True)
        return res

    def _pdt_hs_done(self, engine_id, t0, t1, res, ok) -> None:
        loads = list(getattr(self._pdt_tls, "agent_loads", ()) or ())
        self._pdt_hs[engine_id] = (t0, t1, loads, ok)
        attrs = {"peer.engine_id": str(engine_id), "clock.peer_engine_id": str(engine_id)}
        if ok and res is not None:
            offset = res[1]
            attrs.update({"clock.offset_ns": int(offset * 1e9), "clock.rtt_bound_ns": t1 - t0,
                          "clock.domain": "monotonic", "clock.source": "nixl_handshake"})
            tracer.event("clock.sample", None, time_ns=t1, tp_rank=self._pdt_rank, attrs=attrs)

    def add_remote_agent(self, nixl_agent_meta, *args, **kwargs):
        t0 = tracer.now()
        try:
            return super().add_remote_agent(nixl_agent_meta, *args, **kwargs)
        finally:
            if tracer.on:
                safe(self._pdt_agent_loaded, t0, tracer.now())

    def _add_notif_only_remote_agent(self, metadata, *args, **kwargs):
        t0 = tracer.now()
        try:
            return super()._add_notif_only_remote_agent(metadata, *args, **kwargs)
        finally:
            if tracer.on:
                safe(self._pdt_agent_loaded, t0, tracer.now())

    def _pdt_agent_loaded(self, t0, t1) -> None:
        lst = getattr(self._pdt_tls, "agent_loads", None)
        if lst is not None:
            lst.append((t0, t1))

    def _pdt_record_handshake(self, st: ReqState, parent: int, t_from: int) -> int:
        """Record this request's handoff.handshake child (and agent loads); return its end."""
        hs = self._pdt_hs.get(st.hs_engine)
        t_end = hs[1] if hs else tracer.now()
        t_end = max(t_end, t_from)
        sid = tracer.record("handoff.handshake", st.x, t_from, t_end, parent=parent, prompt_index=st.pidx,
                            tp_rank=self._pdt_rank, attrs={"peer.engine_id": str(st.hs_engine),
                                                           "kv.first_contact": 1,
                                                           "clock.rtt_bound_ns": (hs[1] - hs[0]) if hs else 0})
        if hs:
            for a0, a1 in hs[2]:
                tracer.record("handoff.agent_load", st.x, max(a0, t_from), max(a1, t_from), parent=sid,
                              prompt_index=st.pidx, tp_rank=self._pdt_rank,
                              attrs={"peer.engine_id": str(st.hs_engine)})
        return t_end

    # ------------------------------------------------------------ failures
    def _log_failure(self, failure_type, req_id, *args, **kwargs):
        if tracer.on:
            # error: _log_failure's fourth parameter (vllm_compat: failure_type, req_id, msg, error), passed by
            # keyword by vLLM; None (or not passed) for a failure without an exception
            error = kwargs["error"] if "error" in kwargs else (args[1] if len(args) > 1 else None)
            safe(self._pdt_failure, failure_type, req_id, error)
        return super()._log_failure(failure_type, req_id, *args, **kwargs)

    def _pdt_failure(self, failure_type, req_id, error) -> None:
        name, cause, phase = _FAILURES.get(str(failure_type), ("kv.transfer_failed", str(failure_type)[:64], None))
        x, pidx = split_id(req_id) if req_id else (None, 0)
        if x is not None and not tracer.sampled(x):
            return
        attrs = {"lifecycle.cause": cause, "request.internal_id": req_id or "", "request.mode": self._pdt_mode}
        if phase:
            attrs["lifecycle.phase"] = phase
        if error is not None:
            attrs.update(_attrs.error_attrs(error))
        tracer.event(name, x, prompt_index=pidx, tp_rank=self._pdt_rank, attrs=attrs)

    def _reap_expired_send_leases(self, done_sending, *args, **kwargs):
        if not tracer.on or not self._reqs_to_send:
            return super()._reap_expired_send_leases(done_sending, *args, **kwargs)
        # the reaper adds the expired requests to done_sending: only a step where it grew has any
        n0 = len(done_sending)
        before = set(done_sending) if n0 else ()
        r = super()._reap_expired_send_leases(done_sending, *args, **kwargs)
        if len(done_sending) != n0:
            safe(self._pdt_expired, set(done_sending) - set(before))
        return r

    def _pdt_expired(self, rids) -> None:
        for rid in rids:
            x, pidx = split_id(rid)
            if tracer.sampled(x):
                tracer.event("kv.lease_expired", x, prompt_index=pidx, tp_rank=self._pdt_rank,
                             attrs={"request.internal_id": rid, "lifecycle.cause": "lease_expired",
                                    "request.mode": self._pdt_mode})
            self._pdt_report_obj().expired.add(rid)  # the release cause of P's block hold

    # ------------------------------------------------------------ transfers
    def _pdt_on_post(self, info) -> None:
        """A NIXL transfer was posted (agent proxy); pull/push close handoff.prep here."""

    def _pdt_on_transfer_done(self, info, res, seen_ns) -> None:
        """Record kv.transfer from NIXL's telemetry (µs → ns here)."""
        post_ns = info.post_ns or seen_ns
        xfer_ns = int(res.xferDuration * 1000)
        end = post_ns + xfer_ns
        x, pidx = split_id(info.rid) if info.rid else (None, 0)
        attrs = {"kv.op": info.op, "kv.bytes": int(res.totalBytes), "kv.descriptors": int(res.descCount),
                 "kv.post_ns": int(res.postDuration * 1000), "kv.xfer_ns": xfer_ns,
                 "kv.backend": self._pdt_backend, "request.internal_id": info.rid or "",
                 "request.mode": self._pdt_mode, "kv.descriptors_requested": info.ndesc}
        if info.peer is not None:
            attrs["peer.engine_id"] = str(info.peer)
        if info.rank is not None:
            attrs["peer.tp_rank"] = int(info.rank)
        st0 = self._pdt_req.get(info.rid) if info.rid else None
        blocks = (st0.blocks if st0 is not None else 0) or info.blocks
        if blocks:
            attrs["kv.blocks"] = blocks
        sampled = x is None or tracer.sampled(x)
        if sampled:
            tracer.record("kv.transfer", x, post_ns, end, attrs, prompt_index=pidx, tp_rank=self._pdt_rank)
        if info.rid:
            st = self._pdt_req.get(info.rid)
            if st is not None:
                st.xfer_end = max(st.xfer_end, end)

    def _pdt_on_notif(self, kind, rid, t) -> None:
        """A notification arrived (agent proxy)."""

    def _pdt_finished_recv(self, done_recving, t_seen) -> None:
        rep = None
        for rid in done_recving or ():
            st = self._pdt_req.pop(rid, None)
            end = st.xfer_end if st is not None and st.xfer_end else t_seen
            if rep is None:
                rep = self._pdt_report_obj()
            rep.recv.setdefault(rid, {})[self._pdt_rank] = (min(end, t_seen), t_seen)

