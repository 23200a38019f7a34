"""Fixtures for the dashboard tests: stores to show, an AppTest runner, and the views' own numbers.

``store_dir`` is parametrized over hand-built stores (pull, push, both modes)
and, when the lab's session fixtures exist (``lab_store_pull`` /
``lab_store_push``, directories written by ``pdtrace lab``), over those too;
every page test takes it, so the same assertions run on lab-produced input.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from storegen import build_store, write_corrupt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "dashboard" / "app.py"

HAND = {
    "pull": dict(mode="pull", n_requests=60, seed=1),
    "push": dict(mode="push", n_requests=60, seed=2),
    "mixed": dict(mode="mixed", n_requests=80, seed=3),
}
LAB = {"lab-pull": "lab_store_pull", "lab-push": "lab_store_push"}


@pytest.fixture(scope="session", autouse=True)
def _dashboard_env(tmp_path_factory):
    """Analysis cache files under the test's temp dir, not the user's."""
    old = os.environ.get("PDTRACE_CACHE_DIR")
    os.environ["PDTRACE_CACHE_DIR"] = str(tmp_path_factory.mktemp("pdtrace-cache"))
    yield
    if old is None:
        os.environ.pop("PDTRACE_CACHE_DIR", None)
    else:
        os.environ["PDTRACE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def hand_stores(tmp_path_factory):
    """{name: directory} of the hand-built stores (written once per session)."""
    root = tmp_path_factory.mktemp("stores")
    return {name: build_store(root / name, **kw) for name, kw in HAND.items()}


@pytest.fixture(params=list(HAND) + list(LAB))
def store_dir(request, hand_stores) -> Path:
    """A store directory to show: hand-built (pull / push / mixed) or lab-produced (skipped without the lab)."""
    if request.param in HAND:
        return hand_stores[request.param]
    try:
        return Path(request.getfixturevalue(LAB[request.param]))
    except pytest.FixtureLookupError:
        pytest.skip(f"no {LAB[request.param]} fixture (the lab's session fixture is not defined here)")


@pytest.fixture
def empty_dir(tmp_path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


@pytest.fixture
def corrupt_dir(tmp_path) -> Path:
    d = tmp_path / "corrupt"
    write_corrupt(d)
    return d


@pytest.fixture
def app(monkeypatch):
    """``app(directory, page=None, query_params=None)`` -> an AppTest that has run the page."""
    from streamlit.testing.v1 import AppTest

    def run(directory, page: str | None = None, query_params: dict | None = None, timeout: float = 120):
        monkeypatch.setenv("PDTRACE_DASHBOARD_DIR", str(directory))
        at = AppTest.from_file(str(APP), default_timeout=timeout)
        at.run()
        if page:
            at.switch_page(page)
            for k, v in (query_params or {}).items():
                at.query_params[k] = v
            at.run()
        return at

    return run


@pytest.fixture
def views():
    """``views(directory)`` -> an analysis Trace (in memory) to compute the expected numbers from the views."""
    from pdtrace.analysis import db

    opened = []

    def open_(directory):
        tr = db.open_trace(directory)
        opened.append(tr)
        return tr

    yield open_
    for tr in opened:
        tr.close()
