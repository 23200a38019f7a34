"""Shared test helpers: run a Python snippet in a fresh interpreter with tracing settings."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def run_child(code: str, env: dict | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter (this venv) with ``env`` added to a clean PDTRACE_* environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    base.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=base, capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture
def child():
    return run_child


@pytest.fixture(autouse=True)
def _attribute_allowlist_restored():
    """A test that registers attribute keys (plug-ins do, at run time) leaves the allowlist as it found it."""
    from pdtrace.instrument import attributes

    saved = dict(attributes._ALLOWED)
    yield
    if attributes._ALLOWED != saved:
        attributes._ALLOWED.clear()
        attributes._ALLOWED.update(saved)
        attributes.registrations += 1  # a live writer re-sends the restored allowlist


@pytest.fixture(scope="session")
def spark():
    """One SparkSession (local[2]) for every test that runs the Spark engine (a JVM starts once);
    skipped without pyspark or Java, a failure under ``PDTRACE_LAB_REQUIRED=1``."""
    from answers import require_spark

    require_spark()
    from pdtrace.analysis import spark as _spark

    s = _spark.session("local[2]")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def traced_greedy_record() -> dict:
    """{mode: {"model": Path, "prompts": [[token id]], "outputs": [["token_id:N"]]}}: the greedy tokens of the
    traced P/D lab of each mode, put here by ``tests/connector/test_traced_{pull,push}_lab.py`` and read by
    ``tests/lab/test_{pull,push}.py``, which compare their untraced lab's tokens with them (so no module starts
    an untraced lab for that alone; see ``labkit.traced_greedy``)."""
    return {}


@pytest.fixture(scope="session")
def traced_lab_stores() -> dict:
    """{mode: {"dir": Path, "router_starts": int}}: the span directories of the traced P/D lab of each mode
    (``tests/connector/test_traced_{pull,push}_lab.py``, the production recipe: stock serving command, vLLM
    plugin; stopped: no span file is written after, only those modules' analysis cache ``analysis.duckdb``
    beside the logs), put here by those modules for the dashboard tests,
    which show and check them instead of starting labs of their own (``tests/dashboard/conftest.py``).
    ``router_starts``: router processes the lab started (the push run restarts its router)."""
    return {}


@pytest.fixture(scope="session")
def cli_pull_run(tmp_path_factory) -> dict:
    """The session's one default ``pdtrace lab`` run (pull, 20 requests, through the CLI; see
    ``labkit.cli_pull_run``), shared by the skew and footprint lab modules."""
    import labkit

    return labkit.cli_pull_run(tmp_path_factory.mktemp("cli-pull") / "run")
