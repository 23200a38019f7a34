"""Fixtures of the analysis tests: a hand-built Case written to a fresh store and analysed
(the row helper `one` is in pdtrace_case_builder: a conftest name is not importable beside tests/lab's)."""
import inspect
from pathlib import Path

import pytest

from pdtrace.analysis import db


#: The bug-case stores the Spark equality test compares (``tests/analysis/test_spark_equality.py``):
#: ``stores`` = {"<case module>.<test>": [(store directory, DuckDB's answers there)]}, kept by ``analyse`` at the
#: end of each bug-case test that takes only ``analyse``, when ``keep`` (that test is selected in the session
#: and pyspark and Java are here: :func:`pytest_collection_modifyitems`). So no case runs twice.
CASE_STORES: dict = {"keep": False, "stores": {}}
_HERE = Path(__file__).resolve().parent


def _spark_equality(item) -> bool:
    return item.path.name == "test_spark_equality.py"


def _bug_case_module(path: Path) -> bool:
    """A bug-case test module: ``tests/analysis/test_*_cases.py``."""
    return path.name.startswith("test_") and path.name.endswith("_cases.py") and path.parent.resolve() == _HERE


@pytest.hookimpl(trylast=True)  # after pytest's own -k / -m deselection
def pytest_collection_modifyitems(config, items):
    """With the Spark equality test selected (and Spark runnable): the bug-case tests keep their stores and
    DuckDB's answers for it, and it runs after the last bug-case test (``test_*_cases.py``)."""
    spark = [it for it in items if _spark_equality(it)]
    if not spark:
        return
    from answers import spark_available
    CASE_STORES["keep"] = spark_available()
    rest = [it for it in items if not _spark_equality(it)]
    last = max((i for i, it in enumerate(rest) if _bug_case_module(it.path)), default=None)
    if last is not None:
        items[:] = rest[:last + 1] + spark + rest[last + 1:]


@pytest.fixture(scope="session")
def case_stores_kept() -> dict:
    """{"<case module>.<test>": [(store directory, DuckDB's answers)]} kept by this session's bug-case tests
    (empty unless the Spark equality test is in the session; see :data:`CASE_STORES`)."""
    return CASE_STORES["stores"]


@pytest.fixture
def analyse(tmp_path, tmp_path_factory, request):
    """Write a Case to a fresh directory and return an open, refreshed in-memory Trace.

    At the end of a bug-case test that takes only this fixture, its stores and DuckDB's answers are kept for
    the Spark equality test when :data:`CASE_STORES` says so (the stores then go to a session temporary
    directory, which no tmp_path retention policy removes before the session ends)."""
    keep = (CASE_STORES["keep"] and _bug_case_module(request.path)
            and list(inspect.signature(request.function).parameters) == ["analyse"])
    root = tmp_path_factory.mktemp("case") if keep else tmp_path
    opened = []

    def run(case, directory=None):
        d = directory or (root / f"store{len(opened)}")
        case.write(d)
        tr = db.open_trace(d)
        opened.append((tr, d))
        return tr

    yield run
    try:
        if keep:
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
