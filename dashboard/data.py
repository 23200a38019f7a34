"""The dashboard's one data module: plain functions over the analysis views.

(Over 400 lines on purpose: every SQL query the dashboard runs is here, one function per number
shown, grouped by page, so a reviewer checks what the dashboard reads in one place.)

No Streamlit here (the pages add caching and rendering). Every number the
dashboard shows comes from a function below, and every function reads only
the public views of :mod:`pdtrace.analysis` (``requests``, ``ttft_breakdown``,
``ttft_segments``, ``ttft_hidden``, ``spans``, ``events``, ``incomplete_requests``,
``decode_stalls``, ``request_stalls``, ``transfers``, ``clock_offsets``,
``store_files``) and macros (``prompt_bucket``) through the trace's read-only
:class:`pdtrace.analysis.Session` (:func:`session`, opened with :func:`pdtrace.analysis.open`).

Units: times are ns since the Unix epoch (``*_ns`` absolute) on the router's
clock, as the views give them; durations shown are ms (``*_ms``), shares are
fractions 0..1 of TTFT. A :class:`Window` filters requests by arrival.

Functions return pandas DataFrames (what Streamlit and plotly take) or plain
dicts of numbers.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from pdtrace import analysis
from pdtrace.analysis import Session
from pdtrace.instrument.stages import CATEGORIES

#: Descriptor-count buckets of a request's KV transfers (descriptors): label -> [lo, hi).
DESCRIPTOR_BUCKETS: list[tuple[str, int, int]] = [
    ("<1k", 0, 1000), ("1k-10k", 1000, 10_000), ("10k-100k", 10_000, 100_000), (">=100k", 100_000, 2**62),
]
#: The views the SQL page documents, in reading order.
PUBLIC_VIEWS_FIRST = ("requests", "ttft_breakdown", "ttft_segments", "ttft_hidden", "spans", "events",
                      "incomplete_requests", "decode_stalls", "request_stalls", "transfers", "block_holds",
                      "clock_offsets", "store_files", "stages")


def _bucket_case(col: str, buckets: Sequence[tuple[str, int, int]]) -> str:
    parts = " ".join(f"WHEN {col} < {hi} THEN '{label}'" for label, _, hi in buckets)
    return f"(CASE WHEN {col} IS NULL THEN 'unknown' {parts} END)"


def prompt_bucket_sql(col: str = "prompt_tokens") -> str:
    """SQL expression: the prompt-length bucket label of ``col`` (prompt tokens).

    The analysis's public macro ``prompt_bucket`` (analysis/sql/summary.sql): the buckets of
    ``pdtrace report`` and the ``summary_by_prompt_bucket`` view, powers of two [lo, 2*lo) tokens,
    labelled 'lo-(2*lo-1)' (e.g. '256-511'); '0' for no tokens, 'unknown' when NULL.
    """
    return f"prompt_bucket({col})"



def sorted_buckets(labels: Iterable[str]) -> list[str]:
    """Distinct prompt-bucket labels of :func:`prompt_bucket_sql` in ascending token order, 'unknown' last."""
    return sorted(set(labels), key=lambda b: (b == "unknown", int(b.split("-")[0]) if b != "unknown" else 0))


@dataclass(frozen=True)
class Window:
    """A time window on request arrival: [start_ns, end_ns) in ns since the Unix epoch (None: open)."""

    start_ns: int | None = None
    end_ns: int | None = None

    def sql(self, col: str = "arrival_ns") -> str:
        """A SQL predicate on ``col`` (ints inlined: they are ints, so safe)."""
        parts = []
        if self.start_ns is not None:
            parts.append(f"{col} >= {int(self.start_ns)}")
        if self.end_ns is not None:
            parts.append(f"{col} < {int(self.end_ns)}")
        return " AND ".join(parts) or "TRUE"

    def params(self) -> list:
        """[start_ns, end_ns] (None: open): the window arguments of the analysis's table macros
        (``window_summary``, ``category_shares_over_time``, ...: analysis/sql/window_summary.sql)."""
        return [self.start_ns, self.end_ns]


ALL = Window()


_SESSIONS: dict[str, Session] = {}
_SESSIONS_LOCK = threading.Lock()


def session(directory: str | os.PathLike, memory_limit: str | None = None, refresh: bool = True) -> Session:
    """The process-wide analysis session of ``directory`` (:func:`pdtrace.analysis.open` on first use, one per
    resolved path; a directory that does not exist yet is opened when it appears). Its cache is the
    directory's default cache file, in memory when another process holds that file. ``memory_limit``
    (DuckDB's setting, e.g. '2GB') applies when this call opens the session; ``refresh``: absorb the
    directory's files now if no refresh has yet (False: leave it to the next caller)."""
    key = str(Path(directory).expanduser().resolve())
    with _SESSIONS_LOCK:
        s = _SESSIONS.get(key)
        if s is None:
            s = _SESSIONS[key] = analysis.open(key, live=True, missing_ok=True, refresh=False,
                                                      memory_limit=memory_limit)
    if refresh and s.version == 0:
        s.refresh()
    return s


# ---------------------------------------------------------------------------
# store health
# ---------------------------------------------------------------------------

def store_health(t: Session) -> dict:
    """Files absorbed and skipped: {'files': n ok, 'skipped': [(path, reason)], 'requests': n, 'in_flight': n}.

    ``in_flight`` counts the rows of view ``in_flight``: a request with only open stages so far is in
    flight but not yet in ``requests``."""
    if not t.exists:
        return {"files": 0, "skipped": [], "requests": 0, "in_flight": 0, "missing": True}
    f = t.df("SELECT path, ok, reason FROM store_files ORDER BY path")
    ok = int(f["ok"].sum()) if len(f) else 0
    skipped = [(r.path, r.reason) for r in f.itertuples() if not r.ok]
    n = int(t.df("SELECT count(*) AS n FROM requests")["n"].iloc[0]) if ok else 0
    fl = int(t.df("SELECT count(*) AS n FROM in_flight")["n"].iloc[0]) if ok else 0
    return {"files": ok, "skipped": skipped, "requests": n, "in_flight": fl, "missing": False}


def time_range(t: Session) -> tuple[int, int] | None:
    """(first, last) request arrival in ns since the Unix epoch, or None without requests."""
    r = t.df("SELECT min(arrival_ns) AS lo, max(arrival_ns) AS hi FROM requests")
    if not len(r) or pd.isna(r["lo"].iloc[0]):
        return None
    return int(r["lo"].iloc[0]), int(r["hi"].iloc[0])


def modes(t: Session) -> list[str]:
    """Handoff modes present ('pull', 'push', ...), sorted."""
    return t.df("SELECT DISTINCT mode FROM requests WHERE mode IS NOT NULL ORDER BY 1")["mode"].tolist()


# ---------------------------------------------------------------------------
# overview
# ---------------------------------------------------------------------------

def headline(t: Session, w: Window = ALL, mode: str | None = None) -> dict:
    """Counts and percentiles in the window (the analysis's ``window_summary`` macro).

    Keys: requests, complete, incomplete (counts); ttft_p50/p90/p99_ms and
    tpot_p50/p90/p99_ms (ms, quantile_cont over complete requests); share_queue
    / share_compute / share_transfer / share_coordination (fraction of the
    summed TTFT of requests with a breakdown; NaN without one); unattributed_share (fraction);
    engine_source (count of requests whose TTFT window is the engines' own,
    requests.ttft_source = 'engine': no router record, the router's hop unseen)
    and router_unseen_ms (their summed exposed router.unseen, ms).
    """
    r = t.df("SELECT * FROM window_summary(?, ?, ?)", [*w.params(), mode]).iloc[0].to_dict()
    for c in CATEGORIES:
        v = r.pop(f"{c}_share")
        r[f"share_{c}"] = float("nan") if v is None or pd.isna(v) else v
    if r["unattributed_share"] is None or pd.isna(r["unattributed_share"]):
        r["unattributed_share"] = float("nan")
    r["router_unseen_ms"] = float(r["router_unseen_ms"])
    for k in ("requests", "complete", "incomplete", "engine_source"):
        r[k] = int(r[k] or 0)
    return r


def engine_source_note(n_engine: int, n_requests: int) -> str | None:
    """The dashboard's plain 'router hop unseen' note when ``n_engine`` > 0 of ``n_requests`` have an
    engine-clock TTFT window (requests.ttft_source = 'engine'), else None."""
    if not n_engine:
        return None
    return (f"**Router hop unseen** for {n_engine:,} of {n_requests:,} requests: no router record (a router that "
            "writes no pdtrace spans), so their TTFT is the engines' own window, P's API server received the "
            "request → D's API server wrote the first token chunk (P and D clocks corrected). The router's time "
            "before P and after D is not in it; its hop between the legs is the stage `router.unseen` "
            "(coordination).")


def nice_bucket_ns(span_ns: int, target_points: int = 60) -> int:
    """A round time-bucket width (ns) giving about ``target_points`` buckets over ``span_ns``."""
    steps_s = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400]
    want = max(span_ns / max(target_points, 1), 1) / 1e9
    for s in steps_s:
        if s >= want:
            return s * 1_000_000_000
    return steps_s[-1] * 1_000_000_000


