"""Helpers every lab test shares: the lab-environment gate and small JSON-over-HTTP calls.

Importable from any test module as ``import labkit`` (``tests/`` is on
``sys.path`` under pytest's default import mode, because ``tests/conftest.py``
lives here). Nothing here starts an engine but :func:`traced_greedy`, and that
only when the traced lab of its mode did not run in this session, and
:func:`cli_pull_run` (the session fixture ``cli_pull_run`` of ``tests/conftest.py``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def require_lab() -> None:
    """Skip the calling test when the lab environment is missing, or fail it under ``PDTRACE_LAB_REQUIRED=1`` (CI).

    The environment check is :func:`pdtrace.connector.lab.env.problems` without
    the import check (≈ 5 s); the message names what is missing and the fix.
    """
    from pdtrace.connector.lab import env as lab_env

    found = lab_env.problems(import_check=False)
    if found:
        msg = "lab environment not ready: " + "; ".join(p.what for p in found) + " (run `pdtrace lab setup`)"
        if os.environ.get("PDTRACE_LAB_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def benchmark(name: str):
    """The shipped benchmark script ``benchmarks/<name>.py`` loaded as a module (the tests drive the same code
    that prints BENCHMARKS.md's figures). Raises FileNotFoundError for a missing script."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> dict:
    """POST ``body`` as JSON; return the JSON answer. Raises ``urllib.error.HTTPError`` on an HTTP error."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def post_status(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """POST ``body`` as JSON; return (HTTP status, JSON body), also for HTTP errors (a non-JSON body as ``{"raw": text}``)."""
    try:
        return 200, post(url, body, headers, timeout)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def get_json(url: str, timeout: float = 30) -> dict:
    """GET ``url``; return its JSON answer."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def greedy(lab, prompts, max_tokens: int = 6) -> list[list[str]]:
    """Greedy token ids (as ``token_id:N`` strings) of each prompt through the router."""
    out = []
    for p in prompts:
        r = post(lab.router_url + "/v1/completions",
                 {"model": "lab", "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                  "logprobs": 0, "return_tokens_as_token_ids": True})
        out.append(r["choices"][0]["logprobs"]["tokens"])
    return out


def pdtrace_in_processes(lab) -> dict:
    """What of pdtrace runs for the lab's engine process trees, read from ``/proc`` while the lab runs.

    Returns ``{"writers": [(pid, process name)], "sinks": [pid], "processes": n}``: every process
    with a thread named ``pdtrace-writer`` (the writer names its kernel thread), every
    ``pdtrace.instrument.sink`` process of the lab's trace directory or started by one of the
    lab's processes (the host's sink is detached, not in their trees: ``hostsink.find``,
    ``hostsink.starter``), and how many engine processes were read (API servers, EngineCores,
    workers; the router is not an engine).
    """
    import psutil

    from pdtrace.instrument import hostsink

    writers, n, tree = [], 0, set()
    for name, pid in lab.pids().items():
        root = psutil.Process(pid)
        for p in [root] + root.children(recursive=True):
            tree.add(p.pid)
            if name == "router":
                continue
            try:
                if "pdtrace.instrument.sink" in " ".join(p.cmdline()):
                    continue
                n += 1
                for tid in os.listdir(f"/proc/{p.pid}/task"):
                    with open(f"/proc/{p.pid}/task/{tid}/comm") as f:
                        if f.read().strip() == "pdtrace-writer":
                            writers.append((p.pid, p.name()))
                            break
            except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                continue
    mine = set(hostsink.find(lab.cfg.trace_dir)) if lab.cfg.trace_dir else set()
    sinks = sorted(s for s in hostsink.find() if s in mine or hostsink.starter(s) in tree)
    return {"writers": writers, "sinks": sinks, "processes": n}


def check_untraced_lab(lab, log_name: str, connector: str) -> None:
    """``lab`` runs untraced (``PDTRACE_DIR`` unset, pdtrace's plugin installed): no trace directory, no
    ``pdtrace-writer`` thread and no sink in any of its >= 4 engine processes (:func:`pdtrace_in_processes`, read
    from ``/proc`` now), vLLM's stock ``connector`` class built by the engine whose log is ``log_name``, no span
    file in the run directory."""
    assert lab.cfg.trace_dir is None
    p = pdtrace_in_processes(lab)
    print(p)
    assert p["processes"] >= 4 and p["writers"] == [] and p["sinks"] == [], p
    log = (lab.cfg.run_dir / "logs" / log_name).read_text(errors="replace")
    assert f"Creating v1 connector with name: {connector}" in log
    assert not list(lab.cfg.run_dir.rglob("*.parquet"))


def traced_greedy(record: dict, mode: str, model: Path, prompts: list, run_dir: Path) -> dict:
    """The greedy tokens of a traced P/D lab of ``mode``: ``{"model", "prompts", "outputs"}``.

    ``record`` is the session's ``traced_greedy`` fixture (``tests/conftest.py``), where
    ``tests/connector/test_traced_{pull,push}_lab.py`` put the greedy tokens of their traced lab
    (vLLM's stock serving command traced by pdtrace's plugin). If that lab did not run in this
    session, or ran another model, a traced lab of the same recipe is started here in ``run_dir``,
    warmed up (first contact), asked ``prompts`` greedily and stopped. Raises AssertionError if its
    warm-up fails twice.
    """
    got = record.get(mode)
    if got is not None and Path(got["model"]) == Path(model):
        return got
    from pdtrace.connector.lab.launcher import Lab, LabConfig

    cfg = LabConfig(model=model, mode=mode, run_dir=run_dir, trace_dir=run_dir.resolve(), push_join_timeout_s=60.0,
                    router_timeout_s=300.0)
    with Lab(cfg) as lab:
        for i in range(2):  # first contact (the handshake), once more if it missed the join timeout
            status, body = post_status(lab.router_url + "/v1/completions",
                                       {"model": "lab", "prompt": [20 + i, 21, 22, 23], "max_tokens": 2})
            if status == 200:
                break
        assert status == 200, f"traced {mode} lab: warm-up failed twice: {body}"
        record[mode] = {"model": Path(model), "prompts": prompts, "outputs": greedy(lab, prompts)}
    return record[mode]


def check_greedy_like_traced(lab, record: dict, model: Path, prompts: list, run_dir: Path) -> None:
    """``lab`` (untraced) answers the traced lab of its mode's greedy prompts with the same tokens
    (:func:`traced_greedy`, which starts that traced lab in ``run_dir`` if it did not run in the session)."""
    rec = traced_greedy(record, lab.cfg.mode, model, prompts, run_dir)
    assert greedy(lab, rec["prompts"]) == rec["outputs"]


class HelperSampler(threading.Thread):
    """Reads pdtrace's helper processes (psutil) and the store's file names every 0.3 s, independently of pdtrace.

    ``readings``: [(wall time s, {pid: (RSS bytes, user+system CPU s)})] of every process whose command line
    holds ``pdtrace.instrument.sink`` and that descends from this test process (where an in-process lab
    runs) or names ``run_dir`` after ``--dir`` (the host's sink, detached from the lab's tree; read here
    from the process table, not through ``pdtrace.instrument.hostsink``). ``files``: every ``*.parquet``
    name (dot files excluded) seen under ``run_dir``. Stop with ``stop.set()`` then ``join()``.
    """

    def __init__(self, run_dir):
        super().__init__(daemon=True)
        self.run_dir = os.path.realpath(run_dir)
        self.readings: list[tuple[float, dict[int, tuple[int, float]]]] = []
        self.files: set[str] = set()
        self.stop = threading.Event()

    def run(self):
        import psutil
        me = psutil.Process(os.getpid())
        while not self.stop.wait(0.3):
            seen = {}
            try:
                tree = {c.pid for c in me.children(recursive=True)}
            except psutil.NoSuchProcess:
                tree = set()
            for p in psutil.process_iter():
                try:
                    args = p.cmdline()
                    if "pdtrace.instrument.sink" not in args:
                        continue
                    serves = "--dir" in args and args.index("--dir") + 1 < len(args) and \
                        os.path.realpath(args[args.index("--dir") + 1]) == self.run_dir
                    if p.pid not in tree and not serves:
                        continue
                    t = p.cpu_times()
                    seen[p.pid] = (p.memory_info().rss, t.user + t.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            self.readings.append((time.time(), seen))
            try:
                self.files |= {f for _, _, fs in os.walk(self.run_dir) for f in fs
                               if f.endswith(".parquet") and not f.startswith(".")}
            except OSError:
                pass


#: Replayed requests of :func:`cli_pull_run` (Azure conversation trace, the lab's defaults otherwise).
CLI_RUN_REQUESTS = 20


def cli_pull_run(out: Path) -> dict:
    """``pdtrace lab --mode pull --max-requests 20 --out OUT --no-progress`` exactly as a user starts it (click's
    runner, in this process: the stock connector name, traced through pdtrace's vLLM plugin), with a
    :class:`HelperSampler` reading the run while it lasts.

    Returns {"dir": OUT, "output": the printed text, "exit_code", "exception", "summary": run.json,
    "sampler"}. One lab start serves every check of a default CLI run (the printed report and the plugin
    in ``tests/analysis/test_lab_skew.py``, the footprint line in ``tests/connector/test_footprint_lab.py``).
    """
    from click.testing import CliRunner

    from pdtrace.cli.main import main
    from pdtrace.connector.lab.model import make_model
    require_lab()
    make_model("default")
    out.mkdir(parents=True, exist_ok=True)
    sampler = HelperSampler(out)
    sampler.start()
    try:
        res = CliRunner().invoke(main, ["lab", "--mode", "pull", "--max-requests", str(CLI_RUN_REQUESTS),
                                        "--out", str(out), "--no-progress"])
    finally:
        sampler.stop.set()
        sampler.join()
    print(res.output)
    summary = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else None
    return {"dir": out, "output": res.output, "exit_code": res.exit_code, "exception": res.exception,
            "summary": summary, "sampler": sampler}
