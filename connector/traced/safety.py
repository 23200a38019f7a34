"""Tracing must never block or crash the engine: every pdtrace call in a hook goes through here.

:func:`safe` runs a pdtrace-side function and swallows (and counts) any
exception it raises; vLLM's own code is never wrapped by it, so vLLM's
exceptions propagate exactly as without pdtrace. The first error of each
kind is logged once (class and code only); :func:`error_count` is read by the
tests (it must stay 0 on a healthy run) and written as the ``pdtrace.errors``
counter in the step spans' neighbourhood by nobody else.
"""
from __future__ import annotations

import logging
import threading

from pdtrace.instrument import selfcpu

log = logging.getLogger("pdtrace.connector")

_errors = 0
_seen: set[str] = set()
_lock = threading.Lock()


def _count(exc: BaseException, where: str) -> None:
    global _errors
    with _lock:
        _errors += 1
        key = f"{where}:{type(exc).__name__}"
        first = key not in _seen
        if first:
            _seen.add(key)
    if first:
        try:
            log.warning("pdtrace: tracing error in %s swallowed (%s); counted, engine unaffected",
                        where, type(exc).__name__, exc_info=True)
        except Exception:  # noqa: BLE001 - logging must not raise either
            pass


def safe(fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)``; on any exception count it and return None.

    With ``PDTRACE_SELF_CPU=1`` the call's thread CPU time is charged to
    pdtrace (:mod:`pdtrace.instrument.selfcpu`).
    """
    if selfcpu.enabled:
        t0 = selfcpu.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the whole point
            _count(exc, getattr(fn, "__qualname__", repr(fn)))
            return None
        finally:
            selfcpu.add(t0)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the whole point
        _count(exc, getattr(fn, "__qualname__", repr(fn)))
        return None


def error_count() -> int:
    """Tracing errors swallowed in this process so far."""
    return _errors


def reset() -> None:
    """Reset the counter (tests)."""
    global _errors
    with _lock:
        _errors = 0
        _seen.clear()
