"""pdtrace's analysis: the SQL views over a span store, and the one way to open one.

``pdtrace.analysis.open(directory, cache=True, read_only=True) -> Session`` (:mod:`.session`) is how
the CLI, the dashboard, the lab's report and the benchmarks open a trace. Under it: :mod:`.db` (the
refresh engine), :mod:`.materialize` (its incremental steps), :mod:`.cache` (cache files and the
library template), :mod:`.files` (which store files to read or skip), :mod:`.sandbox` (the read-only
rule), :mod:`.loader` (the SQL library in ``sql/``).
"""
__all__ = ["Session", "open"]


def __getattr__(name: str):
    """``open`` and ``Session`` from :mod:`.session`, imported on first use: importing a light part of
    the analysis (``footprint``, in ``pdtrace lab``) does not load DuckDB and the SQL library."""
    if name in __all__:
        from . import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
