"""The traced facades' shared part: construction and the forward-thread calls.

Side: both. vLLM builds one facade per role: ``SCHEDULER`` in EngineCore,
``WORKER`` in each model-runner process.

Construction starts the process's recorder (:func:`pdtrace.instrument.activate`:
on iff ``PDTRACE_DIR`` is set; ``activation`` 'plugin' when the stock name led
here, see :func:`activation_of`) and builds pdtrace's own scheduler or worker object directly (the
stock facade's ``__init__`` would build the stock worker, whose NIXL agent
and threads a later replacement would leak). With tracing off the stock
vLLM classes are built instead, so the engine runs exactly the stock code
(the facade methods below then only add one ``tracer.on`` check).

Forward-thread calls timed as children of the step span (the step id and the
step span's id ride on the connector metadata from the scheduler):

=====================================  ==================  ============================
facade method (vLLM contract)          span                ``vllm.method``
=====================================  ==================  ============================
``start_load_kv`` (after the forward   ``connector.load``  ``start_load_kv``
unless the step has sync loads)
``wait_for_save``                      ``connector.save``  ``wait_for_save``
``get_transfer_results`` (completion   ``connector.poll``  ``get_transfer_results``
polling; ``get_finished`` legacy)
=====================================  ==================  ============================

``bind_connector_metadata`` keeps the scheduler's
:class:`~pdtrace.connector.traced.messages.StepInfo` on the worker;
``build_connector_worker_meta`` returns pdtrace's per-step
:class:`~pdtrace.connector.traced.messages.StepReport` (tracing on only).
"""
from __future__ import annotations

from pdtrace.instrument import activate, selfcpu, stages, tracer

from .. import vllm_compat
from .safety import safe

#: vLLM's own NIXL connector names: a traced class built under one of them (no module path)
#: was reached through pdtrace's vLLM plugin (:mod:`pdtrace.connector.plugin`).
STOCK_NAMES = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")


def _role_name(kv_role: str) -> str:
    return stages.role_of_kv_role(kv_role, stages.DECODE)


def activation_of(kv_transfer_config) -> str:
    """'plugin' when ``--kv-transfer-config`` names a stock NIXL connector without a module path
    (the plugin re-pointed the name to this class), else 'explicit' (pdtrace's class named)."""
    name, path = kv_transfer_config.kv_connector, kv_transfer_config.kv_connector_module_path
    return "plugin" if name in STOCK_NAMES and not path else "explicit"


class TracedFacadeMixin:
    """Mixed in before the vLLM facade (NixlPullConnector / NixlPushConnector)."""

    _pdt_mode = "pull"
    _pdt_sched_cls = _pdt_work_cls = None          # traced classes
    _pdt_stock_sched_cls = _pdt_stock_work_cls = None

    def _pdt_build(self, vllm_config, role, kv_cache_config) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        kvc = vllm_config.kv_transfer_config
        # the recorder starts here, in the process vLLM builds the connector in (never on import)
        # with its resource columns, so that no row of this process is written before it has its role
        self._pdt_traced = bool(safe(activate, activation_of(kvc), role=_role_name(kvc.kv_role),
                                     engine_id=str(self.engine_id), vllm_version=vllm_compat.vllm_version(),
                                     connector=type(self).__name__) and tracer.on)
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            cls = self._pdt_sched_cls if self._pdt_traced else self._pdt_stock_sched_cls
            self.connector_scheduler = cls(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            cls = self._pdt_work_cls if self._pdt_traced else self._pdt_stock_work_cls
            with vllm_compat.agent_config_override(vllm_compat.prog_thread_setting(kvc)):
                self.connector_worker = cls(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")

    # ------------------------------------------------------------ per step
    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._pdt_traced and self.connector_worker is not None:
            # pdtrace's own StepInfo (messages.py), set by the traced scheduler; absent when its hook
            # failed this step (the error is counted) or the scheduler process is not tracing
            self.connector_worker._pdt_step = getattr(connector_metadata, "_pdtrace", None)

    def _pdt_span(self, name, method, t0, t1, rids) -> None:
        w = self.connector_worker
        step = w._pdt_step  # StepInfo (messages.py) or None
        if step is not None:
            if not step.sid:
                return
            if step.idle:
                if not rids:
                    return  # idle step: nothing scheduled, no request served (see scheduler)
                w._pdt_report_obj().busy = True
            a = {"vllm.method": method, "step.id": step.step}
            parent = step.sid
        else:
            a = {"vllm.method": method}
            parent = None
        if rids:
            a["connector.request_ids"] = ";".join(rids)
        if selfcpu.enabled and name == "connector.load":
            # the forward thread's pdtrace CPU and whole CPU since the previous recorded connector.load
            # (one engine step of this rank; the hook running now is charged to the next one)
            w._pdt_cpu_mark = selfcpu.stamp(a, w._pdt_cpu_mark)
        tracer.record(name, None, t0, t1, a, parent=parent, tp_rank=w._pdt_rank)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if not (self._pdt_traced and tracer.on):
            return super().start_load_kv(forward_context, **kwargs)
        w = self.connector_worker
        t0 = tracer.now()
        rids = safe(w._pdt_before_load, self._connector_metadata, t0)
        try:
            return super().start_load_kv(forward_context, **kwargs)
        finally:
            safe(self._pdt_span, "connector.load", "start_load_kv", t0, tracer.now(), rids)

    def wait_for_save(self):
        if not (self._pdt_traced and tracer.on):
            return super().wait_for_save()
        t0 = tracer.now()
        try:
            return super().wait_for_save()
        finally:
            safe(self._pdt_span, "connector.save", "wait_for_save", t0, tracer.now(), None)

    def get_transfer_results(self, finished_req_ids):
        if not (self._pdt_traced and tracer.on):
            return super().get_transfer_results(finished_req_ids)
        t0 = tracer.now()
        res = super().get_transfer_results(finished_req_ids)
        t1 = tracer.now()
        safe(self._pdt_after_poll, "get_transfer_results", t0, t1, res.finished_recving, res.finished_sending)
        return res

    def get_finished(self, finished_req_ids):
        if not (self._pdt_traced and tracer.on):
            return super().get_finished(finished_req_ids)
        t0 = tracer.now()
        sending, recving = super().get_finished(finished_req_ids)
        safe(self._pdt_after_poll, "get_finished", t0, tracer.now(), recving, sending)
        return sending, recving

    def _pdt_after_poll(self, method, t0, t1, recving, sending) -> None:
        w = self.connector_worker
        if recving:
            w._pdt_finished_recv(recving, t1)
        rids = [w._pdt_x(r) for r in (recving or ())] + [w._pdt_x(r) for r in (sending or ())] \
            if recving or sending else ()
        self._pdt_span("connector.poll", method, t0, t1, rids)

    def build_connector_worker_meta(self):
        if self._pdt_traced and tracer.on and self.connector_worker is not None:
            r = safe(self.connector_worker._pdt_take_report)
            if r is not None:
                return r
        return super().build_connector_worker_meta()

    def shutdown(self):
        try:
            super().shutdown()
        finally:
            if self._pdt_traced and tracer.on:
                # vLLM's engine shutdown handles SIGTERM itself: flush what this process recorded
                safe(tracer.force_flush, 2.0)
