"""Push mode on real engines: replay, metrics, logprobs, the shared-id guard, kill D mid-run (last)."""
from __future__ import annotations

import asyncio
import time

import pytest

from conftest import LOGPROB_TOL, check_logprobs, check_replay, post, start_lab

from pdtrace.connector.lab import metrics, procs, replay
from pdtrace.connector.lab.workload import ReplayRequest, Workload

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]
JOIN_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def push_lab(model_dir, reference, tmp_path_factory):
    lab = start_lab("push", model_dir, tmp_path_factory.mktemp("push"), push_join_timeout_s=JOIN_TIMEOUT_S,
                    router_timeout_s=180.0)
    try:
        # Pay the first-contact handshake once (it stalled 18 s to forever while both engines' forward
        # threads shared one core; see BENCHMARKS.md "Lab"). The router's join watchdog turns a hang into a 504.
        status, resp = post(lab.router_url + "/v1/completions",
                            {"model": "lab", "prompt": [20, 21, 22, 23], "max_tokens": 2}, timeout=300)
        if status != 200:  # a first-contact stall beyond the join timeout: one more try, now connected
            status, resp = post(lab.router_url + "/v1/completions",
                                {"model": "lab", "prompt": [24, 25, 26, 27], "max_tokens": 2}, timeout=300)
        assert status == 200, f"push warm-up failed twice: {resp}"
        yield lab
    finally:
        lab.stop()


def test_replay_real_trace(push_lab, trace_requests):
    check_replay(push_lab, trace_requests)


def test_first_token_logprobs_match_single_engine(push_lab, check_prompts, reference):
    gaps = check_logprobs(push_lab, check_prompts, reference)
    print(f"push: max |Δ logprob| over top-5 = {max(gaps):.4f} nats (tolerance {LOGPROB_TOL})")


def test_push_without_shared_id_fails_fast(push_lab):
    """D's leg carries another X-Request-Id (as if rewritten in between): the router answers 504, not a hang."""
    t0 = time.monotonic()
    status, body = post(push_lab.router_url + "/v1/completions",
                        {"model": "lab", "prompt": list(range(30, 90)), "max_tokens": 4},
                        {"X-Pdtrace-Lab-Fault": "split-id"}, timeout=300)
    took = time.monotonic() - t0
    print(f"split ids: status {status} after {took:.1f} s")
    assert status == 504, body
    assert body["error"]["type"] == "push_join_timeout"
    assert "X-Request-Id" in body["error"]["message"]
    assert took < JOIN_TIMEOUT_S + 30, took  # vLLM alone would wait for its 480 s registration timeout
    # The lab still serves normal requests afterwards.
    status, body = post(push_lab.router_url + "/v1/completions",
                        {"model": "lab", "prompt": list(range(40, 100)), "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def test_shared_id_guard_refuses_mismatch():
    from pdtrace.connector.lab.router import LegError, check_shared_id
    check_shared_id({"X-Request-Id": "a"}, {"X-Request-Id": "a"})
    with pytest.raises(LegError) as e:
        check_shared_id({"X-Request-Id": "a"}, {"X-Request-Id": "b"})
    assert e.value.status == 500 and e.value.kind == "push_id_mismatch"


def test_kill_decode_mid_run(push_lab):
    """Kill D while 4 long streams are in flight: each fails with a clear status in time; no orphans, no ports."""
    lab = push_lab
    # Long streams, and D is killed only once it reports all 4 running (a fixed sleep raced: once push
    # stopped stalling, 400-token streams finished before a 3 s kill, and one 6,000-token stream before 2 s).
    reqs = [ReplayRequest(i, i, 0.05 * i, [16 + (i * 13 + k) % 1500 for k in range(120)], 6000) for i in range(4)]
    wl = Workload("kill-d", "-", "synthetic", 1.0, 1.0, 0, reqs, len(reqs), False)
    pids = lab.pids()
    all_pids = set(pids.values()) | {k.pid for p in pids.values() for k in procs.descendants(p)}
    ports = lab.ports() + [lab.router_port]

    async def run():
        task = asyncio.create_task(replay.replay(wl, lab.router_url, timeout_s=240, progress=False))
        d_url = lab.decodes[0].url
        deadline = time.monotonic() + 120
        first_running = None
        while time.monotonic() < deadline:
            m = await asyncio.to_thread(metrics.scrape, d_url)
            running = metrics.total(m, "vllm:num_requests_running")
            if running >= len(reqs):
                break
            if running >= 1:
                # all 4 were dispatched within 0.15 s; once one decodes, kill within 0.5 s (a 6,000-token
                # stream takes seconds even on an idle machine; waiting for all 4 to show as running let
                # every stream finish first in a CI run)
                first_running = first_running or time.monotonic()
                if time.monotonic() - first_running >= 0.5:
                    break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(lab.kill, "decode-0")
        return await task, time.monotonic()

    t0 = time.monotonic()
    recs, t_done = asyncio.run(run())
    print("kill D:", [(r.status, r.http_status, r.error_type, len(r.token_times_ns)) for r in recs],
          f"{t_done - t0:.1f} s")
    assert all(not r.ok for r in recs), [(r.status, len(r.token_times_ns)) for r in recs]
    for r in recs:
        assert r.status in ("stream_error", "http_error"), r.status
        assert r.error_type in ("upstream_unreachable", "upstream_error", "decode_failed"), r.error_type
    assert t_done - t0 < 120
    lab.stop()
    time.sleep(1.0)
    import psutil
    alive = [p for p in all_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphans: {alive}"
    bound = [p for p in ports if procs.port_is_bound(p)]
    assert not bound, f"ports still bound: {bound}"
