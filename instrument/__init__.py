"""pdtrace.instrument: the in-process span recorder and the Parquet span store.

Switched on by ``PDTRACE_DIR`` (see :mod:`pdtrace.instrument.config` for every
variable). Call sites use the process-wide :data:`tracer`::

    from pdtrace.instrument import tracer
    if tracer.on:
        tracer.record("prefill.compute", request_id, t0_ns, t1_ns, {"step.id": 12})

Modules: ``recorder`` (call-site API, caller's thread), ``writer`` (background
thread handing records to the sink process), ``sink`` (the helper process:
conversion through ``convert``, Parquet files), ``otlp`` (optional OTLP export), ``store``
(writing stores by hand, checking files), ``schema`` (columns and version),
``attributes`` (allowlist), ``stages`` (stage and event vocabulary), ``ids``
(request ids, trace ids, sampling), ``clock`` (anchors), ``config`` (env vars).
This package imports none of pdtrace's other parts and never imports vLLM.
"""
from .recorder import Tracer, tracer

__all__ = ["Tracer", "tracer", "configure"]


def configure(**kwargs):
    """(Re)configure the process-wide tracer from the environment; see Tracer.configure."""
    return tracer.configure(**kwargs)


if tracer.config.trace_dir is None:
    import os as _os

    if _os.environ.get("PDTRACE_DIR"):
        tracer.configure()