def latency_over_time(t: Session, w: Window, bucket_ns: int) -> pd.DataFrame:
    """TTFT and TPOT p50/p90/p99 (ms) per arrival-time bucket and mode, complete requests.

    Columns: bucket_ns (bucket start, ns since the Unix epoch), mode, requests
    (count), ttft_p50_ms, ttft_p90_ms, ttft_p99_ms, tpot_p50_ms, tpot_p90_ms, tpot_p99_ms.
    """
    b = int(bucket_ns)
    return t.df(f"""
        SELECT (arrival_ns // {b}) * {b} AS bucket_ns, mode, count(*) AS requests,
               quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.9) AS ttft_p90_ms,
               quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms,
               quantile_cont(tpot_ms, 0.5) AS tpot_p50_ms, quantile_cont(tpot_ms, 0.9) AS tpot_p90_ms,
               quantile_cont(tpot_ms, 0.99) AS tpot_p99_ms
        FROM requests WHERE status = 'complete' AND {w.sql()}
        GROUP BY ALL ORDER BY bucket_ns, mode""")


def category_share_over_time(t: Session, w: Window, bucket_ns: int) -> pd.DataFrame:
    """Share of TTFT per category per arrival-time bucket and mode (long form; the analysis's
    ``category_shares_over_time`` macro).

    Columns: bucket_ns (ns since the Unix epoch), mode, category, requests (count with a breakdown),
    ms (summed category time in the bucket, ms), share (fraction of the bucket's summed TTFT).
    """
    return t.df("SELECT * FROM category_shares_over_time(?, ?, ?)", [*w.params(), int(bucket_ns)])


