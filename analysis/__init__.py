"""pdtrace's analysis: the SQL views over a span store, and the one way to open one.

``pdtrace.analysis.open(directory, cache=True, read_only=True) -> Session`` (:mod:`.session`) is how
the CLI, the dashboard, the lab's report and the benchmarks open a trace. Under it: :mod:`.db` (the
refresh engine), :mod:`.materialize` (its incremental steps), :mod:`.cache` (cache files and the
library template), :mod:`.files` (which store files to read or skip), :mod:`.sandbox` (the read-only
rule), :mod:`.loader` (the SQL library in ``sql/``).
"""
from .session import Session, open

__all__ = ["Session", "open"]
