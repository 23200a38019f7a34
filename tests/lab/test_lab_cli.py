"""``pdtrace lab`` through its CLI (click's runner), real engines: the ending it prints.

The explicit-class run's report is checked in ``tests/analysis/test_lab_skew.py``
(its unshifted run is a ``pdtrace lab --connector traced`` call). Here: the
default run (vLLM's stock serving command plus ``PDTRACE_DIR``, traced through
pdtrace's vLLM plugin) prints the report; and the reason for ``--no-trace``
(no engines needed).
"""
from __future__ import annotations

import json

import labkit
import pytest

from pdtrace.connector.lab.run import LabOptions, activation, no_report_reason


def test_no_report_reasons_and_activation():
    assert no_report_reason(LabOptions(connector="traced", trace=True)) is None
    assert no_report_reason(LabOptions(connector="stock", trace=True)) is None  # the plugin traces it
    assert "--no-trace" in no_report_reason(LabOptions(connector="traced", trace=False))
    assert "--no-trace" in no_report_reason(LabOptions(connector="stock", trace=False))
    assert [activation(LabOptions(connector=c, trace=t)) for c, t in
            (("stock", True), ("traced", True), ("stock", False))] == ["plugin", "explicit", None]


@pytest.mark.lab
@pytest.mark.timeout(1200)
def test_default_lab_run_is_traced_by_the_plugin_and_reports(tmp_path):
    """``pdtrace lab`` without --connector: stock connector name, no module path, no --middleware."""
    import duckdb
    from click.testing import CliRunner

    from pdtrace.cli.main import main
    labkit.require_lab()
    out = tmp_path / "stock"
    res = CliRunner().invoke(main, ["lab", "--mode", "pull", "--max-requests", "3", "--out", str(out),
                                    "--no-progress"])
    print(res.output)
    assert res.exit_code == 0, (res.output[-3000:], repr(res.exception))
    s = json.loads((out / "run.json").read_text())
    assert s["connector"] == "NixlPullConnector" and s["connector_module"] is None
    assert s["activation"] == "plugin" and s["client"]["ok"] == 3 and s["client"]["failed"] == 0
    assert s["report"] is not None and "pdtrace report " + str(out) in res.output
    log = (out / "logs" / "prefill-0.log").read_text(errors="replace")
    assert "pdtrace.connector.traced" not in log.split("Creating v1 connector")[0]  # not on the command line
    assert "Creating v1 connector with name: TracedNixlPullConnector" in log  # the stock name resolved to it
    # every traced process says how: engines (API servers, EngineCores) through the plugin, the router explicitly
    rows = duckdb.sql(f"""SELECT role, list(DISTINCT attr_str['pdtrace.activation']) AS a, count(DISTINCT pid) AS n
                          FROM read_parquet('{out}/*.parquet', union_by_name=true)
                          WHERE name = 'recorder.stats' GROUP BY role ORDER BY role""").fetchall()
    by = {r: (a, n) for r, a, n in rows}
    assert by["router"][0] == ["explicit"], by
    for role in ("prefill", "decode"):
        assert by[role][0] == ["plugin"] and by[role][1] >= 2, by  # API server + EngineCore (+ worker)
    names = {r[0] for r in duckdb.sql(f"SELECT DISTINCT name FROM read_parquet('{out}/*.parquet', "
                                     "union_by_name=true)").fetchall()}
    assert {"prefill.frontend", "decode.frontend", "kv.transfer", "prefill.compute"} <= names
