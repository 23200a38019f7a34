"""Small helpers shared by the traced scheduler and worker: request ids, notification kinds.

Request id on every span is the base id X (pdtrace.instrument.ids); vLLM's
internal id (external + 8 hex, different on P and D) is kept as the
``request.internal_id`` attribute.
"""
from __future__ import annotations

from pdtrace.instrument import ids as _ids

from ..vllm_compat import HEARTBEAT_PREFIX, PUSH_REG_PREFIX

_cache: dict[str, tuple[str, int]] = {}
#: :func:`split_id`'s cache (internal id -> (X, prompt index)), read directly by a hook that runs per output
#: of every engine step (the API server's output hook), where the function call is most of the cost
SPLIT_CACHE = _cache


def split_id(internal_id: str) -> tuple[str, int]:
    """(base id X, prompt index) of a vLLM internal or external request id (cached)."""
    v = _cache.get(internal_id)
    if v is None:
        p = _ids.parse_request_id(internal_id)
        v = (p.base, p.prompt_index)
        if len(_cache) > 100_000:
            _cache.clear()
        _cache[internal_id] = v
    return v


def notif_kind(msg: bytes, role: str) -> tuple[str, str | None]:
    """Classify a NIXL notification: (kind, internal request id or None).

    Kinds: 'push_reg' (push registration), 'heartbeat' (lease renewal),
    'read_done' (pull: D finished READing P's blocks; received on P),
    'write_done' (push: P finished WRITing into D; received on D), 'other'.
    The prefixes and the ``<request id>:<count>`` form are vLLM's (listed in
    :mod:`pdtrace.connector.vllm_compat`).
    """
    if msg.startswith(PUSH_REG_PREFIX):
        return "push_reg", None
    if msg.startswith(HEARTBEAT_PREFIX):
        return "heartbeat", None
    try:
        s = msg.decode("utf-8")
        rid, _, n = s.rpartition(":")
        if rid and n.isdigit():
            return ("read_done" if role == "prefill" else "write_done"), rid
    except Exception:  # noqa: BLE001
        pass
    return "other", None
