"""The two per-step messages between pdtrace's scheduler and worker halves (one module, both sides).

Both ride on vLLM's own connector channels, once per engine step, and are
only sent while tracing is on:

- scheduler → worker: :class:`StepInfo`, set by the traced scheduler's
  ``build_connector_meta`` as ``meta._pdtrace`` on vLLM's
  ``NixlConnectorMetadata``; vLLM hands that metadata to every worker
  (``bind_connector_metadata``), which keeps it as ``_pdt_step`` for the
  step's ``connector.*`` spans and hook bookkeeping.
- worker → scheduler: :class:`StepReport` (vLLM's ``KVConnectorWorkerMetadata``),
  returned by each traced worker's ``build_connector_worker_meta``; vLLM
  aggregates the reports of all TP workers (``aggregate``) and hands the
  result to the scheduler-side connector in ``update_connector_output``
  (``KVConnectorOutput.kv_connector_worker_meta``).

Both are pickled across processes (EngineCore ↔ workers) at every step:
:class:`StepInfo` is a ``NamedTuple`` (pickled as its class reference and a
tuple of five values) and :class:`StepReport` carries a step id, two small
dicts/sets and a flag, empty on most steps.
"""
from __future__ import annotations

from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


class StepInfo(NamedTuple):
    """Scheduler → worker, for one engine step (``meta._pdtrace``).

    ``step``: the scheduler's step id (counts every ``schedule()`` of this
    engine from 0); ``sid``: the step span's id, the parent of the workers'
    ``connector.*`` spans (0: the step span is not kept, the workers record
    no ``connector.*`` span); ``recv_alloc``: {internal request id: monotonic
    ns when D allocated its blocks} for this step's receives (``reqs_to_recv``
    whose allocation the scheduler saw; pull's ``handoff.prep`` starts
    there); ``kv_ready``: {internal request id: monotonic ns
    when P's KV became ready} for P's held requests handed to the workers this
    step (push's ``handoff.prep`` start); ``idle``: nothing was scheduled
    (a step that only polls transfers; its connector spans are kept only when
    they served a request, and then mark the step busy in the report).
    The dicts are a shared empty mapping when there is nothing to send; never
    written to by the worker.
    """

    step: int
    sid: int
    recv_alloc: dict
    kv_ready: dict
    idle: bool


class StepReport(KVConnectorWorkerMetadata):
    """Worker → scheduler, for one engine step (vLLM's ``KVConnectorWorkerMetadata``).

    - ``step``: the scheduler's step id the report belongs to (pairs the step
      with :class:`StepInfo`; None when the worker had no step bound),
    - ``recv``: {internal request id: {tp_rank: (transfer_end_ns, seen_ns)}}
      for receives this rank reported finished (monotonic ns, same host),
    - ``expired``: P request ids whose lease expired on some rank (release cause),
    - ``busy``: a worker did connector work for some request in a step that had
      no scheduled tokens (the scheduler then records that step's span).
    """

    def __init__(self, step: int | None = None) -> None:
        self.step = step
        self.recv: dict[str, dict[int, tuple[int, int]]] = {}
        self.expired: set[str] = set()
        self.busy = False

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        """Merge ``other`` (another TP rank's report of the same step) into this one; returns self."""
        if not isinstance(other, StepReport):
            return self
        if self.step is None:
            self.step = other.step
        for rid, ranks in other.recv.items():
            self.recv.setdefault(rid, {}).update(ranks)
        self.expired |= other.expired
        self.busy = self.busy or other.busy
        return self

    def __repr__(self) -> str:
        return f"StepReport(step={self.step}, recv={len(self.recv)}, expired={len(self.expired)})"
