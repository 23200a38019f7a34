"""A time window over a store: the requests that arrived in it, and the store files that can hold them.

``pdtrace report``, ``sql`` and ``materialize`` take ``--since`` / ``--until`` (and ``--lookahead``);
:func:`pdtrace.analysis.open` and :class:`pdtrace.analysis.db.Trace` take a :class:`Window`. Rules:

* **Which requests**: those whose arrival (``requests.arrival_ns``: the router's, else P's API
  server's, on the corrected clock) is in ``[since, until)`` (rules for a request without one and
  for linked ids: :meth:`pdtrace.analysis.materialize.Materializer._apply_window`). The
  request-level views hold those only: ``requests``, ``ttft_segments``, ``ttft_breakdown``,
  ``ttft_hidden``, ``incomplete_requests``, ``request_events``, ``request_stalls``, ``in_flight``,
  ``coarse_breakdown``, ``transfers``, ``block_holds`` and the summaries built on them (each is
  ``_<view>_all`` less the keys in table ``_window_out``). Every request of the files read is still
  analysed, so a cause that lies in an earlier request outside the window (a slot held by an
  orphan, a run of requests blocked behind another) is found as on the whole store. The raw and
  engine-level views hold every row of the files read, margins included: ``spans``, ``events``,
  ``in_flight_spans``, ``collected_spans``, ``decode_stalls``, ``engine_stalls``,
  ``decode_stall_causes``, ``decode_step_requests``, ``thread_cpu``, ``thread_cpu_windows``,
  ``processes``, ``clock_offsets``, ``clock_domains``; when adding up hour-by-hour
  materializations, select their rows by their own time column. Rows of the request-level views
  with no request key (a ``coarse_breakdown`` span joined to no request) stay with their file.
* **Same answers?** A request's values are the whole store's when what they depend on lies in the
  files read. Clock offsets, step baselines (decode stalls) and each process's last flush (open
  requests) come from the files read only, so they can differ from the whole store's at the
  edges of the window.
* **Which files** (:meth:`Window.select`): a request arriving in the window has rows whose
  ``end_ns`` lies in ``[since - margin, until + lookahead)``: no row ends before its arrival (less
  the clock error between hosts), and ``lookahead`` is the longest a request is followed after it
  arrived. A file is read when the range of its rows' ``end_ns`` meets that interval, the range
  taken from

  1. its Hive partition (``DIR/.../date=YYYY-MM-DD/hour=HH/...``, :mod:`pdtrace.instrument.layout`):
     a sink writes a file in the hour H it writes it, after its rows ended, so they end before
     H + 1 h; how long before is not bounded (a span written when its request finishes, records
     held by tail retention). ``pdtrace compact``'s outputs (``compact-*.parquet``) hold rows that
     end within hour H exactly (compaction's rule 1). So a partition whose hour ends before
     ``since - margin`` is never opened, its files never checked or named; a compaction output
     whose hour starts at or after ``until + lookahead`` neither;
  2. then the Parquet footer's statistics of ``end_ns`` (min and max over the row groups, one
     statement for every remaining file): files of a flat store, and the files the partition
     left in. A file whose footer has no such statistics, or cannot be
     read, is kept (the store's file check then names it if it is bad).

  ``margin`` (default :data:`MARGIN_NS`, 5 min) must cover the hosts' clock error. A request still running ``lookahead``
  after ``until`` is analysed as the files read show it (open, or incomplete with its cause): widen
  ``--lookahead`` to follow longer requests.

Times: ``--since`` / ``--until`` take an ISO 8601 instant (``2026-12-06T10:00``, ``...Z``,
``...+01:00``; without a zone: UTC) or a duration before now (``90s``, ``30m``, ``2h``, ``1d``).
"""
from __future__ import annotations

import datetime as _dt
import re
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from pdtrace.instrument import compact as _compact

from . import files as _files

NS = 1_000_000_000
HOUR_NS = 3600 * NS

#: Default margin before ``since`` (ns): a row of a request that arrived at ``since`` on the
#: corrected clock ends at or after ``since`` less the error of its host's clock, which NTP keeps
#: far below this.
MARGIN_NS = 300 * NS

