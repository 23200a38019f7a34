"""pdtrace's share of each engine thread's CPU, sampled from outside by py-spy (no clock read in any hook).

    flock /tmp/pdtrace-heavy.lock .venv/bin/python benchmarks/hot_path_sampling.py --mode pull --requests 200
    .venv/bin/python benchmarks/hot_path_sampling.py --profiles DIR [DIR ...]   # re-read runs (pooled per thread)

Runs one lab with the production recipe (vLLM's stock command, tracing switched on by ``PDTRACE_DIR``
alone: the plugin; ``PDTRACE_SAMPLE`` = ``--sample``, default step sampling, ``PDTRACE_SELF_CPU`` off)
and, from just before the replay to just after it, one ``py-spy record --subprocesses --threads
--nonblocking`` per engine (its API server and the EngineCore and worker processes under it) at
``--rate`` samples per second. py-spy reads each thread's Python stack from outside the process and
keeps only samples in which the thread was on a CPU (py-spy's default, no ``--idle``), so a thread's
samples are a random sample of its CPU time.

A sample is **pdtrace's** when the innermost frame of its stack that is not the standard library's
is pdtrace's production code (pdtrace's subpackages but ``connector/lab``). The standard library's
work counts for its caller (pdtrace's hook that reads a clock or pickles is pdtrace's); any other
library's counts for itself: vLLM's own work inside pdtrace's wrapper (the traced connector calls
``super()``), NIXL called by pdtrace's traced agent, starlette and uvicorn inside pdtrace's
middleware are not pdtrace's. Samples owned by the lab's own code (``connector/lab``: its
progress-thread and core-pinning hooks, not shipped to production) are counted apart.

Per thread of each engine process (EngineCore ``MainThread``, the worker's forward thread
``MainThread``, the API server's event loop ``MainThread``, push's ``nixl-push-writer`` threads, ...):
samples, pdtrace's share with a 95 % interval (:func:`block_ci`: a moving-block bootstrap over the
thread's samples in time order, blocks of ``--block``, since hooks recur every engine step; never
narrower than Wilson's), the lab's share, and the pdtrace functions most sampled (:func:`hook`).
Threads with fewer than 20 blocks of samples are listed, not judged. Goal (issue 18): pdtrace ≤ 1 %
of every engine thread's CPU; ``missed`` when one thread's interval lies above it, ``met`` when all
lie at or below it. Unlike ``cpu_accounting.py`` (thread CPU clocks read around every hook,
``PDTRACE_SELF_CPU=1``), nothing is read inside the engine: a clock read cold from cache costs ~10 µs
against ~0.6 µs warm (BENCHMARKS.md "Self-measurement correction"), which the clock method charges
to pdtrace. py-spy's "on a CPU" is the thread state R (running or runnable), so on loaded cores a
thread's samples include run-queue waits, for pdtrace and vLLM alike. ``--nonblocking`` reads a
running process: a stack read that fails is dropped (py-spy's error count, printed per engine).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

GOAL_PCT = 1.0


def _package_dirs() -> list[Path]:
    """The folders of pdtrace's production code (its subpackages, wherever it is installed), without the
    lab harness (``pdtrace.connector.lab``)."""
    import importlib

    dirs = []
    for name in ("instrument", "connector", "analysis", "cli", "dashboard"):
        try:
            mod = importlib.import_module(f"pdtrace.{name}")
        except ImportError:
            continue
        dirs += [Path(p).resolve() for p in getattr(mod, "__path__", [])]
    return dirs


_PDTRACE_DIRS = _package_dirs()
_LAB_DIRS = [d / "lab" for d in _PDTRACE_DIRS if d.name == "connector"]
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_ROOT = _PDTRACE_DIRS[0].parent if _PDTRACE_DIRS else Path.cwd()  # for file names in the output


def classify(path: str) -> str:
    """The kind of a frame's file: ``pdtrace`` (pdtrace's production code), ``lab`` (pdtrace's lab
    harness, ``connector/lab``), ``vllm``, ``std`` (the standard library, code with no file such as
    ``<string>``) or ``lib`` (any other library: NIXL, starlette, uvicorn, torch, ...)."""
    if not path.startswith("/"):  # "<string>", "<frozen ...>"
        return "std"
    p = Path(path).resolve()
    if any(p.is_relative_to(d) for d in _LAB_DIRS):
        return "lab"
    if any(p.is_relative_to(d) for d in _PDTRACE_DIRS):
        return "pdtrace"
    if "site-packages" in p.parts or "dist-packages" in p.parts:
        return "vllm" if "vllm" in p.parts else "lib"
    return "std" if p.is_relative_to(_STDLIB) else "lib"


def owner(stack: list[int], kinds: list[str]) -> str:
    """Who a sample belongs to: the kind of the innermost frame of ``stack`` (frame indices, outermost
    first, as py-spy's speedscope output lists them) that is not the standard library's, else ``std``.
    The standard library's work counts for its caller (pdtrace's hook that pickles is pdtrace's); any
    other library's for itself (NIXL called by pdtrace's traced agent, starlette inside pdtrace's
    middleware: not pdtrace's)."""
    for f in reversed(stack):
        k = kinds[f]
        if k != "std":
            return k
    return "std"


def hook(stack: list[int], kinds: list[str]) -> int:
    """Of a pdtrace-owned sample: the outermost pdtrace frame of the innermost run of pdtrace and
    standard-library frames (the pdtrace function vLLM, or a library, called)."""
    i = len(stack) - 1
    while kinds[stack[i]] == "std":
        i -= 1
    top = i
    while i >= 0 and kinds[stack[i]] in ("pdtrace", "std"):
        if kinds[stack[i]] == "pdtrace":
            top = i
        i -= 1
    return stack[top]


def block_ci(flags: list[int], block: int, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval (percent) of the mean of 0/1 ``flags`` in time order: a moving-block bootstrap
    (blocks of ``block``; Künsch 1989), never narrower than the Wilson score interval (independent
    samples; Wilson 1927), which keeps a share of 0 from an interval of [0, 0]. Callers need
    ``len(flags)`` >= 20 ``block`` for the bootstrap to cover (fewer blocks: too narrow)."""
    n = len(flags)
    if n == 0:
        return (float("nan"), float("nan"))
    b = max(1, min(block, n))
    pre = [0]
    for x in flags:
        pre.append(pre[-1] + x)
    starts = n - b + 1
    rng = random.Random(seed)
    k = -(-n // b)
    means = []
    for _ in range(n_boot):
        s = sum(pre[i + b] - pre[i] for i in (rng.randrange(starts) for _ in range(k)))
        means.append(s / (k * b))
    means.sort()
    p, z = pre[-1] / n, 1.96
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (100 * min(means[int(0.025 * n_boot)], c - h), 100 * max(means[int(0.975 * n_boot) - 1], c + h))


def stall_runs(stacks: list[list[int]], flags: list[int], min_len: int) -> list[tuple[int, int]]:
    """(start, length) of every run of at least ``min_len`` consecutive pdtrace samples (``flags``) whose
    stacks are all the same. py-spy keeps only on-CPU samples and no times, so a run is ``min_len`` /
    rate s of the thread's sampled time on one line, not a measured wall time: likelier a thread
    preempted while runnable, or a garbage collection that pdtrace's allocation happened to trigger
    (CPython collects on the allocation that crosses the threshold, whoever makes it), than a pdtrace
    hook's own work (µs)."""
    runs, i, n = [], 0, len(flags)
    while i < n:
        j = i
        while j < n and flags[j] and stacks[j] == stacks[i]:
            j += 1
        if j - i >= min_len:
            runs.append((i, j - i))
        i = max(j, i + 1)
    return runs


def read_profile(path: Path, block: int, stall_len: int = 0) -> list[dict]:
    """One row per (process, thread) of a py-spy speedscope file: samples, pdtrace / lab shares (%), the
    pdtrace interval (%), ``where``: pdtrace's samples by :func:`hook` (``function (file relative to
    the package root)`` -> samples); with ``stall_len`` > 0 also ``stalls`` (runs of
    :func:`stall_runs`) and ``pdtrace_pct_no_stalls`` / ``ci_no_stalls`` (the same with those samples
    left out of both counts)."""
    d = json.loads(path.read_text())
    frames = d["shared"]["frames"]
    kinds = [classify(f.get("file") or "") for f in frames]
    rows = []
    for p in d["profiles"]:
        flags, lab, where = [], 0, {}
        for st in p["samples"]:
            o = owner(st, kinds)
            flags.append(1 if o == "pdtrace" else 0)
            lab += o == "lab"
            if o == "pdtrace":
                f = frames[hook(st, kinds)]
                rel = os.path.relpath(Path(f.get("file") or "").resolve(), _ROOT)
                key = f"{f.get('name')} ({rel})"
                where[key] = where.get(key, 0) + 1
        n = len(flags)
        lo, hi = block_ci(flags, block)
        row = {"profile": p["name"], "samples": n, "pdtrace_pct": 100 * sum(flags) / n if n else None,
               "ci": (lo, hi), "lab_pct": 100 * lab / n if n else None, "lab_samples": lab,
               "where": dict(sorted(where.items(), key=lambda kv: -kv[1])), "_flags": flags}
        if stall_len > 0:
            runs = stall_runs(p["samples"], flags, stall_len)
            drop = {k for a, m in runs for k in range(a, a + m)}
            rest = [f for k, f in enumerate(flags) if k not in drop]
            row["stalls"] = runs
            row["pdtrace_pct_no_stalls"] = 100 * sum(rest) / len(rest) if rest else None
            row["ci_no_stalls"] = block_ci(rest, block)
            row["_rest"] = rest
        rows.append(row)
    return rows


def profile_ids(name: str) -> tuple[int | None, int | None, str]:
    """(pid, tid, thread name) of a py-spy speedscope profile name (``Process 12 Thread 34 "name"``, or
    ``Thread 34 "name"`` without ``--subprocesses``; a thread id may be hex, ``0x7f..``, when py-spy has no
    native id). py-spy sometimes gives no name (``""``): the thread whose id is its process's is then
    ``MainThread``, another ``tid <n>``."""
    head, _, rest = name.partition('"')
    words = head.split()
    num = {}
    for i in range(len(words) - 1):
        try:
            num[words[i]] = int(words[i + 1], 0)
        except ValueError:
            pass
    pid, tid = num.get("Process"), num.get("Thread")
    thread = rest.rpartition('"')[0] if rest else ""
    if not thread:
        thread = "MainThread" if tid is not None and tid == pid else f"tid {tid}"
    return pid, tid, thread


def _titles(pid: int) -> dict[int, str]:
    """pid -> process title of ``pid`` (``API server``) and every process under it (vLLM names its
    EngineCore and worker processes; else their command line)."""
    import psutil

    out = {}
    try:
        top = psutil.Process(pid)
        for p in [top, *top.children(recursive=True)]:
            try:
                cmd = p.cmdline()
                out[p.pid] = "API server" if p.pid == pid else (" ".join(cmd) if cmd else p.name())
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return out


class Sampler:
    """py-spy on every engine of a lab from :meth:`start` (the lab's ``on_replay`` hook) to the call it
    returns. Files in ``out``: ``py-spy-<engine>.json`` (speedscope), ``py-spy-<engine>.log`` (py-spy's
    messages, its sample and error counts), ``py-spy-titles.json`` ({engine: {pid: process title}}),
    ``py-spy-settings.json`` ({"rate": samples per second}).
    Raises RuntimeError when a py-spy exits at once (no ptrace access, say), after stopping the others."""

    def __init__(self, out: Path, rate: int):
        self.out, self.rate = out, rate
        self.titles: dict[str, dict[int, str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, lab):
        self.out.mkdir(parents=True, exist_ok=True)
        spy = str(Path(sys.executable).with_name("py-spy"))
        try:
            for name, pid in lab.pids().items():
                if name == "router":
                    continue
                self.titles[name] = _titles(pid)
                with open(self.out / f"py-spy-{name}.log", "w") as log:
                    self.procs[name] = subprocess.Popen(
                        [spy, "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking",
                         "--full-filenames", "--rate", str(self.rate), "--format", "speedscope",
                         "--output", str(self.out / f"py-spy-{name}.json")],
                        stdout=log, stderr=subprocess.STDOUT)  # its summary line goes to stdout
            (self.out / "py-spy-titles.json").write_text(json.dumps(self.titles))
            (self.out / "py-spy-settings.json").write_text(json.dumps({"rate": self.rate}))
            time.sleep(1.0)  # attached before the first replayed request
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                logs = "; ".join(f"{n}: {(self.out / f'py-spy-{n}.log').read_text()[-500:]}" for n in dead)
                raise RuntimeError(f"py-spy exited at once ({dead}): {logs}")
        except BaseException:
            self.stop()
            raise
        return self.stop

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for p in self.procs.values():
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def spy_counts(log: Path) -> tuple[int | None, int | None]:
    """(samples, errors) py-spy printed at its end (``Samples: N Errors: M``), None when absent."""
    m = re.search(r"Samples: (\d+) Errors: (\d+)", log.read_text()) if log.exists() else None
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def report(out: Path, block: int, stall_len: int = 0) -> list[dict]:
    """Rows of every engine's py-spy file in ``out``: engine, process title, thread, py-spy's error
    count for the engine, and :func:`read_profile`'s figures. Raises FileNotFoundError when an engine
    of ``py-spy-titles.json`` has no profile (py-spy killed before writing it)."""
    titles = json.loads((out / "py-spy-titles.json").read_text())
    rows = []
    for eng in sorted(titles):
        f = out / f"py-spy-{eng}.json"
        if not f.exists():
            raise FileNotFoundError(f"{f}: py-spy wrote no profile (see {f.with_suffix('.log')})")
        _, errors = spy_counts(f.with_suffix(".log"))
        for r in read_profile(f, block, stall_len):
            pid, tid, thread = profile_ids(r["profile"])
            title = titles[eng].get(str(pid), f"pid {pid}")
            rows.append({"engine": eng, "process": title, "thread": thread, "spy_errors": errors, **r})
    if not any(r["where"] for r in rows):
        raise RuntimeError(f"no sample of any engine thread in {out} is pdtrace's: was tracing on, and is "
                           "pdtrace's code where this script's pdtrace is?")
    return rows


def pool(runs: list[list[dict]], block: int) -> list[dict]:
    """Rows of several runs of the same code (each :func:`report`'s rows) pooled per (engine, process
    title, thread): the runs' samples joined in run order, shares and intervals computed again (blocks
    do not cross much between runs: one block in ``block`` samples straddles two), counts summed."""
    out: dict[tuple, dict] = {}
    for rows in runs:
        for r in rows:
            key = (r["engine"], r["process"], r["thread"])
            o = out.setdefault(key, {"engine": key[0], "process": key[1], "thread": key[2], "profile": r["profile"],
                                     "lab_samples": 0, "where": {}, "_flags": [], "runs": 0})
            o["runs"] += 1
            o["lab_samples"] += r["lab_samples"]
            o["_flags"] += r["_flags"]
            for k, v in r["where"].items():
                o["where"][k] = o["where"].get(k, 0) + v
            if "_rest" in r:
                o.setdefault("_rest", []).extend(r["_rest"])
                base = len(o["_flags"]) - len(r["_flags"])  # the stalls' indices in the pooled samples
                o.setdefault("stalls", []).extend((a + base, m) for a, m in r["stalls"])
    for o in out.values():
        f = o["_flags"]
        o["samples"] = n = len(f)
        o["pdtrace_pct"] = 100 * sum(f) / n if n else None
        o["ci"] = block_ci(f, block)
        o["lab_pct"] = 100 * o["lab_samples"] / n if n else None
        o["where"] = dict(sorted(o["where"].items(), key=lambda kv: -kv[1]))
        if "_rest" in o:
            rest = o["_rest"]
            o["pdtrace_pct_no_stalls"] = 100 * sum(rest) / len(rest) if rest else None
            o["ci_no_stalls"] = block_ci(rest, block)
    return sorted(out.values(), key=lambda o: (o["engine"], o["process"], o["thread"]))


#: The engine threads the goal names: every process's MainThread (API server event loop, EngineCore,
#: the worker's forward thread) and vLLM's push writer threads.
ENGINE_THREADS = ("MainThread", "nixl-push-writer")


def verdict(rows: list[dict], block: int, goal: float = GOAL_PCT) -> tuple[str, list[dict], list[dict]]:
    """The goal's verdict, the rows judged and the engine threads (:data:`ENGINE_THREADS`) with too
    few samples (< 20 ``block``) to judge. Judged: every thread with enough samples but pdtrace's own
    background threads (``pdtrace-*``). ``missed`` when one judged thread's interval lies above
    ``goal``; ``met`` when every judged one lies at or below it and no engine thread is too short;
    else ``undecided``."""
    judged = [r for r in rows if r["samples"] >= 20 * block and not r["thread"].startswith("pdtrace-")]
    short = [r for r in rows if r["samples"] < 20 * block and r["thread"] in ENGINE_THREADS]
    if any(r["ci"][0] > goal for r in judged):
        return "missed", judged, short
    if judged and not short and all(r["ci"][1] <= goal for r in judged):
        return "met", judged, short
    return "undecided", judged, short


def show(rows: list[dict], block: int, top: int = 0, errors: dict | None = None) -> None:
    """Print one line per thread with at least 20 ``block`` samples (fewer: listed as too few), its
    ``top`` pdtrace hooks, and the verdict."""
    print(f"{'engine':<10} {'process':<22} {'thread':<24} {'samples':>8} {'pdtrace %':>9} {'95 % interval':>17}"
          f" {'lab %':>6}")
    enough = [r for r in rows if r["samples"] >= 20 * block]
    for r in enough:
        lo, hi = r["ci"]
        print(f"{r['engine']:<10} {r['process'][:22]:<22} {r['thread'][:24]:<24} {r['samples']:>8} "
              f"{r['pdtrace_pct']:>9.2f} {f'[{lo:.2f}, {hi:.2f}]':>17} {r['lab_pct']:>6.2f}")
        if r.get("stalls"):
            lo2, hi2 = r["ci_no_stalls"]
            print(f"{'':<12}{len(r['stalls'])} stall run(s) of {sum(m for _, m in r['stalls'])} samples on one "
                  f"line; without them {r['pdtrace_pct_no_stalls']:.2f} % [{lo2:.2f}, {hi2:.2f}]")
        if top and r["where"]:
            n = sum(r["where"].values())
            for k, v in list(r["where"].items())[:top]:
                print(f"{'':<12}{v / r['samples'] * 100:6.2f} %  ({v / n * 100:3.0f} % of pdtrace's)  {k}")
    few = [r for r in rows if r["samples"] < 20 * block]
    if few:
        print(f"too few samples (< {20 * block}) to judge: " + ", ".join(
            f"{r['engine']} {r['process'][:16]} {r['thread'][:16]} ({r['samples']})" for r in few))
    if errors:
        print("py-spy read errors per engine (summed over the runs): " + ", ".join(
            f"{k} {'n/a' if v is None else v}" for k, v in sorted(errors.items())))
    v, judged, short = verdict(rows, block)
    if judged:
        w = max(judged, key=lambda r: r["ci"][1])
        print(f"\nlargest share of a judged thread: {w['engine']} {w['process'][:30]} {w['thread']} "
              f"{w['pdtrace_pct']:.2f} % [{w['ci'][0]:.2f}, {w['ci'][1]:.2f}]")
    print(f"goal <= {GOAL_PCT} % on every engine thread: {v} ({len(judged)} threads judged"
          + (f"; too few samples on {len(short)} engine threads: "
             + ", ".join(f"{r['engine']} {r['process'][:16]} {r['thread']}" for r in short) if short else "")
          + ")")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="pull", choices=("pull", "push"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--sample", default="1", help="PDTRACE_SAMPLE (default 1)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second per thread")
    ap.add_argument("--block", type=int, default=50,
                    help="bootstrap block length (samples); threads with fewer than 20 blocks are not judged")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profiles", type=Path, nargs="+",
                    help="only read the py-spy files of these finished runs (several: pooled per thread)")
    ap.add_argument("--top", type=int, default=3, help="per thread, pdtrace's hooks with the most samples")
    ap.add_argument("--stall-ms", type=float, default=20.0,
                    help="also show each share without runs of consecutive on-CPU pdtrace samples on one line "
                         "of at least this many ms of sampled time (stall-ms x rate / 1000 samples; 0: off)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.profiles is None:
        from pdtrace.connector.lab import run as lab_run

        out = a.out or Path("runs") / f"hot-path-sampling-{time.strftime('%Y%m%dT%H%M%S')}-{a.mode}"
        spy_dir = out / "py-spy"  # made once the lab has started (run_lab wants a new or empty directory)
        sampler = Sampler(spy_dir, a.rate)
        env = {"PDTRACE_SAMPLE": a.sample, "PDTRACE_SELF_CPU": "0"}  # no clock read in any hook
        o = lab_run.LabOptions(mode=a.mode, connector="stock", max_requests=a.requests, out=out, progress=False,
                               report=False, role_env={r: dict(env) for r in ("prefill", "decode", "router")},
                               on_replay=sampler.start)
        lab_run.run_lab(o)
        print(f"\nrun directory {out}; mode {a.mode}; PDTRACE_SAMPLE={a.sample}; py-spy {a.rate} Hz")
    dirs = [out / "py-spy"] if a.profiles is None else [d / "py-spy" for d in a.profiles]
    runs = []
    for spy_dir in dirs:
        settings = spy_dir / "py-spy-settings.json"
        if settings.exists():
            rate = json.loads(settings.read_text())["rate"]
        else:
            rate = a.rate
            print(f"{settings}: missing; taking --rate {rate} for the stall length", file=sys.stderr)
        runs.append(report(spy_dir, a.block, max(2, round(a.stall_ms * rate / 1000)) if a.stall_ms > 0 else 0))
    rows = runs[0] if len(runs) == 1 else pool(runs, a.block)
    if len(runs) > 1:
        print(f"{len(runs)} runs pooled: " + ", ".join(str(d.parent) for d in dirs))
    errors: dict[str, int | None] = {}
    for rows_ in runs:  # py-spy's own count, once per run and engine (None: not printed by that run)
        for eng, n in {r["engine"]: r["spy_errors"] for r in rows_}.items():
            errors[eng] = None if n is None or errors.get(eng, 0) is None else errors.get(eng, 0) + n
    show(rows, a.block, a.top, errors)
    if a.json:
        a.json.write_text(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
                                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
