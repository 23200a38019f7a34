"""pdtrace's vLLM plugin: tracing switched on by ``PDTRACE_DIR`` alone (DESIGN.md §6).

Shipped as the ``pdtrace`` entry point of vLLM's ``vllm.general_plugins``
group (``pyproject.toml``). vLLM calls :func:`register` once per process
(``vllm.plugins.load_general_plugins``: in the API server while it parses
its arguments, in EngineCore when it starts, in each worker), so the
operator's serving command does not change::

    PDTRACE_DIR=/traces vllm serve MODEL --kv-transfer-config \\
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", ...}'

``PDTRACE_DIR`` unset: :func:`register` returns after one environment lookup
(:func:`pdtrace.instrument.config.requested`); it imports nothing else of
pdtrace (no recorder, no fork hook), starts no thread and no process, and the
stock classes stay in vLLM's registry (``benchmarks/plugin_cost.py`` measures
it). ``PDTRACE_DIR`` set, two things, each idempotent:

1. **Connector names.** vLLM's ``KVConnectorFactory`` resolves a
   ``kv_connector`` name without ``kv_connector_module_path`` through its
   ``_registry`` (name → zero-argument loader returning the class). The
   entries of :data:`STOCK_TO_TRACED` are re-pointed to loaders returning
   pdtrace's traced subclasses, so ``NixlConnector`` / ``NixlPullConnector``
   build ``TracedNixlPullConnector`` and ``NixlPushConnector`` builds
   ``TracedNixlPushConnector``; the configured name stays what it was, so
   vLLM's own checks on it are unchanged. A name with a module path
   (pdtrace's explicit class names) is resolved by vLLM as before.
2. **API server.** The frontend spans (``prefill.frontend`` /
   ``decode.frontend``) come from :class:`~pdtrace.connector.traced.middleware.FrontendMiddleware`.
   In a process that has vLLM's API-server app module loaded, the function
   that adds the server's middleware (``init_entrypoints_middleware``, called
   once by ``build_app``) is wrapped so that, after vLLM's own middleware
   (``--middleware`` included), it adds ``FrontendMiddleware`` with
   ``activation="plugin"`` — for a server with a ``--kv-transfer-config``
   only, and not when ``--middleware`` already names it.

vLLM's ``vllm.endpoint_plugins`` group is not used: vLLM 0.32 loads endpoint
plugins only when ``VLLM_PLUGINS`` names them (they add HTTP routes; see
``vllm/plugins/__init__.py``), so it cannot be switched on by ``PDTRACE_DIR``
alone, and setting ``VLLM_PLUGINS`` also filters the general plugins. An
operator who sets ``VLLM_PLUGINS`` must list ``pdtrace`` in it.

Nothing here starts a recorder: the traced connector (when vLLM builds it)
and the middleware (when the app is built) call
:func:`pdtrace.instrument.activate`, with ``activation`` 'plugin', in the
processes that trace; other ``vllm`` commands with ``PDTRACE_DIR`` set write
nothing. Every vLLM name relied on here is in
:data:`pdtrace.connector.vllm_compat.PLUGIN_HOOKS`. Never raises into vLLM
(its loader calls plugins unguarded): a failure logs one warning and leaves
the stock classes.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("pdtrace")

#: vLLM's NIXL connector names → pdtrace's traced class (in :data:`TRACED_MODULE`).
STOCK_TO_TRACED = {
    "NixlConnector": "TracedNixlPullConnector",
    "NixlPullConnector": "TracedNixlPullConnector",
    "NixlPushConnector": "TracedNixlPushConnector",
}
TRACED_MODULE = "pdtrace.connector.traced"
MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"
FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
#: Modules holding the name ``init_entrypoints_middleware`` that ``build_app`` calls (vLLM 0.32/0.33):
#: the app module (its own binding, looked up at call time) and the defining module (for later importers).
MIDDLEWARE_FN_MODULES = ("vllm.entrypoints.launchers.app", "vllm.entrypoints.serve.middleware.register")
MIDDLEWARE_FN = "init_entrypoints_middleware"


def register() -> None:
    """Entry point of ``vllm.general_plugins`` (see the module doc). Never raises."""
    try:
        from pdtrace.instrument.config import requested

        if not requested():
            return
        repoint_connectors()
        hook_api_server()
    except Exception as exc:  # noqa: BLE001 - never fail vLLM's start-up
        log.warning("pdtrace: vLLM plugin not installed (%s: %s); stock classes run untraced",
                    type(exc).__name__, exc)


def _loader(cls_name: str):
    def load():
        import importlib

        return getattr(importlib.import_module(TRACED_MODULE), cls_name)

    load._pdtrace = cls_name  # type: ignore[attr-defined]
    return load


def repoint_connectors() -> list[str]:
    """Point the stock NIXL names of ``KVConnectorFactory._registry`` at the traced classes.

    Returns the names re-pointed by this call (empty when already done or
    when this vLLM registers none of them).
    """
    import importlib

    factory = importlib.import_module(FACTORY_MODULE).KVConnectorFactory
    reg = factory._registry
    done = []
    for name, cls_name in STOCK_TO_TRACED.items():
        cur = reg.get(name)
        if cur is None or getattr(cur, "_pdtrace", None):
            continue
        reg[name] = _loader(cls_name)
        done.append(name)
    return done


def _kv_role(args) -> str | None:
    """``kv_role`` of the API server's parsed ``--kv-transfer-config`` (an object or a dict), or None."""
    kvc = args.kv_transfer_config  # None without --kv-transfer-config
    if kvc is None:
        return None
    return kvc.get("kv_role") if isinstance(kvc, dict) else kvc.kv_role


def _wrap_middleware_fn(orig):
    def init_entrypoints_middleware(args, app, *rest, **kw):
        out = orig(args, app, *rest, **kw)
        try:
            # vLLM's parsed serving arguments: both names are in vllm_compat.PLUGIN_HOOKS
            if args.kv_transfer_config and MIDDLEWARE not in (args.middleware or ()):
                from pdtrace.connector.traced.middleware import FrontendMiddleware, role_of

                app.add_middleware(FrontendMiddleware, role=role_of(_kv_role(args)), activation="plugin")
        except Exception as exc:  # noqa: BLE001 - the server runs on, untraced
            log.warning("pdtrace: frontend middleware not added (%s: %s)", type(exc).__name__, exc)
        return out

    init_entrypoints_middleware._pdtrace = True  # type: ignore[attr-defined]
    init_entrypoints_middleware.__wrapped__ = orig  # type: ignore[attr-defined]
    return init_entrypoints_middleware


def hook_api_server() -> list[str]:
    """Wrap ``init_entrypoints_middleware`` where it is already loaded (the API-server process).

    Imports nothing: a process without vLLM's API-server modules loaded (EngineCore,
    workers) is left alone. Returns the modules patched by this call.
    """
    done = []
    for modname in MIDDLEWARE_FN_MODULES:
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        fn = getattr(mod, MIDDLEWARE_FN)  # in vllm_compat.PLUGIN_HOOKS: defined / called there
        if getattr(fn, "_pdtrace", False):  # pdtrace's own mark: already wrapped
            continue
        setattr(mod, MIDDLEWARE_FN, _wrap_middleware_fn(fn))
        done.append(modname)
    return done