#: Default lookahead (ns): how long after ``until`` the rows of a request that arrived before it are
#: read (its lifetime: queueing, prefill, the handoff and the whole decode). 10 min.
LOOKAHEAD_NS = 600 * NS

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PARTITION = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$|^hour=(\d{1,2})$")


def parse_duration(text: str) -> int:
    """``'90s'``, ``'30m'``, ``'2h'``, ``'1d'`` (a decimal number and one unit) -> ns. Raises ValueError
    for anything else."""
    m = _DURATION.match(text or "")
    if not m:
        raise ValueError(f"not a duration: {text!r} (a number and a unit s, m, h or d, e.g. 30m)")
    return int(float(m.group(1)) * _UNIT_S[m.group(2)] * NS)


def parse_instant(text: str, now_ns: int | None = None) -> int:
    """An instant as ns since the Unix epoch: an ISO 8601 date or date-time (no zone: UTC), or a
    duration before ``now_ns`` (default: now; :func:`parse_duration`). Raises ValueError for anything
    else."""
    if _DURATION.match(text or ""):
        return (time.time_ns() if now_ns is None else now_ns) - parse_duration(text)
    try:
        t = _dt.datetime.fromisoformat(text.strip())
    except (ValueError, AttributeError):
        raise ValueError(f"not an instant: {text!r} (ISO 8601 such as 2026-12-06T10:00Z, or a duration "
                         "before now such as 30m)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    delta = t - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
    return (delta.days * 86400 + delta.seconds) * NS + delta.microseconds * 1000


def iso(ns: int | None) -> str:
    """``ns`` (since the epoch) as ISO 8601 UTC with microseconds (``...Z``); ``'-'`` for None."""
    if ns is None:
        return "-"
    return _dt.datetime.fromtimestamp(ns / NS, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def partition_hour(path: str | Path, directory: str | Path) -> int | None:
    """The start (ns since the epoch, UTC) of the Hive hour partition ``path`` lies in below
    ``directory`` (``.../date=YYYY-MM-DD/hour=HH/...``, :mod:`pdtrace.instrument.layout`), or None when
    it is in none (or the values do not parse, e.g. the null partition)."""
    try:
        parts = Path(path).relative_to(directory).parts[:-1]
    except ValueError:
        return None
    date = hour = None
    for p in parts:
        m = _PARTITION.match(p)
        if m and m.group(1):
            date = m.group(1)
        elif m and m.group(2):
            hour = int(m.group(2))
    if date is None or hour is None or hour > 23:
        return None
    try:
        d = _dt.date.fromisoformat(date)
    except ValueError:
        return None
    return ((d - _dt.date(1970, 1, 1)).days * 24 + hour) * HOUR_NS


@dataclass(frozen=True)
class Window:
    """Requests arriving in ``[since_ns, until_ns)`` (ns since the epoch; None: unbounded on that
    side), read from the files whose rows end in ``[since_ns - margin_ns, until_ns + lookahead_ns)``
    (module docstring). Raises ValueError when ``since_ns >= until_ns`` or a margin is negative."""

    since_ns: int | None = None
    until_ns: int | None = None
    lookahead_ns: int = LOOKAHEAD_NS
    margin_ns: int = MARGIN_NS

    def __post_init__(self):
        if self.since_ns is not None and self.until_ns is not None and self.since_ns >= self.until_ns:
            raise ValueError(f"empty window: since {iso(self.since_ns)} is not before until {iso(self.until_ns)}")
        if self.lookahead_ns < 0 or self.margin_ns < 0:
            raise ValueError("the window's lookahead and margin must not be negative")

    @classmethod
    def from_options(cls, since: str | None, until: str | None, lookahead: str | None = None,
                     now_ns: int | None = None) -> "Window | None":
        """The window of the CLI's ``--since``, ``--until`` and ``--lookahead`` texts (module
        docstring), None when neither bound is given. Raises ValueError for a text that does not
        parse, an empty window, or a lookahead without ``until``."""
        if lookahead is not None and until is None:
            raise ValueError("--lookahead needs --until (it is how long after it requests are followed)")
        if since is None and until is None:
            return None
        now = time.time_ns() if now_ns is None else now_ns
        return cls(since_ns=None if since is None else parse_instant(since, now),
                   until_ns=None if until is None else parse_instant(until, now),
                   lookahead_ns=LOOKAHEAD_NS if lookahead is None else parse_duration(lookahead))

    # -- which files --------------------------------------------------------------
    @property
    def lo_ns(self) -> int | None:
        """The earliest ``end_ns`` a row of a request in the window can have (None: no bound)."""
        return None if self.since_ns is None else self.since_ns - self.margin_ns

    @property
    def hi_ns(self) -> int | None:
        """The ``end_ns`` from which no row is read (None: no bound)."""
        return None if self.until_ns is None else self.until_ns + self.lookahead_ns

    def meets(self, lo: int, hi: int) -> bool:
        """True when rows ending in ``[lo, hi]`` (ns) can belong to a request in the window."""
        return (self.lo_ns is None or hi >= self.lo_ns) and (self.hi_ns is None or lo < self.hi_ns)

    def select(self, paths: list[Path], directory: str | Path,
               con: duckdb.DuckDBPyConnection | None = None) -> list[Path]:
        """The files of ``paths`` (store files below ``directory``) to read for this window, in order:
        those of a Hive partition outside the window (module docstring, rule 1) are dropped without
        opening them, then those whose footer statistics put every ``end_ns`` outside it (read through
        ``con``, one statement; without ``con`` or when the statement fails, by partition only). Never
        raises for a bad file: it is kept."""
        kept: list[Path] = []
        for p in paths:
            h = partition_hour(p, directory)
            if h is None:
                kept.append(p)
            elif _compact.OUTPUT_FILE.match(p.name):  # rows end within the hour
                if self.meets(h, h + HOUR_NS - 1):
                    kept.append(p)
            elif self.lo_ns is None or h + HOUR_NS > self.lo_ns:  # rows end before the hour's end, unbounded below
                kept.append(p)
        if con is None or not kept:
            return kept
        ranges = self._end_ranges(con, [str(p) for p in kept])
        return [p for p in kept if (r := ranges.get(str(p))) is None or self.meets(*r)]

    def _end_ranges(self, con: duckdb.DuckDBPyConnection, names: list[str]) -> dict[str, tuple[int, int]]:
        """{file: (min end_ns, max end_ns)} from the footers' row-group statistics, for the files whose
        every row group has both; files DuckDB cannot read (or whose statistics lack) are absent. One
        statement, split in halves when it fails (:func:`pdtrace.analysis.files.by_halves`)."""
        out: dict[str, tuple[int, int]] = {}

        def read(batch: list[str]) -> None:
            rows = con.execute("""
                SELECT file_name, min(TRY_CAST(stats_min AS BIGINT)), max(TRY_CAST(stats_max AS BIGINT)),
                       count(*) = count(TRY_CAST(stats_min AS BIGINT)) AND count(*) = count(TRY_CAST(stats_max AS BIGINT))
                FROM parquet_metadata(?) WHERE path_in_schema = 'end_ns' GROUP BY file_name""", [batch]).fetchall()
            asked = set(batch)
            for name, lo, hi, complete in rows:
                if name in asked and complete and lo is not None and hi is not None:
                    out[name] = (int(lo), int(hi))

        _files.by_halves(names, read, lambda name: None)
        return out

    # -- description ----------------------------------------------------------------
    def key(self) -> str:
        """A text naming the window exactly (the cache stamps it: another window rebuilds)."""
        return f"{self.since_ns}:{self.until_ns}:{self.lookahead_ns}:{self.margin_ns}"

    def describe(self) -> dict:
        """The window as the report prints it: since / until (ISO 8601 UTC, '-' unbounded), lookahead
        and margin (s)."""
        return {"since": iso(self.since_ns), "until": iso(self.until_ns),
                "lookahead_s": self.lookahead_ns / NS, "margin_s": self.margin_ns / NS}
