"""The Spark engine gives DuckDB's answers, row for row, on every hand-built bug-case store.

Every test of ``tests/analysis/test_*_cases.py`` that takes only the ``analyse`` fixture is run
here with an ``analyse`` that also keeps the store it wrote (the test's own assertions run as
usual, on the DuckDB engine); then each store is analysed again by
:class:`pdtrace.analysis.spark.SparkTrace` (Spark local mode, real tasks) and every materialized table
and every public view is compared with DuckDB's: same rows, floats within 1e-9 relative.
Needs pyspark and Java: skipped without them, a failure under ``PDTRACE_LAB_REQUIRED=1`` (CI).
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import shutil
from pathlib import Path

import pytest

from pdtrace.analysis import db
from pdtrace.analysis.materialize import materializations

HERE = Path(__file__).resolve().parent


def _require_spark():
    if shutil.which("java") is None or importlib.util.find_spec("pyspark") is None:
        msg = "the Spark engine needs pyspark (pip install -e '.[spark]') and Java 17 (openjdk-17-jre-headless)"
        if os.environ.get("PDTRACE_LAB_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def spark():
    _require_spark()
    from pdtrace.analysis import spark as _spark

    s = _spark.session("local[2]")
    yield s
    s.stop()


def _norm(v):
    """A value in a comparable form: floats kept for the tolerance check, containers recursively."""
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _sort_key(row):
    return repr(tuple(round(x, 6) if isinstance(x, float) and math.isfinite(x) else x for x in row))


def relations(con) -> list[str]:
    """Every materialized table and every public view of the library, by name."""
    views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal AND NOT "
                                       "starts_with(view_name, '_') AND database_name = current_database() "
                                       "ORDER BY 1").fetchall()]
    return [m.table for m in materializations() if m.kind != "scratch"] + views


def answers(con) -> dict[str, list]:
    """Every relation's rows (:func:`relations`), normalized and sorted: {name: rows}."""
    return {rel: sorted((_norm(r) for r in con.execute(f"SELECT * FROM {rel}").fetchall()), key=_sort_key)
            for rel in relations(con)}


def differences(a, b) -> list[str]:
    """The relations whose rows differ between ``a`` and ``b`` (connections, or :func:`answers` of
    them), each with its first differing row; empty when every one is equal."""
    a = a if isinstance(a, dict) else answers(a)
    b = b if isinstance(b, dict) else answers(b)
    out = [f"{rel}: missing" for rel in a if rel not in b]
    for rel in (r for r in a if r in b):
        ra, rb = a[rel], b[rel]
        if len(ra) != len(rb):
            out.append(f"{rel}: {len(ra)} rows vs {len(rb)}")
            continue
        for x, y in zip(ra, rb):
            if not _close(x, y):
                out.append(f"{rel}: {x!r} != {y!r}")
                break
    return out


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
def case_stores(tmp_path_factory, spark):
    """Run every bug-case test once, keeping each store it wrote and DuckDB's answers there:
    [(test id, store directory, answers)]."""
    root = tmp_path_factory.mktemp("cases")
    stores = []
    for mod, fn in _case_tests():
        opened = []

        def analyse(case, directory=None, _id=f"{mod}.{fn.__name__}"):
            d = Path(directory) if directory else root / f"{_id}-{len(opened)}"
            case.write(d)
            tr = db.open_trace(d, cache=root / f"{d.name}.duckdb")  # (a template copy: no library load)
            opened.append((tr, d))
            return tr

        try:
            fn(analyse)
            for i, (tr, d) in enumerate(opened):
                stores.append((f"{mod}.{fn.__name__}[{i}]", d, answers(tr.con)))
        finally:
            for tr, _ in opened:
                tr.close()
    return stores


def test_every_bug_case_store_gives_duckdbs_answer(spark, case_stores):
    from pdtrace.analysis.spark import SparkTrace

    assert len(case_stores) >= 70, f"only {len(case_stores)} bug-case stores found"
    failed = {}
    multi = 0
    for test_id, d, duck in case_stores:
        with SparkTrace(d, spark=spark, cache=d.parent / f"{d.name}.spark.duckdb") as b:
            b.refresh()
            multi += b.spark_stats.get("batches", 0) > 1
            diff = differences(duck, b.con)
            if diff:
                failed[test_id] = diff[:3]
    assert not failed, failed
    assert multi > len(case_stores) // 2, "most stores should run in more than one Spark task"


def test_batches_split_across_tasks_give_the_same_rows(spark, tmp_path):
    """A store of many requests, cut into tiny batches (3 requests per Spark task), equals one pass."""
    from pdtrace.analysis.spark import SparkTrace

    from pdtrace_case_builder import Case

    c = Case()
    for i in range(24):
        t = 10.0 * i
        rid = f"r{i}"
        c.router_request(rid, t, t + 60, "pull", first_token_ms=t + 40, last_token_ms=t + 58)
        c.span("prefill", "prefill.queue", t + 1, t + 5, rid=rid, engine="p0")
        c.span("prefill", "prefill.compute", t + 5, t + 20, rid=rid, engine="p0")
        c.span("decode", "kv.transfer", t + 21, t + 30, rid=rid, engine="d0", attrs={"kv.bytes": 4096})
        c.span("decode", "decode.first_step", t + 31, t + 39, rid=rid, engine="d0")
    c.write(tmp_path / "s")
    with db.open_trace(tmp_path / "s") as a:
        tr = SparkTrace(tmp_path / "s", spark=spark)
        tr.batch_requests = 3
        with tr:
            tr.refresh()
            assert tr.spark_stats["batches"] >= 8
            assert tr.spark_stats["requests"] == 24
            assert differences(a.con, tr.con) == []
            assert a.con.execute("SELECT count(*) FROM requests").fetchone()[0] == 24
