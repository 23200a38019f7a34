"""pdtrace's traced NIXL connectors for vLLM (0.32 run, 0.33 checked statically).

Select one with ``--kv-transfer-config``::

    {"kv_connector": "TracedNixlPullConnector",            # or TracedNixlPushConnector
     "kv_connector_module_path": "pdtrace.connector.traced",
     "kv_role": "kv_producer" | "kv_consumer", "kv_buffer_device": "cpu",
     "kv_connector_extra_config": {"nixl_progress_thread": false}}   # optional

Or keep vLLM's stock names (``NixlConnector``, ``NixlPullConnector``,
``NixlPushConnector``, no module path): with ``PDTRACE_DIR`` set, pdtrace's
vLLM plugin (:mod:`pdtrace.connector.plugin`) resolves them to these classes.

Tracing is on iff ``PDTRACE_DIR`` is set in the engine's environment (the
recorder starts when vLLM builds the connector); off, the stock vLLM
scheduler/worker objects are built and run unchanged.

Reading order (like vLLM's NIXL package):

1. ``facade``    — construction; forward-thread calls → ``connector.load/poll/save``
2. ``scheduler`` — EngineCore side: queue, compute chunks, steps, promotion, first step, block hold
3. ``worker``    — worker side shared by both modes: handshake, clock samples, failures, leases
4. ``agent``     — the NIXL agent proxy: posts, telemetry → ``kv.transfer``, notifications
5. ``pull`` / ``push`` — the mode-specific hooks and the two public facades
6. ``messages``  — the per-step scheduler → worker ``StepInfo`` and worker → scheduler ``StepReport``
7. ``safety``    — every pdtrace call is swallowed-and-counted on error, never raised into vLLM
8. ``middleware``— the API server's ``--middleware`` hook (``prefill.frontend`` / ``decode.frontend``)

Each module's docstring lists the vLLM methods it hooks, on which side and
thread they run, and what they record. Every vLLM name they use (hooked
methods, attributes and message fields read, strings parsed) is listed, and
checked against the installed vLLM and the 0.33.0 wheel, in
:mod:`pdtrace.connector.vllm_compat`.
"""
from .pull import TracedNixlPullConnector
from .push import TracedNixlPushConnector

__all__ = ["TracedNixlPullConnector", "TracedNixlPushConnector"]
