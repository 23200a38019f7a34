"""Pull mode on real engines: replay, metrics, logprobs vs one engine, negative control, kill P before D's READ,
SIGTERM D mid-stream; tracing off gives the traced lab's greedy tokens and runs no pdtrace thread.

One lab for the module; the destructive tests (kill P, then SIGTERM D) run last, in that order.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import labkit
import pytest

from pdtrace.connector.lab import replay
from pdtrace.connector.lab.workload import ReplayRequest

from conftest import (LOGPROB_TOL, check_logprobs, check_replay, first_token_body, get_json, logprob_gap, post,
                      start_lab, top_logprobs)

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]
STREAM_TIMEOUT_S = 20.0  # the client's timeout of a stream in test_sigterm_decode_mid_stream


@pytest.fixture(scope="module")
def pull_lab(model_dir, reference, tmp_path_factory):
    lab = start_lab("pull", model_dir, tmp_path_factory.mktemp("pull"))
    try:
        yield lab
    finally:
        lab.stop()


def test_replay_real_trace(pull_lab, trace_requests):
    check_replay(pull_lab, trace_requests)


def test_first_token_logprobs_match_single_engine(pull_lab, check_prompts, reference):
    gaps = check_logprobs(pull_lab, check_prompts, reference)
    print(f"pull: max |Δ logprob| over top-5 = {max(gaps):.4f} nats (tolerance {LOGPROB_TOL})")


def test_greedy_outputs_equal_with_tracing_on(pull_lab, model_dir, traced_greedy_record, check_prompts,
                                               tmp_path_factory):
    """Tracing changes no output: this untraced lab gives the traced pull lab's greedy tokens."""
    labkit.check_greedy_like_traced(pull_lab, traced_greedy_record, model_dir, check_prompts["trace"],
                                    tmp_path_factory.mktemp("traced-greedy"))


def test_unset_no_pdtrace_thread_or_process_in_any_engine_process(pull_lab):
    labkit.check_untraced_lab(pull_lab, "decode-0.log", "NixlPullConnector")


def test_negative_control_wrong_blocks_fail_the_check(pull_lab, check_prompts, reference):
    """D handed prompt A's blocks while asked for prompt B (same length and last token): the check must fail."""
    P, D = pull_lab.prefills[0], pull_lab.decodes[0]
    a, b = check_prompts["neg_a"], check_prompts["neg_b"]
    rid = {"X-Request-Id": "negctl-1"}
    body = dict(first_token_body(a), kv_transfer_params={"do_remote_decode": True})
    status, p_resp = post(P.url + "/v1/completions", body, rid)
    assert status == 200, p_resp
    status, d_resp = post(D.url + "/v1/completions",
                          dict(first_token_body(b), kv_transfer_params=p_resp["kv_transfer_params"]), rid)
    assert status == 200, d_resp
    got = top_logprobs(d_resp)
    gap_b = logprob_gap(reference["neg_b"][0], got)
    gap_a = logprob_gap(reference["neg_a"][0], got)
    print(f"negative control: gap to B's reference {gap_b:.3f}, to A's {gap_a:.4f} nats")
    assert gap_b > LOGPROB_TOL, "the check did not notice D computing from another prompt's KV"
    assert gap_a <= LOGPROB_TOL, "D's output should follow the KV it was given (A's)"


def test_kill_prefill_after_response_before_read(pull_lab, trace_requests):
    """Hold D's leg at the router, kill P, release: the request fails clearly; D keeps serving."""
    lab = pull_lab
    prompt = trace_requests.requests[10].prompt
    result = {}

    def client():
        result["resp"] = post(lab.router_url + "/v1/completions",
                              {"model": "lab", "prompt": prompt, "max_tokens": 8, "ignore_eos": True},
                              {"X-Pdtrace-Lab-Hold": "1"}, timeout=600)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 120
    while not get_json(lab.router_url + "/_lab/held")["held"]:
        assert time.monotonic() < deadline, "P's response never reached the hold point"
        time.sleep(0.1)
    lab.kill("prefill-0")
    t0 = time.monotonic()
    post(lab.router_url + "/_lab/release", {})
    t.join(timeout=lab.cfg.router_timeout_s + 30)
    assert not t.is_alive(), "request hung after P died"
    status, body = result["resp"]
    print(f"kill P: status {status} after {time.monotonic() - t0:.1f} s: {body.get('error', {}).get('type')}")
    assert status >= 500 and body["error"]["leg"] == "decode", (status, body)
    assert body["error"]["type"] in ("decode_failed", "upstream_error", "upstream_unreachable", "timeout"), body
    # D keeps serving: a plain (non-disaggregated) request straight to D completes.
    status, resp = post(lab.decodes[0].url + "/v1/completions",
                        {"model": "lab", "prompt": prompt[:50], "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and resp["usage"]["completion_tokens"] == 4, resp


def test_sigterm_decode_mid_stream(pull_lab):
    """SIGTERM D's API server (what Kubernetes sends a pod it deletes) while it streams: no stream is
    reported as a complete response.

    vLLM 0.32's graceful shutdown (abort mode, timeout 0) was seen to end it either way on this machine:
    each open stream got a tokenless ``finish_reason: "abort"`` chunk and ``data: [DONE]`` within 0.1 s (a
    clean end on the wire: ``finish_abort``), or the EngineCore was force-killed before its aborts reached
    the API server, which then waited for the open connections to close with no byte sent (uvicorn's
    "Waiting for connections to close"): the client's own timeout (STREAM_TIMEOUT_S here) ends them.

    The streams go straight to D (P was killed by the test before): this checks the client's own rule
    on a real engine; the router's rule for the same chunk is ``test_router_stream_end.py``.
    """
    lab, n, max_tokens = pull_lab, 2, 6000
    D = lab.decodes[0]
    reqs = [ReplayRequest(i, i, 0.0, [16 + (i * 31 + k) % 1500 for k in range(40)], max_tokens) for i in range(n)]
    recs = [replay.ClientRecord(r.index, r.index, len(r.prompt), max_tokens, 0) for r in reqs]

    async def run():
        import aiohttp
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(replay.send_one(s, D.url + "/v1/completions", q, rec, replay._Clock(),
                                                         STREAM_TIMEOUT_S))
                     for q, rec in zip(reqs, recs)]
            deadline = time.monotonic() + 60
            while not all(rec.token_times_ns for rec in recs) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert all(rec.token_times_ns for rec in recs), "D streamed no token within 60 s"
            os.kill(lab.pids()["decode-0"], signal.SIGTERM)
            await asyncio.gather(*tasks)

    t0 = time.monotonic()
    asyncio.run(run())
    print("SIGTERM D:", [(r.status, r.http_status, r.error_type, len(r.token_times_ns)) for r in recs],
          f"{time.monotonic() - t0:.1f} s")
    for r in recs:
        assert r.status in ("stream_error", "timeout"), (r.status, r.error_type)
        if r.status == "stream_error":
            # an abort finish (graceful shutdown answered the stream) or bytes that stopped (the server closed)
            assert r.error_type in ("finish_abort", "stream_truncated"), r.error_type
        assert 0 < len(r.token_times_ns) < max_tokens, len(r.token_times_ns)
