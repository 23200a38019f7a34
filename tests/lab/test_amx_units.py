"""The lab's AMX permission request (pdtrace.connector.lab.amx), run in a fresh process."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHECK = """
import ctypes, json
from pdtrace.connector.lab import amx
libc = ctypes.CDLL(None)
v = ctypes.c_uint64(0)
def get(code):
    libc.syscall(158, code, ctypes.byref(v))
    return v.value
supp, before = get(0x1021), get(0x1022)   # ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM
granted = amx.install()
print(json.dumps({"supp": supp, "before": before, "granted": granted, "after": get(0x1022)}))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="x86-64 Linux only")
def test_tile_data_permission_is_granted_where_the_cpu_has_amx():
    import json

    r = json.loads(subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout)
    bit = 1 << 18  # XFEATURE_XTILEDATA
    if r["supp"] & bit:
        assert r["granted"] is True and r["after"] & bit
    else:
        assert r["granted"] is False and not r["after"] & bit


STARTED = """
import json, platform, sys
out = {"lab_modules": sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith("pdtrace.connector.lab."))}
if sys.platform == "linux" and platform.machine() == "x86_64":
    import ctypes
    libc = ctypes.CDLL(None)
    v = ctypes.c_uint64(0)
    libc.syscall(158, 0x1021, ctypes.byref(v)); out["supp"] = v.value   # ARCH_GET_XCOMP_SUPP
    libc.syscall(158, 0x1022, ctypes.byref(v)); out["perm"] = v.value   # ARCH_GET_XCOMP_PERM
print(json.dumps(out))
"""


def test_the_lab_sitecustomize_makes_the_request(tmp_path):
    """A fresh interpreter with the lab's generated sitecustomize on its path (as the launcher writes it
    into the run's bootstrap directory) ran it before its own code: each lab patch's module is loaded
    (progthread, kvcore, amx, inject), none reported a failure, and where the CPU has AMX the permission
    is granted (elsewhere the request leaves no trace to read)."""
    import json
    import os

    from pdtrace.connector.lab.progthread import SITECUSTOMIZE

    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", STARTED], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pdtrace:" not in r.stderr, r.stderr[-2000:]  # every patch of the sitecustomize installed
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"progthread", "kvcore", "amx", "inject"} <= set(out["lab_modules"]), out
    bit = 1 << 18  # XFEATURE_XTILEDATA
    if out.get("supp", 0) & bit:
        assert out["perm"] & bit