def category_share_by_bucket(t: Session, w: Window = ALL) -> pd.DataFrame:
    """Share of TTFT per category by mode and prompt-length bucket (long form; the analysis's
    ``category_shares_by_prompt_bucket`` macro).

    Columns: mode, prompt_bucket (see :func:`prompt_bucket_sql`), category, requests (count),
    ms (summed, ms), share (fraction of the group's summed TTFT), mean_ms (per request, ms).
    """
    return t.df("SELECT * FROM category_shares_by_prompt_bucket(?, ?)", w.params())


def in_flight(t: Session, limit: int = 200) -> pd.DataFrame:
    """Requests not finished at the trace end (view ``in_flight``), oldest stage first.

    Columns: request_id, mode, stage, role, engine_id, age_ms (ms), waits_for (text), since_ns
    (router clock, ns since the Unix epoch). Not windowed: "now" is the trace end.
    """
    return t.df(f"""
        SELECT request_id, mode, stage, role, engine_id, age_ms, waits_for, since_ns
        FROM in_flight ORDER BY age_ms DESC, request_id LIMIT {int(limit)}""")


def in_flight_request(t: Session, request_id: str) -> dict | None:
    """The ``in_flight`` row of ``request_id`` (base id X, as :func:`request_row` takes it), or None.

    Keys: rkey, request_id, mode, stage, role, engine_id, age_ms (ms), waits_for, since_ns (ns since
    the Unix epoch). For a request that has only open stages so far (nothing ended yet, so no
    ``requests`` row), this is all the trace knows of it.
    """
    df = t.df("SELECT rkey, request_id, mode, stage, role, engine_id, age_ms, waits_for, since_ns "
                 "FROM in_flight WHERE request_id = $1 ORDER BY since_ns LIMIT 1", [request_id])
    return None if df.empty else df.iloc[0].to_dict()


