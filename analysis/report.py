"""The report: numbers from the analysis views (collect) and their text rendering (render).

``collect(con)`` returns a plain dict (JSON-ready; times in ms); ``render`` and
``render_compare`` turn one or two of them into text tables.
"""
from __future__ import annotations

import decimal
import math
from typing import Any

_MODE_COLS = ["mode", "requests", "complete", "incomplete", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms",
              "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "queue_share", "compute_share",
              "transfer_share", "coordination_share", "unattributed_share", "unattributed_p50_share"]
_BUCKET_COLS = ["mode", "prompt_bucket_lo", "requests", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms",
                "compute_share", "coordination_share"]


#: Columns of view ttft_stage_means that ``collect`` keeps (and :func:`compare_delta` reads), with their SQL types.
STAGE_MEAN_COLS = {"scope": "VARCHAR", "mode": "VARCHAR", "prompt_bucket_lo": "BIGINT", "stage": "VARCHAR",
                   "stage_group": "VARCHAR", "category": "VARCHAR", "requests": "BIGINT",
                   "requests_with_stage": "BIGINT", "exposed_ns": "BIGINT", "group_ttft_ns": "BIGINT"}

#: Stages listed per bucket in the text of the delta decomposition (largest |delta| first); the rest are summed
#: on one line, so the printed parts still add up to the difference.
DELTA_TOP = 6

#: In-flight requests the report lists (the oldest); the total is printed beside them.
IN_FLIGHT_ROWS = 20


def _rows(con, sql: str) -> list[dict[str, Any]]:
    cur = con.execute(sql)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def collect(con) -> dict[str, Any]:
    """Report data from a connection with the analysis views loaded.

    Keys: ``by_mode``, ``by_prompt_bucket`` (lists of summary rows),
    ``dominant_stages`` ([{mode, dominant_stage, requests}]), ``incomplete``
    ([{cause, requests}]), ``clock`` (worst offset bound per clock pair),
    ``skipped_files`` ([{path, reason}]), ``transfers`` (count, descriptor-bound count),
    ``ttft_source`` ([{ttft_source, requests, complete, router_unseen_mean_ms}]: whose clocks gave
    the TTFT windows, DESIGN.md §3; router_unseen_mean_ms is the mean exposed router.unseen of the
    complete requests, NULL for router windows),
    ``coarse`` ({by_engine: per-engine means from ``coarse_breakdown``, only: True when no request has
    a pdtrace breakdown}),
    ``in_flight`` (requests not finished at the trace end, oldest first, at most
    :data:`IN_FLIGHT_ROWS`: [{request_id, mode, stage, role, engine_id, age_ms, waits_for}]) and
    ``in_flight_total`` (all of them, count),
    ``ttft_stage_means`` (the rows of view ``ttft_stage_means``: per scope, mode, prompt bucket and critical-path
    (stage, category), exposed ns and mean ms per complete request; the terms :func:`compare_delta` subtracts),
    ``retention`` (the tail-retention settings in force, one row per distinct setting, from view ``processes``:
    [{tail_ttft_ms, tail_tpot_ms, tail_head}]; [] when no sink retained by tail).
    """
    return {
        "in_flight": _rows(con, "SELECT request_id, mode, stage, role, engine_id, round(age_ms, 3) AS age_ms, "
                                f"waits_for FROM in_flight ORDER BY age_ms DESC, request_id LIMIT {IN_FLIGHT_ROWS}"),
        "in_flight_total": _rows(con, "SELECT count(*) AS n FROM in_flight")[0]["n"],
        "by_mode": _rows(con, f"SELECT {', '.join(_MODE_COLS)} FROM summary_by_mode ORDER BY mode"),
        "by_prompt_bucket": _rows(con, f"SELECT {', '.join(_BUCKET_COLS)} FROM summary_by_prompt_bucket "
                                       "ORDER BY mode, prompt_bucket_lo"),
        "dominant_stages": _rows(con, "SELECT mode, dominant_stage, count(*) AS requests, "
                                      "round(avg(dominant_ms), 3) AS mean_ms FROM ttft_breakdown "
                                      "GROUP BY ALL ORDER BY mode, requests DESC, dominant_stage"),
        "incomplete": _rows(con, "SELECT cause, count(*) AS requests, round(avg(time_to_failure_ms), 3) "
                                 "AS mean_time_to_failure_ms FROM incomplete_requests GROUP BY cause ORDER BY requests DESC, cause"),
        "clock": _rows(con, "SELECT clock_a, clock_b, offset_ms, bound_ms, messages, samples, consistent "
                            "FROM clock_offsets WHERE window_start_ns IS NULL ORDER BY clock_a, clock_b"),
        "transfers": _rows(con, "SELECT count(*) AS transfers, count(*) FILTER (WHERE descriptor_bound) "
                                "AS descriptor_bound FROM transfers")[0],
        "skipped_files": _rows(con, "SELECT path, reason FROM store_files WHERE NOT ok ORDER BY path"),
        "ttft_source": _rows(con, "SELECT q.ttft_source, count(*) AS requests, "
                                  "count(*) FILTER (WHERE q.status = 'complete') AS complete, "
                                  "CASE WHEN q.ttft_source = 'engine' THEN round(avg(b.router_unseen_ms), 3) END "
                                  "AS router_unseen_mean_ms FROM requests q LEFT JOIN ttft_breakdown b "
                                  "ON b.rkey = q.rkey GROUP BY q.ttft_source ORDER BY q.ttft_source DESC"),
        "coarse": _coarse(con),
        "ttft_stage_means": _rows(con, f"SELECT {', '.join(STAGE_MEAN_COLS)} FROM ttft_stage_means "
                                       "ORDER BY scope, mode, prompt_bucket_lo, stage, category"),
        "retention": _rows(con, "SELECT DISTINCT tail_ttft_ms, tail_tpot_ms, tail_head FROM processes "
                                "WHERE retain = 'tail' ORDER BY ALL"),
    }


