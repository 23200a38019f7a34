"""Streamlit glue shared by the pages: the opened trace, the sidebar, cached queries, banners.

The trace directory comes from the sidebar (default: ``PDTRACE_DASHBOARD_DIR``,
set by ``pdtrace dashboard DIR``). The trace is opened once per directory and process
(:func:`pdtrace.dashboard.data.session`, a :class:`pdtrace.analysis.Session` shared by the
browser sessions); query results are cached as data (``st.cache_data``, the session passed
unhashed), keyed by the directory and the session's version (bumped when new files are
absorbed), bounded by ``max_entries`` and a ttl.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from pdtrace.instrument import config

from pdtrace.instrument.stages import CATEGORIES  # noqa: F401 - re-exported for the pages (ui.CATEGORIES)

from pdtrace.analysis import Session
from pdtrace.analysis.sandbox import ReadOnlyError

from . import data

#: Streamlit markdown colour per category (closest to the charts' colours).
CATEGORY_MD = {"queue": "orange", "compute": "blue", "transfer": "green", "coordination": "red"}

ENV_DIR = "PDTRACE_DASHBOARD_DIR"
ENV_COMPARE_DIR = "PDTRACE_DASHBOARD_COMPARE_DIR"
#: Seconds between checks for new files when "Follow new files" is on.
FOLLOW_EVERY_S = 5


def open_trace(directory: str) -> Session:
    """The session of ``directory`` (absolute path), opened once per process (:func:`data.session`)."""
    return data.session(directory)


@st.cache_data(show_spinner=False, max_entries=512, ttl=3600)
def _cached(_session: Session, directory: str, version: int, fn_name: str, args: tuple, kwargs: tuple) -> Any:
    """``data.<fn_name>(_session, *args, **kwargs)``, cached by (directory, version, fn_name, args, kwargs):
    Streamlit does not hash ``_session`` (leading underscore)."""
    return getattr(data, fn_name)(_session, *args, **dict(kwargs))


def q(t: Session, fn: Callable, *args, **kwargs) -> Any:
    """Call ``data.<fn>(t, *args, **kwargs)`` through the result cache (args must be hashable)."""
    return _cached(t, str(t.directory), t.version, fn.__name__, args, tuple(sorted(kwargs.items())))


def _abs(p: str) -> str:
    return str(Path(p).expanduser().resolve()) if p else ""


def current_dir() -> str:
    """The trace directory chosen in the sidebar (absolute path, '' when none)."""
    return st.session_state.get("_trace_dir", "")


def sidebar() -> None:
    """Render the shared sidebar (trace directory, follow toggle, time window) into session state."""
    # The chosen directory lives under a plain key: widget state is dropped on some page switches.
    if "_trace_dir" not in st.session_state:
        st.session_state["_trace_dir"] = _abs(config.raw(ENV_DIR) or "")
    with st.sidebar:
        v = st.text_input("Trace directory", value=st.session_state["_trace_dir"], key="trace_dir",
                          help="A pdtrace span store: a directory of Parquet files.")
        st.session_state["_trace_dir"] = _abs(v) if v else ""
        st.toggle("Follow new files", key="follow", value=True,
                  help=f"Check the directory every {FOLLOW_EVERY_S} s and absorb new files (live incidents).")


def trace_or_stop() -> Session:
    """Open the sidebar's trace; show a clear message and stop the page when there is nothing to show.

    Names skipped (corrupt/foreign/other-major) files in a warning banner.
    """
    d = _abs(current_dir())
    if not d:
        st.info("No trace directory chosen. Enter one in the sidebar, or start with `pdtrace dashboard DIR`.")
        st.stop()
    t = open_trace(d)
    if not t.exists:
        st.info(f"Trace directory `{d}` does not exist (yet). It is picked up as soon as it appears.")
        _follow(t)
        st.stop()
    h = q(t, data.store_health)
    if h["skipped"]:
        lines = "\n".join(f"- `{Path(p).name}`: {reason}" for p, reason in h["skipped"][:20])
        more = f"\n- … and {len(h['skipped']) - 20} more" if len(h["skipped"]) > 20 else ""
        st.warning(f"**{len(h['skipped'])} file(s) skipped** in `{d}`; the other files are shown:\n{lines}{more}")
    if h["files"] == 0:
        st.info(f"No readable span files in `{d}` yet. Start the lab or an engine with `PDTRACE_DIR={d}`; "
                "new files are picked up as the directory grows.")
        _follow(t)
        st.stop()
    if h["requests"] == 0 and h.get("in_flight", 0) == 0:
        st.info(f"`{d}` holds {h['files']} span file(s) but no request yet.")
        _follow(t)
        st.stop()
    _follow(t)
    return t


def _follow(t: Session) -> None:
    if not st.session_state.get("follow", True):
        return

    @st.fragment(run_every=FOLLOW_EVERY_S)
    def _check() -> None:
        before = t.version
        try:
            t.refresh()
        except Exception as exc:  # a file being replaced mid-read: try again next tick
            st.sidebar.caption(f"refresh failed: {type(exc).__name__}")
            return
        if t.version != before:
            st.rerun(scope="app")

    with st.sidebar:
        _check()


def _to_dt(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc).replace(microsecond=0)


def _to_ns(d: dt.datetime) -> int:
    return int(d.replace(tzinfo=dt.timezone.utc).timestamp()) * 1_000_000_000


PRESETS = {"whole trace": None, "last 5 min": 300, "last 15 min": 900, "last 1 h": 3600}


def window_picker(t: Session, key: str = "win", label: str = "Time window (arrival, UTC)",
                  in_sidebar: bool = True, default_fraction: tuple[float, float] | None = None) -> data.Window:
    """A time window on request arrival, chosen from presets or a range slider; returned as a Window."""
    rng = q(t, data.time_range)
    if rng is None:
        return data.ALL
    lo, hi = _to_dt(rng[0]), _to_dt(rng[1]) + dt.timedelta(seconds=1)
    where = st.sidebar if in_sidebar else st
    preset = where.selectbox(label, list(PRESETS) + ["custom"], key=f"{key}_preset",
                             index=len(PRESETS) if default_fraction else 0)
    if preset != "custom":
        secs = PRESETS[preset]
        if secs is None:
            return data.ALL
        return data.Window(int(rng[1]) + 1_000_000_000 - secs * 1_000_000_000, None)
    if default_fraction:
        span = hi - lo
        default = (lo + span * default_fraction[0], lo + span * default_fraction[1])
        default = tuple(x.replace(microsecond=0) for x in default)
    else:
        default = (lo, hi)
    a, b = where.slider("Arrival between", min_value=lo, max_value=hi, value=default, key=f"{key}_range",
                        step=dt.timedelta(seconds=1), format="HH:mm:ss")
    return data.Window(_to_ns(a), _to_ns(b))


def window() -> data.Window:
    """The sidebar's window (set by the entry script)."""
    return st.session_state.get("_window", data.ALL)


