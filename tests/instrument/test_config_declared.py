"""Every ``PDTRACE_*`` variable is declared in ``instrument/config.py`` and read only there.

The README says every environment variable pdtrace reads is in
:mod:`pdtrace.instrument.config`. Two scans of the source tree hold it to that:

* every ``PDTRACE_<NAME>`` the code, the tests, the benchmarks or the docs name is in
  :data:`config.VARIABLES` (with its meaning, default and bounds) and in the module's table;
* no product module but ``config.py`` reads one (``os.environ.get``, ``os.getenv``,
  ``env.get``, ``env[...]``): they call :func:`config.raw` (or :func:`config.from_env`).

The scanner itself is checked on a snippet with each kind of read, so a scan that finds
nothing cannot pass by finding nothing anywhere.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdtrace.instrument import config

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("instrument", "connector", "analysis", "dashboard", "cli")
NAME = re.compile(r"\bPDTRACE_[A-Z0-9_]*[A-Z0-9]\b")


def _files(folders, suffixes=(".py",)):
    for folder in folders:
        for p in sorted((ROOT / folder).rglob("*")):
            if p.suffix in suffixes and p.is_file() and ".venv" not in p.parts:
                yield p


def _constants(tree: ast.AST) -> dict[str, str]:
    """Module-level ``NAME = "PDTRACE_..."`` assignments of one module."""
    out = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def env_reads(source: str, known: dict[str, str]) -> list[tuple[int, str]]:
    """(line, variable) of every read of a PDTRACE_* variable in ``source``.

    A read: a call ``<anything>.get(X, ...)`` or ``<anything>.getenv(X, ...)``, or a subscript
    ``<anything>[X]`` in load context, where X is the variable's name as a string constant, a
    module-level constant of ``source`` or, as ``module.NAME``, any module's constant in ``known``.
    """
    tree = ast.parse(source)
    consts = {**known, **_constants(tree)}

    def name_of(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value
        elif isinstance(node, ast.Name):
            v = consts.get(node.id)
        elif isinstance(node, ast.Attribute):
            v = consts.get(node.attr)
        else:
            return None
        return v if v and NAME.fullmatch(v) else None

    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "getenv") and node.args):
            v = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            v = name_of(node.slice)
        else:
            continue
        if v:
            found.append((node.lineno, v))
    return found


def test_the_scanner_finds_each_kind_of_read():
    snippet = (
        "import os\nSW = 'PDTRACE_BAR'\n"
        "a = os.environ.get('PDTRACE_FOO', '')\n"
        "b = os.getenv(SW)\n"
        "c = os.environ['PDTRACE_BAZ']\n"
        "d = extra_env.get(ui.ENV_DIR)\n"
        "os.environ['PDTRACE_SET'] = '1'\n"  # a write, not a read
        "e = dict(os.environ, PDTRACE_CHILD='1')\n"  # setting a child's environment
    )
    assert env_reads(snippet, {"ENV_DIR": "PDTRACE_DASHBOARD_DIR"}) == [
        (3, "PDTRACE_FOO"), (4, "PDTRACE_BAR"), (5, "PDTRACE_BAZ"), (6, "PDTRACE_DASHBOARD_DIR")]


def test_every_named_variable_is_declared():
    named: dict[str, list[str]] = {}
    for p in _files(PRODUCT + ("tests", "benchmarks", "docs", ".ci"), (".py", ".md", ".sql", "")):
        if p.resolve() == Path(__file__).resolve():
            continue  # this file's made-up names
        text = p.read_text(errors="replace")
        for m in NAME.finditer(text):
            named.setdefault(m.group(0), []).append(f"{p.relative_to(ROOT)}")
    for p in (ROOT / "README.md", ROOT / "BENCHMARKS.md"):
        for m in NAME.finditer(p.read_text()):
            named.setdefault(m.group(0), []).append(p.name)
    assert "PDTRACE_DIR" in named and len(named) >= 20  # the scan saw the tree
    missing = {k: sorted(set(v))[:3] for k, v in named.items() if k not in config.VARIABLES}
    assert not missing, f"named but not declared in instrument/config.py VARIABLES: {missing}"


def test_every_declared_variable_is_in_the_modules_table():
    doc = config.__doc__
    assert [n for n in config.VARIABLES if f"``{n}``" not in doc] == []
    for v in config.VARIABLES.values():
        assert v.meaning and v.bounds and v.scope in ("recorder", "analysis", "dashboard", "lab", "test"), v


def test_no_product_module_but_config_reads_one():
    trees = {p: ast.parse(p.read_text()) for p in _files(PRODUCT)}
    known = {}
    for t in trees.values():
        known.update({k: v for k, v in _constants(t).items() if NAME.fullmatch(v)})
    assert "ENV_SWITCH" in known  # the lab's switches are seen as constants
    reads = {f"{p.relative_to(ROOT)}:{line}": v for p in trees if p.name != "config.py"
             for line, v in env_reads(p.read_text(), known)}
    assert reads == {}, f"read outside instrument/config.py (use config.raw): {reads}"


@pytest.mark.parametrize("name", ["PDTRACE_NOT_A_VARIABLE", "HOME"])
def test_raw_refuses_an_undeclared_name(name):
    with pytest.raises(KeyError, match="not declared"):
        config.raw(name)


def test_raw_reads_the_given_environment():
    assert config.raw("PDTRACE_CACHE_DIR", {"PDTRACE_CACHE_DIR": "/x"}) == "/x"
    assert config.raw("PDTRACE_CACHE_DIR", {"PDTRACE_CACHE_DIR": ""}) is None
    assert config.raw("PDTRACE_CACHE_DIR", {}) is None