#: Printed above the summaries of a tail-retained store (PDTRACE_RETAIN=tail).
TAIL_NOTE = (
    "Tail-retained store (PDTRACE_RETAIN=tail; {settings}): failed, marked and slow requests are kept whole, the "
    "others only at the head-sampled fraction, so the percentiles, means and shares below are those of the kept "
    "requests, not of all traffic (the records dropped by decision: processes.tail_dropped).")


def tail_note(data: dict[str, Any]) -> str | None:
    """The tail-retention sentence for ``collect``'s dict, or None when no sink retained by tail."""
    rows = data.get("retention") or []
    if not rows:
        return None
    settings = "; ".join(f"TTFT >= {fmt_value(r['tail_ttft_ms'])} ms, TPOT >= {fmt_value(r['tail_tpot_ms'])} ms "
                         f"(0: no rule), head {fmt_value(r['tail_head'])}" for r in rows)
    return TAIL_NOTE.format(settings=settings)


#: Printed under the TTFT-source table when any window is the engines' own.
ENGINE_SOURCE_NOTE = (
    "Router hop unseen: {n} request(s) have no router record (a router that writes no pdtrace spans), so "
    "their TTFT is the engines' own window: P's API server received the request -> D's API server wrote "
    "the first token chunk (P and D clocks corrected). The router's time before P and after D is not in "
    "it; its hop between the legs is the stage router.unseen (coordination) in the breakdown.")


def engine_source_note(data: dict[str, Any]) -> str | None:
    """The 'router hop unseen' sentence for ``collect``'s dict, or None when no complete request's TTFT window
    is the engines' own (every window is the router's, or no engine-source request got a first token)."""
    n = sum(r["complete"] for r in data.get("ttft_source", []) if r["ttft_source"] == "engine")
    return ENGINE_SOURCE_NOTE.format(n=n) if n else None


def _coarse(con) -> dict[str, Any]:
    """Per engine from stock vLLM llm_request spans (view coarse_breakdown); ``only`` when no request has a
    pdtrace breakdown (then the report prints it: the coarse numbers are all the store allows)."""
    rows = _rows(con, "SELECT role, engine_id, count(*) AS requests, round(median(engine_ttft_ms), 3) AS engine_ttft_p50_ms, "
                      "round(avg(queue_ms), 3) AS queue_mean_ms, round(avg(prefill_ms), 3) AS prefill_mean_ms, "
                      "round(avg(decode_ms), 3) AS decode_mean_ms, round(avg(other_ms), 3) AS other_mean_ms "
                      "FROM coarse_breakdown GROUP BY ALL ORDER BY role, engine_id")
    only = bool(rows) and _rows(con, "SELECT count(*) AS n FROM ttft_breakdown")[0]["n"] == 0
    return {"by_engine": rows, "only": only}


