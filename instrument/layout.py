"""Where store files go in a trace directory: the flat layout and the Hive-style fleet layout.

``flat`` (the default, PDTRACE_LAYOUT unset): every file directly in the trace directory.

``hive`` (PDTRACE_LAYOUT=hive, and always for ``pdtrace compact``'s output): files under
``DIR/date=YYYY-MM-DD/hour=HH/host=<host>/``, the Hive partition convention Spark, Trino and
DuckDB read (``DIR/**/*.parquet`` with hive partitioning on). Values:

* ``date``, ``hour``: UTC. The host's sink uses the instant it writes the file (a segment: the
  partition of its parts, see :mod:`pdtrace.instrument.sink`); ``pdtrace compact`` uses each
  row's ``end_ns`` (:mod:`pdtrace.instrument.compact`). A row's partition is therefore never
  earlier than its end's hour, give or take a flush interval and the host's clock error: a
  query that selects rows by ``start_ns`` through partitions must also read the partitions of
  the longest span's duration after it.
* ``host``: the sink's host name (:func:`socket.gethostname`), or the rows' own ``host``
  column (compaction). The partition *duplicates* the ``host`` column; the column is the truth
  (pdtrace's analysis never reads partition values, it passes ``hive_partitioning = false``).

A value is escaped like Hive's: every character outside ``[A-Za-z0-9._-]`` becomes ``%XX``
(its UTF-8 bytes), and a null value is ``__HIVE_DEFAULT_PARTITION__``.
"""
from __future__ import annotations

import time

#: Hive's name of the partition that holds null values.
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"

#: The layouts PDTRACE_LAYOUT accepts.
LAYOUTS = ("flat", "hive")

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def escape(value: str | None) -> str:
    """``value`` as a Hive partition value: characters outside ``[A-Za-z0-9._-]`` as ``%XX`` of
    their UTF-8 bytes; None (or an empty string) as :data:`NULL_PARTITION`. Never raises."""
    if value is None or value == "":
        return NULL_PARTITION
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in value)


def hour_of(wall_ns: int | None) -> tuple[str, str]:
    """``(date, hour)`` partition values (``'YYYY-MM-DD'``, ``'HH'``, UTC) of ``wall_ns`` (ns since the
    Unix epoch); both :data:`NULL_PARTITION` for None."""
    if wall_ns is None:
        return NULL_PARTITION, NULL_PARTITION
    t = time.gmtime(wall_ns // 1_000_000_000)
    return time.strftime("%Y-%m-%d", t), f"{t.tm_hour:02d}"


def partition(wall_ns: int | None, host: str | None) -> str:
    """The relative directory ``date=YYYY-MM-DD/hour=HH/host=<escaped host>`` of instant ``wall_ns``
    (ns since the Unix epoch, UTC; None: the null partition) and ``host``."""
    date, hour = hour_of(wall_ns)
    return f"date={date}/hour={hour}/host={escape(host)}"
