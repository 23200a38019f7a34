"""Clocks: the monotonic clock spans are stamped with, and (monotonic, wall) anchors.

Call sites stamp with ``time.monotonic_ns()`` (CLOCK_MONOTONIC on Linux, the
clock vLLM's own ``time.monotonic()`` engine events use, so those convert
too). The writer turns monotonic ns into Unix-epoch ns through the latest
anchor: ``epoch = mono + (wall_anchor - mono_anchor)``. Anchors are taken
periodically and written to the store, because the two clocks drift apart
over days (NTP slews the wall clock, not the monotonic one).

A hook that has a single time on the other clock (vLLM's wall-clock
``Request.arrival_time``, a wall time sent by a peer, a monotonic time to
send as wall) converts it with :func:`wall_to_mono` / :func:`mono_to_wall`:
the offset read now, no anchor, no bound. These are the only conversions
between the two clocks outside the store's anchors.
"""
from __future__ import annotations

import bisect
import statistics
import time
from typing import NamedTuple

#: The monotonic clock of every span timestamp, in ns.
now_ns = time.monotonic_ns


class Anchor(NamedTuple):
    """One (monotonic, wall) pair: ``wall_ns`` read between two monotonic reads whose midpoint is ``mono_ns``.

    ``uncertainty_ns`` is half the read window; ``offset_ns`` = wall - mono (the
    amount added to a monotonic time to get epoch ns); ``test_offset_ns`` the
    test-only shift included in ``wall_ns``.
    """

    mono_ns: int
    wall_ns: int
    uncertainty_ns: int
    test_offset_ns: int

    @property
    def offset_ns(self) -> int:
        return self.wall_ns - self.mono_ns


def take_anchor(test_offset_ns: int = 0, tries: int = 5) -> Anchor:
    """Read an anchor: the tightest of ``tries`` (mono, wall, mono) triples.

    ``test_offset_ns`` (PDTRACE_TEST_WALL_OFFSET_NS) is added to the wall
    reading; it exists only to reproduce skew between hosts on one machine.
    """
    best = None
    for _ in range(tries):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[2] - best[0]:
            best = (m0, w, m1)
    m0, w, m1 = best
    return Anchor((m0 + m1) // 2, w + test_offset_ns, (m1 - m0 + 1) // 2, test_offset_ns)


class HostAnchors:
    """The anchors of one host's sink, shared by all its clients (traced processes).

    Every traced process on a host reads the same CLOCK_MONOTONIC, so converting all
    their records through the same anchors keeps their epoch times consistent with
    one another, whatever the wall clock does. Each client converting through an
    anchor of its own, re-taken at its own moment, did not: after a wall-clock step
    (seen on this machine kind: +34.3 s), records of the same instant were converted
    with the old offset in some processes and the new one in others for up to one
    anchor interval, which the clock-skew analysis (DESIGN.md §3) then read as an
    offset between them.

    A record converts through the anchor in effect at its start: the latest anchor
    taken at or before its monotonic start (the oldest kept one for a record that
    started earlier), whenever it is converted. Its end uses the same offset, so a
    duration never includes a step. :meth:`refresh` takes a new anchor once
    ``interval_s`` has passed; ``keep`` anchors are kept (memory only: one tuple each).
    Not thread-safe: the sink's one thread uses it.
    """

    def __init__(self, interval_s: float, keep: int = 720) -> None:
        self.interval_s = interval_s
        self.keep = max(2, keep)
        self._anchors: list[Anchor] = []
        self._monos: list[int] = []
        self._due = 0.0
        self.refresh()

    def refresh(self) -> Anchor:
        """Take a new anchor if ``interval_s`` has passed since the last one; return the latest."""
        now = time.monotonic()
        if now >= self._due:
            a = take_anchor()
            self._anchors.append(a)
            self._monos.append(a.mono_ns)
            if len(self._anchors) > self.keep:
                del self._anchors[0], self._monos[0]
            self._due = now + self.interval_s
        return self._anchors[-1]

    def latest(self, test_offset_ns: int = 0) -> Anchor:
        """The latest anchor, its wall reading shifted by ``test_offset_ns`` (one client's test setting)."""
        a = self._anchors[-1]
        return Anchor(a.mono_ns, a.wall_ns + test_offset_ns, a.uncertainty_ns, test_offset_ns)

    def split(self, recs: list[tuple], start_index: int, test_offset_ns: int = 0) -> list[tuple[list[tuple], int]]:
        """``recs`` grouped by the anchor in effect at each one's start: ``[(records, offset_ns)]``.

        ``start_index``: where a record tuple holds its monotonic start (ns; a record
        without one, None, takes the latest anchor). ``offset_ns`` = wall - mono of the
        anchor plus ``test_offset_ns``. Groups follow the anchors' order; records keep
        their order within a group.
        """
        monos, last = self._monos, self._monos[-1]
        if len(monos) == 1 or all(r[start_index] is None or r[start_index] >= last for r in recs):
            return [(recs, self._anchors[-1].offset_ns + test_offset_ns)] if recs else []
        groups: dict[int, list[tuple]] = {}
        top = len(monos) - 1
        for r in recs:
            t = r[start_index]
            k = top if t is None else max(0, bisect.bisect_right(monos, t) - 1)
            groups.setdefault(k, []).append(r)
        return [(g, self._anchors[k].offset_ns + test_offset_ns) for k, g in sorted(groups.items())]


def wall_minus_mono_ns() -> int:
    """This process's clock offset now: wall-clock (Unix-epoch) ns minus monotonic ns.

    One read of each clock, wall first (two clock reads, ~100 ns; the error is the time between
    them). :func:`take_anchor` is the bounded reading the store uses.
    """
    return time.time_ns() - time.monotonic_ns()


def wall_to_mono(wall_ns: int) -> int:
    """A Unix-epoch ns time as this process's monotonic ns, through the offset now (:func:`wall_minus_mono_ns`).

    A wall time read on another host keeps that host's wall-clock skew (the analysis corrects it
    per clock domain).
    """
    return wall_ns - wall_minus_mono_ns()


def mono_to_wall(mono_ns: int) -> int:
    """A monotonic ns time of this process as Unix-epoch ns, through the offset now (inverse of :func:`wall_to_mono`)."""
    return mono_ns + wall_minus_mono_ns()


def clock_source() -> str:
    """Implementation name of the monotonic clock (e.g. 'clock_gettime(CLOCK_MONOTONIC)')."""
    return time.get_clock_info("monotonic").implementation


def read_cost_ns(samples: int = 2000) -> int:
    """Median cost of one ``time.monotonic_ns()`` call, in ns (measured in batches of 100)."""
    costs = []
    for _ in range(max(1, samples // 100)):
        t0 = time.perf_counter_ns()
        for _ in range(100):
            now_ns()
        costs.append((time.perf_counter_ns() - t0) / 100)
    return int(statistics.median(costs))