def incomplete_by_cause(t: Session, w: Window = ALL) -> pd.DataFrame:
    """Incomplete requests per cause in the window: cause, requests (count), median time to failure (ms)."""
    return t.df(f"""
        SELECT cause, count(*) AS requests, median(time_to_failure_ms) AS median_time_to_failure_ms
        FROM incomplete_requests WHERE {w.sql()} GROUP BY cause ORDER BY requests DESC, cause""")


def incomplete_list(t: Session, w: Window = ALL, limit: int = 200) -> pd.DataFrame:
    """Incomplete requests (newest first): request_id, mode, cause, detail, time_to_failure_ms, arrival_ns."""
    return t.df(f"""
        SELECT request_id, mode, cause, detail, time_to_failure_ms, arrival_ns
        FROM incomplete_requests WHERE {w.sql()} ORDER BY arrival_ns DESC LIMIT {int(limit)}""")


def slowest_requests(t: Session, w: Window = ALL, limit: int = 20, mode: str | None = None) -> pd.DataFrame:
    """The slowest complete requests by TTFT with their split (ms) and dominant stage.

    Columns: request_id, run_id, mode, prompt_tokens, ttft_ms, queue_ms, compute_ms,
    transfer_ms, coordination_ms, hidden_ms, dominant_stage, first_contact, arrival_ns.
    """
    mf = "TRUE" if mode is None else "mode = $1"
    return t.df(f"""
        SELECT request_id, run_id, mode, prompt_tokens, ttft_ms, queue_ms, compute_ms, transfer_ms,
               coordination_ms, hidden_ms, dominant_stage, first_contact, arrival_ns
        FROM ttft_breakdown WHERE {w.sql()} AND {mf}
        ORDER BY ttft_ms DESC, request_id LIMIT {int(limit)}""", [mode] if mode else [])


# ---------------------------------------------------------------------------
# request explorer
# ---------------------------------------------------------------------------

def find_requests(t: Session, text: str, limit: int = 50) -> pd.DataFrame:
    """Requests whose id contains ``text`` (case-insensitive): request_id, run_id, mode, status, ttft_ms."""
    return t.df(f"""
        SELECT request_id, run_id, mode, status, ttft_ms FROM requests
        WHERE request_id ILIKE '%' || $1 || '%' ORDER BY arrival_ns LIMIT {int(limit)}""", [text])


def request_row(t: Session, request_id: str, run_id: str | None = None) -> dict | None:
    """The request's ``requests`` row joined with its ``ttft_breakdown`` row (None if unknown)."""
    r = t.df("""
        SELECT r.*, b.queue_ms, b.compute_ms, b.transfer_ms, b.coordination_ms, b.unattributed_ms, b.hidden_ms,
               b.dominant_stage, b.first_contact, b.router_unseen_ms
        FROM requests r LEFT JOIN ttft_breakdown b USING (rkey)
        WHERE r.request_id = $1 AND ($2 IS NULL OR r.run_id = $2)
        ORDER BY r.arrival_ns LIMIT 1""", [request_id, run_id])
    return None if r.empty else r.iloc[0].to_dict()


def request_spans(t: Session, rkey: int) -> pd.DataFrame:
    """All spans of a request plus the engine steps that served it, with lane and critical-path share.

    Columns: span_id, parent_span_id, stage, category, role, engine_id, thread, tp_rank,
    lane (role · engine · thread), start_ns, end_ns (router clock, ns since the Unix epoch),
    raw_start_ns, clock_offset_ns, clock_bound_ns (ns), dur_ms, exposed_ms (time this span
    owns on the critical path, ms), hidden_ms (time of this stage off the critical path, ms),
    attrs (short text). A stage still open at the trace end (view ``in_flight_spans``) is a row
    in lane ``role · engine · open``, ending at its process's trace end ("now"), thread ``open``.
    """
    return t.df("""
        WITH seg AS (SELECT span_id, sum(dur_ns) AS exposed_ns FROM ttft_segments WHERE rkey = $1 GROUP BY span_id)
        SELECT s.span_id, s.parent_span_id, s.stage, s.category, s.role, s.engine_id, s.thread, s.tp_rank,
               s.role || coalesce(' · ' || s.engine_id, '') || coalesce(' · rank ' || s.tp_rank, '')
                   || ' · ' || coalesce(s.thread, '?') AS lane,
               s.start_ns, s.end_ns, s.raw_start_ns, s.clock_offset_ns, s.clock_bound_ns,
               s.dur_ns / 1e6 AS dur_ms, coalesce(seg.exposed_ns, 0) / 1e6 AS exposed_ms,
               s.attr_int, s.attr_str
        FROM spans s LEFT JOIN seg USING (span_id)
        WHERE s.rkey = $1
        UNION ALL
        -- stages still open at the trace end, drawn to "now" (the trace end of their process)
        SELECT f.span_id, NULL, f.stage, f.category, f.role, f.engine_id, 'open' AS thread, f.tp_rank,
               f.role || coalesce(' · ' || f.engine_id, '') || coalesce(' · rank ' || f.tp_rank, '') || ' · open',
               f.since_ns, f.trace_end_ns, f.since_ns, 0, NULL, f.age_ms, 0, NULL::MAP(VARCHAR, BIGINT),
               MAP {'open.waits_for': concat_ws(' ', f.wait_for, CASE WHEN f.wait_expected IS NOT NULL
                    THEN coalesce(f.wait_received, 0) || ' of ' || f.wait_expected END)}
        FROM in_flight_spans f WHERE f.rkey = $1
        ORDER BY start_ns, span_id""", [rkey])


