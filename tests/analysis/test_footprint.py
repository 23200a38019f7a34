"""The footprint line's computation (pdtrace.analysis.footprint): pure parts, file counting, a live helper."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from pdtrace.analysis import footprint as fpm


def _fig(shares, writer_s=0.2, sink_s=0.5, requests=20):
    return {"threads": [{"role": r, "pid": p, "thread": "MainThread", "hot_path_share": s} for r, p, s in shares],
            "writer_cpu_s": writer_s, "sink_cpu_s": sink_s, "requests": requests, "records": 1000}


def test_compute_takes_the_largest_share_and_the_helpers_reading():
    h = fpm.Helpers(pids=[11, 12, 13], rss_bytes=300 * 2**20, cpu_s=1.3, time_s=0.0)
    fp = fpm.compute(_fig([("prefill", 1, 0.012), ("decode", 2, 0.031), ("decode", 3, None)]), h,
                     files=90, run_s=180.0)
    assert fp.hot_path_share_max_pct == 3.1
    assert fp.hot_path_thread == "decode pid 2 MainThread"
    # (writer 0.2 s + helpers 1.3 s) / 20 requests = 75 ms
    assert abs(fp.background_ms_per_request - 75.0) < 1e-9
    assert fp.processes == 3 and fp.rss_mib == 300.0
    assert fp.files_per_min == 30.0  # 90 files in 3 minutes
    line = fpm.line(fp)
    assert line == ("pdtrace footprint: hot_path_share_max=3.10% background_ms_per_request=75.0 processes=3 "
                    "rss_mib=300 files_per_min=30.0")
    assert fpm.parse(line) == {"hot_path_share_max": 3.1, "background_ms_per_request": 75.0, "processes": 3,
                               "rss_mib": 300.0, "files_per_min": 30.0}


def test_compute_without_measurements_says_na():
    fp = fpm.compute(_fig([], requests=0), None, files=0, run_s=60.0)
    # no helper reading: the store's sink CPU stands in; no requests: no per-request figure
    assert fp.helper_cpu_s == 0.5 and fp.background_ms_per_request is None
    line = fpm.line(fp)
    assert line.startswith("pdtrace footprint: hot_path_share_max=n/a background_ms_per_request=n/a processes=0 ")
    assert fpm.parse(line)["hot_path_share_max"] is None
    assert fpm.parse("pdtrace footprint: nonsense") is None


def test_files_created_counts_merged_parts_by_sequence(tmp_path):
    # helper A wrote parts 1-4, merged them into segment 5 (parts deleted), then part 6; helper B one part
    for n in ("prefill-h-10-20261204T180000-s000005.parquet", "prefill-h-10-20261204T180000-p000006.parquet",
              "decode-h-11-20261204T180001-p000001.parquet", "other.parquet", ".x.parquet.tmp"):
        (tmp_path / n).write_bytes(b"")
    assert fpm.files_created(tmp_path) == 6 + 1 + 1


def test_sample_helpers_finds_a_helper_by_module_name_and_trace_dir(tmp_path):
    """A real process whose command line names the helper module as an argument (``python -c ... -m
    pdtrace.instrument.sink``: it only sleeps, so the test does not depend on the sink's own protocol)."""
    env = {**os.environ, "PDTRACE_DIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 << 20); time.sleep(60)", "-m",
                          fpm.HELPER_MODULE], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and psutil.Process(p.pid).memory_info().rss < 32 * 2**20:
            time.sleep(0.05)
        h = fpm.sample_helpers(tmp_path)
        assert p.pid in h.pids
        rss = psutil.Process(p.pid).memory_info().rss
        assert rss * 0.95 <= h.rss_bytes
        assert p.pid not in fpm.sample_helpers(tmp_path / "elsewhere").pids
        assert p.pid in fpm.sample_helpers(None).pids
        # a descendant of the given root counts whatever its environment
        assert p.pid in fpm.sample_helpers(tmp_path / "elsewhere", root_pid=os.getpid()).pids
        assert p.pid not in fpm.sample_helpers(tmp_path / "elsewhere", root_pid=p.pid).pids
    finally:
        p.kill()
        p.wait()
