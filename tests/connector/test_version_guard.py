"""Version guard: fails, naming the hook, when the installed vLLM lacks a name the traced connectors use."""
import pytest

vllm = pytest.importorskip("vllm")

from pdtrace.connector import vllm_compat  # noqa: E402


def test_every_hook_present_in_installed_vllm():
    missing = vllm_compat.missing_hooks()
    assert not missing, (
        f"vLLM {vllm_compat.vllm_version()} lacks hooks the traced connectors rely on "
        f"(supported: run {vllm_compat.SUPPORTED_RUN}, static {vllm_compat.SUPPORTED_STATIC}):\n  "
        + "\n  ".join(missing))


def test_guard_names_a_missing_hook(monkeypatch):
    fake = vllm_compat.Hook("pull_worker", "NixlPullConnectorWorker", "_no_such_method_xyz", ("a",))
    monkeypatch.setattr(vllm_compat, "HOOKS", vllm_compat.HOOKS + (fake,))
    missing = vllm_compat.missing_hooks()
    assert any("NixlPullConnectorWorker._no_such_method_xyz" in m and "method missing" in m for m in missing)


def test_guard_names_a_changed_signature(monkeypatch):
    fake = vllm_compat.Hook("pull_worker", "NixlPullConnectorWorker", "_read_blocks_for_req", ("request", "meta"))
    monkeypatch.setattr(vllm_compat, "HOOKS", (fake,))
    (m,) = vllm_compat.missing_hooks()
    assert "_read_blocks_for_req" in m and "parameters" in m


def test_traced_classes_import_and_override_what_they_hook():
    from pdtrace.connector import TracedNixlPullConnector, TracedNixlPushConnector
    from pdtrace.connector.traced import pull, push

    for cls in (TracedNixlPullConnector, TracedNixlPushConnector):
        for name in ("start_load_kv", "wait_for_save", "get_transfer_results", "bind_connector_metadata",
                     "build_connector_worker_meta"):
            assert name in vars(cls.__mro__[1]), name  # the facade mixin defines it
    for name in ("_read_blocks_for_req", "_background_nixl_handshake"):
        assert name in vars(pull.TracedNixlPullConnectorWorker)
    for name in ("_do_send_reg_notif", "_handle_push_reg_notif", "_xfer_blocks_for_req", "_do_start_push_kv"):
        assert name in vars(push.TracedNixlPushConnectorWorker)


_PLUGIN_FAKES = (
    vllm_compat.Hook(vllm_compat.FACTORY, "KVConnectorFactory", "NoSuchNixlConnector", kind="registered"),
    vllm_compat.Hook("vllm.plugins", None, "DEFAULT_PLUGINS_GROUP", ("vllm.renamed_plugins",), kind="value"),
    vllm_compat.Hook("vllm.v1.engine.core", None, "load_renamed_plugins", kind="calls"),
    vllm_compat.Hook("vllm.entrypoints.serve.middleware.register", None, "init_entrypoints_middleware",
                     ("app", "args"), kind="function"),
)


def _names_each_fake(problems):
    assert len(problems) == 4, problems
    assert "NoSuchNixlConnector: connector name not registered" in problems[0]
    assert "DEFAULT_PLUGINS_GROUP" in problems[1] and "vllm.renamed_plugins" in problems[1]
    assert "load_renamed_plugins: no longer called" in problems[2]
    assert "init_entrypoints_middleware: parameters" in problems[3]


def test_guard_names_a_changed_plugin_hook(monkeypatch):
    """The plugin's table (connector registry, plugin group, loading processes, middleware function)."""
    assert not [m for m in vllm_compat.missing_hooks() if "plugins" in m or "factory" in m]
    monkeypatch.setattr(vllm_compat, "HOOKS", ())
    monkeypatch.setattr(vllm_compat, "PLUGIN_HOOKS", _PLUGIN_FAKES)
    _names_each_fake(vllm_compat.missing_hooks())


def test_static_check_names_a_changed_plugin_hook(monkeypatch):
    import os

    root = os.path.dirname(os.path.dirname(vllm.__file__))
    monkeypatch.setattr(vllm_compat, "HOOKS", ())
    assert vllm_compat.static_check(root) == []  # the real plugin hooks, read from the installed source
    monkeypatch.setattr(vllm_compat, "PLUGIN_HOOKS", _PLUGIN_FAKES)
    _names_each_fake(vllm_compat.static_check(root))


def test_guard_reads_fields_and_names_changed_source_hooks(monkeypatch):
    """Dataclass fields without a class attribute (``default_factory``) count as present; the source kinds
    (strings vLLM writes, calls with keywords, f-string shapes, attributes assigned / read) are named
    when the installed source no longer has them."""
    H = vllm_compat.Hook
    present = (H("vllm.v1.outputs", "KVConnectorOutput", "failed_recving", kind="attr"),
               H("vllm.v1.outputs", "KVConnectorOutput", "invalid_block_ids", kind="attr"),
               H("base_worker", None, "transfer_failed", kind="literal"),
               H("pull_worker", None, "make_prepped_xfer", ("notif_msg",), kind="calls"),
               H("pull_worker", None, "{}:{}", kind="fstring"))
    monkeypatch.setattr(vllm_compat, "PLUGIN_HOOKS", ())
    monkeypatch.setattr(vllm_compat, "HOOKS", present)
    assert vllm_compat.missing_hooks() == []
    fakes = (H("vllm.v1.outputs", "KVConnectorOutput", "no_such_field", kind="attr"),
             H("base_worker", None, "no_such_failure_xyz", kind="literal"),
             H("pull_worker", None, "make_prepped_xfer", ("no_such_kw",), kind="calls"),
             H("pull_worker", None, "{}|{}", kind="fstring"),
             H("vllm.entrypoints.launchers.api_server.app_state", None, "no_such_state", kind="assigns"),
             H("vllm.entrypoints.serve.middleware.register", None, "no_such_arg", kind="reads"))
    monkeypatch.setattr(vllm_compat, "HOOKS", fakes)
    problems = vllm_compat.missing_hooks()
    assert len(problems) == 6, problems
    assert "KVConnectorOutput.no_such_field: instance attribute never assigned" in problems[0]
    assert "'no_such_failure_xyz': string no longer in" in problems[1]
    assert "make_prepped_xfer: no call passes the keywords ('no_such_kw',)" in problems[2]
    assert "'{}|{}': no f-string shaped" in problems[3]
    assert "no_such_state: attribute no longer assigned" in problems[4]
    assert "no_such_arg: attribute no longer read" in problems[5]