def request_segments(t: Session, rkey: int) -> pd.DataFrame:
    """The request's critical path: seq, stage, stage_group, category, start_ns, end_ns (ns), dur_ms, detail, span_id."""
    return t.df("""
        SELECT seq, stage, stage_group, category, start_ns, end_ns, dur_ns / 1e6 AS dur_ms, detail, span_id, role
        FROM ttft_segments WHERE rkey = $1 ORDER BY seq""", [rkey])


def request_hidden(t: Session, rkey: int) -> pd.DataFrame:
    """Per stage, time that ran off the critical path (hidden): stage, hidden_ms."""
    return t.df("SELECT stage, hidden_ms FROM ttft_hidden WHERE rkey = $1 ORDER BY hidden_ms DESC", [rkey])


def request_events(t: Session, rkey: int) -> pd.DataFrame:
    """Events of a request: event, role, engine_id, thread, tp_rank, time_ns (router clock), raw_time_ns, attr_str, attr_int."""
    return t.df("""
        SELECT event, role, engine_id, thread, tp_rank, time_ns, raw_time_ns, clock_offset_ns, attr_str, attr_int,
               role || coalesce(' · ' || engine_id, '') || coalesce(' · rank ' || tp_rank, '')
                   || ' · ' || coalesce(thread, '?') AS lane
        FROM events WHERE rkey = $1 ORDER BY time_ns""", [rkey])


def request_clock(t: Session, rkey: int) -> pd.DataFrame:
    """Clock correction applied to the request's rows per clock domain: clock_domain, offset_ms, bound_ms, spans."""
    return t.df("""
        SELECT clock_domain, any_value(clock_offset_ns) / 1e6 AS offset_ms,
               max(clock_bound_ns) / 1e6 AS bound_ms, count(*) AS spans
        FROM spans WHERE rkey = $1 GROUP BY clock_domain ORDER BY clock_domain""", [rkey])


# ---------------------------------------------------------------------------
# push vs pull
# ---------------------------------------------------------------------------

def percentiles_by_bucket(t: Session, w: Window = ALL) -> pd.DataFrame:
    """Per mode and prompt-length bucket: requests, TTFT p50/p90/p99 and TPOT p50/p90/p99 (ms), complete only
    (the analysis's ``percentiles_by_prompt_bucket`` macro)."""
    return t.df("SELECT * FROM percentiles_by_prompt_bucket(?, ?)", w.params())


# ---------------------------------------------------------------------------
# decode stalls
# ---------------------------------------------------------------------------

def decode_engines(t: Session) -> list[str]:
    """Decode engines that served requests, sorted (from ``requests``: cheap, unlike a scan of the steps)."""
    return t.df("SELECT DISTINCT decode_engine FROM requests WHERE decode_engine IS NOT NULL ORDER BY 1")[
        "decode_engine"].tolist()