def fmt_value(v: Any) -> str:
    """One cell: floats to 3 significant decimals, None as '-'."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 1e6 else f"{v:.0f}"
    return str(v)


def _is_number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float, decimal.Decimal)) and not isinstance(v, bool))


def table(rows: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    """Fixed-width text table of ``rows`` (list of dicts) over ``cols`` (default: the first row's keys).

    Columns whose values are all numbers (or missing) are right-aligned, the others left-aligned.
    """
    if not rows:
        return "(none)"
    cols = cols or list(rows[0])
    cells = [[fmt_value(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    numeric = [all(_is_number_or_none(r.get(c)) for r in rows) for c in cols]
    line = lambda vals: "  ".join(v.rjust(w) if num else v.ljust(w)
                                  for v, w, num in zip(vals, widths, numeric)).rstrip()
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def render(data: dict[str, Any], title: str = "") -> str:
    """Text report of one trace (``collect``'s dict)."""
    out = []
    if title:
        out += [f"# {title}", ""]
    if data.get("in_flight"):
        n = data.get("in_flight_total", len(data["in_flight"]))
        shown = "" if n <= len(data["in_flight"]) else f"; the {len(data['in_flight'])} oldest shown"
        out += [f"In flight now ({n} requests not finished at the trace end{shown}; age in ms)",
                table(data["in_flight"]), ""]
    note = tail_note(data)
    out += [note, ""] if note else []
    out += ["TTFT and TPOT by mode (ms; shares of TTFT)", table(data["by_mode"]), ""]
    if "ttft_source" in data:
        out += ["TTFT source (router: the router's clock; engine: P's API server -> D's API server)",
                table(data["ttft_source"])]
        note = engine_source_note(data)
        out += ([note] if note else []) + [""]
    out += ["By prompt-length bucket [lo, 2*lo) tokens", table(data["by_prompt_bucket"]), ""]
    out += ["Dominant stage on the critical path", table(data["dominant_stages"]), ""]
    out += ["Incomplete requests", table(data["incomplete"]), ""]
    t = data["transfers"]
    out += [f"Transfers: {t['transfers']} ({t['descriptor_bound']} descriptor-bound)", ""]
    out += ["Clock offsets (whole trace)", table(data["clock"]), ""]
    coarse = data.get("coarse") or {}
    if coarse.get("only"):
        out += ["Coarse breakdown (stock vLLM llm_request spans only, no pdtrace stages: engine_ttft = queue + "
                "prefill + other per engine, ms; view coarse_breakdown)", table(coarse["by_engine"]), ""]
    if data["skipped_files"]:
        out += ["Skipped files", table(data["skipped_files"]), ""]
    return "\n".join(out)


def _delta_sql() -> str:
    from importlib import resources
    return (resources.files("pdtrace.analysis.sql") / "_compare_delta.sql").read_text()


def compare_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The delta decomposition of mean TTFT, run B minus run A (``collect``'s dicts), per prompt bucket.

    Runs the macro ``ttft_stage_delta`` of ``analysis/sql/_compare_delta.sql`` in a private in-memory DuckDB
    over both runs' ``ttft_stage_means`` rows. Returns ``by_stage`` (per scope, bucket and (stage, category):
    mean exposed ms in A and B, ``delta_ms``, ``share_of_delta``, ``rank`` by |delta|; the deltas of a bucket add
    up to its ``ttft_delta_ms``), ``by_category`` (the same summed per category) and ``only_a`` / ``only_b``
    (prompt buckets with complete requests in one run only: no difference to split).
    """
    import duckdb
    con = duckdb.connect()
    try:
        cols = ", ".join(f"{c} {t}" for c, t in STAGE_MEAN_COLS.items())
        for name, data in (("compare_a", a), ("compare_b", b)):
            con.execute(f"CREATE TABLE {name} ({cols})")
            rows = [[r.get(c) for c in STAGE_MEAN_COLS] for r in data.get("ttft_stage_means", [])]
            if rows:
                con.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(STAGE_MEAN_COLS))})", rows)
        con.execute(_delta_sql())
        by_stage = _rows(con, "SELECT * FROM ttft_stage_delta()")
        by_category = _rows(con, "SELECT scope, prompt_bucket_lo, category, sum(mean_a_ms) AS mean_a_ms, "
                                 "sum(mean_b_ms) AS mean_b_ms, sum(delta_ms) AS delta_ms, "
                                 "any_value(ttft_delta_ms) AS ttft_delta_ms FROM ttft_stage_delta() "
                                 "GROUP BY scope, prompt_bucket_lo, category "
                                 "ORDER BY scope = 'bucket', prompt_bucket_lo NULLS FIRST, abs(sum(delta_ms)) DESC, category")
        only = {}
        for side, x, y in (("only_a", "compare_a", "compare_b"), ("only_b", "compare_b", "compare_a")):
            only[side] = [r["prompt_bucket_lo"] for r in _rows(
                con, f"SELECT DISTINCT x.prompt_bucket_lo FROM {x} x WHERE x.scope = 'bucket' AND NOT EXISTS "
                     f"(SELECT 1 FROM {y} y WHERE y.scope = 'bucket' AND y.prompt_bucket_lo IS NOT DISTINCT FROM "
                     "x.prompt_bucket_lo) ORDER BY x.prompt_bucket_lo NULLS FIRST")]
    finally:
        con.close()
    return {"by_stage": by_stage, "by_category": by_category, **only}


def _bucket_name(scope: str, lo) -> str:
    if scope == "all":
        return "all prompts"
    return "prompt tokens unknown" if lo is None else f"prompt tokens [{lo}, {2 * lo})"


def render_delta(delta: dict[str, Any], label_a: str, label_b: str, top: int = DELTA_TOP) -> list[str]:
    """Text lines of :func:`compare_delta`'s result: per bucket the difference and its largest stage terms."""
    out = [f"Why mean TTFT differs: {label_b} minus {label_a}, split by critical-path stage (ms per request; "
           "the parts add up to the difference; view ttft_stage_means, largest |delta| first)"]
    if not delta["by_stage"]:
        return out + ["(no prompt bucket has complete requests in both runs)", ""]
    groups: dict[tuple, list[dict]] = {}
    for r in delta["by_stage"]:
        groups.setdefault((r["scope"], r["prompt_bucket_lo"]), []).append(r)
    cats: dict[tuple, list[dict]] = {}
    for r in delta["by_category"]:
        cats.setdefault((r["scope"], r["prompt_bucket_lo"]), []).append(r)
    for key, rows in groups.items():
        r0 = rows[0]
        out.append(f"{_bucket_name(*key)}: n {r0['n_a']} / {r0['n_b']}; TTFT mean {fmt_value(r0['ttft_mean_a_ms'])} -> "
                   f"{fmt_value(r0['ttft_mean_b_ms'])} ms, delta {r0['ttft_delta_ms']:+.3f} ms; by category: "
                   + ", ".join(f"{c['category']} {c['delta_ms']:+.3f}" for c in cats.get(key, [])))
        shown = [{"stage": r["stage"], "category": r["category"], f"mean[{label_a}]": r["mean_a_ms"],
                  f"mean[{label_b}]": r["mean_b_ms"], "delta_ms": r["delta_ms"], "share_of_delta": r["share_of_delta"]}
                 for r in rows[:top]]
        rest = rows[top:]
        if rest:
            shown.append({"stage": f"({len(rest)} other stages)", "category": "",
                          f"mean[{label_a}]": sum(r["mean_a_ms"] for r in rest),
                          f"mean[{label_b}]": sum(r["mean_b_ms"] for r in rest),
                          "delta_ms": sum(r["delta_ms"] for r in rest),
                          "share_of_delta": (sum(r["delta_ms"] for r in rest) / r0["ttft_delta_ms"]
                                             if r0["ttft_delta_ms"] else None)})
        out += [table(shown), ""]
    for side, label in (("only_a", label_a), ("only_b", label_b)):
        if delta.get(side):
            out.append(f"Buckets with complete requests only in {label}: "
                       + ", ".join(_bucket_name("bucket", lo) for lo in delta[side]))
    return out + [""]


def render_compare(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str,
                   delta: dict[str, Any] | None = None) -> str:
    """Two traces side by side: the by-mode and by-bucket summaries, rows labelled by trace, then the delta
    decomposition of mean TTFT (``delta``: :func:`compare_delta`'s result, computed when None)."""
    def tag(rows, label):
        return [{"trace": label, **r} for r in rows]
    out = [f"# {label_a} vs {label_b}", ""]
    out += ["TTFT and TPOT by mode (ms; shares of TTFT)",
            table(tag(a["by_mode"], label_a) + tag(b["by_mode"], label_b)), ""]
    keyed: dict[tuple, dict] = {}
    for label, data in ((label_a, a), (label_b, b)):
        for r in data["by_prompt_bucket"]:
            row = keyed.setdefault((r["prompt_bucket_lo"] if r["prompt_bucket_lo"] is not None else -1,),
                                   {"prompt_bucket_lo": r["prompt_bucket_lo"]})
            for k in ("ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms"):
                row[f"{k}[{label}]"] = r[k]
    out += ["By prompt-length bucket (both traces)", table([keyed[k] for k in sorted(keyed)]), ""]
    out += render_delta(delta if delta is not None else compare_delta(a, b), label_a, label_b)
    out += [f"Incomplete: {label_a}", table(a["incomplete"]), "", f"Incomplete: {label_b}", table(b["incomplete"]), ""]
    return "\n".join(out)
