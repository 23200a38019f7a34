"""Every package folder is listed in pyproject.toml, so `pip install .` ships it."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = {"instrument", "connector", "analysis", "dashboard", "cli"}


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for part in PARTS:
        for init in (ROOT / part).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join(("pdtrace",) + rel))
    missing = found - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    for pkg in listed:
        assert cfg["package-dir"].get(pkg) or any(pkg.startswith(k + ".") for k in cfg["package-dir"]), pkg


def test_instrument_imports_no_other_part():
    for f in (ROOT / "instrument").rglob("*.py"):
        src = f.read_text()
        for other in ("pdtrace.connector", "pdtrace.analysis", "pdtrace.dashboard", "vllm"):
            assert f"import {other}" not in src and f"from {other}" not in src, (f, other)