def decode_steps(t: Session, w: Window, engine_id: str | None = None, limit: int = 20_000) -> pd.DataFrame:
    """One decode engine's steps starting in the window (``decode_stalls`` rows, first ``limit`` by time).

    Columns: step_id, start_ns (ns since the Unix epoch), dur_ms, baseline_ms, excess_ms,
    connector_ms (connector work on the forward thread, ms), prefill_tokens, recompute_tokens,
    culprit_request_id, culprit_kind.
    """
    ef = "TRUE" if engine_id is None else "engine_id = $1"
    return t.df(f"""
        SELECT step_id, start_ns, dur_ms, baseline_ms, excess_ms, connector_ms, prefill_tokens, recompute_tokens,
               culprit_request_id, culprit_kind
        FROM decode_stalls WHERE {w.sql('start_ns')} AND {ef}
        ORDER BY start_ns LIMIT {int(limit)}""", [engine_id] if engine_id else [])


def stall_totals(t: Session, w: Window, engine_id: str | None = None) -> dict:
    """Totals over the window's decode steps: steps, stalled (count with excess > 0), excess_ms,
    connector_ms (forward-thread connector time, ms)."""
    ef = "TRUE" if engine_id is None else "engine_id = $1"
    r = t.df(f"""
        SELECT count(*) AS steps, count(*) FILTER (WHERE excess_ns > 0) AS stalled,
               coalesce(sum(excess_ms), 0) AS excess_ms, coalesce(sum(connector_ms), 0) AS connector_ms
        FROM decode_stalls WHERE {w.sql('start_ns')} AND {ef}""", [engine_id] if engine_id else [])
    return {k: (int(v) if k in ("steps", "stalled") else float(v)) for k, v in r.iloc[0].to_dict().items()}


def worst_tpot(t: Session, w: Window, limit: int = 20) -> pd.DataFrame:
    """Requests whose TPOT other requests' work inflated most (``request_stalls``, arrival in the window).

    Columns: request_id, run_id, mode, tpot_ms, stall_tpot_ms, tpot_without_stalls_ms (ms per token),
    stall_ms (ms), top_culprit_request_id, top_culprit_kind, top_culprit_ms (ms), rkey.
    """
    return t.df(f"""
        SELECT s.request_id, s.run_id, s.mode, s.tpot_ms, s.stall_tpot_ms, s.tpot_without_stalls_ms, s.stall_ms,
               s.top_culprit_request_id, s.top_culprit_kind, s.top_culprit_ms, s.rkey
        FROM request_stalls s
        WHERE {w.sql('s.arrival_ns')}
        ORDER BY s.stall_ms DESC NULLS LAST, s.request_id LIMIT {int(limit)}""")


def stall_culprits(t: Session, rkey: int) -> pd.DataFrame:
    """Which other requests' work stalled the decode steps a request decoded in, largest first.

    A victim's steps are the ``decode.step`` spans whose batch (``step.batch``) names
    it between its first and last token (``decode_step_requests``, materialized by the
    analysis); their causes come from ``decode_stall_causes``. Columns:
    culprit_request_id, kind, steps (count), share_ms (summed share of those steps' excess, ms).
    """
    return t.df("""
        WITH v AS (SELECT request_id, first_token_ns, last_token_ns FROM requests WHERE rkey = $1),
             st AS (SELECT DISTINCT e.step_span_id AS span_id FROM decode_step_requests e, v
                    WHERE e.request_id = v.request_id AND e.start_ns >= v.first_token_ns - 1000000000
                      AND e.start_ns <= coalesce(v.last_token_ns, v.first_token_ns))
        SELECT c.culprit_request_id, c.kind, count(DISTINCT c.step_span_id) AS steps, sum(c.share_ms) AS share_ms
        FROM decode_stall_causes c JOIN st ON st.span_id = c.step_span_id, v
        WHERE c.culprit_request_id IS DISTINCT FROM v.request_id
        GROUP BY ALL ORDER BY share_ms DESC, c.culprit_request_id NULLS LAST""", [rkey])


# ---------------------------------------------------------------------------
# what changed
# ---------------------------------------------------------------------------

def stage_share_change(t: Session, incident: Window, baseline: Window) -> pd.DataFrame:
    """Stages ranked by how much their share of TTFT grew from baseline to incident (the analysis's
    ``stage_share_change`` macro).

    Share = a stage's summed critical-path time / the window's summed TTFT
    (fraction). Columns: stage, category, share_baseline, share_incident,
    mean_ms_baseline, mean_ms_incident (per request, ms), growth_pp (percentage points).
    """
    return t.df("SELECT * FROM stage_share_change(?, ?, ?, ?)", [*incident.params(), *baseline.params()])


