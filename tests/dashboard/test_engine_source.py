"""Dashboard with engine-clock TTFT windows (issue 16 item 2): the 'router hop unseen' note is shown plainly.

The store is the hand-built engine-clock pull case of tests/analysis/test_engine_ttft.py (no router file),
next to one router-recorded request, so the overview counts 1 of 2 and only that request's page warns.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_ANALYSIS = Path(__file__).resolve().parents[1] / "analysis"


def _load(name):
    if str(_ANALYSIS) not in sys.path:
        sys.path.insert(0, str(_ANALYSIS))
    spec = importlib.util.spec_from_file_location(name, _ANALYSIS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _store(tmp_path) -> Path:
    cases = _load("test_engine_ttft")
    c = cases._case_ep(0)
    root = c.router_request("rt", 1000, 1200, "pull", first_token_ms=1170)
    c.span("router", "router.dispatch", 1000, 1001, rid="rt", parent=root, attrs={"router.leg": "prefill"})
    c.span("prefill", "prefill.compute", 1001, 1100, rid="rt", engine="p0")
    c.span("decode", "decode.first_step", 1105, 1168, rid="rt", engine="d0")
    d = tmp_path / "engine-store"
    c.write(d)
    return d


def test_overview_and_request_page_say_router_hop_unseen(app, views, tmp_path):
    d = _store(tmp_path)
    tr = views(d)
    assert {r["request_id"]: r["ttft_source"] for r in tr.query("SELECT request_id, ttft_source FROM requests")} \
        == {"ep": "engine", "rt": "router"}
    at = app(d)
    assert not at.exception, [e.value for e in at.exception]
    banner = " ".join(w.value for w in at.warning)
    assert "Router hop unseen" in banner and "1 of 2 requests" in banner, banner
    assert "router.unseen" in banner and "Exposed router.unseen in the window: 3.0 ms" in banner, banner

    at = app(d, "app_pages/request.py", {"request": "ep"})
    assert not at.exception, [e.value for e in at.exception]
    warn = " ".join(w.value for w in at.warning)
    assert "Router hop unseen" in warn and "`router.unseen` (3.0 ms)" in warn, warn

    at = app(d, "app_pages/request.py", {"request": "rt"})
    assert not at.exception, [e.value for e in at.exception]
    assert "Router hop unseen" not in " ".join(w.value for w in at.warning)
