"""``pdtrace check``: is tracing healthy? Numbers from the analysis views (collect), problems, text (render).

What an operator runs after switching tracing on. ``collect(con, ...)``
reads the views ``processes`` (one row per writing process, its last
``recorder.stats`` row), ``clock_offsets`` (whole-trace rows) and
``store_files``, and returns a plain dict (JSON-ready) with the problems
found; ``render`` turns it into a short text. A problem is one of
(:data:`PROBLEM_KINDS`):

================================  ===========================================================
kind                              when
================================  ===========================================================
``no_process``                    no process has written into the directory (or it is missing)
``none_recent``                   processes wrote, but none in the last ``recent_s`` seconds
``dropped``                       a live process dropped records (buffer full, sink
                                  unreachable, failed writes): ``recorder.dropped`` > 0
``write_errors``                  a live process's sink failed to write or merge files
``export_errors``                 a live process's OTLP export failed
``dropped_attributes``            a live process dropped attributes (unknown key, wrong type)
``hook_errors``                   a live process swallowed errors of pdtrace's own code in its
                                  hooks (``recorder.hook_errors`` > 0; the engine ran on, but
                                  those hooks' records may be missing)
``skipped_file``                  a store file was skipped (``store_files.ok`` false), one per file
``clock_bound``                   a clock pair's offset bound exceeds ``max_clock_bound_ms``
``clock_unbounded``               a clock pair's offset has no bound (evidence one way only)
``clock_inconsistent``            a clock pair's bounds contradict each other (drift, bad sample)
``prefill_without_decode``        live prefill processes but no live decode process
``decode_without_prefill``        live decode processes but no live prefill process
``version_mismatch``              live processes run different pdtrace or vLLM versions
``collect_dropped``               a live ``pdtrace collect`` dropped spans (queue full, failed write)
``collect_write_errors``          a live ``pdtrace collect`` failed to write or merge files
``collect_bad_bodies``            a live ``pdtrace collect`` refused OTLP bodies (HTTP 400/413/415)
================================  ===========================================================

*Live*: a process whose last flush (its last ``recorder.stats`` row; for a
process that wrote none, the end of its last record) is at most ``recent_s``
seconds before the reference instant: now (this host's wall clock, compared
with each process's own wall clock, uncorrected: skew between hosts adds to
the age), or with ``at_end`` the trace end (the newest flush of any process:
for a finished run, such as a lab run directory). Counters and pairing are
judged on live processes only, so a process that exited long ago (an engine
restarted under a new pid) does not fail the check forever; it is listed as
stale.
"""
from __future__ import annotations

import time
from typing import Any

from . import report as _report

#: Every kind of problem :func:`collect` reports (see the module doc).
PROBLEM_KINDS = ("no_process", "none_recent", "dropped", "write_errors", "export_errors", "dropped_attributes",
                 "hook_errors", "skipped_file", "clock_bound", "clock_unbounded", "clock_inconsistent",
                 "prefill_without_decode", "decode_without_prefill", "version_mismatch",
                 "collect_dropped", "collect_write_errors", "collect_bad_bodies")

#: Default of ``recent_s`` (s): 60 flush intervals at the default PDTRACE_FLUSH_INTERVAL_S of 1 s.
RECENT_S = 60.0
#: Default of ``max_clock_bound_ms`` (ms). The lab on a shared 2-core machine gives 1-20 ms (HTTP round trips,
#: registrations, the NIXL handshake); above 50 ms the order of stages on P and D within one TTFT is unreliable.
MAX_CLOCK_BOUND_MS = 50.0

_COUNTERS = (("dropped", "dropped {n} of {recorded} records (buffer full, sink unreachable or failed writes)"),
             ("write_errors", "had {n} failed file writes (directory not writable, deleted, disk full?)"),
             ("export_errors", "had {n} failed OTLP exports"),
             ("dropped_attributes", "dropped {n} attributes (key not allowlisted or value of the wrong type)"),
             ("hook_errors", "swallowed {n} errors of pdtrace's code in its hooks (first: {first}; the engine ran on, "
                             "those hooks' records may be missing; the process's log has the first traceback of "
                             "each kind)"))
#: pdtrace collect's counters judged by the check (view ``collect_stats``): (column, problem kind, text).
_COLLECT_COUNTERS = (("dropped_spans", "collect_dropped", "dropped {n} spans (queue full or a failed write)"),
                     ("write_errors", "collect_write_errors", "had {n} failed file writes"),
                     ("bad_bodies", "collect_bad_bodies", "refused {n} OTLP bodies (not decodable, too large or "
                                                          "another content type: is a sender misconfigured?)"))


