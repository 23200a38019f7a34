"""The SQL library: ``.sql`` modules in ``pdtrace/analysis/sql/``, loaded in dependency order.

One file is one module, named by its file stem (``ttft_segments.sql`` is module
``ttft_segments``). A module only *defines* (views, macros, and the empty
``_mat_*`` tables behind materialized views); it never computes on load. Its
header declares, in SQL comments::

    -- module: ttft_segments
    -- requires: request_base, stages
    -- materialize: ttft_segments request

A view that shares columns with another can take their documentation
instead of repeating it::

    -- comments-like: summary_by_mode -> summary_by_window, summary_by_prompt_bucket
    -- comments-like: decode_stall_causes (engine_id, step_id) -> decode_stalls

copies the module's ``COMMENT ON COLUMN summary_by_mode.<col>`` statements
(all of them, or only the listed columns) to each target view; a column the
target documents itself keeps its own comment. The copies are appended to the
module's text when it is read (so they are part of :func:`library_hash`).

``requires`` lists the modules that must be loaded first. ``materialize: NAME
KIND`` says that view ``NAME`` reads table ``_mat_NAME``, filled from view
``_calc_NAME`` by :mod:`pdtrace.analysis.materialize` on refresh: ``full`` recomputes the
whole table, ``request`` only the request keys in ``_scope_keys``; ``scratch``
holds an intermediate step for the refreshed requests only and is emptied
after the refresh (read by several later steps, so computed once); ``file``
holds what each store file's own rows give (partial aggregates that views
merge across files, keyed by ``_file``): ``_calc_NAME`` reads ``_file_rows``,
which a refresh points at the new files only (or an earlier ``file`` table's
rows of the files listed in ``_read_files``), and a vanished file's rows are
deleted, so absorbing a file never rescans the others. ``changed`` keeps rows
keyed by request (``rkey``) that depend only on the request's own rows, as
the ``file`` tables hold them: it recomputes the keys in ``_changed_keys``
(those of the files added or removed; every key on a cold build) and may read
``file`` tables only. ``window`` rolls a ``changed`` table that has a
``window_idx`` column up per window: it recomputes the windows listed in
``_changed_windows`` (those holding rows of the changed keys, before or after
the change; every window on a cold build). ``file`` tables are refreshed
first, then ``changed``, then ``window``, then ``full``, then
``request``/``scratch``.

``_tables.sql`` (no header) creates the base tables the connection module
fills; it runs before every module.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib import resources

_HEADER = re.compile(r"^--\s*(module|requires|materialize):(.*)$", re.MULTILINE)
_LIKE = re.compile(r"^--\s*comments-like:\s*(\w+)\s*(?:\(([^)]*)\))?\s*->\s*(.+)$", re.MULTILINE)
_COLUMN_COMMENT = re.compile(r"^COMMENT ON COLUMN (\w+)\.(\w+) IS ('(?:[^']|'')*');$", re.MULTILINE)


def expand_comments(text: str) -> str:
    """``text`` with the column comments its ``-- comments-like:`` lines ask for appended.

    Raises ValueError when a source view has no column comments in ``text``
    or a listed column is not commented on the source.
    """
    extra: list[str] = []
    own = {(v, c) for v, c, _ in _COLUMN_COMMENT.findall(text)}
    for src, cols, targets in _LIKE.findall(text):
        docs = {c: doc for v, c, doc in _COLUMN_COMMENT.findall(text) if v == src}
        if not docs:
            raise ValueError(f"comments-like: view {src} has no column comments in this module")
        wanted = [c.strip() for c in cols.split(",") if c.strip()] if cols else list(docs)
        missing = [c for c in wanted if c not in docs]
        if missing:
            raise ValueError(f"comments-like: {src} does not comment {', '.join(missing)}")
        for tgt in (t.strip() for t in targets.split(",")):
            extra += [f"COMMENT ON COLUMN {tgt}.{c} IS {docs[c]};" for c in wanted if (tgt, c) not in own]
    return text if not extra else text.rstrip("\n") + "\n-- (copied by comments-like)\n" + "\n".join(extra) + "\n"


@dataclass(frozen=True)
class Module:
    """One SQL module: name, declared dependencies, materializations [(view, kind)], text."""

    name: str
    requires: tuple[str, ...]
    materialize: tuple[tuple[str, str], ...]
    text: str = field(repr=False)


def _sql_dir():
    return resources.files("pdtrace.analysis.sql")


def read_module(name: str, text: str) -> Module:
    """Parse a module's header. Raises ValueError when ``-- module:`` is missing or differs from ``name``,
    or a materialize line is not ``NAME full|request|scratch|file|changed|window``."""
    requires: list[str] = []
    mats: list[tuple[str, str]] = []
    declared = None
    for key, value in _HEADER.findall(text):
        value = value.strip()
        if key == "module":
            declared = value
        elif key == "requires":
            requires += [v.strip() for v in value.split(",") if v.strip()]
        else:
            parts = value.split()
            if len(parts) != 2 or parts[1] not in ("full", "request", "scratch", "file", "changed", "window"):
                raise ValueError(f"module {name}: bad materialize line {value!r}")
            mats.append((parts[0], parts[1]))
    if declared != name:
        raise ValueError(f"module file {name}.sql declares module {declared!r}")
    return Module(name, tuple(requires), tuple(mats), expand_comments(text))


#: The modules last read: ((file name, mtime_ns, size) of every module file, {name: Module}).
_read_cache: tuple[tuple, dict[str, "Module"]] | None = None


def modules() -> dict[str, Module]:
    """All modules of the library by name (files not starting with ``_``), as a new dict.

    The files are read on every call, parsed again only when their text changed (the directory
    and every file's name and text are the cache key): a refresh asks for the modules'
    materializations a dozen times and parsing them all takes ~25 ms (the ``comments-like``
    expansion), reading them well under that.
    """
    global _read_cache
    d = _sql_dir()
    entries = sorted((e.name, e.read_text()) for e in d.iterdir()
                     if e.name.endswith(".sql") and not e.name.startswith("_"))
    key = (str(d), tuple(entries))
    if _read_cache is not None and _read_cache[0] == key:
        return dict(_read_cache[1])
    out = {name[:-4]: read_module(name[:-4], text) for name, text in entries}
    _read_cache = (key, out)
    return dict(out)


def load_order(mods: dict[str, Module] | None = None) -> list[Module]:
    """Modules in an order where each comes after what it requires (ties by name).

    Raises ValueError for an unknown dependency or a cycle.
    """
    mods = modules() if mods is None else mods
    done: list[Module] = []
    state: dict[str, int] = {}

    def visit(name: str, via: str) -> None:
        if name not in mods:
            raise ValueError(f"module {via} requires unknown module {name!r}")
        s = state.get(name)
        if s == 2:
            return
        if s == 1:
            raise ValueError(f"module dependency cycle through {name!r}")
        state[name] = 1
        for dep in mods[name].requires:
            visit(dep, name)
        state[name] = 2
        done.append(mods[name])

    for name in sorted(mods):
        visit(name, name)
    return done


def with_requirements(names, mods: dict[str, Module] | None = None) -> list[Module]:
    """The modules ``names`` and every module they require (``-- requires:``, transitively), in load
    order (:func:`load_order` of that set): what loading them into a fresh database takes.

    Raises ValueError for an unknown module name or dependency, or a dependency cycle.
    """
    mods = modules() if mods is None else mods
    need: set[str] = set()
    todo = [(n, None) for n in names]
    while todo:
        name, via = todo.pop()
        if name in need:
            continue
        if name not in mods:
            raise ValueError(f"unknown module {name!r}" if via is None else f"module {via} requires unknown module {name!r}")
        need.add(name)
        todo += [(dep, name) for dep in mods[name].requires]
    return load_order({n: mods[n] for n in need})


def base_tables_sql() -> str:
    """Text of ``_tables.sql``: idempotent CREATE TABLE IF NOT EXISTS statements."""
    return (_sql_dir() / "_tables.sql").read_text()


def library_hash() -> str:
    """sha256 over every module's text: a cache built with other SQL must be rebuilt."""
    h = hashlib.sha256(base_tables_sql().encode())
    for m in load_order():
        h.update(m.name.encode() + b"\0" + m.text.encode())
    return h.hexdigest()


def materializations() -> list[tuple[str, str]]:
    """[(view name, 'full'|'request'|'scratch'|'file'|'changed'|'window')] in load order."""
    return [mat for m in load_order() for mat in m.materialize]
