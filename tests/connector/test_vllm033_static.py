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
