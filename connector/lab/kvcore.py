"""Keep each lab engine's forward thread on the engine's own core.

Why: vLLM 0.32.0's NIXL worker, on CPU, moves the thread that builds it (the
worker's main thread, which also runs every forward and every connector hook)
onto "the last core of each NUMA node" (``NixlBaseConnectorWorker.__init__``:
``os.sched_setaffinity(0, [max(cores) for cores in
current_platform.discover_numa_topology()])``). The topology comes from
``/sys/devices/system/node``, not from the process's affinity, so on the lab's
2-core machine *both* engines' forward threads end up on core 1, whatever
``VLLM_CPU_OMP_THREADS_BIND`` said (measured: the prefill worker's main thread
and its ``nixl-push-writer`` thread on core 1, its NIXL/UCX threads on core 0;
every decode thread on core 1). There is no setting for it.

In push mode the router dispatches P and D concurrently, so while P runs its
first prefill, D is already stepping every ~1 ms on its ``WAITING_FOR_REMOTE_KVS``
request and its worker spin-waits (``sched_yield``) between steps — on the same
core as P's forward thread. P's first execute_model then crawls or never
returns ("No available shared memory broadcast block found in 60 seconds" in
P's EngineCore). Pull mode dispatches D only after P answered, so it did not show.

How: the launcher sets ``PDTRACE_LAB_KV_CORES`` (the engine's core, e.g. ``0``)
and the lab's ``sitecustomize`` calls :func:`install`, an import hook that
wraps ``vllm.platforms.cpu.CpuPlatform.discover_numa_topology`` to return
``[[core]]``. vLLM then pins the forward thread to the engine's own core — the
one its OpenMP threads are bound to. Unset or empty: nothing is patched.
A lab measure (vLLM behaviour, not a pdtrace one).
"""
from __future__ import annotations

import importlib.abc
import sys

from pdtrace.instrument import config

ENV_SWITCH = "PDTRACE_LAB_KV_CORES"
_TARGET = "vllm.platforms.cpu"


def cores() -> list[int] | None:
    """Cores from ``PDTRACE_LAB_KV_CORES`` (comma-separated ints), or None when unset/invalid."""
    raw = (config.raw(ENV_SWITCH) or "").strip()
    if not raw:
        return None
    try:
        got = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        print(f"pdtrace: bad {ENV_SWITCH}={raw!r} (want comma-separated core ids); not patched", file=sys.stderr)
        return None
    return got or None


def patch_module(module, kv_cores: list[int]) -> bool:
    """Make ``CpuPlatform.discover_numa_topology`` return ``[kv_cores]``. True if patched."""
    cls = getattr(module, "CpuPlatform", None)
    real = getattr(cls, "discover_numa_topology", None) if cls is not None else None
    if real is None or getattr(real, "_pdtrace_patched", False):
        return False

    def discover_numa_topology(cls_):
        return [list(kv_cores)]

    discover_numa_topology._pdtrace_patched = True
    discover_numa_topology.__wrapped__ = real
    cls.discover_numa_topology = classmethod(discover_numa_topology)
    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, kv_cores):
        self._inner, self._cores = inner, kv_cores

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        patch_module(module, self._cores)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, kv_cores):
        self._cores = kv_cores

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self._cores)
                return spec
        return None


def install() -> bool:
    """Install the hook (idempotent) when ``PDTRACE_LAB_KV_CORES`` is set; False otherwise."""
    kv_cores = cores()
    if kv_cores is None:
        return False
    if _TARGET in sys.modules:
        patch_module(sys.modules[_TARGET], kv_cores)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(kv_cores))
    return True
