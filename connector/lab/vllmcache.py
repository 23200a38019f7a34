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
of the model's source file and ignores a stale or unreadable one (it then
runs the child and writes a fresh entry, which :func:`keep` takes). Both functions
are best effort: a seed that cannot be read or written changes nothing but
the start time.
"""
from __future__ import annotations

import filecmp
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
    """Copy entries of ``cache_root/modelinfos`` that the shared copy lacks or holds with other bytes into it.

    vLLM names an entry by the model class alone and keeps the hash of the
    class's source file inside it, so after an upgrade the engine writes a new
    entry under the old name: it replaces the kept one. Each copy is an atomic
    rename of a temporary file (removed if the copy fails). Returns how many
    were copied (those before an OSError).
    """
    src, dst = Path(cache_root) / SUBDIR, seed_dir(model)
    n = 0
    try:
        for f in sorted(src.glob("*.json")):
            kept = dst / f.name
            if kept.exists() and filecmp.cmp(f, kept, shallow=False):
                continue
            dst.mkdir(parents=True, exist_ok=True)
            tmp = dst / f".{f.name}.{os.getpid()}.tmp"
            try:
                shutil.copyfile(f, tmp)
                os.replace(tmp, kept)
            finally:
                tmp.unlink(missing_ok=True)
            n += 1
    except OSError:
        pass
    return n
