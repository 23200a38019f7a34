"""Request ids, trace ids and the sampling rule shared by router, prefill and decode.

DESIGN.md §3: the router gives each dispatch an id X and sends it as
``X-Request-Id`` to both legs. vLLM turns it into an external id
``cmpl-X-<i>`` (completions, prompt index i) or ``chatcmpl-X`` (chat), and an
internal id = external id + ``-`` + 8 hex characters, different on P and D.
:func:`parse_request_id` strips prefix, index and suffix back to X.

Sampling: a request is traced iff sha256(X) read as a big-endian integer is
below ``p * 2**256``; the trace id is the first 16 bytes of the same digest,
so every process derives the same trace id and the same decision from X alone.
"""
from __future__ import annotations

import hashlib
import re
from fractions import Fraction
from typing import NamedTuple

_SUFFIX = re.compile(r"^(?P<base>.+)-(?P<suffix>[0-9a-f]{8})$")
_CMPL = re.compile(r"^cmpl-(?P<x>.+)-(?P<index>\d+)$")
_CHAT = re.compile(r"^chatcmpl-(?P<x>.+)$")


class RequestId(NamedTuple):
    """A vLLM request id taken apart.

    ``base``: X, the router's id; ``prompt_index``: i of ``cmpl-X-i`` (0 for
    chat or a bare id); ``external``: the id without the internal suffix;
    ``suffix``: the 8-hex internal suffix or None.
    """

    base: str
    prompt_index: int
    external: str
    suffix: str | None


def parse_request_id(rid: str, internal: bool | None = None) -> RequestId:
    """Take a vLLM request id (external or internal) apart into X, prompt index and suffix.

    ``internal=True`` says ``rid`` carries the 8-hex suffix; ``False`` that it
    does not; ``None`` strips a trailing ``-xxxxxxxx`` when one is present
    (a router id that itself ends in 8 hex after a dash is then ambiguous:
    pass ``internal`` where the caller knows). Ids in neither vLLM form are
    returned unchanged as their own base. Raises TypeError for a non-str.
    """
    if not isinstance(rid, str):
        raise TypeError(f"request id must be str, not {type(rid).__name__}")
    external, suffix = rid, None
    if internal is not False:
        m = _SUFFIX.match(rid)
        if m and (internal or m.group("base").startswith(("cmpl-", "chatcmpl-"))):
            external, suffix = m.group("base"), m.group("suffix")
    m = _CMPL.match(external)
    if m:
        return RequestId(m.group("x"), int(m.group("index")), external, suffix)
    m = _CHAT.match(external)
    if m:
        return RequestId(m.group("x"), 0, external, suffix)
    return RequestId(external, 0, external, suffix)


def base_id(rid: str) -> str:
    """Return X for any vLLM request id form (see :func:`parse_request_id`)."""
    return parse_request_id(rid).base


def digest(request_id: str) -> bytes:
    """sha256 of the UTF-8 request id: the one hash behind sampling and trace ids."""
    return hashlib.sha256(request_id.encode()).digest()


def trace_id(request_id: str) -> str:
    """W3C trace id (32 lowercase hex) of a request: the first 16 bytes of sha256(X)."""
    return digest(request_id)[:16].hex()


def sample_threshold(fraction: float) -> int:
    """The integer bound ``fraction * 2**256`` of the sampling rule, exact for the float given.

    Raises ValueError outside [0, 1].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"sampling fraction must be within [0, 1], got {fraction}")
    return int(Fraction(fraction) * (1 << 256))


def is_sampled(request_id: str, fraction: float) -> bool:
    """True iff sha256(request_id) as a big-endian integer is below ``fraction * 2**256``."""
    return int.from_bytes(digest(request_id), "big") < sample_threshold(fraction)


def traceparent(request_id: str, span_id: int, sampled: bool) -> str:
    """W3C ``traceparent`` header for a request's trace and a parent span id (uint64)."""
    return f"00-{trace_id(request_id)}-{span_id & 0xFFFFFFFFFFFFFFFF:016x}-{'01' if sampled else '00'}"
