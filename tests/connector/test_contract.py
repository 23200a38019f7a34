"""The vLLM contract is complete: every vLLM name the traced connectors and the plugin read is in
``pdtrace.connector.vllm_compat``'s table, every table entry is used, and no hooked name is read
through a silent ``getattr(obj, name, default)`` unless the table notes that vLLM may leave it unset.

Read from the source with :mod:`ast` (nothing of vLLM is run). The version guard
(``test_version_guard.py``) and the static check against the 0.33.0 wheel
(``test_vllm033_static.py``) then check the table's names against vLLM itself.
"""
import ast
import collections
import importlib.util
import pathlib
import queue
import threading

import pytest

pytest.importorskip("vllm")

from pdtrace.connector import vllm_compat  # noqa: E402

CONNECTOR = pathlib.Path(vllm_compat.__file__).parent
FILES = sorted((CONNECTOR / "traced").glob("*.py")) + [CONNECTOR / "plugin.py"]

#: Attributes read that are neither vLLM's nor pdtrace's, with their owner.
NOT_VLLM = {
    "xferDuration": "NIXL telemetry", "postDuration": "NIXL telemetry", "totalBytes": "NIXL telemetry",
    "descCount": "NIXL telemetry", "_handle": "NIXL transfer handle",
    "state": "Starlette app.state", "add_middleware": "Starlette app",
    "warning": "logging.Logger",
    "base": "pdtrace.instrument.ids.RequestId", "prompt_index": "pdtrace.instrument.ids.RequestId",
    "feed": "pdtrace.connector.sse.SSEDecoder", "done": "pdtrace.connector.sse.SSEDecoder",
    "pending": "pdtrace.connector.sse.SSEDecoder",
}
#: Python's own attributes (containers, queue.Queue's deque, thread-locals, exceptions).
PY = set().union(*(dir(o) for o in (dict(), set(), [], "", b"", (), collections.deque(), 0, queue.Queue(),
                                    threading.local(), Exception())))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _scan(path: pathlib.Path):
    """(reads, own) of one source file: {attribute read: [line, ...]} (``obj.name`` loads and
    ``getattr``/``hasattr`` string names, on anything but a module or a pdtrace import) and the
    attribute names pdtrace itself defines there (its own classes' fields and methods, anything it
    assigns on an object that is not a vLLM class's ``self``)."""
    tree = ast.parse(path.read_text())
    pkg = "pdtrace.connector" + (".traced" if path.parent.name == "traced" else "")
    namespaces = set()  # local names bound to a module or to something imported from pdtrace
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            namespaces.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - n.level + 1] + ([n.module] if n.module else []))
            for a in n.names:
                if base.startswith("pdtrace") or _is_module(f"{base}.{a.name}"):
                    namespaces.add(a.asname or a.name)
    own = set()
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        # a Traced* class (other than the agent proxy) is a vLLM class: its self.<name> are vLLM's
        vllm_cls = c.name.startswith("Traced") and c.name != "TracedAgent"
        for n in c.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not vllm_cls:
                own.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for tg in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    if isinstance(tg, ast.Name):
                        own.add(tg.id)
                        if tg.id == "__slots__":
                            own.update(e.value for e in n.value.elts)
        for n in ast.walk(c):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and not (
                    vllm_cls and isinstance(n.value, ast.Name) and n.value.id == "self"):
                own.add(n.attr)
    for fn in (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))):
        own.add(fn.name)
        for n in ast.walk(fn):
            if isinstance(fn, ast.FunctionDef) and isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
    reads: dict[str, list[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            if not (isinstance(n.value, ast.Name) and n.value.id in namespaces):
                reads.setdefault(n.attr, []).append(f"{path.name}:{n.lineno}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                and len(n.args) > 1 and isinstance(n.args[1], ast.Constant):
            reads.setdefault(n.args[1].value, []).append(f"{path.name}:{n.lineno}")
    return reads, own


def _table_names(hooks):
    return {h.name for h in hooks} | {h.cls for h in hooks if h.cls}


def unlisted_reads(files=FILES, hooks=None) -> dict[str, list[str]]:
    """Attributes the files read that are vLLM's by elimination and missing from the table."""
    reads, own = {}, set()
    for f in files:
        r, o = _scan(f)
        own |= o
        for k, v in r.items():
            reads.setdefault(k, []).extend(v)
    table = _table_names(vllm_compat.all_hooks() if hooks is None else hooks)
    return {k: v for k, v in sorted(reads.items())
            if k not in own and k not in PY and k not in table and k not in NOT_VLLM
            and not k.startswith(("__", "_pdt"))}


def test_every_vllm_name_the_connectors_read_is_in_the_table():
    assert unlisted_reads() == {}, "vLLM names read by the traced connectors / plugin but missing from " \
                                   "vllm_compat.HOOKS / PLUGIN_HOOKS (name: where)"


def test_the_audit_finds_a_name_missing_from_the_table():
    """The check above can fail: with the hooks the issue named taken out of the table, it names each."""
    gone = {"_ready_requests", "arrival_time", "preempted_req_ids", "failed_recving", "kv_connector_worker_meta",
            "reqs_to_recv", "reqs_to_send", "nixl_wrapper"}
    hooks = tuple(h for h in vllm_compat.all_hooks() if h.name not in gone)
    found = unlisted_reads(hooks=hooks)
    assert set(found) == gone, found
    assert any(w.startswith("pull.py:") for w in found["_ready_requests"])


def _identifiers_and_strings():
    """Every identifier (attribute, function, class, name, getattr string) and string constant of the
    traced connectors, plus the two vLLM-facing functions of vllm_compat itself."""
    ids, strs = set(), {vllm_compat.HEARTBEAT_PREFIX.decode()}
    for f in FILES + [CONNECTOR / "vllm_compat.py"]:
        tree = ast.parse(f.read_text())
        if f.name == "vllm_compat.py":
            tree = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef)
                                    and n.name in ("agent_config_override", "prog_thread_setting")],
                              type_ignores=[])
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                ids.add(n.attr)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ids.add(n.name)
            elif isinstance(n, ast.Name):
                ids.add(n.id)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                strs.add(n.value)
    return ids, strs


