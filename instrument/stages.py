"""The public vocabulary: process roles, stage (span) names, their categories, and event names.

Taken from DESIGN.md §2. Only *leaf* stages own time in the TTFT breakdown;
parents group and are never charged. The analysis loads :data:`STAGES` as its
stage → category mapping table, so code, SQL and dashboard share one list.
The roles and vLLM's ``kv_role`` of each engine role are defined here once
(:data:`ROLES`, :data:`KV_ROLES`, :func:`role_of_kv_role`) for the connectors,
the lab, the collector and the analysis.
"""
from __future__ import annotations

from typing import NamedTuple

#: Roles of the processes of a disaggregated deployment (the store's ``role`` resource column):
#: the router, the prefill engine (P) and the decode engine (D). Other processes write other
#: roles (``client``, ``bench``, ``collect``, ``engine`` for a vLLM of unknown role).
ROUTER, PREFILL, DECODE = "router", "prefill", "decode"
#: The roles in pipeline order (router, P, D).
ROLES = (ROUTER, PREFILL, DECODE)
#: The engine roles (P, D).
ENGINE_ROLES = (PREFILL, DECODE)
#: vLLM's ``kv_role`` (``--kv-transfer-config``) of each engine role: P produces the KV cache, D consumes it.
KV_ROLES = {PREFILL: "kv_producer", DECODE: "kv_consumer"}


def role_of_kv_role(kv_role: str | None, default: str | None = None) -> str | None:
    """The engine role of a vLLM ``kv_role``: 'prefill' for 'kv_producer', 'decode' for 'kv_consumer'.

    Any other value ('kv_both', None, a typo) gives ``default``.
    """
    for role, kv in KV_ROLES.items():
        if kv_role == kv:
            return role
    return default


class Stage(NamedTuple):
    """A stage: owning role (one of :data:`ROLES`; '' for none), category charged in the TTFT breakdown
    (one of :data:`CATEGORIES`; None: parent, never charged), meaning."""

    role: str
    category: str | None
    doc: str


#: The categories a leaf stage's time is charged to (the ``*_ns`` / ``share_*`` columns of the breakdown views).
QUEUE, COMPUTE, TRANSFER, COORDINATION = "queue", "compute", "transfer", "coordination"
CATEGORIES = (QUEUE, COMPUTE, TRANSFER, COORDINATION)

STAGES: dict[str, Stage] = {
    "router.request": Stage("router", None, "request received -> last byte written (root)"),
    "router.dispatch": Stage("router", COORDINATION, "router work before a leg is sent (one per leg)"),
    "router.wait": Stage("router", COORDINATION, "a leg's response awaited while no engine stage is known to run"),
    "router.unseen": Stage("router", COORDINATION, "engine-clock TTFT only (no router record): the router's hop "
                           "between P's response and D's request (pull), or before D's leg reached D (push); not "
                           "recorded, a pseudo-stage owning only time no engine stage covers"),
    "prefill.frontend": Stage("prefill", COORDINATION, "P's API server: HTTP received -> queued in EngineCore; output -> chunk written"),
    "decode.frontend": Stage("decode", COORDINATION, "D's API server: HTTP received -> queued in EngineCore; output -> chunk written"),
    "prefill.queue": Stage("prefill", QUEUE, "P: queued -> scheduled; waits between chunks; preempted intervals"),
    "prefill.compute": Stage("prefill", COMPUTE, "P: forward passes of the prompt (one child per chunk)"),
    "dest.register": Stage("decode", COORDINATION, "push: D's blocks allocated -> registration matched on P"),
    "handoff.prep": Stage("decode", COORDINATION, "pull: D's blocks allocated -> READ posted; push: KV ready and registration matched -> WRITE posted"),
    "handoff.step_wait": Stage("decode", COORDINATION, "child of handoff.prep: wait for the next engine step"),
    "handoff.handshake": Stage("decode", COORDINATION, "child of handoff.prep: NIXL handshake on first contact"),
    "handoff.agent_load": Stage("decode", COORDINATION, "child of handoff.prep: remote agent metadata load"),
    "handoff.descriptors": Stage("decode", COORDINATION, "child of handoff.prep: descriptor list build"),
    "handoff.writer_queue": Stage("prefill", COORDINATION, "child of handoff.prep (push): wait in the nixl-push-writer queue"),
    "kv.transfer": Stage("decode", TRANSFER, "post -> post + NIXL's own transfer duration (per NIXL handle); "
                         "counts as coordination when it failed or moved 0 bytes (DESIGN.md §2)"),
    "kv.ready": Stage("decode", COORDINATION, "transfer finished -> seen by the poll on every expected rank -> promoted by the scheduler"),
    "decode.queue": Stage("decode", QUEUE, "D: queued -> blocks allocated"),
    "decode.first_step": Stage("decode", COMPUTE, "D: promoted -> first token sampled"),
    "decode.step": Stage("decode", None, "one engine step (also on P); children: connector work on the forward thread"),
    "prefill.step": Stage("prefill", None, "one engine step on P (same shape as decode.step)"),
    "connector.load": Stage("decode", COORDINATION, "connector work on the forward thread before the forward (start_load_kv)"),
    "connector.poll": Stage("decode", COORDINATION, "connector completion polling on the forward thread (get_finished)"),
    "connector.save": Stage("decode", COORDINATION, "connector save work on the forward thread (wait_for_save)"),
    "prefill.block_hold": Stage("prefill", None, "P's KV blocks from KV ready to release (attr kv.release_cause)"),
    "decode.block_reserve": Stage("decode", None, "D's KV blocks from reservation to first use (push reserves early)"),
    "unattributed": Stage("", COORDINATION, "part of an interval no leaf covers; named by its neighbours"),
}

