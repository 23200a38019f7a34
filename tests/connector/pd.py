"""A hand-started prefill/decode pair for the connector tests (until/unless the lab launcher is used).

Starts two ``vllm.entrypoints.openai.api_server`` processes with the traced
connector, the frontend middleware, their own side-channel ports, cores and
cache dirs (``lab-notes.md``), waits for health, and drives requests the way
the lab's router does (pull: P with ``max_tokens=1`` + ``do_remote_decode``,
then D with P's params; push: both legs concurrently with the same
``X-Request-Id``). Stops every process it started (process group) on exit.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PY = sys.executable
MIDDLEWARE = "pdtrace.connector.traced.middleware.FrontendMiddleware"
MODULE = "pdtrace.connector.traced"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class PD:
    def __init__(self, model: Path, run_dir: Path, mode: str = "pull", traced: bool = True,
                 trace_dir: Path | None = None, extra: dict | None = None, env: dict | None = None,
                 connector: str | None = None, module: str | None = MODULE, middleware: bool = True):
        self.model, self.run_dir, self.mode = Path(model), Path(run_dir), mode
        self.trace_dir = trace_dir
        self.extra = {"nixl_progress_thread": False} if extra is None else extra
        self.env = env or {}
        self.connector = connector or ("TracedNixlPullConnector" if mode == "pull" else "TracedNixlPushConnector")
        self.module = module
        self.middleware = middleware
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, tuple[int, int]] = {}
        self.p_engine_id = f"p-{os.getpid()}"

    def _cmd(self, role: str, http: int) -> list[str]:
        kv = {"kv_connector": self.connector, "kv_role": "kv_producer" if role == "p" else "kv_consumer",
              "kv_buffer_device": "cpu"}
        if self.module:
            kv["kv_connector_module_path"] = self.module
        if self.extra:
            kv["kv_connector_extra_config"] = self.extra
        if role == "p":
            kv["engine_id"] = self.p_engine_id
        cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "lab", "--host", "127.0.0.1", "--port", str(http),
               "--dtype", "bfloat16", "--enforce-eager", "--seed", "0", "--max-model-len", "4096",
               "--max-num-seqs", "32", "--kv-transfer-config", json.dumps(kv)]
        if self.middleware:
            cmd += ["--middleware", MIDDLEWARE]
        return cmd

    def start(self, timeout: float = 400.0) -> "PD":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for i, role in enumerate(("p", "d")):
            http, side = free_port(), free_port()
            self.ports[role] = (http, side)
            env = dict(os.environ)
            env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "VLLM_CACHE_ROOT": str(self.run_dir / f"cache-{role}"),
                        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), "VLLM_CPU_OMP_THREADS_BIND": str(i),
                        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                        "UCX_RCACHE_MAX_UNRELEASED": "1024",
                        "PDTRACE_ROLE": "prefill" if role == "p" else "decode"})
            env.pop("PDTRACE_DIR", None)
            if self.trace_dir is not None:
                env["PDTRACE_DIR"] = str(self.trace_dir)
            env.update(self.env)
            log = open(self.run_dir / f"{role}.log", "wb")
            self.procs[role] = subprocess.Popen(self._cmd(role, http), env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)
        deadline = time.monotonic() + timeout
        for role in ("p", "d"):
            url = f"http://127.0.0.1:{self.ports[role][0]}/health"
            while True:
                if self.procs[role].poll() is not None:
                    raise RuntimeError(f"{role} exited: {self.log_tail(role)}")
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{role} not healthy: {self.log_tail(role)}")
                time.sleep(1.0)
        return self

    def log_tail(self, role: str, n: int = 30) -> str:
        try:
            return "\n".join((self.run_dir / f"{role}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role][0]}"

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    def kill(self, role: str) -> None:
        os.killpg(self.procs[role].pid, signal.SIGKILL)
        self.procs[role].wait(timeout=30)

    # ------------------------------------------------------------ requests
    def request(self, x: str, prompt: str, max_tokens: int = 8, hold=None) -> dict:
        """One P/D request with id X; returns {'text', 'p', 'd'}. ``hold(x)`` runs between the legs (pull)."""
        hdr = {"X-Request-Id": x}
        if self.mode == "pull":
            p = post(self.url("p") + "/v1/completions",
                     {"model": "lab", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                      "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                             "remote_engine_id": None, "remote_block_ids": None,
                                             "remote_host": None, "remote_port": None}}, hdr)
            if hold is not None:
                hold(x)
            d = post(self.url("d") + "/v1/completions",
                     {"model": "lab", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                      "kv_transfer_params": p["kv_transfer_params"]}, hdr)
        else:
            p_side = self.ports["p"][1]
            with cf.ThreadPoolExecutor(2) as ex:
                fp = ex.submit(post, self.url("p") + "/v1/completions",
                               {"model": "lab", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "kv_transfer_params": {"do_remote_decode": True}}, hdr)
                fd = ex.submit(post, self.url("d") + "/v1/completions",
                               {"model": "lab", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                                       "remote_engine_id": self.p_engine_id,
                                                       "remote_host": "127.0.0.1", "remote_port": p_side,
                                                       "tp_size": 1, "remote_block_ids": None,
                                                       "remote_request_id": None}}, hdr)
                p, d = fp.result(), fd.result()
        return {"text": d["choices"][0]["text"], "p": p, "d": d}

    def metrics(self, role: str) -> str:
        with urllib.request.urlopen(self.url(role) + "/metrics", timeout=10) as r:
            return r.read().decode()