def _who(p: dict) -> str:
    """A process as an operator names it: role, engine id, pid@host."""
    parts = [p["role"] or "process", p["engine_id"] or "", f"pid {p['pid']}@{p['host']}"]
    return " ".join(x for x in parts if x)


def missing(directory: str, recent_s: float = RECENT_S, max_clock_bound_ms: float = MAX_CLOCK_BOUND_MS
            ) -> dict[str, Any]:
    """:func:`collect`'s dict for a directory that does not exist (one ``no_process`` problem; no reference)."""
    return {"directory": str(directory), "reference": None, "reference_ns": None, "recent_s": recent_s,
            "max_clock_bound_ms": max_clock_bound_ms, "processes": [], "clock": [], "files": {"read": 0, "skipped": []},
            "problems": [{"kind": "no_process", "message": f"trace directory {directory} does not exist: no process "
                                                           "has written to it (is PDTRACE_DIR set for the engines?)"}],
            "ok": False}


def collect(con, directory: str = "", recent_s: float = RECENT_S, at_end: bool = False,
            max_clock_bound_ms: float = MAX_CLOCK_BOUND_MS, now_ns: int | None = None) -> dict[str, Any]:
    """Check data from a connection with the analysis views loaded.

    ``recent_s``: a process is live when its last flush is at most this many
    seconds before the reference instant (``now_ns``, default this host's
    wall clock; with ``at_end`` the newest flush in the trace).
    Keys: ``processes`` (rows of view ``processes`` plus ``age_s``, ``live``),
    ``clock`` (whole-trace ``clock_offsets`` rows), ``files`` ({read: count,
    skipped: [{path, reason}]}), ``problems`` ([{kind, message}], kinds in
    :data:`PROBLEM_KINDS`), ``ok`` (no problem), ``reference`` ('now' |
    'trace end'), ``reference_ns``, ``recent_s``, ``max_clock_bound_ms``.
    """
    procs = _report._rows(con, "SELECT * FROM processes ORDER BY CASE role WHEN 'router' THEN 0 WHEN 'prefill' THEN 1 "
                       "WHEN 'decode' THEN 2 ELSE 3 END, engine_id, host, pid")
    for p in procs:
        p["last_ns"] = p["last_flush_ns"] if p["last_flush_ns"] is not None else p["last_record_ns"]
    ends = [p["last_ns"] for p in procs if p["last_ns"] is not None]
    if at_end:
        ref = max(ends) if ends else 0
    else:
        ref = time.time_ns() if now_ns is None else now_ns
    for p in procs:
        p["age_s"] = None if p["last_ns"] is None else round((ref - p["last_ns"]) / 1e9, 3)
        p["live"] = p["age_s"] is not None and p["age_s"] <= recent_s
    clock = _report._rows(con, "SELECT clock_a, clock_b, offset_ms, bound_ms, messages, samples, consistent "
                       "FROM clock_offsets WHERE window_start_ns IS NULL ORDER BY clock_a, clock_b")
    files = _report._rows(con, "SELECT path, ok, reason FROM store_files ORDER BY path")
    problems: list[dict[str, str]] = []

    def problem(kind: str, message: str) -> None:
        problems.append({"kind": kind, "message": message})

    live = [p for p in procs if p["live"]]
    if not procs:
        problem("no_process", f"no process has written to {directory or 'the directory'} (no store file with records)")
    elif not live:
        newest = min(procs, key=lambda p: p["age_s"] if p["age_s"] is not None else float("inf"))
        problem("none_recent", f"no process wrote in the last {recent_s:g} s (newest flush {newest['age_s']:.1f} s "
                               f"ago: {_who(newest)})")
    for p in live:
        for col, text in _COUNTERS:
            n = p[col] or 0
            if n > 0:
                problem(col, f"{_who(p)} " + text.format(n=n, recorded=p["recorded"], first=p["hook_error_first"]))
    for c in _report._rows(con, "SELECT host, pid, time_ns, dropped_spans, write_errors, bad_bodies "
                                "FROM collect_stats ORDER BY host, pid"):
        if c["time_ns"] is None or (ref - c["time_ns"]) / 1e9 > recent_s:
            continue  # a collector that stopped long ago is not judged, as for processes
        for col, kind, text in _COLLECT_COUNTERS:
            if (c[col] or 0) > 0:
                problem(kind, f"pdtrace collect pid {c['pid']}@{c['host']} " + text.format(n=c[col]))
    for f in files:
        if not f["ok"]:
            problem("skipped_file", f"store file skipped: {f['path']}: {f['reason']}")
    for c in clock:
        pair = f"{c['clock_a']} / {c['clock_b']}"
        if c["bound_ms"] is None:
            problem("clock_unbounded", f"clock offset {pair} has no bound (evidence in one direction only): "
                                       "its skew correction cannot be trusted")
        elif c["bound_ms"] > max_clock_bound_ms:
            problem("clock_bound", f"clock offset {pair}: {c['offset_ms']:.3f} ms +- {c['bound_ms']:.3f} ms, bound "
                                   f"above {max_clock_bound_ms:g} ms")
        if c["consistent"] is False:
            problem("clock_inconsistent", f"clock offset {pair}: its bounds contradict each other (clock drift or "
                                          "a bad sample)")
    roles = {p["role"] for p in live}
    for have, lack in (("prefill", "decode"), ("decode", "prefill")):
        if have in roles and lack not in roles:
            engines = sorted({p["engine_id"] or "?" for p in live if p["role"] == have})
            problem(f"{have}_without_{lack}", f"{have} engines write ({', '.join(engines)}) but no {lack} process "
                                              f"does (is tracing on for the {lack} engines?)")
    for col, label in (("pdtrace_version", "pdtrace"), ("vllm_version", "vLLM")):
        by_version: dict[str, list[str]] = {}
        for p in live:
            if p[col] is not None:
                by_version.setdefault(p[col], []).append(f"pid {p['pid']}@{p['host']}")
        if len(by_version) > 1:
            problem("version_mismatch", f"live processes run different {label} versions: " + "; ".join(
                f"{v} ({', '.join(w)})" for v, w in sorted(by_version.items())))
    for p in procs:
        del p["last_ns"]
    return {"directory": str(directory), "reference": "trace end" if at_end else "now", "reference_ns": ref,
            "recent_s": recent_s, "max_clock_bound_ms": max_clock_bound_ms, "processes": procs, "clock": clock,
            "files": {"read": sum(1 for f in files if f["ok"]),
                      "skipped": [{"path": f["path"], "reason": f["reason"]} for f in files if not f["ok"]]},
            "problems": problems, "ok": not problems}


