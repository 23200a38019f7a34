"""A real browser on a running ``pdtrace dashboard``: Debian's Chromium driven by Playwright.

Loads every page, clicks from the overview's slowest request into its
waterfall, saves a screenshot of each page under ``artifacts/dashboard/``
(git-ignored; CI keeps it), and fails on any page error (a JavaScript error,
a Streamlit exception box). No browser is downloaded: the system Chromium at
``/usr/bin/chromium`` (``apt-get install chromium``) is used.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "dashboard"
CHROMIUM = os.environ.get("PDTRACE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = {"overview": "", "request": "request", "compare": "compare", "stalls": "stalls", "changed": "changed",
         "sql": "sql"}

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"no system Chromium at {CHROMIUM} (apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path):
    """``serve(directory)`` -> base URL of a ``pdtrace dashboard`` subprocess (stopped at teardown)."""
    procs = []

    def start(directory: Path, *args: str) -> str:
        port = _free_port()
        log = open(tmp_path / f"dashboard-{port}.log", "w")
        env = dict(os.environ, PDTRACE_CACHE_DIR=str(tmp_path / "cache"))
        p = subprocess.Popen([sys.executable, "-m", "pdtrace.cli.main", "dashboard", str(directory), "--port",
                              str(port), *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append((p, log))
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert p.poll() is None, (tmp_path / f"dashboard-{port}.log").read_text()
            try:
                with urllib.request.urlopen(url + "_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"dashboard did not start on {url}")

    yield start
    for p, log in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield b
        b.close()


def settle(page, timeout: float = 90.0) -> float:
    """Wait until the page shows content (a title or a message) and Streamlit has stopped running for 1.5 s.

    The status widget appears only some time after a run starts, so an empty main area counts as busy.
    """
    t0 = time.monotonic()
    calm = None
    while time.monotonic() - t0 < timeout:
        content = page.locator('[data-testid="stMain"] h1, [data-testid="stMain"] [data-testid="stAlert"]').count()
        busy = (not content or page.locator('[data-testid="stStatusWidget"]').count() > 0
                or page.locator('[data-testid="stSkeleton"]').count() > 0)
        if busy:
            calm = None
        elif calm is None:
            calm = time.monotonic()
        elif time.monotonic() - calm > 1.5:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError("the page kept running")


def _benign(msg) -> bool:
    """Streamlit's frontend probes ``<page path>/_stcore/health|host-config`` on a deep link before it finds the
    app's base path; those 404s are not page errors."""
    url = (msg.location or {}).get("url", "")
    return "/_stcore/" in url and "404" in msg.text


def _check(page, errors: list, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    boxes = page.locator('[data-testid="stException"]')
    assert boxes.count() == 0, f"{name}: Streamlit exception: {boxes.first.inner_text()[:2000]}"
    assert not errors, f"{name}: page errors: {errors}"


@pytest.fixture(params=["mixed", pytest.param("lab-push", marks=pytest.mark.lab)])
def browse_store(request, hand_stores) -> tuple[str, Path, list[str]]:
    """(screenshot prefix, directory, extra ``pdtrace dashboard`` args): the hand-built store of both modes,
    and the traced push lab's store with the pull lab's preselected for comparison (``--compare``)."""
    if request.param == "mixed":
        return "", hand_stores["mixed"], []
    pull = Path(request.getfixturevalue("lab_store_pull"))
    return "lab-push-", Path(request.getfixturevalue("lab_store_push")), ["--compare", str(pull)]


def test_every_page_and_click_into_waterfall(serve, browser, browse_store):
    prefix, store, args = browse_store
    url = serve(store, *args)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(f"{m.text} {m.location.get('url')}")
            if m.type == "error" and not _benign(m) else None)
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    for name, path in PAGES.items():
        page.goto(url + path)
        page.wait_for_selector('[data-testid="stAppViewContainer"]', timeout=30_000)
        if name not in ("request", "sql"):  # charts expected: wait for one (a second trace may still be opening)
            page.wait_for_selector(".js-plotly-plot", timeout=120_000)
        settle(page)
        _check(page, errors, prefix + name)
        assert page.locator(".js-plotly-plot").count() >= (1 if name not in ("request", "sql") else 0), name
    # the overview's first thing is the split of TTFT into the four categories
    page.goto(url)
    settle(page)
    title = page.locator('[data-testid="stPlotlyChart"]').first.inner_text()
    assert "Share of TTFT" in title
    # click the slowest request: lands on its waterfall
    button = page.get_by_role("button", name="Open the slowest request")
    label = button.inner_text()
    rid = label.split(":", 1)[1].split("—")[0].strip()
    button.click()
    page.wait_for_url(f"**/request?request={rid}", timeout=30_000)
    settle(page)
    assert page.get_by_text("Waterfall (critical path outlined").count() == 1
    assert page.get_by_text(rid).count() >= 1
    _check(page, errors, prefix + "slowest-request-waterfall")


def test_empty_and_corrupt_directories_in_a_browser(serve, browser, empty_dir, corrupt_dir):
    for name, d, text in (("empty", empty_dir, "No readable span files"),
                          ("corrupt", corrupt_dir, "3 file(s) skipped")):
        url = serve(d)
        page = browser.new_page(viewport={"width": 1400, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_selector('[data-testid="stAppViewContainer"]', timeout=30_000)
        settle(page)
        assert page.get_by_text(text).count() >= 1
        _check(page, errors, f"dir-{name}")
        page.close()

