"""Tail retention on real engines (issue 18, item 4): with a TTFT threshold, every request over it is in the
store complete, the others at the head-sampled rate, nothing of an unkept request.

One traced pull lab (real vLLM P and D, NIXL, pdtrace's router) with ``PDTRACE_RETAIN=tail``,
``PDTRACE_TAIL_TTFT_MS`` = :data:`THRESHOLD_MS`, ``PDTRACE_TAIL_HEAD`` = :data:`HEAD` in every process
(the sink takes the settings of whichever process starts it). To have requests on both sides of the
threshold on any load, the lab's own injection (``PDTRACE_LAB_INJECT``, :mod:`pdtrace.connector.lab.inject`)
adds :data:`INJECT_MS` inside ``router.dispatch`` of about half the requests; the truth of which request
was slow is not that rule but the router's own TTFT per request, read from ``GET /_lab/stats`` (the
router's clock, the definition of DESIGN.md §3 the sink applies too). The store is read through
``pdtrace.analysis.open``: ``requests``, ``ttft_breakdown`` and ``spans``.
"""
from __future__ import annotations

import json
import math

import duckdb
import pytest

import labtrace as lt
from pdtrace.connector.lab.launcher import Lab
from pdtrace.instrument import retention, store

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]

THRESHOLD_MS = 500.0
INJECT_MS = 700
HEAD = 0.3
N = 48
#: Stages each kept request has (pull): the router's, P's and D's (DESIGN.md §2).
STAGES = ("router.request", "router.dispatch", "prefill.frontend", "prefill.queue", "prefill.compute",
          "handoff.prep", "kv.transfer", "kv.ready", "decode.queue", "decode.first_step", "decode.frontend")


@pytest.fixture(scope="module")
def tail_run(tmp_path_factory):
    model = lt.lab_model("default")
    wl = lt.azure_workload(model, N)
    run_dir = tmp_path_factory.mktemp("tail")
    env = {"PDTRACE_RETAIN": "tail", "PDTRACE_TAIL_TTFT_MS": str(THRESHOLD_MS), "PDTRACE_TAIL_HEAD": str(HEAD),
           "PDTRACE_LAB_INJECT": f"router.dispatch={INJECT_MS}ms"}
    cfg = lt.traced_cfg(model, run_dir, trace=True, mode="pull", env=env, role_env={"router": env})
    with Lab(cfg) as lab:
        lt.warm_up(lab, wl.requests[0].prompt)
        lt.replay_ok(lab, wl)
        stats = lt.get_json(lab.router_url + "/_lab/stats")["requests"]
    from pdtrace import analysis

    s = analysis.open(run_dir, cache=run_dir / "analysis.duckdb")
    yield {"dir": run_dir, "stats": stats, "s": s}
    s.close()


def test_every_slow_request_complete_others_head_sampled_nothing_else(tail_run):
    s = tail_run["s"]
    truth = {r["id"]: r["ttft_ns"] / 1e6 for r in tail_run["stats"] if r["status"] == 200}
    slow = {x for x, t in truth.items() if t >= THRESHOLD_MS}
    fast = set(truth) - slow
    print(f"{len(truth)} requests: {len(slow)} at or over {THRESHOLD_MS:.0f} ms, {len(fast)} under")
    assert len(slow) >= 5 and len(fast) >= 5, truth  # both sides populated (the injection)
    head = {x for x in fast if retention.head_sampled(x, HEAD)}
    in_store = {r["request_id"] for r in s.query("SELECT DISTINCT request_id FROM spans WHERE request_id IS NOT NULL")}
    # nothing of an unkept request: exactly the slow ones and the head-sampled fast ones
    assert in_store == slow | head, (sorted(in_store - slow - head), sorted((slow | head) - in_store))
    # the rate of fast requests in the store (not the hash of the known ids), within 3 sigma of the binomial
    n, k = len(fast), len(in_store & fast)
    assert abs(k - HEAD * n) <= 3 * math.sqrt(n * HEAD * (1 - HEAD)), (k, n)
    # every kept request complete: every stage, a complete request, its TTFT the router's own
    req = {r["request_id"]: r for r in s.query("SELECT * FROM requests")}
    stages = {}
    for r in s.query("SELECT request_id, stage FROM spans WHERE request_id IS NOT NULL"):
        stages.setdefault(r["request_id"], set()).add(r["stage"])
    bd = {r["request_id"]: r for r in s.query("SELECT * FROM ttft_breakdown")}
    for x in slow | head:
        assert set(STAGES) <= stages[x], (x, set(STAGES) - stages[x])
        assert req[x]["status"] == "complete", req[x]
        assert abs(req[x]["ttft_ms"] - truth[x]) < 0.01, (x, req[x]["ttft_ms"], truth[x])
        assert x in bd and bd[x]["ttft_ms"] == pytest.approx(req[x]["ttft_ms"], abs=1e-6)
    # the sink's accounting: every process's records are written or dropped by the decision, none lost:
    # on each traced process's last stats row (written by the sink after its last decision; read from the
    # files: the processes view does not read recorder.tail_dropped), recorded = written + tail_dropped.
    # The last row is the one with the most records settled (written + tail_dropped: both only grow); by
    # written alone, a row written before the last tail drop ties with the one after it
    files = [str(f) for f in store.store_files(tail_run["dir"])]
    last = duckdb.sql(f"SELECT role, pid, arg_max(attr_int, attr_int['recorder.written'] "
                      f"+ coalesce(attr_int['recorder.tail_dropped'], 0)) FROM read_parquet({files!r}, "
                      "union_by_name=true) WHERE record = 'stats' GROUP BY role, pid").fetchall()
    assert {r for r, _, _ in last} >= {"router", "prefill", "decode"}, last
    td = 0
    for role, pid, st in last:
        assert st["recorder.dropped"] == 0, (role, pid, st)
        assert st["recorder.recorded"] == st["recorder.written"] + st["recorder.tail_dropped"], (role, pid, st)
        td += st["recorder.tail_dropped"]
    assert td > 0
    summ = json.loads(next(tail_run["dir"].glob("tail-retention-*.json")).read_text())
    print("sink summary:", summ)
    assert summ["held_records"] == 0 and summ["evicted"] == 0, summ
    assert summ["dropped"] == len(fast - head), summ