def _sample(p: dict) -> str | None:
    if p["sample"] is None and p["step_sample"] is None:
        return None
    return "/".join("-" if v is None else f"{v:g}" for v in (p["sample"], p["step_sample"]))


_PROC_COLS = ["role", "engine_id", "host", "pid", "service", "pdtrace", "vllm", "connector", "activation",
              "sample", "age_s", "written", "dropped", "errors", "attrs_dropped", "state"]


def render(data: dict[str, Any]) -> str:
    """Short text of :func:`collect`'s dict: processes, clock offsets, files, then each problem on its own line."""
    out = [f"# pdtrace check {data['directory']}"]
    procs = data["processes"]
    if data["reference"] is not None:
        out.append(f"ages from {data['reference']}; live = last flush within {data['recent_s']:g} s")
    if procs:
        n_live = sum(1 for p in procs if p["live"])
        out += ["", f"Processes: {len(procs)} ({n_live} live; age_s: since the last flush; "
                    "sample: requests/steps traced)"]
        rows = [{"role": p["role"], "engine_id": p["engine_id"], "host": p["host"], "pid": p["pid"],
                 "service": p["service_name"], "pdtrace": p["pdtrace_version"], "vllm": p["vllm_version"],
                 "connector": p["connector"], "activation": p["activation"], "sample": _sample(p),
                 "age_s": p["age_s"], "written": p["written"], "dropped": p["dropped"],
                 "errors": None if p["write_errors"] is None else p["write_errors"] + (p["export_errors"] or 0),
                 "attrs_dropped": p["dropped_attributes"], "state": "live" if p["live"] else "stale"}
                for p in procs]
        out.append(_report.table(rows, _PROC_COLS))
    if data["clock"]:
        out += ["", f"Clock offsets (whole trace; bound limit {data['max_clock_bound_ms']:g} ms)",
                _report.table(data["clock"])]
    f = data["files"]
    out += ["", f"Store files: {f['read']} read, {len(f['skipped'])} skipped", ""]
    if data["ok"]:
        out.append("OK: no problems")
    else:
        out.append(f"{len(data['problems'])} problem(s):")
        out += [f"PROBLEM {p['kind']}: {p['message']}" for p in data["problems"]]
    return "\n".join(out)
