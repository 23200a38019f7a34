"""pdtrace report / pdtrace sql on hand-built stores."""
import json

from click.testing import CliRunner

from pdtrace.cli.main import main
from test_ttft_cases import _case_c, _case_h


def _run(args, tmp_path, input=None):
    r = CliRunner().invoke(main, args, input=input, env={"PDTRACE_CACHE_DIR": str(tmp_path / "cache")})
    return r


def test_sql_formats(tmp_path):
    d = tmp_path / "h"
    _case_h().write(d)
    r = _run(["sql", str(d), "SELECT request_id, ttft_ms, coordination_ms FROM ttft_breakdown", "--format", "json"], tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [{"request_id": "h1", "ttft_ms": 4070.0, "coordination_ms": 4000.0}]
    r = _run(["sql", str(d), "SELECT request_id, ttft_ms FROM ttft_breakdown", "--format", "csv"], tmp_path)
    assert r.output.splitlines() == ["request_id,ttft_ms", "h1,4070.0"]
    r = _run(["sql", str(d), "SELECT stage FROM ttft_segments ORDER BY seq"], tmp_path)
    assert r.exit_code == 0 and "dest.register" in r.output


def test_sql_table_aligns_text_left_and_numbers_right(tmp_path):
    """Text columns (stage names, comments) read left-aligned, wherever they are; numbers line up on the right."""
    d = tmp_path / "h"
    _case_h().write(d)
    r = _run(["sql", str(d), "SELECT seq, stage, dur_ns // 1000000 AS ms FROM ttft_segments ORDER BY seq"], tmp_path)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["seq", "stage", "ms"]
    rows = [ln for ln in lines[2:] if ln]
    assert len(rows) >= 3 and len({len(ln.split()[1]) for ln in rows}) > 1  # stage names of different lengths
    at = lines[0].index("stage")
    for ln in rows:
        seq, stage, ms = ln.split()
        assert ln.index(stage, len(seq)) == at  # every stage name starts under its header
        assert len(ln) == len(lines[1])  # and every ms value ends at the column's right edge


def test_sql_refuses_writes(tmp_path):
    d = tmp_path / "h"
    _case_h().write(d)
    out = tmp_path / "x.csv"
    r = _run(["sql", str(d), f"COPY (SELECT 1) TO '{out}'"], tmp_path)
    assert r.exit_code != 0 and not out.exists()
    r = _run(["sql", str(d), f"ATTACH '{tmp_path / 'y.duckdb'}'"], tmp_path)
    assert r.exit_code != 0 and not (tmp_path / "y.duckdb").exists()


def test_sql_shell(tmp_path):
    d = tmp_path / "h"
    _case_h().write(d)
    r = _run(["sql", str(d)], tmp_path, input=".views\nSELECT ttft_ms\nFROM ttft_breakdown;\n.quit\n")
    assert r.exit_code == 0, r.output
    assert "ttft_breakdown" in r.output and "4070.000" in r.output


def test_report_and_compare(tmp_path):
    a, b = tmp_path / "pull", tmp_path / "push"
    _case_c().write(a)
    _case_h().write(b)
    r = _run(["report", str(a), "--format", "json"], tmp_path)
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["by_mode"][0]["mode"] == "pull" and data["by_mode"][0]["ttft_p50_ms"] == 600
    r = _run(["report", str(a), "--compare", str(b)], tmp_path)
    assert r.exit_code == 0, r.output
    assert "pull" in r.output and "push" in r.output and "4070.000" in r.output and "600.000" in r.output
    (b / "junk.parquet").write_bytes(b"not parquet")
    r = CliRunner(mix_stderr=False).invoke(main, ["report", str(b)], env={"PDTRACE_CACHE_DIR": str(tmp_path / "cache")}) \
        if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else _run(["report", str(b)], tmp_path)
    assert r.exit_code == 0
    assert "junk.parquet" in (r.output + (getattr(r, "stderr", "") or ""))
