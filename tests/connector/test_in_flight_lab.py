"""A request stuck in a traced push lab is visible while it hangs (real engines, NIXL, router, DuckDB).

One small traced push lab (its own: the module test_traced_push_lab.py asserts
exact request counts and NIXL counter totals that a held request would change)
with the router's TEST HOOK ``X-Pdtrace-Lab-Hold: 1``: in push mode the router
does not send D's leg until ``POST /_lab/release``, so D never allocates nor
sends its registration, and P, its prefill done, holds the KV waiting for a
registration that does not come. This is the hook standing in for a lost
registration; nothing else is faked.

1. warm-up (first contact) and one normal request;
2. the held request H: while it hangs the live store is read (refresh of an
   analysis cache outside the run directory, and ``pdtrace report`` on the
   directory): H is in ``in_flight`` with its stage (P's
   ``prefill.block_hold``, waiting for its ``registration``), since when and
   its age, while it is still held, long before any timeout (router 400 s,
   P's KV lease set to 480 s: ``kv_lease_duration``, vLLM's default 30 s); its first open row is in the store within two flush
   intervals of the stage's start;
3. release: H completes; in the final store it is no longer in ``in_flight``
   and is a complete request.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import duckdb
import pytest

import labtrace as lt
from pdtrace.analysis import db, report
from pdtrace.connector.lab.launcher import Lab
from pdtrace.instrument import store

pytestmark = [pytest.mark.lab, pytest.mark.timeout(900)]

FLUSH_S = 1.0  # the lab's PDTRACE_FLUSH_INTERVAL_S; PDTRACE_OPEN_AFTER_S is left at its default (1 s)
HOLD_S = 6.0  # how long H is held after it was first seen in in_flight


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    model = lt.lab_model("default")
    wl = lt.azure_workload(model, 4)
    run_dir = tmp_path_factory.mktemp("push-held")
    live_cache = tmp_path_factory.mktemp("live-cache") / "live.duckdb"
    cfg = lt.traced_cfg(model, run_dir, trace=True, mode="push", router_test_hooks=True, router_timeout_s=400.0,
                        push_join_timeout_s=60.0,
                        # P's KV lease (vLLM's kv_lease_duration, 30 s by default): P releases the held
                        # blocks when it expires, and the live reads below (refreshes, `pdtrace report`)
                        # take longer than that on a loaded 2-core machine (seen: 40 s), so the released
                        # request then found no KV and timed out. 480 s outlasts every wait of the test.
                        connector_extra={"kv_lease_duration": 480},
                        # no compaction while the live store is read: a refresh that takes seconds on this
                        # loaded machine would otherwise meet merged-away part files on every attempt
                        env={"PDTRACE_FLUSH_INTERVAL_S": str(FLUSH_S), "PDTRACE_ROTATE_S": "900"})
    out = {"dir": run_dir}
    with Lab(cfg) as lab:
        lt.warm_up(lab, wl.requests[0].prompt)
        out["normal"] = lt.one(lab, wl.requests[1].prompt)
        res = {}

        def held():
            res["held"] = lt.post_status(lab.router_url + "/v1/completions",
                                         {"model": "lab", "prompt": wl.requests[2].prompt, "max_tokens": 4,
                                          "ignore_eos": True}, {"X-Pdtrace-Lab-Hold": "1"}, timeout=300)

        th = threading.Thread(target=held)
        th.start()
        deadline = time.monotonic() + 60
        while not (ids := lt.get_json(lab.router_url + "/_lab/held")["held"]):
            assert time.monotonic() < deadline and th.is_alive(), f"the router never held the request: {res}"
            time.sleep(0.05)
        x = out["held_id"] = ids[0]
        out["held_wall_ns"] = time.time_ns()
        tr = db.Trace(run_dir, cache=live_cache)
        tr.refresh_attempts = 10  # a file renamed under a refresh (tmp -> part) makes it start again
        tr.refresh()
        seen = None
        polls = out["polls"] = []  # (s since held, refresh s, stage, age ms): what each read saw
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            tr.refresh()
            rows = tr.query("SELECT * FROM in_flight WHERE request_id = ?", [x])
            polls.append((round((time.time_ns() - out["held_wall_ns"]) / 1e9, 2), round(time.monotonic() - t0, 2),
                          rows[0]["stage"] if rows else None, round(rows[0]["age_ms"]) if rows else None))
            if rows and rows[0]["stage"] == "prefill.block_hold":
                seen = rows[0]
                out["seen_wall_ns"] = time.time_ns()
                out["seen_refresh_s"] = time.monotonic() - t0
                break
            time.sleep(0.1)
        out["live"] = seen
        out["live_report"] = report.collect(tr.con) if seen else None
        time.sleep(HOLD_S)
        tr.refresh()
        out["later"] = tr.query("SELECT * FROM in_flight WHERE request_id = ?", [x])
        tr.close()
        files_before = sorted(p.name for p in run_dir.iterdir())
        cli = subprocess.run([sys.executable, "-m", "pdtrace.cli.main", "report", "--no-cache", str(run_dir)],
                             capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "PDTRACE_DIR"})
        out["cli"] = cli
        out["new_other_files"] = [n for n in sorted(p.name for p in run_dir.iterdir())
                                      if n not in files_before and not n.endswith(".parquet")]
        out["still_held"] = x in lt.get_json(lab.router_url + "/_lab/held")["held"]
        lt.post(lab.router_url + "/_lab/release", {})
        th.join(timeout=120)
        assert not th.is_alive(), "the released request did not finish"
        out.update(res)
    tr = lt.open_trace(run_dir)
    out["tr"] = tr
    yield out
    tr.close()


def test_held_request_is_in_flight_with_stage_wait_and_age(held_run):
    live = held_run["live"]
    print("reads (s since held, refresh s, stage, age ms):", held_run["polls"])
    assert live is not None, "the held request never appeared in in_flight at P's block hold"
    assert held_run["still_held"]  # seen while it hung, not after
    assert (live["stage"], live["role"], live["mode"], live["wait_for"]) == \
        ("prefill.block_hold", "prefill", "push", "registration")
    assert live["engine_id"]
    # Seen by a reader while it hung. The store has it within two flush intervals of the stage's start
    # (test_store_has_the_open_rows_within_two_flush_intervals); a reader sees it when a refresh that
    # began after that finishes (a refresh here took seconds on the shared 2-core machine, printed).
    delay_s = (held_run["seen_wall_ns"] - live["since_ns"]) / 1e9
    print(f"held request {held_run['held_id']}: seen in in_flight {delay_s:.2f} s after its stage started, "
          f"age {live['age_ms']:.0f} ms as of the trace end read, that refresh {held_run['seen_refresh_s']:.2f} s; "
          f"reads (s since held, refresh s, stage, age ms): {held_run['polls']}")
    assert 0 < delay_s < 180
    # the age is the trace end (P's last flush read) minus the stage's start: at least the open-row
    # threshold, at most the time since the stage started
    assert FLUSH_S * 1000 * 0.9 <= live["age_ms"] <= delay_s * 1000, live
    # refreshed while it hangs: the age grows with the hold
    later = held_run["later"]
    assert len(later) == 1 and later[0]["stage"] == "prefill.block_hold" and abs(later[0]["since_ns"] - live["since_ns"]) < 1000  # (each file's anchor: within 1 µs)
    # the router's open root is there too: asserted on the later read, because each process's open rows
    # reach the store with its own flushes (a fresh-clone CI run read P's hold 3.7 s after the hold began,
    # before the router's open router.request row had arrived)
    assert "router.request" in later[0]["open_stages"], later
    # (each read's trace end lags the wall clock by what the sink and the refresh took: seconds under load)
    assert later[0]["as_of_ns"] > live["as_of_ns"] and later[0]["age_ms"] >= live["age_ms"] + FLUSH_S * 1000, \
        (live, later)


def test_store_has_the_open_rows_within_two_flush_intervals(held_run):
    """The first open row of P's block hold was written within threshold + one flush interval of its start."""
    files = [str(f) for f in store.store_files(held_run["dir"])]
    lst = "[" + ",".join(f"'{f}'" for f in files) + "]"
    rows = duckdb.sql(f"""
        SELECT span_id, min(start_ns) AS start_ns, min(end_ns) AS first_ns, count(*) AS n
        FROM read_parquet({lst}, union_by_name = true)
        WHERE record = 'open' AND name = 'prefill.block_hold' AND request_id = '{held_run["held_id"]}'
        GROUP BY span_id""").fetchall()
    assert len(rows) == 1, rows
    _, start, first, n = rows[0]
    print(f"first open row {(first - start) / 1e9:.2f} s after the stage started; {n} open rows")
    assert FLUSH_S * 1e9 <= first - start <= 2 * FLUSH_S * 1e9 + 0.5e9
    assert n >= HOLD_S / FLUSH_S - 1  # refreshed at (nearly) every flush while held
    # its final span row has the same span id (the stage ended when D's registration came)
    span = duckdb.sql(f"SELECT count(*) FROM read_parquet({lst}, union_by_name = true) "
                      f"WHERE record = 'span' AND span_id = {rows[0][0]}").fetchall()[0][0]
    assert span == 1


