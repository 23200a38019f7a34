"""Worker → scheduler per-step message (vLLM's ``KVConnectorWorkerMetadata`` channel).

Each traced worker returns one :class:`StepReport` per engine step from
``build_connector_worker_meta``; vLLM aggregates the reports of all TP
workers (``aggregate``) and hands the result to the scheduler-side connector
in ``update_connector_output``. It carries what only the workers know and
the scheduler needs to close per-request stages:

- ``step``: the scheduler's step id the report belongs to (pairs the step),
- ``recv``: {internal request id: {tp_rank: (transfer_end_ns, seen_ns)}} for
  receives this rank reported finished (times: monotonic ns, same host),
- ``expired``: P request ids whose lease expired on some rank (release cause),
- ``busy``: a worker did connector work for some request in a step that had
  no scheduled tokens (the scheduler then records that step's span).

Only sent while tracing is on. Pickled across processes with TP > 1.
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


class StepReport(KVConnectorWorkerMetadata):
    """pdtrace's per-step worker report (see module doc)."""

    def __init__(self, step: int | None = None) -> None:
        self.step = step
        self.recv: dict[str, dict[int, tuple[int, int]]] = {}
        self.expired: set[str] = set()
        self.busy = False

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if not isinstance(other, StepReport):
            return self
        if self.step is None:
            self.step = other.step
        for rid, ranks in other.recv.items():
            self.recv.setdefault(rid, {}).update(ranks)
        self.expired |= other.expired
        self.busy = self.busy or getattr(other, "busy", False)
        return self

    def __repr__(self) -> str:
        return f"StepReport(step={self.step}, recv={len(self.recv)}, expired={len(self.expired)})"
