"""vLLM's own production P/D router (``vllm-router``) in front of the lab's engines.

``pdtrace lab --router vllm-router`` starts this instead of pdtrace's router
(:mod:`pdtrace.connector.lab.router`). ``vllm-router`` is the PyPI package of
vLLM's Rust router (pinned :data:`VERSION`, installed by ``pdtrace lab
setup``); the lab runs it as ``python -m vllm_router.launch_router`` (the same
entry point as its ``vllm-router`` script) with ``--vllm-pd-disaggregation
--kv-connector nixl``, one ``--prefill`` / ``--decode`` URL per engine,
round-robin, no retries (a retry would be a second dispatch with a new id),
its Prometheus listener on a free loopback port (its default 29000 could be
taken) and the lab's per-request timeout.

What it does with a request (seen against these engines, vllm-router 0.1.17,
2026-12; ``tests/lab/test_vllm_router.py`` checks the id rule):

- P gets the body with ``max_tokens=1``, ``stream=false`` and
  ``kv_transfer_params.do_remote_decode=true``. Pull: D gets the client's body
  plus the params P returned, after P answered. Push: it learns push from
  ``"transfer_mode": "push"`` in P's first answer (no flag); from then on it
  sends both legs at once, D's ``do_remote_prefill`` params built from P's
  first answer (engine id, host, port, TP size).
- Ids: the client's ``X-Request-Id`` never reaches the engines. Both legs get
  one generated id G (``___prefill_addr_<P>___decode_addr_<D>_<32 hex>``);
  vLLM makes ``cmpl-G-0-<8 hex>`` of it as usual, so pdtrace's ``request_id``
  is G, and the response relayed to the client (every SSE chunk) has
  ``"id": "cmpl-G"``. The client's record keeps that id
  (``client/requests.parquet`` column ``response_id``): the join key.
- It records no spans, so the analysis has no router window:
  ``requests.ttft_source = 'engine'`` (DESIGN.md §3), the router hop unseen.

No pdtrace code runs in its process and no ``PDTRACE_DIR`` is given to it.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from . import procs
from .env import VLLM_ROUTER_DIST as DIST  # noqa: F401 (the pin lives in .env: setup and check read it)
from .env import VLLM_ROUTER_VERSION as VERSION  # noqa: F401

#: Seconds the router may take to bind and find every engine healthy.
START_TIMEOUT_S = 60.0


def command(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, metrics_port: int,
            timeout_s: float) -> list[str]:
    """The router's command line: P/D mode over the given engine URLs, NIXL, round-robin, no retries.

    ``timeout_s`` (s) becomes ``--request-timeout-secs`` (whole seconds, at least 1).
    Raises ValueError without at least one prefill and one decode URL.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("vllm-router needs at least one prefill and one decode URL")
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
           "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin",
           "--prometheus-host", host, "--prometheus-port", str(metrics_port),
           "--request-timeout-secs", str(max(1, int(round(timeout_s)))), "--disable-retries",
           "--worker-startup-check-interval", "1"]
    for u in prefill_urls:
        cmd += ["--prefill", u]
    for u in decode_urls:
        cmd += ["--decode", u]
    return cmd


def start(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, timeout_s: float, env: dict,
          log: Path, health=None) -> subprocess.Popen:
    """Spawn the router (own process group, output to ``log``) and wait until ``/health`` answers 200.

    ``health(url) -> bool`` is the probe (the launcher's ``http_ok``). Raises
    RuntimeError with the log's tail when the process exits or misses
    :data:`START_TIMEOUT_S`; the process is stopped first.
    """
    from .launcher import http_ok, log_tail

    health = health or http_ok
    cmd = command(prefill_urls, decode_urls, host, port, procs.free_port(host), timeout_s)
    p = procs.spawn(cmd, env, log)
    url = f"http://{host}:{port}/health"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not health(url):
        if p.poll() is not None or time.monotonic() > deadline:
            procs.stop_group(p, term_timeout_s=2.0)
            raise RuntimeError(f"vllm-router did not become healthy (exit code {p.returncode}); "
                               f"log {log}:\n{log_tail(log)}")
        time.sleep(0.2)
    return p
