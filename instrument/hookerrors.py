"""Errors swallowed inside pdtrace's hooks: a per-process count that reaches the store.

A layer that runs pdtrace code inside another program's hooks (the traced
connectors' :func:`pdtrace.connector.traced.safety.safe`) must never let an
exception of its own reach that program; it swallows it and calls
:func:`count`. The recorder's writer reads :func:`total` and :func:`first`
at every flush (:meth:`pdtrace.instrument.writer.Writer._traced`), and the
host's sink writes them on the process's ``recorder.stats`` rows as
``attr_int['recorder.hook_errors']`` (cumulative since the process started)
and ``attr_str['recorder.hook_error_first']`` (the first swallowed error, as
``'<hook qualname>: <exception class qualname>'``); analysis view
``processes`` has them as ``hook_errors`` / ``hook_error_first`` and
``pdtrace check`` reports a live process with ``hook_errors`` > 0.

Only names are kept, never an exception's message or arguments (they can
hold prompt text). Cost: nothing until an error happens (the hook's caller
calls :func:`count` only in its ``except``), then one lock. A forked child
starts at zero (its rows carry its own pid). This module imports nothing of
pdtrace's.
"""
from __future__ import annotations

import os
import threading

#: Longest ``where`` kept (characters); a longer one is cut.
MAX_WHERE = 200

_total = 0
_first: str | None = None
_kinds: set[str] = set()
_lock = threading.Lock()


def count(where: str, exc: BaseException) -> bool:
    """Count one error swallowed in hook ``where`` (a qualified function name); True iff it is the first of
    its kind (same ``where`` and exception class) in this process, so that the caller can log it once."""
    global _total, _first
    kind = f"{where[:MAX_WHERE]}: {type(exc).__qualname__}"
    with _lock:
        _total += 1
        if _first is None:
            _first = kind
        if kind in _kinds:
            return False
        _kinds.add(kind)
        return True


def total() -> int:
    """Errors swallowed in this process's hooks so far (count, cumulative)."""
    return _total


def first() -> str | None:
    """The first swallowed error, ``'<where>: <exception class>'``; None if there was none."""
    return _first


def reset() -> None:
    """Back to zero (tests; a forked child)."""
    global _total, _first
    with _lock:
        _total = 0
        _first = None
        _kinds.clear()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
