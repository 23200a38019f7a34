"""Fixtures for the dashboard tests: stores to show, an AppTest runner, and the views' own numbers.

``store_dir`` is parametrized over hand-built stores (pull, push, both modes)
and the lab's stores (``lab_store_pull`` / ``lab_store_push``): span
directories written by real vLLM CPU engines (1 prefill + 1 decode) with
pdtrace's traced NIXL connectors, the frontend middleware and the traced
router, after replaying 20 Azure-conversation requests (and more). Every page
test takes it, so the same assertions run on lab-produced input.

The lab stores are those of the session's traced lab modules when they ran
(``traced_lab_stores``: ``tests/connector/test_traced_{pull,push}_lab.py``, the
production recipe, their labs stopped), so no lab starts for the dashboard in a
full run; a mode whose module did not run gets a lab of its own here (pdtrace's
explicit class names and ``--middleware``; the missing modes at the same time),
stopped before any test reads it. Without the lab environment the lab cases are
skipped with the reason, unless ``PDTRACE_LAB_REQUIRED=1`` (CI), which turns
that into a failure.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import labkit
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
#: Requests replayed from the Azure conversation trace per lab (lengths x0.25, rate x1: the lab defaults).
LAB_REQUESTS = 20
LAB_TRACED = {"pull": "TracedNixlPullConnector", "push": "TracedNixlPushConnector"}
LAB_MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"


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


_lab_ready = labkit.require_lab


def _run_traced_lab(mode: str, model: Path, wl, root: Path) -> dict:
    """Start a traced lab of ``mode``, pay first contact, replay ``wl``, stop it; return what it wrote.

    The spans go to ``root/<mode>-trace`` (``PDTRACE_DIR`` of router and engines, nothing else in
    it); logs and engine caches to ``root/<mode>-run``. Returns {'dir', 'seconds' (wall, s),
    'router_starts': 1}; raises AssertionError if a request failed.
    """
    from pdtrace.connector.lab import replay
    from pdtrace.connector.lab.launcher import Lab, LabConfig
    from pdtrace.connector.lab.model import model_info
    from pdtrace.connector.lab.run import _warmup

    t0 = time.monotonic()
    trace_dir = (root / f"{mode}-trace").resolve()
    cfg = LabConfig(model=model, mode=mode, run_dir=root / f"{mode}-run", trace_dir=trace_dir,
                    connector_class=LAB_TRACED[mode], connector_module="pdtrace.connector.traced",
                    extra_args=["--middleware", LAB_MIDDLEWARE], router_timeout_s=300.0)
    with Lab(cfg) as lab:
        _warmup(lab.router_url, model_info(model)["vocab_size"], 1)  # first contact (NIXL handshake), retried once
        recs = asyncio.run(replay.replay(wl, lab.router_url, timeout_s=300, progress=False))
    bad = [(r.request_index, r.status, r.http_status, r.error_type) for r in recs if not r.ok]
    assert not bad, f"{mode} lab: failed requests {bad}; logs in {cfg.run_dir / 'logs'}"
    return {"dir": trace_dir, "seconds": time.monotonic() - t0, "router_starts": 1}


#: Developer shortcut: a directory holding ``pull-trace/`` and ``push-trace/`` of an earlier session's labs
#: (:func:`_run_traced_lab`'s, one router start each; e.g. a kept ``--basetemp``); the lab cases then read those
#: instead of starting engines. CI never sets it.
REUSE_ENV = "PDTRACE_TEST_REUSE_LAB_STORES"


@pytest.fixture(scope="session")
def lab_stores(tmp_path_factory, traced_lab_stores) -> dict:
    """{'pull': run, 'push': run}: {'dir', 'seconds', 'router_starts'} of each mode's traced lab, stopped.

    The session's traced lab module of a mode when it ran (``traced_lab_stores``); otherwise a lab started here
    (:func:`_run_traced_lab`; the missing modes side by side)."""
    reuse = os.environ.get(REUSE_ENV)
    if reuse:
        runs = {m: {"dir": (Path(reuse) / f"{m}-trace").resolve(), "seconds": 0.0, "router_starts": 1}
                for m in LAB_TRACED}
        missing = [str(r["dir"]) for r in runs.values() if not r["dir"].is_dir()]
        assert not missing, f"{REUSE_ENV}: no lab store at {missing}"
        return runs
    runs = {m: {"dir": Path(traced_lab_stores[m]["dir"]), "seconds": 0.0,
                "router_starts": traced_lab_stores[m]["router_starts"]} for m in LAB_TRACED if m in traced_lab_stores}
    todo = [m for m in LAB_TRACED if m not in runs]
    if not todo:
        return runs
    _lab_ready()
    from pdtrace.connector.data import AZURE_CONV
    from pdtrace.connector.lab import workload
    from pdtrace.connector.lab.model import make_model, model_info

    model = make_model("default")  # the shared model cache (built once per machine)
    wl = workload.build("azure-conv", AZURE_CONV, vocab_size=model_info(model)["vocab_size"], length_scale=0.25,
                        rate_scale=1.0, max_requests=LAB_REQUESTS, max_model_len=8192)
    root = tmp_path_factory.mktemp("lab-stores")
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(todo)) as ex:
        futs = {m: ex.submit(_run_traced_lab, m, model, wl, root) for m in todo}
        runs.update({m: f.result() for m, f in futs.items()})
    print("\nlab stores: " + ", ".join(f"{m} {runs[m]['seconds']:.0f} s" for m in todo)
          + f", {time.monotonic() - t0:.0f} s (wall)")
    return runs


@pytest.fixture(scope="session")
def lab_store_pull(lab_stores) -> Path:
    """Span directory of the traced pull lab: 20 Azure-conversation requests + 1 warm-up (+ the traced module's
    4 greedy prompts when it is that module's run)."""
    return lab_stores["pull"]["dir"]


@pytest.fixture(scope="session")
def lab_store_push(lab_stores) -> Path:
    """Span directory of the traced push lab: 20 Azure-conversation requests + 1 warm-up (+, when it is the traced
    module's run, its greedy and 3,000-token prompts, a router restart and a request whose client went away)."""
    return lab_stores["push"]["dir"]


@pytest.fixture(params=list(HAND) + [pytest.param(k, marks=pytest.mark.lab) for k in LAB])
def store_dir(request, hand_stores) -> Path:
    """A store directory to show: hand-built (pull / push / mixed) or lab-produced (skipped without the lab)."""
    if request.param in HAND:
        return hand_stores[request.param]
    return Path(request.getfixturevalue(LAB[request.param]))


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
