"""The Spark engine gives DuckDB's answers, row for row, on every hand-built bug-case store.

Every test of ``tests/analysis/test_*_cases.py`` that takes only the ``analyse`` fixture keeps the
stores it wrote and DuckDB's answers there (``analyse`` in ``tests/analysis/conftest.py``, when this
module is in the session; it then runs after the last bug-case test; a case not run in the session is
run here, its assertions as usual, on the DuckDB engine); then each store is analysed again by
:class:`pdtrace.analysis.spark.SparkTrace` (Spark local mode, real tasks) and every materialized table
and every public view is compared with DuckDB's: same rows, floats within 1e-9 relative.
Needs pyspark and Java: skipped without them, a failure under ``PDTRACE_LAB_REQUIRED=1`` (CI).
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from answers import answers, differences
from pdtrace.analysis import db

HERE = Path(__file__).resolve().parent


def _case_tests():
    """(module name, test function) of every bug-case test that takes only ``analyse``."""
    found = []
    for path in sorted(HERE.glob("test_*_cases.py")):
        mod = importlib.import_module(path.stem)
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("test_") and callable(fn) and list(inspect.signature(fn).parameters) == ["analyse"]:
                found.append((path.stem, fn))
    return found


@pytest.fixture(scope="module")
def case_stores(tmp_path_factory, spark, case_stores_kept):
    """Every bug-case test's stores and DuckDB's answers there: [(test id, store directory, answers)].

    Taken from what this session's bug-case tests kept (``case_stores_kept``: their stores, analysed by the
    tests themselves); a case test not run in this session (this module run alone, ``-k``) is run here
    once, keeping each store it writes."""
    root = tmp_path_factory.mktemp("cases")
    stores = []
    for mod, fn in _case_tests():
        key = f"{mod}.{fn.__name__}"
        if key in case_stores_kept:
            stores += [(f"{key}[{i}]", d, duck) for i, (d, duck) in enumerate(case_stores_kept[key])]
            continue
        opened = []

        def analyse(case, directory=None, _id=key):
            d = Path(directory) if directory else root / f"{_id}-{len(opened)}"
            case.write(d)
            tr = db.open_trace(d, cache=root / f"{d.name}.duckdb")  # (a template copy: no library load)
            opened.append((tr, d))
            return tr

        try:
            fn(analyse)
            for i, (tr, d) in enumerate(opened):
                stores.append((f"{key}[{i}]", d, answers(tr.con)))
        finally:
            for tr, _ in opened:
                tr.close()
    return stores


def test_every_bug_case_store_gives_duckdbs_answer(spark, case_stores):
    """Two stores at a time, each its own :class:`SparkTrace` on the one session (one store's driver-side
    DuckDB work overlaps the other's Spark tasks: 1.9 s a store alone, 1.2 s two at a time, on 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    from pdtrace.analysis.spark import SparkTrace

    assert len(case_stores) >= 70, f"only {len(case_stores)} bug-case stores found"

    def compare(store):
        test_id, d, duck = store
        with SparkTrace(d, spark=spark, cache=d.parent / f"{d.name}.spark.duckdb") as b:
            b.refresh()
            return test_id, b.spark_stats.get("batches", 0) > 1, differences(duck, b.con)

    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(compare, case_stores))
    failed = {test_id: diff[:3] for test_id, _, diff in results if diff}
    multi = sum(m for _, m, _ in results)
    assert not failed, failed
    assert multi > len(case_stores) // 2, "most stores should run in more than one Spark task"


def test_batches_split_across_tasks_give_the_same_rows(spark, tmp_path):
    """A store of many requests, cut into tiny batches (3 requests per Spark task), equals one pass."""
    from pdtrace.analysis.spark import SparkTrace

    from pdtrace_case_builder import Case

    Case().pull_requests(24).write(tmp_path / "s")
    with db.open_trace(tmp_path / "s") as a:
        tr = SparkTrace(tmp_path / "s", spark=spark)
        tr.batch_requests = 3
        with tr:
            tr.refresh()
            assert tr.spark_stats["batches"] >= 8
            assert tr.spark_stats["requests"] == 24
            assert differences(a.con, tr.con) == []
            assert a.con.execute("SELECT count(*) FROM requests").fetchone()[0] == 24


def test_a_culprit_in_another_file_is_found_whatever_the_batching(spark, tmp_path):
    """ttft_segments' culprit (DESIGN.md §4): request A waits in prefill.queue on p0; B's prefill.compute
    on p0 ends during the wait, written in another file (another rotation). One pass, batches of one
    request (each reading only its own files) and Spark's tasks all name B."""
    from pdtrace.analysis.spark import SparkTrace

    from pdtrace_case_builder import Case

    d = tmp_path / "s"
    a = Case()
    a.router_request("A", 0, 200, "pull", first_token_ms=150, last_token_ms=190)
    a.span("prefill", "prefill.queue", 1, 50, rid="A", engine="p0")
    a.span("prefill", "prefill.compute", 50, 100, rid="A", engine="p0")
    a.write(d, prefix="a-")
    b = Case()
    b.router_request("B", 0, 60, "pull", first_token_ms=50, last_token_ms=58)
    b.span("prefill", "prefill.compute", 5, 40, rid="B", engine="p0")
    b.write(d, prefix="b-")
    sql = "SELECT culprit_request_id AS r, culprit_kind AS k FROM _segment_culprits"
    with db.Trace(d) as one, db.Trace(d) as batched, SparkTrace(d, spark=spark) as sp:
        batched.batch_requests = 1
        for tr in (one, batched, sp):
            tr.refresh()
            assert tr.query(sql) == [{"r": "B", "k": "batch_slot"}]
        assert sp.spark_stats["batches"] == 2
        assert differences(one.con, sp.con) == [] and differences(one.con, batched.con) == []
