"""pdtrace's own footprint on a traced run: the one line ``pdtrace lab`` prints at its end.

::

    pdtrace footprint: hot_path_share_max=<%> background_ms_per_request=<ms> processes=<n> rss_mib=<MiB> files_per_min=<n>

=============================  =====================================================================
field                          meaning (source)
=============================  =====================================================================
``hot_path_share_max``         the largest hot-path share over the engine threads (every thread of
                               roles prefill and decode that ran a pdtrace hook: the EngineCore
                               thread, the worker's forward thread, the API server's event loop,
                               vLLM's ``nixl-push-writer`` threads): pdtrace's CPU on the thread /
                               the thread's whole CPU over the flush windows in which a pdtrace hook
                               ran, in % (store: view ``thread_cpu``, needs ``PDTRACE_SELF_CPU=1``;
                               ``n/a`` without it)
``background_ms_per_request``  CPU off the engine threads per traced request, ms: every traced
                               process's ``pdtrace-writer`` thread (store: ``processes.writer_cpu_ns``,
                               last flush) plus pdtrace's helper processes (psutil, user + system, read
                               at the end of the run; the store's ``sink_cpu_ns`` when no reading was
                               taken), divided by the traced requests (distinct request ids with a
                               span in the store)
``processes``                  pdtrace's helper processes of the run on the host (psutil: a command line
                               running the module :data:`HELPER_MODULE`: the host's sink of the run's
                               directory, or one descending from the lab's process; :func:`sample_helpers`)
``rss_mib``                    their total resident set size, MiB (psutil)
``files_per_min``              store files created per minute of the run: files created (each helper's
                               highest file sequence number in the names it wrote, see
                               :func:`files_created`) / the run's wall time in minutes
=============================  =====================================================================

One module for the lab (:mod:`pdtrace.connector.lab.run`) and the benchmark
(``benchmarks/cpu_accounting.py``): :func:`sample_helpers` while the run's
processes live, :func:`from_store` after they flushed, :func:`line` to print.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

from pdtrace.instrument import stages

#: Module name in a pdtrace helper process's command line (``python -m pdtrace.instrument.sink``).
HELPER_MODULE = "pdtrace.instrument.sink"

#: Roles whose threads are engine threads (the router is pdtrace's lab router, not an engine).
ENGINE_ROLES = stages.ENGINE_ROLES

_SEQ = re.compile(r"^(?P<prefix>.+)-[a-z](?P<seq>\d{6})\.parquet$")


@dataclasses.dataclass
class Helpers:
    """pdtrace's helper processes at one instant (psutil)."""

    pids: list[int]
    rss_bytes: int         # total resident set size, bytes
    cpu_s: float           # total CPU (user + system) since each started, s
    time_s: float          # time.time() of the reading


@dataclasses.dataclass
class Footprint:
    """The footprint figures (see the module docstring for each)."""

    hot_path_share_max_pct: float | None
    hot_path_thread: str | None          # 'role pid thread' of that share
    background_ms_per_request: float | None
    processes: int
    rss_mib: float
    files_per_min: float
    requests: int
    writer_cpu_s: float
    helper_cpu_s: float
    files_created: int
    run_s: float


