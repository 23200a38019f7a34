"""Fixtures of the analysis tests: a hand-built Case written to a fresh store and analysed
(the row helper `one` is in pdtrace_case_builder: a conftest name is not importable beside tests/lab's)."""
import pytest

from pdtrace.analysis import db


@pytest.fixture
def analyse(tmp_path):
    """Write a Case to a fresh directory and return an open, refreshed in-memory Trace."""
    opened = []

    def run(case, directory=None):
        d = directory or (tmp_path / f"store{len(opened)}")
        case.write(d)
        tr = db.open_trace(d)
        opened.append(tr)
        return tr

    yield run
    for tr in opened:
        tr.close()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh PDTRACE_CACHE_DIR (default caches and library templates) under the test's tmp_path."""
    root = tmp_path / "cache-root"
    monkeypatch.setenv("PDTRACE_CACHE_DIR", str(root))
    return root
