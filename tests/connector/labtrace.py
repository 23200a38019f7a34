"""Shared helpers of the traced-connector lab tests (pull, push, failures, transfer-heavy).

Imported by the ``tests/connector/test_traced_*_lab.py`` modules (this
directory is on ``sys.path`` under pytest's default import mode). Nothing
here starts a lab by itself: the modules' fixtures do, so each module decides
how many labs it pays for (≈1 min each on the shared 2-core machine).

The ``check_*`` functions are the per-request assertions both connector modes
share; they take the open trace (``pdtrace.analysis.db``), the replayed router
ids and real values only.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import labkit

from pdtrace.connector.lab import metrics, replay, workload
from pdtrace.connector.lab.launcher import Lab, LabConfig
from pdtrace.connector.lab.model import make_model, model_info

MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"
MODULE = "pdtrace.connector.traced"
TRACED_CLASS = {"pull": "TracedNixlPullConnector", "push": "TracedNixlPushConnector"}
N_REPLAY = 20
BLOCK_TOKENS = 128  # vLLM's CPU block size (tokens per KV block in the lab's engines)


post, post_status, get_json = labkit.post, labkit.post_status, labkit.get_json
greedy, pdtrace_in_processes = labkit.greedy, labkit.pdtrace_in_processes


def traced_cfg(model: Path, run_dir: Path, trace: bool, mode: str = "pull", env: dict | None = None,
               **kw) -> LabConfig:
    """A lab with the traced connector of ``mode`` and the frontend middleware; ``PDTRACE_DIR`` iff ``trace``."""
    return LabConfig(model=model, mode=mode, run_dir=run_dir, trace_dir=(run_dir.resolve() if trace else None),
                     connector_class=TRACED_CLASS[mode], connector_module=MODULE,
                     extra_args=["--middleware", MIDDLEWARE], extra_env=env or {}, **kw)


def plugin_cfg(model: Path, run_dir: Path, trace: bool, mode: str = "pull", env: dict | None = None,
               **kw) -> LabConfig:
    """The production recipe: vLLM's stock serving command (stock connector name, no module path, no
    ``--middleware``), traced by pdtrace's vLLM plugin iff ``PDTRACE_DIR`` is set (``trace``)."""
    return LabConfig(model=model, mode=mode, run_dir=run_dir, trace_dir=(run_dir.resolve() if trace else None),
                     extra_env=env or {}, **kw)


def check_activation(run_dir: Path, engines: str, router: str = "explicit") -> dict:
    """Every ``recorder.stats`` row of the engines' processes says ``engines`` ('plugin' | 'explicit'),
    the router's ``router``; at least API server and EngineCore of each engine wrote some."""
    import duckdb

    rows = duckdb.sql(f"""
        SELECT role, list(DISTINCT attr_str['pdtrace.activation']) AS a, count(DISTINCT pid) AS n
        FROM read_parquet('{run_dir}/*.parquet', union_by_name = true)
        WHERE name = 'recorder.stats' GROUP BY role""").fetchall()
    by = {r: (sorted(a), n) for r, a, n in rows}
    assert by["router"][0] == [router], by
    for role in ("prefill", "decode"):
        assert by[role][0] == [engines] and by[role][1] >= 2, by
    return by


def lab_model(profile: str = "default") -> Path:
    """The lab model of ``profile`` (shared cache); skip — or fail under ``PDTRACE_LAB_REQUIRED=1`` — without the lab."""
    labkit.require_lab()
    return make_model(profile)


def azure_workload(model_dir: Path, n: int = N_REPLAY):
    """``n`` Azure-conversation requests, lengths ×0.25, rate ×1 (the lab's defaults)."""
    from pdtrace.connector.data import AZURE_CONV
    return workload.build("azure-conv", AZURE_CONV, vocab_size=model_info(model_dir)["vocab_size"],
                          length_scale=0.25, rate_scale=1.0, max_requests=n, max_model_len=8192)