def sample_helpers(trace_dir: str | os.PathLike | None = None, root_pid: int | None = None) -> Helpers:
    """Read pdtrace's helper processes on this host now (psutil).

    A process is a helper iff its command line holds :data:`HELPER_MODULE` as
    one argument (``-m pdtrace.instrument.sink``). With neither ``trace_dir``
    nor ``root_pid`` every such process on the host counts; otherwise only
    those that descend from ``root_pid`` (the lab's own process: every engine,
    API server and router are its descendants), the host's sink of
    ``trace_dir`` (detached from the tree: its command line names the directory,
    :func:`pdtrace.instrument.hostsink.find`), or whose environment's
    ``PDTRACE_DIR`` is ``trace_dir``. A process that exits during the scan is
    skipped.
    """
    import psutil

    from pdtrace.instrument import config, hostsink

    td = None if trace_dir is None else os.path.realpath(trace_dir)
    serving = set(hostsink.find(td)) if td is not None else set()  # the host's sink of this directory
    tree: set[int] = set()
    if root_pid is not None:
        try:
            tree = {c.pid for c in psutil.Process(root_pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    pids, rss, cpu = [], 0, 0.0
    for p in psutil.process_iter():
        try:
            if HELPER_MODULE not in p.cmdline():
                continue
            if td is not None or root_pid is not None:
                mine = p.pid in tree or p.pid in serving
                if not mine and td is not None:
                    d = config.raw("PDTRACE_DIR", p.environ())  # another process's environment
                    mine = d is not None and os.path.realpath(d) == td
                if not mine:
                    continue
            with p.oneshot():
                m, t = p.memory_info(), p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        pids.append(p.pid)
        rss += m.rss
        cpu += t.user + t.system
    return Helpers(sorted(pids), rss, cpu, time.time())


def files_created(trace_dir: str | os.PathLike) -> int:
    """Store files the run's helpers created, read from the names in ``trace_dir``.

    A helper numbers every file it writes (part and segment,
    ``<prefix>-<kind><6-digit seq>.parquet``), and its last file (the final
    merge) is still there, so its highest number counts its files, those
    merged and deleted included. A name without that pattern counts as one.
    """
    from pdtrace.instrument import store

    best: dict[str, int] = {}
    other = 0
    for f in store.store_files(trace_dir):
        m = _SEQ.match(f.name)
        if m is None:
            other += 1
            continue
        k = str(f.parent / m["prefix"])
        best[k] = max(best.get(k, 0), int(m["seq"]))
    return sum(best.values()) + other


def store_figures(con) -> dict:
    """The store's part of the footprint, from an analysis connection (views thread_cpu, processes, spans).

    Returns {'threads': [thread_cpu rows as dicts, engine roles only], 'writer_cpu_s',
    'sink_cpu_s' (from the stats rows: the host's sink counted once per host), 'requests', 'records' (written)}.
    """
    cols = ["role", "pid", "thread", "service_name", "busy_windows", "hooks", "pdtrace_ns", "thread_ns",
            "hot_path_share"]
    roles = ", ".join(f"'{r}'" for r in ENGINE_ROLES)
    threads = [dict(zip(cols, r)) for r in con.execute(
        f"SELECT {', '.join(cols)} FROM thread_cpu WHERE role IN ({roles}) ORDER BY role, pid, thread").fetchall()]
    # one sink per host serves every traced process there and each reports the sink's whole CPU:
    # count it once per host (the largest reading: its last; a sink that was restarted counts its last life)
    w, n = con.execute("SELECT coalesce(sum(writer_cpu_ns), 0), coalesce(sum(written), 0) FROM processes").fetchall()[0]
    s = con.execute("SELECT coalesce(sum(m), 0) FROM (SELECT max(sink_cpu_ns) AS m FROM processes GROUP BY host)"
                    ).fetchall()[0][0]
    req = con.execute("SELECT count(DISTINCT request_id) FROM _records WHERE record = 'span' "
                      "AND request_id IS NOT NULL").fetchall()[0][0]
    return {"threads": threads, "writer_cpu_s": w / 1e9, "sink_cpu_s": s / 1e9, "requests": int(req),
            "records": int(n)}


def compute(fig: dict, helpers: Helpers | None, files: int, run_s: float) -> Footprint:
    """Combine the store's figures (:func:`store_figures`), a helper reading and the file count.

    ``run_s``: the run's wall time (s), > 0. Pure: no I/O.
    """
    best = None
    for t in fig["threads"]:
        if t["hot_path_share"] is not None and (best is None or t["hot_path_share"] > best["hot_path_share"]):
            best = t
    helper_cpu = helpers.cpu_s if helpers is not None else fig["sink_cpu_s"]
    bg = (fig["writer_cpu_s"] + helper_cpu) * 1e3 / fig["requests"] if fig["requests"] else None
    return Footprint(
        hot_path_share_max_pct=None if best is None else best["hot_path_share"] * 100,
        hot_path_thread=None if best is None else f"{best['role']} pid {best['pid']} {best['thread']}",
        background_ms_per_request=bg,
        processes=len(helpers.pids) if helpers is not None else 0,
        rss_mib=(helpers.rss_bytes if helpers is not None else 0) / 2**20,
        files_per_min=files / (run_s / 60.0) if run_s > 0 else 0.0,
        requests=fig["requests"], writer_cpu_s=fig["writer_cpu_s"], helper_cpu_s=helper_cpu,
        files_created=files, run_s=run_s)


def line(fp: Footprint) -> str:
    """The footprint line (one line, no newline); ``n/a`` for a figure the run did not measure."""
    share = "n/a" if fp.hot_path_share_max_pct is None else f"{fp.hot_path_share_max_pct:.2f}%"
    bg = "n/a" if fp.background_ms_per_request is None else f"{fp.background_ms_per_request:.1f}"
    return (f"pdtrace footprint: hot_path_share_max={share} background_ms_per_request={bg} "
            f"processes={fp.processes} rss_mib={fp.rss_mib:.0f} files_per_min={fp.files_per_min:.1f}")


_LINE = re.compile(r"^pdtrace footprint: hot_path_share_max=(?P<share>n/a|[0-9.]+%) "
                   r"background_ms_per_request=(?P<bg>n/a|[0-9.]+) processes=(?P<processes>\d+) "
                   r"rss_mib=(?P<rss>\d+) files_per_min=(?P<files>[0-9.]+)$")


def parse(text: str) -> dict | None:
    """The fields of a footprint line (floats; None for n/a), or None if ``text`` is not one."""
    m = _LINE.match(text.strip())
    if m is None:
        return None
    def num(v: str):
        return None if v == "n/a" else float(v.rstrip("%"))
    return {"hot_path_share_max": num(m["share"]), "background_ms_per_request": num(m["bg"]),
            "processes": int(m["processes"]), "rss_mib": float(m["rss"]), "files_per_min": float(m["files"])}


def of_run(trace_dir: str | os.PathLike, helpers: Helpers | None, run_s: float, cache=None) -> Footprint:
    """The footprint of the run whose store is ``trace_dir`` (opens it with :func:`pdtrace.analysis.open`;
    ``cache``: a cache file, default the directory's default cache file)."""
    from pdtrace import analysis

    with analysis.open(trace_dir, cache=cache or True) as s:
        fig = store_figures(s.cursor())
    return compute(fig, helpers, files_created(trace_dir), run_s)


__all__ = ["HELPER_MODULE", "Helpers", "Footprint", "sample_helpers", "files_created", "store_figures", "compute",
           "line", "parse", "of_run"]
