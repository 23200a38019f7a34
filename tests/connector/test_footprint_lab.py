"""The ``pdtrace footprint:`` line of a traced ``pdtrace lab`` run, against independent readings.

The session's default ``pdtrace lab`` run (fixture ``cli_pull_run``: real vLLM CPU engines, NIXL, the
pdtrace router; pull mode, 20 requests, through the CLI and pdtrace's vLLM plugin; shared with
``tests/analysis/test_lab_skew.py``). While it runs, a thread of the test process reads the helper
processes itself with psutil (``labkit.HelperSampler``: every process whose command line holds
``pdtrace.instrument.sink`` and that descends from the test's process, where the lab runs, or names the
run directory after ``--dir``: the host's sink) and lists the run directory. Then:

- exactly one footprint line is printed, the last line of the run's output (after the report);
- ``processes`` equals the count this test read at the reading nearest before
  the lab's own reading; ``rss_mib`` is within 15 % of this test's total RSS
  there;
- ``background_ms_per_request`` equals (writer threads' CPU from the raw stats
  rows + this test's helper CPU reading) / traced requests (raw rows) within
  15 % + 1 ms (the two psutil readings are up to 0.3 s apart);
- ``hot_path_share_max`` equals the same share computed here from the raw
  ``pdtrace.thread_cpu`` rows (own SQL, not the analysis views) within 0.01
  percentage points; it lies in (0, 100);
- ``files_per_min`` × run minutes ≥ the files this test saw (each was created).
"""
from __future__ import annotations

import duckdb
import labkit
import pytest

from pdtrace.analysis import footprint as fpm

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1200)]


def _raw(run_dir, sql):
    con = duckdb.connect()
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{run_dir}/**/*.parquet', union_by_name = true)")
    return con.execute(sql).fetchall()


def test_footprint_line_agrees_with_independent_readings(cli_pull_run):
    out, s, sampler = cli_pull_run["dir"], cli_pull_run["summary"], cli_pull_run["sampler"]
    assert cli_pull_run["exit_code"] == 0, cli_pull_run["output"][-3000:]
    assert s["client"]["failed"] == 0
    lines = cli_pull_run["output"].rstrip("\n").split("\n")
    fl = [ln for ln in lines if ln.startswith("pdtrace footprint:")]
    assert len(fl) == 1 and lines[-1] == fl[0], lines[-5:]
    got = fpm.parse(fl[0])
    assert got is not None, fl[0]
    fp = s["footprint"]

    # processes and RSS: this test's own psutil reading nearest before the lab's
    t_lab = fp["helper_reading_time_s"]
    before = [r for r in sampler.readings if r[0] <= t_lab and r[1]]
    assert before, "the sampler saw no helper process before the lab's reading"
    t_mine, mine = before[-1]
    assert t_lab - t_mine < 1.0
    assert got["processes"] == len(mine) == len(fp["helper_pids"]) == 1  # one sink per host and directory
    assert set(fp["helper_pids"]) == set(mine)
    rss_mine = sum(v[0] for v in mine.values()) / 2**20
    assert abs(got["rss_mib"] - rss_mine) <= 0.15 * rss_mine + 1, (got["rss_mib"], rss_mine)

    # background: writer CPU from the raw stats rows + this test's helper CPU, per traced request (raw rows)
    writer_ns = _raw(out, "SELECT sum(w) FROM (SELECT pid, max(attr_int['recorder.writer_cpu_ns']) AS w FROM r "
                          "WHERE record = 'stats' AND name = 'recorder.stats' GROUP BY pid)")[0][0]
    requests = _raw(out, "SELECT count(DISTINCT request_id) FROM r WHERE record = 'span' "
                         "AND request_id IS NOT NULL")[0][0]
    assert requests >= labkit.CLI_RUN_REQUESTS
    helper_cpu = sum(v[1] for v in mine.values())
    bg = (writer_ns / 1e9 + helper_cpu) * 1e3 / requests
    assert abs(got["background_ms_per_request"] - bg) <= 0.15 * bg + 1.0, (got["background_ms_per_request"], bg)

    # hot path: the largest engine-thread share, recomputed from the raw per-thread rows
    share = _raw(out, """
        WITH d AS (
            SELECT pid, thread, role,
                   attr_int['cpu.pdtrace_ns'] - lag(attr_int['cpu.pdtrace_ns']) OVER w AS pd,
                   attr_int['cpu.thread_ns'] - lag(attr_int['cpu.thread_ns']) OVER w AS th,
                   attr_int['cpu.hooks'] - lag(attr_int['cpu.hooks']) OVER w AS hooks
            FROM (SELECT DISTINCT record_id, pid, thread, role, start_ns, attr_int FROM r
                  WHERE record = 'stats' AND name = 'pdtrace.thread_cpu')
            WINDOW w AS (PARTITION BY pid, thread ORDER BY start_ns))
        SELECT max(s) FROM (SELECT sum(pd) / sum(th) * 100 AS s FROM d
                            WHERE hooks > 0 AND role IN ('prefill', 'decode') GROUP BY pid, thread)""")[0][0]
    assert share is not None and 0 < got["hot_path_share_max"] < 100
    assert abs(got["hot_path_share_max"] - share) <= 0.01, (got["hot_path_share_max"], share)

    # files: every file this test saw was created
    assert got["files_per_min"] * fp["run_s"] / 60 >= len(sampler.files) * 0.99 > 0
