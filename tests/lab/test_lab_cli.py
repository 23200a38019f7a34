"""``pdtrace lab``'s report and activation rules (no engines needed).

The default run through the CLI (click's runner, real engines: vLLM's stock
serving command plus ``PDTRACE_DIR``, traced through pdtrace's vLLM plugin) and
the report it prints are checked on the unshifted run of
``tests/analysis/test_lab_skew.py``, which is that call: one lab start for both.
"""
from __future__ import annotations

from pdtrace.connector.lab.run import LabOptions, activation, no_report_reason


def test_no_report_reasons_and_activation():
    assert no_report_reason(LabOptions(connector="traced", trace=True)) is None
    assert no_report_reason(LabOptions(connector="stock", trace=True)) is None  # the plugin traces it
    assert "--no-trace" in no_report_reason(LabOptions(connector="traced", trace=False))
    assert "--no-trace" in no_report_reason(LabOptions(connector="stock", trace=False))
    assert [activation(LabOptions(connector=c, trace=t)) for c, t in
            (("stock", True), ("traced", True), ("stock", False))] == ["plugin", "explicit", None]
