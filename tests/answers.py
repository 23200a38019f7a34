"""Comparing two analyses of one store, relation by relation (the Spark engine against DuckDB), and the
gate of the tests that need Spark.

Importable from any test module as ``import answers`` (``tests/`` is on ``sys.path``, as for ``labkit``).
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil

import pytest

from pdtrace.analysis.materialize import materializations


def spark_available() -> bool:
    """True when pyspark is installed and a ``java`` is on PATH (what the Spark engine needs)."""
    return shutil.which("java") is not None and importlib.util.find_spec("pyspark") is not None


def require_spark() -> None:
    """Skip the calling test without pyspark or Java, or fail it under ``PDTRACE_LAB_REQUIRED=1`` (CI)."""
    if not spark_available():
        msg = "the Spark engine needs pyspark (pip install -e '.[spark]') and Java 17 (openjdk-17-jre-headless)"
        if os.environ.get("PDTRACE_LAB_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def _norm(v):
    """A value in a comparable form: maps as sorted pairs, containers as tuples (floats kept for :func:`_close`)."""
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _close(a, b) -> bool:
    """Equal, floats within 1e-9 relative (NaN equals NaN), recursively through tuples."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _sort_key(row):
    """Rows sorted with floats rounded to 6 digits, so that 1e-9 differences do not reorder them."""
    return repr(tuple(round(x, 6) if isinstance(x, float) and math.isfinite(x) else x for x in row))


def relations(con) -> list[str]:
    """Every materialized table (scratch steps excepted: empty after a refresh) and every public view."""
    views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal AND NOT "
                                       "starts_with(view_name, '_') AND database_name = current_database() "
                                       "ORDER BY 1").fetchall()]
    return [m.table for m in materializations() if m.kind != "scratch"] + views


def answers(con, skip: tuple[str, ...] = ()) -> dict[str, list]:
    """Every relation's rows (:func:`relations` but ``skip``), normalized and sorted: {name: rows}."""
    return {rel: sorted((_norm(r) for r in con.execute(f"SELECT * FROM {rel}").fetchall()), key=_sort_key)
            for rel in relations(con) if rel not in skip}


def differences(a, b, skip: tuple[str, ...] = ()) -> list[str]:
    """The relations whose rows differ between ``a`` and ``b`` (connections, or :func:`answers` of
    them), each with its first differing row; empty when every one is equal."""
    a = a if isinstance(a, dict) else answers(a, skip)
    b = b if isinstance(b, dict) else answers(b, skip)
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


def same_within(a, b) -> bool:
    """True when ``a`` and ``b`` (nested dicts, lists and scalars, e.g. ``report.collect`` data) are
    equal, floats within 1e-9 relative."""
    return _close(_norm(a), _norm(b))