#: Instants recorded as events (DESIGN.md §2): name -> meaning.
EVENTS: dict[str, str] = {
    "router.first_token": "router wrote the first chunk carrying >= 1 generated token (TTFT end)",
    "router.last_token": "router wrote the last token chunk",
    "token": "a chunk with generated tokens was written to the client (attr gen_ai.usage.output_tokens = tokens so far)",
    "registration.sent": "push: D sent its PUSH_REG notification",
    "registration.received": "push: P received a registration",
    "notification.sent": "a NIXL notification was sent (attr kv.notif_kind)",
    "notification.received": "a NIXL notification was received (attr kv.notif_kind)",
    "clock.sample": "a cross-engine clock offset sample (attrs clock.*)",
    "request.abort": "the request was aborted",
    "response.tokenless": "an API server ended a 2xx response without any token: the engine gave the request up "
                          "(attr lifecycle.cause finish_abort | finish_error | error_event | no_token | stream_cut; "
                          "vllm-project/vllm#57082)",
    "request.finished": "D's engine finished the request normally (attr gen_ai.usage.output_tokens = tokens it generated)",
    "request.preempted": "the request was preempted (a recompute starts a new attempt)",
    "request.timeout": "a timeout fired (attr lifecycle.cause says which)",
    "kv.lease_expired": "P's lease on the blocks expired before a release notification",
    "kv.ttl_expired": "D's reserved blocks' TTL expired before every write arrived",
    "kv.post_failed": "posting a NIXL transfer failed",
    "kv.transfer_failed": "a posted NIXL transfer failed",
    "kv.load_failed": "KV load failed; the prompt is recomputed locally",
    "notification.unmatched": "a notification matched no known request (attr request id as received)",
    "registration.timeout": "push: no registration matched before the timeout",
    "handshake.failed": "the NIXL handshake with a peer failed",
    "router.leg_failed": "a router leg failed (attrs http.response.status_code, error.*)",
    "engine.thread_exited": "engine-level (no request id): a connector background thread (nixl-push-writer, handshake "
                            "executor, a transfer worker) exited; recorded from the exiting thread, so the record's "
                            "thread names it; attrs lifecycle.cause, error.type. Every later request that needs the "
                            "thread on that engine waits (incomplete_requests.cause thread_exited)",
    "lab.inject": "lab only (PDTRACE_LAB_INJECT): a known delay was added inside a stage for this request "
                  "(attrs lab.stage, lab.injected_ms; pdtrace.connector.lab.inject)",
}

#: Events that make a request failed: the ``is_failure`` list of ``analysis/sql/incomplete.sql`` (keep the two
#: equal). Tail retention (:mod:`pdtrace.instrument.retention`) keeps every request with one of them.
#: ``kv.load_failed`` is not in it: the prompt is recomputed locally and the request goes on.
FAILURE_EVENTS = frozenset((
    "request.abort", "request.timeout", "kv.lease_expired", "kv.ttl_expired", "kv.post_failed",
    "kv.transfer_failed", "registration.timeout", "handshake.failed", "router.leg_failed",
    "notification.unmatched", "response.tokenless"))

#: Attributes of the failure and lifecycle events above that the analysis reads
#: (module incomplete; the allowlist with types is pdtrace.instrument.attributes):
#: ``lifecycle.cause`` -- the reason (e.g. ``aborted_waiting_for_kv``, ``notification_failed``,
#: ``release_failed``, a timeout's kind: an abort whose cause names a timeout, expiry or deadline
#: is a deadline check); ``lifecycle.phase`` -- the handoff phase the failure happened in
#: (``handshake`` | ``registration`` | ``post`` | ``transfer`` | ``notification`` | ``release`` |
#: ``load``); ``lifecycle.expected`` / ``lifecycle.received`` -- rank counts; ``error.type`` on
#: ``router.leg_failed`` (``timeout``: the router's own deadline).
FAILURE_ATTRIBUTES = ("lifecycle.cause", "lifecycle.phase", "lifecycle.expected", "lifecycle.received", "error.type")


def category(stage: str) -> str | None:
    """Category of a stage name (queue/compute/transfer/coordination), None for parents.

    Raises KeyError for a name not in :data:`STAGES`.
    """
    return STAGES[stage].category