def test_report_prints_it_first_while_it_hangs(held_run):
    data = held_run["live_report"]
    assert data is not None
    assert held_run["held_id"] in [r["request_id"] for r in data["in_flight"]]
    cli = held_run["cli"]
    assert cli.returncode == 0, cli.stderr
    first = cli.stdout.split("\n\n")[1]  # the first section after the report's title line
    assert first.startswith("In flight now ("), cli.stdout[:500]
    assert held_run["held_id"] in first and "prefill.block_hold" in first and "registration" in first
    # the live report left no other file (a cache, a lock) in the directory; that a reader starts no recorder
    # (no new .parquet of its own) is tests/dashboard/test_reading_never_writes.py
    assert held_run["new_other_files"] == []


def test_after_release_it_leaves_in_flight_and_completes(held_run):
    status, body = held_run["held"]
    assert status == 200 and body["usage"]["completion_tokens"] == 4, (status, body)
    tr = held_run["tr"]
    x = held_run["held_id"]
    assert tr.query("SELECT * FROM in_flight") == []
    req = tr.query("SELECT status, ttft_ms FROM requests WHERE request_id = ?", [x])
    assert req and req[0]["status"] == "complete" and req[0]["ttft_ms"] >= HOLD_S * 1000, req
    # the hold is on its critical path: D's leg was not sent, a router-side coordination wait
    normal = tr.query("SELECT status FROM requests WHERE request_id = ?", [held_run["normal"]])
    assert normal == [{"status": "complete"}]
