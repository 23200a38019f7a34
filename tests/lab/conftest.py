"""Fixtures for the lab tests: real vLLM engines (CPU build), one lab per mode per module.

Engines are expensive on 2 cores (≈25–60 s to start, longer when other engines
run), so each test module starts one lab and shares it; the reference engine
(non-disaggregated) is started once per session, used, and stopped.

Without the lab environment the lab tests are skipped with the reason, unless
``PDTRACE_LAB_REQUIRED=1`` (CI), which turns that into a failure.
"""
from __future__ import annotations

from pathlib import Path

import labkit
import pytest

from pdtrace.connector.lab import workload
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model, model_info

LOGPROB_TOL = 0.05  # nats: max |Δ logprob| over the reference's top-k tokens (bf16 on CPU)
TOP_K = 5


#: (HTTP status, JSON body) of a POST, also for HTTP errors; GET's JSON (shared with every lab test)
post = labkit.post_status
get_json = labkit.get_json


def top_logprobs(resp: dict) -> dict[int, float]:
    """{token id: logprob} of the first generated token's top-k (needs return_tokens_as_token_ids)."""
    lp = resp["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.split(":", 1)[1]): float(v) for k, v in lp.items()}


def logprob_gap(ref: dict[int, float], got: dict[int, float]) -> float:
    """Max |Δ logprob| over the reference's top-k tokens (inf if one is missing from ``got``)."""
    return max((abs(v - got[k]) if k in got else float("inf")) for k, v in ref.items())


def first_token_body(prompt: list[int]) -> dict:
    return {"model": "lab", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": TOP_K,
            "return_tokens_as_token_ids": True}


@pytest.fixture(scope="session")
def lab_ready():
    labkit.require_lab()


@pytest.fixture(scope="session")
def model_dir(lab_ready):
    """The shared lab model (``pdtrace lab setup`` builds it once per machine), as the traced lab tests use:
    ``test_pull``/``test_push`` compare their greedy tokens with the traced labs' (``traced_greedy_record``)."""
    return make_model("default")


@pytest.fixture(scope="session")
def vocab(model_dir):
    return model_info(model_dir)["vocab_size"]


@pytest.fixture(scope="session")
def trace_requests(vocab):
    """24 real Azure-conversation requests, lengths x0.25, rate x1 (the lab defaults)."""
    from pdtrace.connector.data import AZURE_CONV
    return workload.build("azure-conv", AZURE_CONV, vocab_size=vocab, length_scale=0.25, rate_scale=1.0,
                          max_requests=24, max_model_len=8192)


@pytest.fixture(scope="session")
def check_prompts(trace_requests):
    """Prompts for the logprob check: 4 from the trace, plus the negative-control pair (same length and last token)."""
    ps = [r.prompt for r in trace_requests.requests[:4]]
    a = trace_requests.requests[5].prompt
    b = [(t * 7 + 3) % 2000 + 16 for t in a[:-1]] + [a[-1]]
    return {"trace": ps, "neg_a": a, "neg_b": b}


@pytest.fixture(scope="session")
def reference(model_dir, check_prompts, tmp_path_factory):
    """First-token top-k logprobs from one plain (non-disaggregated) engine; the engine is stopped after.

    {"trace": [{token id: logprob}], "neg_a": [...], "neg_b": [...], "ports": see below}. Its start also
    reproduces a lost port for real (the clash of CI on 2026-11-30, ``tests/lab/test_ports.py``, one engine
    start for both): a socket here really holds a port, and the lab's first port pick is forced to return it
    as the engine's HTTP port; the lab must start again on new ports. ``ports`` = {"taken": the held port,
    "calls": every pick (list of ports), "engine_port": the port the engine serves on, "run_dir"}.
    """
    import socket

    from pdtrace.connector.lab import procs

    run_dir = tmp_path_factory.mktemp("ref")
    cfg = LabConfig(model=model_dir, run_dir=run_dir, router=False)
    out = {}
    held = socket.socket()
    held.bind(("127.0.0.1", procs.free_port()))
    held.listen()
    taken = held.getsockname()[1]
    real, calls = procs.free_ports, []

    def first_pick_taken(n, host="127.0.0.1"):
        ports = real(n, host)
        if not calls:
            ports[0] = taken  # the single engine's HTTP port: really bound by `held`
        calls.append(list(ports))
        return ports

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(procs, "free_ports", first_pick_taken)  # (only the start picks ports)
            with Lab(cfg, single=True) as lab:
                out["ports"] = {"taken": taken, "calls": calls, "engine_port": lab.singles[0].http_port,
                                "run_dir": run_dir}
                url = lab.singles[0].url + "/v1/completions"
                for key, prompts in (("trace", check_prompts["trace"]),
                                     ("neg_a", [check_prompts["neg_a"]]), ("neg_b", [check_prompts["neg_b"]])):
                    got = []
                    for p in prompts:
                        status, resp = post(url, first_token_body(p))
                        assert status == 200, resp
                        got.append(top_logprobs(resp))
                    out[key] = got
    finally:
        held.close()
    return out


def start_lab(mode: str, model_dir: Path, run_dir: Path, **kw) -> Lab:
    cfg = LabConfig(model=model_dir, mode=mode, run_dir=run_dir, router_test_hooks=True, **kw)
    lab = Lab(cfg)
    try:
        lab.start()
    except BaseException:
        lab.stop()
        raise
    return lab


def replay_through_router(lab: Lab, wl) -> tuple[list, dict]:
    """Replay ``wl`` through the lab's router; return (client records, D's prompt-token deltas by source)."""
    import asyncio

    from pdtrace.connector.lab import metrics, replay

    before = metrics.prompt_tokens_by_source(lab.decodes[0].url)
    recs = asyncio.run(replay.replay(wl, lab.router_url, timeout_s=300, progress=False))
    after = metrics.prompt_tokens_by_source(lab.decodes[0].url)
    return recs, {k: after[k] - before[k] for k in after}


def check_replay(lab: Lab, trace_requests) -> None:
    """≥20 real-trace requests through the router: all complete with every token; D computed no prompt token."""
    from pdtrace.connector.lab import metrics

    recs, delta = replay_through_router(lab, trace_requests)
    assert len(recs) >= 20
    bad = [(r.request_index, r.status, r.http_status, r.error_type) for r in recs if not r.ok]
    assert not bad, bad
    for r, q in zip(recs, trace_requests.requests):
        assert len(r.token_times_ns) == q.max_tokens, (r.request_index, len(r.token_times_ns), q.max_tokens)
        assert r.send_ns < r.first_token_ns <= r.token_times_ns[-1] <= r.end_ns
    assert delta["local_compute"] == 0, delta
    assert delta["external_kv_transfer"] > 0, delta
    # Every request's prompt reached D as transferred KV or a prefix-cache hit, none computed.
    assert delta["external_kv_transfer"] + delta["local_cache_hit"] >= sum(len(q.prompt) for q in trace_requests.requests) - len(recs)
    rows = {r["id"]: r for r in metrics.router_stats(lab.router_url)}
    for r in recs:
        row = rows[r.router_request_id]
        assert row["status"] == 200 and 0 <= row["overhead_ns"] < row["ttft_ns"], row


def check_logprobs(lab: Lab, check_prompts, reference) -> list[float]:
    """First-token top-k logprobs through the router equal the single engine's within LOGPROB_TOL."""
    gaps = []
    for p, ref in zip(check_prompts["trace"], reference["trace"]):
        status, resp = post(lab.router_url + "/v1/completions", first_token_body(p))
        assert status == 200, resp
        got = top_logprobs(resp)
        assert max(ref, key=ref.get) == max(got, key=got.get), "top-1 token differs from the single engine"
        gaps.append(logprob_gap(ref, got))
    assert max(gaps) <= LOGPROB_TOL, gaps
    return gaps
