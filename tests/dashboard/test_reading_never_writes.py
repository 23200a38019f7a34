"""DESIGN.md §6 "Reading never writes": with ``PDTRACE_DIR`` set to the directory they read (a traced
host's environment), ``pdtrace report``, ``pdtrace sql`` and the dashboard leave its file list unchanged.

Real processes: the installed ``pdtrace`` command, and the dashboard app run by
Streamlit's AppTest in a child interpreter (the script's imports happen there
with ``PDTRACE_DIR`` set, as under ``pdtrace dashboard``). Before the recorder
stopped starting on import, each wrote a ``proc-*.parquet`` into the directory.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from storegen import build_store

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


def _listing(d: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))


def _env(d: Path, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDTRACE_", "OTEL_"))}
    env.update({"PDTRACE_DIR": str(d), "PDTRACE_CACHE_DIR": str(tmp_path / "cache"),
                "PDTRACE_FLUSH_INTERVAL_S": "0.05"})
    return env


def test_report_sql_dashboard_leave_the_directory_unchanged(tmp_path):
    d = tmp_path / "trace"
    build_store(d, n_requests=12)
    before = _listing(d)
    env = _env(d, tmp_path)
    pdtrace = str(Path(sys.executable).with_name("pdtrace"))
    r = subprocess.run([pdtrace, "report", str(d)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TTFT" in r.stdout
    r = subprocess.run([pdtrace, "sql", str(d), "select count(*) AS n from requests", "--format", "csv"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["n", "12"]
    code = f"""
        import os, time
        os.environ["PDTRACE_DASHBOARD_DIR"] = {str(d)!r}
        from streamlit.testing.v1 import AppTest
        at = AppTest.from_file({str(APP)!r}, default_timeout=180)
        at.run()
        assert not at.exception, at.exception
        time.sleep(0.3)  # > several flush intervals: a recorder started on import would have written
        from pdtrace.instrument import tracer
        print("tracer on:", tracer.on)
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "tracer on: False"
    assert _listing(d) == before
