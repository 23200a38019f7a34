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


def test_the_lab_sitecustomize_makes_the_request():
    from pdtrace.connector.lab.progthread import SITECUSTOMIZE

    compile(SITECUSTOMIZE, "sitecustomize.py", "exec")
    assert "_pdtrace_amx.install()" in SITECUSTOMIZE