def replay_ok(lab: Lab, wl) -> list:
    """Replay ``wl`` through the router; every request must succeed."""
    recs = asyncio.run(replay.replay(wl, lab.router_url, timeout_s=300, progress=False))
    bad = [(r.request_index, r.status, r.http_status, r.error_type) for r in recs if not r.ok]
    assert not bad, bad
    return recs


def one(lab: Lab, prompt, max_tokens: int = 4, headers: dict | None = None) -> str:
    """One non-streaming completion through the router (waits for it); returns the router's request id X."""
    body = {"model": "lab", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(lab.router_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
        x = r.headers.get("X-Request-Id", "")
    assert out["usage"]["completion_tokens"] == max_tokens, out
    assert x, "the router sent no X-Request-Id"
    return x


def send_and_go_away(lab: Lab, prompt, after_s: float = 0.05) -> None:
    """POST one completion to the router and close the connection ``after_s`` s later, unanswered.

    A real client going away: the router's handler is cancelled (aiohttp's
    ``handler_cancellation``) while it still waits for P when P's prefill takes
    longer than ``after_s`` (a 7,000-token prompt takes P ≥ 120 ms here).
    """
    import aiohttp

    body = {"model": "lab", "prompt": list(prompt), "max_tokens": 2, "ignore_eos": True}

    async def go():
        async with aiohttp.ClientSession() as session:
            try:
                async with asyncio.timeout(after_s):  # cancelling the request closes its connection
                    await session.post(lab.router_url + "/v1/completions", json=body)
            except TimeoutError:
                pass

    asyncio.run(go())


def warm_up(lab: Lab, prompt, tries: int = 2) -> str:
    """First request of the P/D pair (first contact: the handshake). Returns the router's id for it."""
    last = None
    for _ in range(tries):
        status, body = post_status(lab.router_url + "/v1/completions",
                                   {"model": "lab", "prompt": list(prompt)[:40], "max_tokens": 2, "ignore_eos": True})
        if status == 200:
            return body.get("id", "")
        last = (status, body)
    raise AssertionError(f"warm-up failed {tries} times: {last}")


def open_trace(run_dir: Path):
    from pdtrace.analysis import db
    return db.open_trace(run_dir, cache=run_dir / "analysis.duckdb")


# ------------------------------------------------------------------ checks
def check_spark_engine(run_dir: Path, tr, spark) -> None:
    """Issue 20: the Spark engine's cold build of the run (in at least two Spark tasks) equals DuckDB's
    ``tr``: every materialized table and public view row for row (floats within 1e-9 relative), the
    report's data (floats within 1e-9 relative) and the printed report (identical)."""
    from answers import differences, same_within
    from pdtrace.analysis import report
    from pdtrace.analysis.spark import SparkTrace

    with SparkTrace(run_dir, spark=spark) as st:
        st.refresh()
        assert st.spark_stats["batches"] >= 2, st.spark_stats
        assert st.spark_stats["requests"] == tr.query("SELECT count(DISTINCT rkey) AS n FROM _file_keys")[0]["n"]
        assert differences(tr.con, st.con) == []
        got, want = report.collect(st.con.cursor()), report.collect(tr.con.cursor())
        assert same_within(got, want)  # (a mean's last digit may differ: summed in another order)
        assert report.render(got, str(run_dir)) == report.render(want, str(run_dir))


def check_joined(tr, ids: set, n_total: int) -> None:
    """Each id has one router root and P and D spans; the store holds exactly ``n_total`` request ids, all router ids."""
    assert len(ids) >= N_REPLAY and None not in ids
    rows = tr.query("""
        SELECT request_id,
               count(*) FILTER (WHERE stage = 'router.request') AS roots,
               count(*) FILTER (WHERE role = 'prefill') AS p_spans,
               count(*) FILTER (WHERE role = 'decode') AS d_spans
        FROM spans WHERE request_id IS NOT NULL GROUP BY request_id""")
    # (the one-token completions settled_metrics sends an engine directly, when its counters lag,
    # never pass the router: not requests of the run)
    by = {r["request_id"]: r for r in rows if not r["request_id"].startswith(NUDGE_PREFIX)}
    for x in ids:
        r = by.get(x)
        assert r is not None, f"{x}: no span at all"
        assert r["roots"] == 1 and r["p_spans"] > 0 and r["d_spans"] > 0, r
    # every id an engine recorded is a router id (internal ids stripped back to X on both engines)
    assert all(r["roots"] == 1 for r in by.values()), [r for r in by.values() if r["roots"] != 1]
    assert len(by) == n_total, len(by)
    req = {r["request_id"]: r for r in tr.query("SELECT * FROM requests")}
    assert all(req[x]["status"] == "complete" and req[x]["ttft_ms"] > 0 for x in ids)


def check_stages_once(tr, ids, stages_once) -> None:
    """Per request, attempt and rank: each stage exactly once (frontends: one in + one out part); no span ends before it starts."""
    rows = tr.query("""
        SELECT request_id, stage, attempt, coalesce(tp_rank, -1) AS rank, count(*) AS n,
               count(*) FILTER (WHERE attr_str['frontend.part'] = 'in') AS n_in,
               count(*) FILTER (WHERE attr_str['frontend.part'] = 'out') AS n_out,
               count(*) FILTER (WHERE parent_span_id IS NULL) AS n_top
        FROM spans WHERE request_id IS NOT NULL GROUP BY ALL""")
    got = {}
    for r in rows:
        got.setdefault(r["request_id"], {})[(r["stage"], r["attempt"], r["rank"])] = r
    for x in ids:
        st = got[x]
        for stage in tuple(stages_once) + ("prefill.frontend", "decode.frontend"):
            hits = [v for (s, a, k), v in st.items() if s == stage]
            assert hits, f"{x}: {stage} missing"
            assert all(h["attempt"] == 0 for h in hits), (x, stage)
            if stage.endswith("frontend"):
                assert [(h["n_in"], h["n_out"]) for h in hits] == [(1, 1)], (x, stage, hits)
            elif stage == "prefill.queue":
                # the wait before the first chunk, plus one per wait between chunks (chunked prefill)
                chunks = sum(v["n"] - v["n_top"] for (s, a, k), v in st.items() if s == "prefill.compute")
                assert [h["n"] for h in hits] and all(1 <= h["n"] <= max(1, chunks) for h in hits), (x, stage, hits)
            else:
                assert all(h["n"] == 1 for h in hits), (x, stage, hits)
        # prefill.compute: one top-level span (+ one child per chunk)
        pc = [v for (s, a, k), v in st.items() if s == "prefill.compute"]
        assert len(pc) == 1 and pc[0]["n_top"] == 1 and pc[0]["n"] >= 2, (x, pc)
        assert ("router.request", 0, -1) in st and st[("router.request", 0, -1)]["n"] == 1
    bad = tr.query("SELECT stage, request_id FROM spans WHERE raw_end_ns < raw_start_ns")
    assert not bad, bad


def causal_rows(tr) -> dict:
    """Per request: the instants the causal checks compare (raw ns: as recorded).

    Raw, not skew-corrected: every lab process runs on one host and reads the
    same clock, so the recorded times are the ground truth of the order; the
    analysis' per-window skew correction may move one engine's spans by its
    estimate's error (seen: −79 ms from a handshake clock sample under load),
    which is the analysis' accuracy, tested elsewhere, not the connectors'.
    """
    rows = tr.query("""
        SELECT request_id,
               max(raw_end_ns) FILTER (WHERE stage = 'prefill.compute') AS p_compute_end,
               max(raw_end_ns) FILTER (WHERE stage = 'kv.transfer') AS xfer_end,
               min(raw_start_ns) FILTER (WHERE stage = 'kv.transfer') AS xfer_start,
               min(raw_start_ns) FILTER (WHERE stage = 'kv.ready') AS ready_start,
               min(raw_start_ns) FILTER (WHERE stage = 'decode.first_step') AS first_step_start,
               min(raw_end_ns) FILTER (WHERE stage = 'handoff.prep') AS prep_end,
               min(raw_start_ns) FILTER (WHERE stage = 'handoff.prep') AS prep_start,
               min(raw_end_ns) FILTER (WHERE stage = 'decode.queue') AS d_queue_end,
               min(raw_start_ns) FILTER (WHERE stage = 'dest.register') AS reg_start,
               min(raw_end_ns) FILTER (WHERE stage = 'dest.register') AS reg_end,
               min(raw_start_ns) FILTER (WHERE stage = 'router.request') AS arrival
        FROM spans WHERE request_id IS NOT NULL GROUP BY request_id""")
    return {r["request_id"]: r for r in rows}


def check_causal(tr, ids, transfer_owner_is_decode: bool = True) -> dict:
    """arrival ≤ P compute end < transfer end; the post ends prep; readiness before D's first step.

    ``transfer_owner_is_decode`` (pull): the transfer also ends before D's first step. In push
    the WRITE's handle is P's, and NIXL's own duration ends when *P* polls it DONE (P's next
    engine step), which can be after D got the write-done notification and stepped (seen: 24 ms
    under load); there the transfer must have started before D saw it done (``kv.ready``).
    """
    by = causal_rows(tr)
    for x in ids:
        r = by[x]
        assert r["arrival"] <= r["p_compute_end"] < r["xfer_end"], r
        assert r["prep_end"] <= r["xfer_start"] + 1_000_000, r  # the post ends prep
        assert r["ready_start"] <= r["first_step_start"], r
        if transfer_owner_is_decode:
            assert r["xfer_end"] <= r["first_step_start"], r
        else:
            assert r["xfer_start"] <= r["ready_start"], r
    return by


def check_transfer_bytes(tr, ids, kv_bytes_per_token: int) -> None:
    """``kv.transfer`` bytes = blocks × block bytes, blocks = ⌈prompt / 128⌉ (or of prompt − 1)."""
    block_bytes = BLOCK_TOKENS * kv_bytes_per_token
    rows = tr.query("""
        SELECT t.request_id, t.bytes, t.blocks, q.prompt_tokens
        FROM transfers t JOIN requests q USING (rkey)""")
    by = {}
    for r in rows:
        assert r["request_id"] not in by, f"{r['request_id']}: more than one kv.transfer"
        by[r["request_id"]] = r
    for x in ids:
        r = by[x]
        assert r["blocks"] and r["bytes"] == r["blocks"] * block_bytes, r
        n = r["prompt_tokens"]
        assert r["blocks"] in (math.ceil((n - 1) / BLOCK_TOKENS), math.ceil(n / BLOCK_TOKENS)), r


#: Request id prefix of the completions :func:`settled_metrics` sends an engine directly.
NUDGE_PREFIX = "pdtrace-test-nudge-"


def settled_metrics(engine_url: str, name: str, at_least: float, timeout_s: float = 60.0) -> dict:
    """Scrape ``engine_url``'s ``/metrics`` once series ``name`` totals ``at_least``; return the last scrape.

    vLLM reports a worker's KV-connector stats (the ``vllm:nixl_*`` series)
    with the output of the engine's next step, so a transfer that completed
    while the engine was idle, or during a long step (a 7,000-token prefill
    here), is not in ``/metrics`` until a step ends (seen in CI: 41 transfers
    traced, 40 in P's counters, scraped right after the last request). While
    short, this sends the engine a one-token completion of its own (no
    ``kv_transfer_params``: no handoff, no transfer) to make it step, and
    scrapes again, for up to ``timeout_s`` s; the caller's check then
    compares whatever the engine reported.
    """
    deadline = time.monotonic() + timeout_s
    m = metrics.scrape(engine_url)
    while metrics.total(m, name) < at_least and time.monotonic() < deadline:
        labkit.post_status(engine_url.rstrip("/") + "/v1/completions",
                           {"model": "lab", "prompt": [16, 17, 18, 19], "max_tokens": 1},
                           headers={"X-Request-Id": f"{NUDGE_PREFIX}{uuid.uuid4().hex[:12]}"}, timeout=timeout_s)
        time.sleep(0.5)
        m = metrics.scrape(engine_url)
    return m


def check_nixl_counters(tr, m: dict, min_count: int) -> dict:
    """Totals of ``kv.transfer`` (count, bytes, NIXL duration) = vLLM's ``vllm:nixl_*`` counters ``m`` within 1 %."""
    prom_count = metrics.total(m, "vllm:nixl_xfer_time_seconds_count")
    prom_bytes = metrics.total(m, "vllm:nixl_bytes_transferred_sum")
    prom_time = metrics.total(m, "vllm:nixl_xfer_time_seconds_sum")
    t = tr.query("""SELECT count(*) AS n, sum(attr_int['kv.bytes']) AS b, sum(attr_int['kv.xfer_ns']) AS ns
                    FROM spans WHERE stage = 'kv.transfer'""")[0]
    print(f"kv.transfer: {t['n']} spans, {t['b']} B, {t['ns'] / 1e9:.4f} s; vLLM: {prom_count:.0f}, "
          f"{prom_bytes:.0f} B, {prom_time:.4f} s")
    assert prom_count >= min_count
    assert abs(t["n"] - prom_count) <= 0.01 * prom_count
    assert abs(t["b"] - prom_bytes) <= 0.01 * prom_bytes
    assert abs(t["ns"] / 1e9 - prom_time) <= 0.01 * prom_time + 1e-6
    return {"spans": t, "prom": (prom_count, prom_bytes, prom_time)}


def check_handshake_once(tr, replay_ids: set) -> str:
    """Exactly one ``handoff.handshake`` (and one first-contact prep): on the first request, rank 0. Returns its id."""
    hs = tr.query("""
        SELECT s.request_id, s.engine_id, s.tp_rank, s.attr_str['peer.engine_id'] AS peer
        FROM spans s WHERE s.stage = 'handoff.handshake'""")
    assert len(hs) == 1, hs
    first = tr.query("SELECT request_id FROM requests ORDER BY arrival_ns LIMIT 1")[0]["request_id"]
    assert hs[0]["request_id"] == first and hs[0]["tp_rank"] in (0, None), (hs, first)
    assert first not in replay_ids
    fc = tr.query("SELECT request_id FROM spans WHERE stage = 'handoff.prep' AND attr_int['kv.first_contact'] = 1")
    assert [r["request_id"] for r in fc] == [first]
    return first


def check_no_tracing_errors(run_dir: Path) -> None:
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "pdtrace: tracing error" not in logs


def helper_affinities(lab: Lab) -> dict:
    """CPU affinity of the lab's processes while it runs (psutil), to check pdtrace's helpers are not pinned.

    Returns ``{"sinks": [(starter name, cpus)], "pinned_engine_procs": [(name, cpus)], "allowed": cpus}``:
    the host's ``pdtrace.instrument.sink`` process of the lab's trace directory with the name of the
    traced process that started it (``--by``; '?' if it has exited), the engine processes (vLLM's
    ``VLLM::Worker``) whose main thread is pinned to fewer CPUs than this test may use, and the CPUs
    this test may use.
    """
    import os

    import psutil

    from pdtrace.instrument import hostsink

    allowed = set(os.sched_getaffinity(0))
    sinks, pinned = [], []
    for pid in (hostsink.find(lab.cfg.trace_dir) if lab.cfg.trace_dir else []):
        try:
            by = hostsink.starter(pid)
            try:
                who = psutil.Process(by).name() if by else "?"
            except psutil.NoSuchProcess:
                who = "?"
            sinks.append((who, set(psutil.Process(pid).cpu_affinity())))
        except psutil.NoSuchProcess:
            continue
    for pid in lab.pids().values():
        root = psutil.Process(pid)
        for p in [root] + root.children(recursive=True):
            try:
                if "pdtrace.instrument.sink" not in " ".join(p.cmdline()) and set(p.cpu_affinity()) < allowed:
                    pinned.append((p.name(), set(p.cpu_affinity())))
            except psutil.NoSuchProcess:
                continue
    return {"sinks": sinks, "pinned_engine_procs": pinned, "allowed": allowed}
