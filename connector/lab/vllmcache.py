"""vLLM's model-inspection cache, shared between the lab's engine starts.

Every engine keeps its own ``VLLM_CACHE_ROOT`` (``<run>/cache/<engine>``), so
nothing one engine writes there is read by another while it runs. But vLLM
inspects the model class in a child process (a fresh ``import torch, vllm``:
~10 s of CPU on this machine kind) whenever ``<cache root>/modelinfos`` has no
entry for it (``vllm/model_executor/models/registry.py``,
``_LazyRegisteredModel.inspect_model_cls``), so an empty cache root paid that
child at every engine start.

The lab keeps one copy of that directory beside the model
(``<model dir's parent>/vllm-modelinfos``): :func:`seed` copies it into an
engine's cache root before the engine starts; :func:`keep` copies back entries
an engine wrote, once it is healthy. vLLM checks each entry against the hash
of the model's source file and ignores a stale or unreadable one, so a stale
seed costs only the child process it would have paid anyway. Both functions
are best effort: a seed that cannot be read or written changes nothing but
the start time.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

SUBDIR = "modelinfos"  # vLLM's directory under VLLM_CACHE_ROOT


def seed_dir(model: Path) -> Path:
    """The shared copy for ``model`` (a model directory): ``<model.parent>/vllm-modelinfos``."""
    return Path(model).parent / "vllm-modelinfos"


def seed(model: Path, cache_root: Path) -> int:
    """Copy the shared entries into ``cache_root/modelinfos``; returns how many (0 when none or on OSError)."""
    src, dst = seed_dir(model), Path(cache_root) / SUBDIR
    n = 0
    try:
        files = sorted(src.glob("*.json"))
        if files:
            dst.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, dst / f.name)
            n += 1
    except OSError:
        pass
    return n


def keep(model: Path, cache_root: Path) -> int:
    """Copy entries of ``cache_root/modelinfos`` the shared copy lacks into it (each by an atomic rename).

    Returns how many were copied (0 on OSError).
    """
    src, dst = Path(cache_root) / SUBDIR, seed_dir(model)
    n = 0
    try:
        for f in sorted(src.glob("*.json")):
            if (dst / f.name).exists():
                continue
            dst.mkdir(parents=True, exist_ok=True)
            tmp = dst / f".{f.name}.{os.getpid()}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, dst / f.name)
            n += 1
    except OSError:
        pass
    return n