def test_every_table_entry_is_used_by_the_connectors():
    """No stale entry: a name in HOOKS that the connectors no longer use would fail the guard for nothing.
    (PLUGIN_HOOKS also lists what vLLM itself must do for the plugin to load: not checked here.)"""
    ids, strs = _identifiers_and_strings()
    stale = [vllm_compat._where(h) for h in vllm_compat.HOOKS if h.kind not in ("fstring", "value")
             and h.name not in (strs if h.kind == "literal" else ids)]
    assert stale == []
    # the notification prefixes pdtrace parses are the table's (PUSH_REG_NOTIF_PREFIX's value)
    from pdtrace.connector.traced import common

    (prefix,) = [h.params[0] for h in vllm_compat.HOOKS if h.name == "PUSH_REG_NOTIF_PREFIX"]
    assert common.PUSH_REG_PREFIX == prefix == b"PUSH_REG:"
    assert common.notif_kind(vllm_compat.HEARTBEAT_PREFIX + b"r1,r2", "prefill")[0] == "heartbeat"


def test_failure_types_are_the_tables():
    """Each failure type pdtrace maps to an event (worker._FAILURES) is a literal vLLM writes, checked."""
    from pdtrace.connector.traced.worker import _FAILURES

    listed = {h.name for h in vllm_compat.HOOKS if h.kind == "literal" and h.note == "failure_type"}
    assert set(_FAILURES) == listed


def silent_getattrs(files=FILES) -> list[str]:
    """``getattr(obj, name, default)`` / ``hasattr(obj, name)`` calls on a table name whose hook has no
    note (vLLM does not leave it unset), as ``file:line name``."""
    noted = {h.name for h in vllm_compat.all_hooks() if h.note}
    table = _table_names(vllm_compat.all_hooks())
    silent = []
    for f in files:
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and (
                    (n.func.id == "getattr" and len(n.args) == 3) or n.func.id == "hasattr") \
                    and isinstance(n.args[1], ast.Constant) and n.args[1].value in table \
                    and n.args[1].value not in noted:
                silent.append(f"{f.name}:{n.lineno} {n.args[1].value}")
    return silent


def test_no_silent_getattr_default_on_a_hooked_name():
    """A silent default on a hooked name hides a vLLM rename: allowed only where the table's note says
    vLLM may leave the value unset (then the reading code says so too)."""
    assert silent_getattrs() == []


def test_the_audit_finds_a_silent_getattr_and_an_unlisted_read(tmp_path):
    f = tmp_path / "hook.py"
    f.write_text("def _hook(request, so, out):\n"
                 "    arr = getattr(request, 'arrival_time', None)\n"              # hooked, no note: silent
                 "    meta = getattr(out, 'kv_connector_worker_meta', None)\n"     # noted: may be None
                 "    return so.scheduled_spec_decode_tokens\n")                   # not in the table
    assert silent_getattrs([f]) == ["hook.py:2 arrival_time"]
    assert unlisted_reads([f]) == {"scheduled_spec_decode_tokens": ["hook.py:4"]}
