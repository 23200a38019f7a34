"""Fixtures of the analysis tests: a hand-built Case written to a fresh store and analysed
(the row helper `one` is in pdtrace_case_builder: a conftest name is not importable beside tests/lab's)."""
import inspect
from pathlib import Path

import pytest

from pdtrace.analysis import db


#: The bug-case stores the Spark equality test compares (``tests/analysis/test_spark_equality.py``):
#: ``stores`` = {"<case module>.<test>": [(store directory, DuckDB's answers there)]}, kept by ``analyse`` at the
#: end of each bug-case test that takes only ``analyse``, when ``keep`` (that test module is in the session
#: and pyspark and Java are here: :func:`pytest_collection_modifyitems`). So no case runs twice.
CASE_STORES: dict = {"keep": False, "stores": {}}


def _spark_equality(item) -> bool:
    return item.path.name == "test_spark_equality.py"


def pytest_collection_modifyitems(config, items):
    """With the Spark equality test selected (and Spark runnable): the bug-case tests keep their stores and
    DuckDB's answers for it, and it runs after the last bug-case test (``test_*_cases.py``)."""
    spark = [it for it in items if _spark_equality(it)]
    if not spark:
        return
    from answers import spark_available
    CASE_STORES["keep"] = spark_available()
    rest = [it for it in items if not _spark_equality(it)]
    last = max((i for i, it in enumerate(rest) if it.path.name.endswith("_cases.py")), default=None)
    if last is not None:
        items[:] = rest[:last + 1] + spark + rest[last + 1:]


@pytest.fixture(scope="session")
def case_stores_kept() -> dict:
    """{"<case module>.<test>": [(store directory, DuckDB's answers)]} kept by this session's bug-case tests
    (empty unless the Spark equality test is in the session; see :data:`CASE_STORES`)."""
    return CASE_STORES["stores"]


@pytest.fixture
def analyse(tmp_path, request):
    """Write a Case to a fresh directory and return an open, refreshed in-memory Trace.

    At the end of a bug-case test that takes only this fixture, its stores and DuckDB's answers are kept for
    the Spark equality test when :data:`CASE_STORES` says so."""
    opened = []

    def run(case, directory=None):
        d = directory or (tmp_path / f"store{len(opened)}")
        case.write(d)
        tr = db.open_trace(d)
        opened.append((tr, d))
        return tr

    yield run
    try:
        if (CASE_STORES["keep"] and request.path.name.endswith("_cases.py")
                and list(inspect.signature(request.function).parameters) == ["analyse"]):
            from answers import answers
            CASE_STORES["stores"][f"{request.path.stem}.{request.function.__name__}"] = \
                [(Path(d), answers(tr.con)) for tr, d in opened]
    finally:
        for tr, _ in opened:
            tr.close()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh PDTRACE_CACHE_DIR (default caches and library templates) under the test's tmp_path."""
    root = tmp_path / "cache-root"
    monkeypatch.setenv("PDTRACE_CACHE_DIR", str(root))
    return root
