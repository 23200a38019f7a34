"""pdtrace's vLLM plugin (``vllm.general_plugins`` entry point ``pdtrace``), without engines.

Each case runs in a fresh interpreter (``child``) and loads the plugin through
the installed entry point, as vLLM's ``load_general_plugins`` does. Real vLLM
objects: its connector factory, its argument parser and ``build_app`` (the
API server's app, not served). The engines with the plugin recipe are in
``test_traced_pull_lab.py`` / ``test_traced_push_lab.py``.
"""
import json

import pytest

pytest.importorskip("vllm")

_LOAD = """
    import sys, threading
    from importlib.metadata import entry_points
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "pdtrace"]
    assert ep.value == "pdtrace.connector.plugin:register", ep.value
"""


def test_unset_imports_nothing_starts_nothing_keeps_stock_classes(child):
    r = child(_LOAD + """
    import os
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    before = dict(KVConnectorFactory._registry)
    assert not [m for m in sys.modules if m.startswith("pdtrace")]
    ep.load()()
    assert KVConnectorFactory._registry == before
    assert all(KVConnectorFactory._registry[k] is v for k, v in before.items())
    print(sorted(m for m in sys.modules if m.startswith("pdtrace")))
    print(sorted(t.name for t in threading.enumerate()))
    print(os.listdir(f"/proc/{os.getpid()}/task").__len__() == threading.active_count(),
          open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    mods, threads, procs = r.stdout.strip().splitlines()[-3:]
    # the plugin module and the one-lookup config check (its package is lazy: no recorder, no fork hook)
    assert mods == str(["pdtrace", "pdtrace.connector", "pdtrace.connector.plugin", "pdtrace.instrument",
                        "pdtrace.instrument.config", "pdtrace.instrument.cpus"])
    assert "pdtrace-writer" not in threads
    assert procs.endswith("[]"), procs  # no child process (no sink)


def test_set_repoints_stock_names_keeps_explicit_ones_starts_no_recorder(child, tmp_path):
    d = tmp_path / "t"
    r = child(_LOAD + """
    ep.load()()
    ep.load()()  # idempotent: vLLM may load plugins again in another path
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
    def cls(**kw):
        return F.get_connector_class(KVTransferConfig(kv_role="kv_both", **kw)).__name__
    print(cls(kv_connector="NixlConnector"), cls(kv_connector="NixlPullConnector"),
          cls(kv_connector="NixlPushConnector"), cls(kv_connector="ExampleConnector"))
    print(cls(kv_connector="TracedNixlPushConnector", kv_connector_module_path="pdtrace.connector.traced"))
    from pdtrace.connector.traced.facade import activation_of
    print(activation_of(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")),
          activation_of(KVTransferConfig(kv_connector="TracedNixlPullConnector", kv_role="kv_both",
                                         kv_connector_module_path="pdtrace.connector.traced")))
    from pdtrace.instrument import tracer
    print(tracer.on, sum(t.name == "pdtrace-writer" for t in threading.enumerate()))
    """, {"PDTRACE_DIR": str(d)}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-4:] == [
        "TracedNixlPullConnector TracedNixlPullConnector TracedNixlPushConnector ExampleConnector",
        "TracedNixlPushConnector",
        "plugin explicit",
        "False 0",  # the recorder starts where a traced object is built, not in the plugin
    ]
    assert not d.exists() or not list(d.iterdir())


_APP = _LOAD + """
    import json
    from vllm.entrypoints.launchers.api_server import entry  # what vLLM's API server has loaded
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())   # loads the general plugins (vLLM's own call)
    kv = {{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}}
    for extra in ({extras}):
        args = parser.parse_args(["--model", "/nonexistent"] + extra)
        app = build_app(args, supported_tasks=("generate",))
        print(json.dumps([[m.cls.__name__, m.kwargs] for m in app.user_middleware
                          if m.cls.__name__ == "FrontendMiddleware"]))
"""


def test_api_server_gets_the_frontend_middleware_once(child, tmp_path):
    """Stock serving command: added by the plugin (role from --kv-transfer-config); with --middleware
    naming it: only vLLM's; no --kv-transfer-config (not a P/D engine): none."""
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"})
    extras = repr([["--kv-transfer-config", kv],
                   ["--kv-transfer-config", kv, "--middleware", "pdtrace.connector.traced.middleware.FrontendMiddleware"],
                   []])[1:-1]
    r = child(_APP.format(extras=extras), {"PDTRACE_DIR": str(tmp_path / "t")}, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x) for x in r.stdout.strip().splitlines()[-3:]] == [
        [["FrontendMiddleware", {"role": "prefill", "activation": "plugin"}]],
        [["FrontendMiddleware", {}]],
        [],
    ]
    r = child(_APP.format(extras=repr([["--kv-transfer-config", kv]])[1:-1] + ","), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []  # PDTRACE_DIR unset: stock app
