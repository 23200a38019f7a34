"""vLLM 0.33.0 (CUDA-only on PyPI): hooked names and signatures checked statically, not run.

Reads the connector source from the 0.33.0 wheel (``pip download --no-deps
vllm==0.33.0``; set ``PDTRACE_VLLM033_WHEEL`` to the wheel, default
``/tmp/vllm033/vllm-0.33.0-*.whl``), unzips only the files it needs and
checks :data:`pdtrace.connector.vllm_compat.HOOKS` and ``PLUGIN_HOOKS`` (the vLLM plugin's)
with :mod:`ast`. Skipped
(with the reason) when the wheel is not available; vLLM 0.33 is never installed.
"""
import glob
import os
import re
import shutil
import zipfile

import pytest

from pdtrace.connector import vllm_compat

# the NIXL connector package (hooked classes and their bases) plus every module a hook names
_PREFIXES = ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/",
             "vllm/distributed/kv_transfer/kv_connector/v1/base.py") + vllm_compat.hook_source_files()


def _wheel():
    env = os.environ.get("PDTRACE_VLLM033_WHEEL")
    if env:
        return env
    hits = sorted(glob.glob("/tmp/vllm033/vllm-0.33.0-*.whl"))
    return hits[0] if hits else None


def test_hooks_exist_in_vllm_033_checked_statically_not_run(tmp_path):
    whl = _wheel()
    if not whl or not os.path.exists(whl):
        pytest.skip("vLLM 0.33.0 wheel not found (pip download --no-deps vllm==0.33.0 -d /tmp/vllm033)")
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.startswith(_PREFIXES)]
        assert names, "no NIXL connector source in the wheel"
        for n in names:
            z.extract(n, tmp_path)
    problems = vllm_compat.static_check(tmp_path)
    print(f"vLLM 0.33.0 ({os.path.basename(whl)}): {len(vllm_compat.all_hooks())} hooks checked statically, not run; "
          f"problems: {problems or 'none'}")
    assert not problems, "vLLM 0.33.0 lacks hooks (checked statically):\n  " + "\n  ".join(problems)


def test_static_check_reports_a_missing_method(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import vllm

    root = os.path.dirname(os.path.dirname(vllm.__file__))
    fake = vllm_compat.Hook("push_worker", "NixlPushConnectorWorker", "_gone_in_future", ())
    monkeypatch.setattr(vllm_compat, "HOOKS", (fake,))
    (p,) = vllm_compat.static_check(root)
    assert "_gone_in_future" in p and "missing" in p


@pytest.fixture(scope="module")
def vllm_src(tmp_path_factory):
    """The hooked modules' source: from the 0.33.0 wheel when it is here, else the installed vLLM's."""
    root = tmp_path_factory.mktemp("vllm_src")
    whl = _wheel()
    if whl and os.path.exists(whl):
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                if n.startswith(_PREFIXES):
                    z.extract(n, root)
        return root
    vllm = pytest.importorskip("vllm")
    site = os.path.dirname(os.path.dirname(vllm.__file__))
    for rel in _PREFIXES:
        src = os.path.join(site, rel)
        if os.path.isdir(src):
            shutil.copytree(src, root / rel, dirs_exist_ok=True)
        elif os.path.exists(src):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, root / rel)
    return root


_NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"


@pytest.mark.parametrize("path, old, new, hook, problem", [
    # an instance attribute assigned in __init__ (read by pull's connector.load span)
    (_NIXL + "base_worker.py", r"\b_ready_requests\b", "_ready_reqs",
     "NixlBaseConnectorWorker._ready_requests", "attribute never assigned"),
    # a dataclass field of the step's connector output
    ("vllm/v1/outputs.py", r"\bfailed_recving\b", "failed_receives", "KVConnectorOutput.failed_recving",
     "attribute never assigned"),
    # the request's arrival (start of *.queue)
    ("vllm/v1/request.py", r"\barrival_time\b", "arrived_at", "Request.arrival_time", "attribute never assigned"),
    # a failure type pdtrace maps to an event
    (_NIXL + "push_worker.py", r"push_reg_notif_failed", "push_reg_send_failed", "'push_reg_notif_failed'",
     "string no longer in"),
    # the keyword the agent proxy reads the request id from
    (_NIXL + "pull_worker.py", r"\bnotif_msg=", "notification=", "pull_worker.make_prepped_xfer",
     "no call passes the keywords ('notif_msg',)"),
    # the transfer-done notification's "<request id>:<count>" form
    (_NIXL + "push_worker.py", r"\}:\{", "}/{", "push_worker.'{}:{}'", "no f-string shaped"),
    # where the middleware finds the engine id
    ("vllm/entrypoints/launchers/api_server/app_state.py", r"state\.vllm_config\b", "state.config",
     "app_state.vllm_config", "attribute no longer assigned"),
])
def test_static_check_names_a_name_removed_from_a_copy(vllm_src, tmp_path, path, old, new, hook, problem):
    """A copy of the source with one listed name renamed: the static check names exactly that hook."""
    root = tmp_path / "copy"
    shutil.copytree(vllm_src, root)
    f = root / path
    text, n = re.subn(old, new, f.read_text())
    assert n, f"{old!r} not in {path}"
    f.write_text(text)
    (p,) = vllm_compat.static_check(root)
    assert hook in p and problem in p, p
