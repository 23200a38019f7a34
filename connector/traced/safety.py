"""Tracing must never block or crash the engine: every pdtrace call in a hook goes through here.

:func:`safe` runs a pdtrace-side function and swallows (and counts) any
exception it raises; vLLM's own code is never wrapped by it, so vLLM's
exceptions propagate exactly as without pdtrace. Each swallowed error is
counted in :mod:`pdtrace.instrument.hookerrors`, which the recorder writes on
the process's ``recorder.stats`` rows at every flush
(``recorder.hook_errors``, ``recorder.hook_error_first``; view ``processes``
columns ``hook_errors``, ``hook_error_first``; ``pdtrace check`` reports a
live process with errors). The first error of each kind (hook and exception
class) is logged once: its class and the code it went through (the
traceback's frames: file, line, function, source line), never its message,
which can hold prompt text; the store gets the names only. :func:`error_count` must stay 0 on a healthy
run (the tests read it).
"""
from __future__ import annotations

import logging
import traceback

from pdtrace.instrument import hookerrors, selfcpu

log = logging.getLogger("pdtrace.connector")


def _where(fn) -> str:
    """The hook's qualified name; for a callable without one, its class's (never its repr: a bound
    ``functools.partial`` shows its arguments)."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else type(fn).__qualname__


def count_error(exc: BaseException, where: str) -> None:
    """Count (and log once per kind) a tracing error swallowed at ``where`` (a hook's qualified name):
    what :func:`safe` does with one; for a hook that writes :func:`safe` out on a per-step path."""
    if hookerrors.count(where, exc):
        try:
            frames = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
            log.warning("pdtrace: tracing error in %s swallowed (%s; message not logged); counted, engine "
                        "unaffected. Traceback (most recent call last):\n%s", where, type(exc).__qualname__,
                        frames.rstrip())
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
            count_error(exc, _where(fn))
            return None
        finally:
            selfcpu.add(t0)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the whole point
        count_error(exc, _where(fn))
        return None


def error_count() -> int:
    """Tracing errors swallowed in this process so far (:func:`pdtrace.instrument.hookerrors.total`)."""
    return hookerrors.total()


def reset() -> None:
    """Reset the counter (tests)."""
    hookerrors.reset()