def pct(v: float | None) -> str:
    """A fraction as a percentage for display ('—' when missing)."""
    if v is None or v != v:
        return "—"
    return f"{v * 100:.1f}%"


def trace() -> Session:
    """The trace the entry script opened and checked (pages call this)."""
    return open_trace(_abs(current_dir()))


def clock_corrections(clock: Any, spans: Any) -> Any:
    """The clocks a correction moved for one request, for display.

    ``clock``: ``data.request_clock`` (clock_domain, offset_ms, bound_ms, spans);
    ``spans``: ``data.request_spans`` (for each clock's roles: a clock is its
    engine id, else its role). Returns the rows with a non-zero offset, columns
    clock_domain, role, shift_ms (= -offset_ms: what was added to raw times,
    ms), offset_ms (clock minus router clock, ms), bound_ms (± ms, NaN when
    unbounded), spans (count).
    """
    c = clock[clock["offset_ms"].fillna(0) != 0].copy()
    dom = spans["engine_id"].fillna(spans["role"])
    roles = {d: "/".join(sorted(set(spans.loc[dom == d, "role"]))) for d in c["clock_domain"]}
    c["role"] = c["clock_domain"].map(roles).replace("", "?")
    c["shift_ms"] = -c["offset_ms"]
    return c[["clock_domain", "role", "shift_ms", "offset_ms", "bound_ms", "spans"]].reset_index(drop=True)


def open_request(request_id: str) -> None:
    """Switch to the request explorer on ``request_id`` (kept in the URL, so the link can be shared)."""
    st.switch_page("app_pages/request.py", query_params={"request": request_id})


#: Rows the SQL console shows at most (rows).
CONSOLE_MAX_ROWS = 10_000


def console_query(t: Session, sql: str, max_rows: int = CONSOLE_MAX_ROWS) -> tuple[Any, bool]:
    """Run one statement typed into the SQL console; return (a DataFrame of at most ``max_rows`` rows, truncated?).

    The read-only rule is the analysis's, not the dashboard's own: the session's cursor
    (:meth:`pdtrace.analysis.Session.cursor`, a :class:`pdtrace.analysis.sandbox.ReadOnlyConnection`)
    refuses anything but a query (COPY, ATTACH, CREATE, INSERT, SET, INSTALL/LOAD, EXPLAIN ANALYZE
    of a non-query ...) before it runs, and DuckDB itself keeps the session from reading or writing
    files outside the trace directory. Raises :class:`pdtrace.analysis.sandbox.ReadOnlyError` when
    refused (also for more than one statement), ``duckdb.Error`` for a query that fails.
    """
    import pandas as pd

    cur = t.cursor()
    try:
        stmts = cur.statements(sql)
        if len(stmts) != 1:
            raise ReadOnlyError(f"read-only console: one statement at a time, got {len(stmts)}")
        res = cur.execute(stmts[0].query)
        if res.description is None:
            return pd.DataFrame(), False
        cols = [d[0] for d in res.description]
        rows = res.fetchmany(max_rows + 1)
        return pd.DataFrame(rows[:max_rows], columns=cols), len(rows) > max_rows
    finally:
        cur.close()
