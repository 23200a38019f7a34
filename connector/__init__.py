"""pdtrace.connector: the serving side — traced NIXL connectors (``traced``), vLLM differences
(``vllm_compat``), and the local P/D lab (``lab``).

``TracedNixlPullConnector`` / ``TracedNixlPushConnector`` are importable from
here; they import vLLM, so they load lazily (the lab and tests can import
``pdtrace.connector`` without vLLM).
"""

__all__ = ["TracedNixlPullConnector", "TracedNixlPushConnector"]


def __getattr__(name):
    if name in __all__:
        from . import traced

        return getattr(traced, name)
    raise AttributeError(name)