#: Attributes "What changed" ranks: label -> SQL expression over ttft_breakdown (alias b).
CHANGE_ATTRIBUTES: dict[str, str] = {
    "mode": "b.mode",
    "prefill engine": "b.prefill_engine",
    "decode engine": "b.decode_engine",
    "prompt bucket": prompt_bucket_sql("b.prompt_tokens"),
    "first contact": "CASE WHEN b.first_contact THEN 'first contact' ELSE 'warm pair' END",
    "descriptors": _bucket_case("b.kv_descriptors", DESCRIPTOR_BUCKETS),
}


def attribute_share_change(t: Session, incident: Window, baseline: Window) -> pd.DataFrame:
    """Attribute values ranked by how much their requests' share of summed TTFT grew.

    For each attribute (:data:`CHANGE_ATTRIBUTES`) and value: share = summed
    TTFT of requests with that value / the window's summed TTFT (fraction).
    Columns: attribute, value, requests_baseline, requests_incident (counts),
    share_baseline, share_incident, growth_pp (percentage points),
    mean_ttft_ms_baseline, mean_ttft_ms_incident (ms).
    """
    unions = " UNION ALL ".join(
        f"SELECT '{label}' AS attribute, coalesce(CAST({expr} AS VARCHAR), 'unknown') AS value, b.ttft_ns, "
        f"b.inc, b.base FROM b"
        for label, expr in CHANGE_ATTRIBUTES.items())
    df = t.df(f"""
        WITH b AS (SELECT *, {incident.sql()} AS inc, {baseline.sql()} AS base
                   FROM ttft_breakdown WHERE ({incident.sql()}) OR ({baseline.sql()})),
             tot AS (SELECT sum(ttft_ns) FILTER (WHERE inc) AS ti, sum(ttft_ns) FILTER (WHERE base) AS tb FROM b),
             a AS ({unions})
        SELECT attribute, value,
               count(*) FILTER (WHERE base) AS requests_baseline, count(*) FILTER (WHERE inc) AS requests_incident,
               coalesce(sum(ttft_ns) FILTER (WHERE base), 0) / any_value(tot.tb) AS share_baseline,
               coalesce(sum(ttft_ns) FILTER (WHERE inc), 0) / any_value(tot.ti) AS share_incident,
               avg(ttft_ns) FILTER (WHERE base) / 1e6 AS mean_ttft_ms_baseline,
               avg(ttft_ns) FILTER (WHERE inc) / 1e6 AS mean_ttft_ms_incident
        FROM a, tot GROUP BY attribute, value""")
    df["growth_pp"] = (df["share_incident"].fillna(0) - df["share_baseline"].fillna(0)) * 100
    return df.sort_values(["growth_pp", "attribute", "value"], ascending=[False, True, True]).reset_index(drop=True)


# ---------------------------------------------------------------------------
# SQL console and view docs
# ---------------------------------------------------------------------------

def view_docs(t: Session) -> pd.DataFrame:
    """Public views and their documented columns: view, view_doc, column, type, column_doc."""
    df = t.df("""
        SELECT v.view_name AS view, v.comment AS view_doc, c.column_name AS "column", c.data_type AS type,
               c.comment AS column_doc, c.column_index
        FROM duckdb_views() v JOIN duckdb_columns() c
          ON c.table_name = v.view_name AND c.schema_name = v.schema_name AND c.database_name = v.database_name
        WHERE NOT v.internal AND v.view_name NOT LIKE '\\_%' ESCAPE '\\'
        ORDER BY v.view_name, c.column_index""")
    order = {v: i for i, v in enumerate(PUBLIC_VIEWS_FIRST)}
    df["_o"] = df["view"].map(lambda v: order.get(v, len(order)))
    return df.sort_values(["_o", "view", "column_index"]).drop(columns=["_o", "column_index"]).reset_index(drop=True)


def fmt_ms(v: float | None) -> str:
    """A duration (given in ms) for display: '—' when missing; 1 decimal under 100 ms, whole ms under 1 s,
    else seconds with 2 decimals."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if abs(v) < 100:
        return f"{v:,.1f} ms"
    if abs(v) < 1000:
        return f"{v:,.0f} ms"
    return f"{v / 1000:,.2f} s"
