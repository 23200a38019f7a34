"""pdtrace.instrument: the in-process span recorder and the Parquet span store.

Tracing needs two things: ``PDTRACE_DIR`` set (see :mod:`pdtrace.instrument.config`
for every variable) *and* a process that traces calling :func:`activate`
(the traced connectors, the API-server middleware, the lab's router; the
vLLM plugin's objects call it when vLLM builds them). Importing this package
starts nothing (DESIGN.md §6 "Reading never writes": ``pdtrace report``,
``sql`` and ``dashboard`` import it on a traced host and must not write into
the directory they read). Call sites use the process-wide :data:`tracer`::

    from pdtrace.instrument import activate, tracer
    activate("explicit")          # once, where the process starts tracing (idempotent)
    if tracer.on:
        tracer.record("prefill.compute", request_id, t0_ns, t1_ns, {"step.id": 12})

Modules: ``recorder`` (call-site API, caller's thread), ``writer`` (background
thread handing records to the host's sink process), ``hostsink`` (finding or
starting that sink: address, lock, ``find``, ``sync``), ``sink`` (the helper
process, one per host and trace directory: conversion through ``convert``,
Parquet files), ``otlp`` (optional OTLP export), ``store``
(writing stores by hand, checking files), ``schema`` (columns and version),
``attributes`` (allowlist), ``hookerrors`` (errors swallowed in hooks, counted), ``stages`` (stage and event vocabulary), ``ids``
(request ids, trace ids, sampling), ``clock`` (anchors), ``config`` (env vars).
This package imports none of pdtrace's other parts and never imports vLLM.
The recorder module is imported on first use of :data:`tracer` (PEP 562), so
``import pdtrace.instrument.config`` alone (the vLLM plugin's check) loads no
recorder and registers no fork hook.
"""
from __future__ import annotations

__all__ = ["Tracer", "tracer", "configure", "activate", "ACTIVATIONS"]

#: How a process's tracing was switched on, written on every ``recorder.stats`` row as
#: ``attr_str['pdtrace.activation']``: 'plugin' (vLLM loaded pdtrace's plugin and the stock
#: connector names or the API server were traced through it) or 'explicit' (the process named
#: pdtrace's classes itself: ``TracedNixl*Connector``, ``--middleware``, the lab's router, or code
#: calling :func:`configure`).
ACTIVATIONS = ("plugin", "explicit")


def __getattr__(name: str):
    if name in ("Tracer", "tracer"):
        from . import recorder

        return getattr(recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def configure(**kwargs):
    """(Re)configure the process-wide tracer from the environment; see Tracer.configure."""
    from .recorder import tracer

    return tracer.configure(**kwargs)


def activate(activation: str = "explicit", **resource: object) -> bool:
    """Start the process-wide recorder if ``PDTRACE_DIR`` is set; True iff tracing is on.

    Idempotent (the first call in a process decides; later calls return the state).
    ``activation`` is one of :data:`ACTIVATIONS`; raises ValueError for another.
    ``resource``: the process's resource columns (role, engine_id, ...), in force before
    its first row is written. See :meth:`pdtrace.instrument.recorder.Tracer.activate`.
    """
    from .recorder import tracer

    return tracer.activate(activation, **resource)
