-- module: intervals
-- requires:
-- Interval building blocks of the TTFT critical path (module ttft_segments),
-- as table macros over rows named by their first argument: a table, view or
-- CTE name (DuckDB's query_table), so a caller states its input as a CTE and
-- reads the macro in the same query. Times are ns on one clock; an interval
-- [s, e] is half-open in ownership (it owns the instants s <= t < e).
-- Golden tests with timelines: tests/analysis/test_sql_blocks.py.

-- "Latest end wins" (Perfetto's startup breakdown; ttft_segments step 4): among
-- the rows of one key, the row ending last owns each instant it
-- covers, so each row owns [s, owned_end] with
--   owned_end = min(e, earliest s of the rows ending later)
-- where "later" is the order e DESC, s DESC, tie ASC (equal ends: the later
-- start owns the shared part; equal ends and starts: the lower tie owns it).
-- Rows owning nothing (owned_end <= s) are dropped; the rows kept own
-- disjoint intervals. Arguments: rows (name), key (the partition: a column of
-- `rows`, or row(a, b) for several), s, e (interval columns, ns), tie (a
-- column ordering exact ties).
-- Returns every column of the kept rows plus owned_end (ns; same type as e).
-- A NULL e sorts after every end (it owns up to the earliest start of the
-- others; alone, nothing).
CREATE OR REPLACE MACRO _latest_end_wins(rows, key, s, e, tie) AS TABLE
SELECT * FROM (
    SELECT *, least(e, coalesce(min(s) OVER w, e)) AS owned_end
    FROM query_table(rows)
    WINDOW w AS (PARTITION BY key ORDER BY e DESC, s DESC, tie
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
) WHERE owned_end > s;

-- Gap filling (ttft_segments step 5): the parts of each window [lo, hi] that
-- no interval covers. `intervals` (name) has columns k (the window's key: a
-- value, or a struct for several columns), s, e (ns), lo (the window's
-- start, on every row), label; a key's intervals are disjoint and inside its
-- window. `windows` (name) has columns k, lo, hi (ns): one row per key; a
-- window without intervals is one gap. Returns (k, gap_start, gap_end,
-- prev_label, next_label), one row per gap with gap_end > gap_start:
-- prev_label / next_label are the labels of the intervals before and after
-- it (NULL: the window's start / end). An interval with a NULL e makes the
-- next gap start at lo (callers pass closed intervals).
CREATE OR REPLACE MACRO _uncovered(intervals, windows) AS TABLE
SELECT k, gap_start, gap_end, prev_label, next_label FROM (
    SELECT k, s AS gap_end, label AS next_label,
           coalesce(lag(e) OVER w, lo) AS gap_start, lag(label) OVER w AS prev_label
    FROM (SELECT k, s, e, lo, label FROM query_table(intervals)
          UNION ALL
          SELECT k, hi, hi, lo, NULL FROM query_table(windows))
    WINDOW w AS (PARTITION BY k ORDER BY s, e)
) WHERE gap_end > gap_start;
