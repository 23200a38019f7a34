"""A trace's cache file: where it lives, what it was built with, and how a new one starts.

The analysis keeps one DuckDB file per trace directory (:func:`default_cache_path`, under
:func:`cache_root`) so a second look at a growing trace is warm. A cache records the
:func:`library_stamp` it was built with (cache format, SQL library hash, stage vocabulary hash); one with another stamp is
rebuilt. A new cache file, and a new in-memory database, starts as a copy of the library template
(:func:`library_template`, :mod:`pdtrace.analysis.template`, written in :func:`cache_root` by
whichever needs it first): the SQL library installed once per user, library, vocabulary and
DuckDB version, instead of loading every module on each cold open.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import duckdb

from pdtrace.instrument import config
from pdtrace.instrument import stages as _stages

from . import loader
from . import template as _template


#: Version of the cache layout beyond the SQL text (bump to force rebuilds).
CACHE_FORMAT = "1"


def _vocab_text(docs: bool = False) -> str:
    """The stage and event vocabulary as text (stage, role, category; event names), with each
    stage's and event's documentation when ``docs``."""
    return (repr(sorted((k, v.role, v.category) + ((v.doc,) if docs else ()) for k, v in _stages.STAGES.items()))
            + repr(sorted(_stages.EVENTS.items() if docs else _stages.EVENTS)))


def _vocab_hash() -> str:
    """sha256 (16 hex) of the stage and event vocabulary a cache was built with.

    The vocabulary is loaded into the cache (``_stage_vocab``) and fixes the
    ``_stage_name`` ENUM; a cache built with another vocabulary is rebuilt.
    """
    return hashlib.sha256(_vocab_text().encode()).hexdigest()[:16]


def library_stamp() -> str:
    """What a cache was built with: cache format, SQL library hash, stage vocabulary hash."""
    return f"{CACHE_FORMAT}:{loader.library_hash()}:{_vocab_hash()}"


def install(con: duckdb.DuckDBPyConnection, stamp: str) -> None:
    """Load the vocabulary and every SQL module into the empty database ``con``; record ``stamp``.

    Raises RuntimeError naming the module whose SQL fails to load.
    """
    con.execute("CREATE TABLE IF NOT EXISTS _meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
    con.execute(loader.base_tables_sql())
    # one statement per table (executemany runs one per row)
    stages = list(_stages.STAGES.items())
    con.execute("DELETE FROM _stage_vocab")
    con.execute("INSERT INTO _stage_vocab SELECT unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), "
                "unnest(?::VARCHAR[])", [[k for k, _ in stages], [v.role for _, v in stages],
                                         [v.category for _, v in stages], [v.doc for _, v in stages]])
    con.execute("DELETE FROM _event_vocab")
    con.execute("INSERT INTO _event_vocab SELECT unnest(?::VARCHAR[]), unnest(?::VARCHAR[])",
                [list(_stages.EVENTS), list(_stages.EVENTS.values())])
    for mod in loader.load_order():
        try:
            con.execute(mod.text)
        except duckdb.Error as exc:
            raise RuntimeError(f"SQL module {mod.name} failed to load: {exc}") from exc
    con.execute("INSERT OR REPLACE INTO _meta VALUES ('library', ?)", [stamp])


def cache_root() -> Path:
    """Where default caches and library templates live: ``$PDTRACE_CACHE_DIR``, else ``<tmp>/pdtrace-cache``
    (created if missing; raises OSError when it cannot be)."""
    root = Path(config.raw("PDTRACE_CACHE_DIR") or Path(tempfile.gettempdir()) / "pdtrace-cache")
    root.mkdir(parents=True, exist_ok=True)
    return root


def library_template(stamp: str | None = None) -> Path:
    """The library template (:mod:`pdtrace.analysis.template`) for ``stamp`` (default: this library's):
    ``<cache_root()>/pdtrace-library-<16 hex>.duckdb``, keyed by everything its contents depend on: the
    stamp, the stage and event vocabulary with its documentation, the DuckDB version (a file is
    readable by the storage version that wrote it) and the user (a template is never shared). Other
    versions' templates stay (about 2 MB each) until the directory is cleaned. Raises OSError when
    the cache root cannot be created.
    """
    key = hashlib.sha256(f"{stamp or library_stamp()}:{duckdb.__version__}:{os.getuid()}:{_vocab_text(docs=True)}".encode())
    key = key.hexdigest()[:16]
    return cache_root() / f"pdtrace-library-{key}.duckdb"


def _stamp_check(stamp: str):
    """A template copy's check: its library stamp is ``stamp``."""
    def check(con: duckdb.DuckDBPyConnection) -> bool:
        row = con.execute("SELECT value FROM _meta WHERE key = 'library'").fetchone()
        return row is not None and row[0] == stamp
    return check


def _from_template(copy, target, stamp: str) -> bool:
    """``copy(target, template, build, check)`` with this library's template, build and stamp check;
    False when the template's path cannot be made (the cache root cannot be created)."""
    try:
        tpl = library_template(stamp)
    except OSError:
        return False
    return copy(target, tpl, lambda con: install(con, stamp), _stamp_check(stamp))


def new_from_template(cache: Path, stamp: str) -> bool:
    """Create the absent ``cache`` as a copy of the library template (True), or leave it to the caller
    to install the library (False: see :func:`pdtrace.analysis.template.copy_into`)."""
    return _from_template(_template.copy_into, cache, stamp)


def memory_from_template(con: duckdb.DuckDBPyConnection, stamp: str) -> bool:
    """Fill the new in-memory database ``con`` from the library template (True), or leave it to the
    caller to open a new connection and install the library (False: see
    :func:`pdtrace.analysis.template.copy_to_memory`)."""
    return _from_template(_template.copy_to_memory, con, stamp)



def default_cache_path(directory: str | os.PathLike) -> Path:
    """Cache file for ``directory``: :func:`cache_root`/pdtrace-<16 hex of sha256(resolved path)>.duckdb."""
    key = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]
    return cache_root() / f"pdtrace-{key}.duckdb"
