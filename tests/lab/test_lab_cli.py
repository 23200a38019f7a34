"""``pdtrace lab`` through its CLI (click's runner), real engines: the ending it prints.

The traced run's report is checked in ``tests/analysis/test_lab_skew.py`` (its
unshifted run is a ``pdtrace lab --connector traced`` call). Here: a run with
vLLM's stock connectors (the default) still works end to end and says why it
prints no report; and the reason for ``--no-trace`` (no engines needed).
"""
from __future__ import annotations

import json

import labkit
import pytest

from pdtrace.connector.lab.run import LabOptions, no_report_reason


def test_no_report_reasons():
    assert no_report_reason(LabOptions(connector="traced", trace=True)) is None
    assert "--no-trace" in no_report_reason(LabOptions(connector="traced", trace=False))
    assert "stock connectors" in no_report_reason(LabOptions(connector="stock", trace=True))


@pytest.mark.lab
@pytest.mark.timeout(1200)
def test_stock_lab_run_says_there_is_no_report(tmp_path):
    from click.testing import CliRunner

    from pdtrace.cli.main import main
    labkit.require_lab()
    out = tmp_path / "stock"
    res = CliRunner().invoke(main, ["lab", "--mode", "pull", "--connector", "stock", "--max-requests", "3",
                                    "--out", str(out), "--no-progress"])
    print(res.output)
    assert res.exit_code == 0, (res.output[-3000:], repr(res.exception))
    s = json.loads((out / "run.json").read_text())
    assert s["connector"] == "NixlPullConnector" and s["client"]["ok"] == 3 and s["client"]["failed"] == 0
    assert s["report"] is None
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("no pdtrace report: the stock connectors"), last
    assert "pdtrace report " + str(out) not in res.output
    # the router still traced its own spans (tracing on by default): no engine spans
    assert list(out.glob("router-*.parquet")) and not list(out.glob("decode-*.parquet"))
