"""Ask Linux for AMX tile-data permission in each lab engine process.

Why: on a CPU with AMX (``amx_tile`` in ``/proc/cpuinfo``, e.g. Sapphire Rapids), torch reports
``torch.cpu._is_amx_tile_supported() == True`` from CPUID alone, and vLLM 0.32.0's CPU attention
then picks its AMX kernels for bf16 (``vllm/v1/attention/backends/cpu_attn.py``, isa ``"amx"``). Since
Linux 5.16 a process must first request the AMX tile-data state with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` (Linux kernel documentation,
``Documentation/arch/x86/xstate.rst``); an AMX instruction without it raises SIGILL. Neither torch's
check nor vLLM requests it, so on such a machine the decode engine's worker died with exit code -4
(SIGILL) at its first decode step (measured 2026-12-04 on an AMX VM: ``ARCH_GET_XCOMP_PERM`` =
0x200e7 before and after ``torch.cpu._is_amx_tile_supported()``, tile data bit 18 missing).

How: the lab's generated ``sitecustomize`` calls :func:`install` in every engine process (API
server, EngineCore, workers); it makes the request once (x86-64 Linux only). Where AMX is absent
or the kernel refuses, nothing changes (vLLM then does not pick AMX either: torch reports it
missing). A lab measure for vLLM behaviour, not a pdtrace one.
"""
from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158          # x86-64 syscall number (arch/x86/entry/syscalls/syscall_64.tbl)
ARCH_REQ_XCOMP_PERM = 0x1023  # arch/x86/include/uapi/asm/prctl.h
XFEATURE_XTILEDATA = 18


def install() -> bool:
    """Request AMX tile-data permission for this process; True iff the kernel granted it. Never raises."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
