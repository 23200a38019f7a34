"""Kill the prefill engine after its response and before D's READ (traced pull, real engines).

One traced pull lab with the router's test hooks (``X-Pdtrace-Lab-Hold: 1``
parks D's leg after P answered until ``POST /_lab/release``):

1. warm-up request (first contact, the handshake) and 3 normal requests;
2. a long request L (``LONG_TOKENS`` greedy tokens) is sent and runs on D;
3. the victim V is sent with the hold header; once the router holds V (P has
   answered, so P holds V's blocks under its lease), P is killed (SIGKILL of
   its process group), then V is released: D posts its READ to a dead peer.

"D keeps serving" means, in this test: (a) the request L that D was decoding
when P died completes with all its tokens through the router; (b) D's
``/health`` answers 200 afterwards; (c) a new request sent straight to D
without ``kv_transfer_params`` (D prefills it itself: with P dead no new
disaggregated request can be prefilled) completes. Then the lab stops (router
and D flush their spans; P's unflushed spans died with it) and the store must
say what happened to V on D's side.
"""
from __future__ import annotations

import threading
import time

import pytest

import labtrace as lt
from pdtrace.connector.lab import metrics
from pdtrace.connector.lab.launcher import Lab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]

LONG_TOKENS = 7000  # long enough to still be decoding when P dies (a fast run decoded 3,000 first)
# failure events on D that name a cause (lifecycle.cause); which one depends on where UCX noticed the dead peer
D_FAILURES = ("kv.post_failed", "kv.transfer_failed", "kv.load_failed", "request.abort", "handshake.failed")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    model = lt.lab_model("default")
    wl = lt.azure_workload(model, 12)
    run_dir = tmp_path_factory.mktemp("pull-kill")
    cfg = lt.traced_cfg(model, run_dir, trace=True, mode="pull", router_test_hooks=True, router_timeout_s=180.0)
    out = {"dir": run_dir}
    with Lab(cfg) as lab:
        lt.warm_up(lab, wl.requests[0].prompt)
        out["normal"] = [lt.one(lab, r.prompt) for r in wl.requests[1:4]]
        d_url = lab.decodes[0].url
        res = {}

        def long_req():
            res["long"] = lt.post_status(lab.router_url + "/v1/completions",
                                         {"model": "lab", "prompt": wl.requests[4].prompt, "max_tokens": LONG_TOKENS,
                                          "temperature": 0.0, "ignore_eos": True}, timeout=600)

        def victim():
            res["victim"] = lt.post_status(lab.router_url + "/v1/completions",
                                           {"model": "lab", "prompt": wl.requests[10].prompt, "max_tokens": 8,
                                            "ignore_eos": True}, {"X-Pdtrace-Lab-Hold": "1"}, timeout=600)

        t_long = threading.Thread(target=long_req)
        t_long.start()
        deadline = time.monotonic() + 120
        while metrics.total(metrics.scrape(d_url), "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline and t_long.is_alive(), f"L never ran on D: {res}"
            time.sleep(0.05)
        t_v = threading.Thread(target=victim)
        t_v.start()
        deadline = time.monotonic() + 120
        while not (held := lt.get_json(lab.router_url + "/_lab/held")["held"]):
            assert time.monotonic() < deadline, "P's response never reached the hold point"
            time.sleep(0.05)
        out["victim_id"] = held[0]
        out["long_running_at_kill"] = t_long.is_alive()
        lab.kill("prefill-0")
        t_kill = time.monotonic()
        lt.post(lab.router_url + "/_lab/release", {})
        t_v.join(timeout=cfg.router_timeout_s + 60)
        assert not t_v.is_alive(), "the victim hung after P died"
        out["victim_s"] = time.monotonic() - t_kill
        t_long.join(timeout=600)
        assert not t_long.is_alive(), "L hung after P died"
        out.update(res)
        out["health"] = _health(d_url)
        out["direct"] = lt.post_status(d_url + "/v1/completions",
                                       {"model": "lab", "prompt": wl.requests[5].prompt[:60], "max_tokens": 4,
                                        "ignore_eos": True}, {"X-Request-Id": "direct-after-kill"})
    tr = lt.open_trace(run_dir)
    out["tr"] = tr
    yield out
    tr.close()


def _health(url: str) -> int:
    import urllib.request
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return r.status


def test_victim_fails_clearly_in_time(killed_run):
    status, body = killed_run["victim"]
    print(f"victim {killed_run['victim_id']}: HTTP {status} {body.get('error', {}).get('type')} "
          f"after {killed_run['victim_s']:.1f} s")
    assert status >= 500 and body["error"]["leg"] == "decode", (status, body)
    assert killed_run["victim_s"] < 180


def test_failure_event_with_cause_on_decode(killed_run):
    """The store holds, for V, at least one failure event recorded by D with a lifecycle cause."""
    x = killed_run["victim_id"]
    ev = killed_run["tr"].query("""
        SELECT event, role, attr_str['lifecycle.cause'] AS cause, time_ns FROM events
        WHERE request_id = ? ORDER BY time_ns""", [x])
    print("victim events:", [(e["event"], e["role"], e["cause"]) for e in ev])
    d_fail = [e for e in ev if e["role"] == "decode" and e["event"] in D_FAILURES and e["cause"]]
    assert d_fail, ev
    # the router saw its decode leg fail too
    assert any(e["event"] == "router.leg_failed" and e["role"] == "router" for e in ev), ev
    # and D did not claim a first token for it (a freed request samples none); P's own token event (its
    # one prefill token, written to the router before the kill) is legitimate and is in the store when
    # P's writer flushed before the SIGKILL
    assert not [e for e in ev if e["event"] == "token" and e["role"] == "decode"], ev
    assert not killed_run["tr"].query(
        "SELECT 1 FROM spans WHERE request_id = ? AND stage = 'decode.first_step'", [x])


def test_incomplete_requests_shows_the_decode_cause(killed_run):
    x = killed_run["victim_id"]
    rows = killed_run["tr"].query("SELECT request_id, cause, detail, events FROM incomplete_requests")
    print("incomplete:", rows)
    mine = [r for r in rows if r["request_id"] == x]
    assert len(mine) == 1, rows
    # a cause from D's evidence, not merely "the router's leg failed"
    assert mine[0]["cause"] in ("transfer_failure", "post_failure", "abort", "handshake_failure"), mine[0]
    assert mine[0]["detail"], mine[0]
    # no other request the router dispatched is incomplete: the warm-up, the normal requests and L
    # all completed. (Not router requests: the direct request to D has no router record by design;
    # and after the failed READ vLLM's D sent P a release notification under an internal id of its
    # own, which failed too — recorded as that id's kv.post_failed, seen in the test runs.)
    routed = {r["request_id"] for r in killed_run["tr"].query(
        "SELECT DISTINCT request_id FROM spans WHERE stage = 'router.request'")}
    assert {r["request_id"] for r in rows} & routed == {x}, rows


def test_decode_keeps_serving(killed_run):
    assert killed_run["long_running_at_kill"], "L finished before P was killed: it proves nothing"
    status, body = killed_run["long"]
    assert status == 200 and body["usage"]["completion_tokens"] == LONG_TOKENS, (status, body)
    assert killed_run["health"] == 200
    status, body = killed_run["direct"]
    assert status == 200 and body["usage"]["completion_tokens"] == 4, (status, body)


def test_normal_requests_complete_in_the_store(killed_run):
    req = {r["request_id"]: r for r in killed_run["tr"].query("SELECT request_id, status FROM requests")}
    for x in killed_run["normal"]:
        assert req[x]["status"] == "complete", req[x]
