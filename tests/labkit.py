"""Helpers every lab test shares: the lab-environment gate and small JSON-over-HTTP calls.

Importable from any test module as ``import labkit`` (``tests/`` is on
``sys.path`` under pytest's default import mode, because ``tests/conftest.py``
lives here). Nothing here starts an engine.
"""
from __future__ import annotations

import importlib.util
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def require_lab() -> None:
    """Skip the calling test when the lab environment is missing, or fail it under ``PDTRACE_LAB_REQUIRED=1`` (CI).

    The environment check is :func:`pdtrace.connector.lab.env.problems` without
    the import check (≈ 5 s); the message names what is missing and the fix.
    """
    from pdtrace.connector.lab import env as lab_env

    found = lab_env.problems(import_check=False)
    if found:
        msg = "lab environment not ready: " + "; ".join(p.what for p in found) + " (run `pdtrace lab setup`)"
        if os.environ.get("PDTRACE_LAB_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def benchmark(name: str):
    """The shipped benchmark script ``benchmarks/<name>.py`` loaded as a module (the tests drive the same code
    that prints BENCHMARKS.md's figures). Raises FileNotFoundError for a missing script."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> dict:
    """POST ``body`` as JSON; return the JSON answer. Raises ``urllib.error.HTTPError`` on an HTTP error."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def post_status(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """POST ``body`` as JSON; return (HTTP status, JSON body), also for HTTP errors (a non-JSON body as ``{"raw": text}``)."""
    try:
        return 200, post(url, body, headers, timeout)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def get_json(url: str, timeout: float = 30) -> dict:
    """GET ``url``; return its JSON answer."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())
