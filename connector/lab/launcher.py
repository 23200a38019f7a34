"""Engine launcher: real vLLM OpenAI servers for prefill (P) and decode (D), and the router.

(A little over 400 lines: the lab's configuration (``LabConfig``, ``EngineConfig``) and the class that
starts, watches and stops the processes it describes (``Lab``) are kept side by side.)

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (vLLM's own
server) with:

- its own core (``VLLM_CPU_OMP_THREADS_BIND``), NIXL side-channel port
  (``VLLM_NIXL_SIDE_CHANNEL_PORT``) and cache root (``VLLM_CACHE_ROOT``,
  seeded with vLLM's model-inspection entries of earlier starts, see
  :mod:`pdtrace.connector.lab.vllmcache`),
  ``HF_HUB_OFFLINE=1``, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache,
  ``--enforce-eager``, ``--dtype bfloat16``;
- a ``--kv-transfer-config`` naming the connector class with a fixed
  ``engine_id``, so the router knows P's id before P answers (needed for
  concurrent push): by default vLLM's stock name, which pdtrace's vLLM plugin
  traces when ``PDTRACE_DIR`` is set (the production recipe); or pdtrace's
  class name and module path (``connector_class`` / ``connector_module``);
- NIXL's progress thread not busy-polling (sleeps ``prog_thread`` µs between
  polls; see :mod:`pdtrace.connector.lab.progthread`);
- its forward thread kept on its own core (vLLM's NIXL worker would move it to
  the machine's last core, both engines on one core; see
  :mod:`pdtrace.connector.lab.kvcore`);
- its log streamed to ``<run>/logs/<name>.log``.

:class:`Lab` starts everything, waits for health with a timeout and stops every
process it started (process groups; descendants that escape a group are killed
too) on success, failure, timeout and Ctrl-C. Use it as a context manager.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdtrace.instrument import config, stages

from . import procs, vllmcache
from .kvcore import ENV_SWITCH as KV_CORES_ENV
from .progthread import ENV_SWITCH, SITECUSTOMIZE

HOST = "127.0.0.1"
CONNECTORS = {"pull": "NixlPullConnector", "push": "NixlPushConnector"}
# UCX transports per profile (None: UCX's default, which works on loopback).
PROFILE_UCX_TLS = {"default": None, "transfer-heavy": "tcp,self"}


class LabStartError(RuntimeError):
    """An engine or the router did not become healthy; the message has its log tail."""


@dataclasses.dataclass
class EngineConfig:
    """One vLLM engine of the lab. Ports are chosen free by :class:`Lab`."""

    name: str                 # e.g. "prefill-0", "decode-0", "single-0"
    role: str                 # "prefill" | "decode" | "single"
    core: int | None          # CPU core to pin to (None: no pinning)
    http_port: int = 0
    side_port: int = 0
    engine_id: str = ""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"


@dataclasses.dataclass
class LabConfig:
    """What to run. ``connector_class`` / ``connector_module`` override the stock class."""

    model: Path
    mode: str = "pull"                          # pull | push
    run_dir: Path = Path("runs/lab")
    n_prefill: int = 1
    n_decode: int = 1
    profile: str = "default"                    # key of PROFILE_UCX_TLS
    connector_class: str | None = None          # default: CONNECTORS[mode]
    connector_module: str | None = None         # kv_connector_module_path
    connector_extra: dict = dataclasses.field(default_factory=dict)
    kv_cache_gib: int = 1                       # VLLM_CPU_KVCACHE_SPACE (GiB) per engine
    max_model_len: int = 8192
    max_num_seqs: int = 64
    prog_thread: str = "100"                    # PDTRACE_NIXL_PROG_THREAD: µs between polls, 'busy', 'off'

    health_timeout_s: float = 420.0             # per start; two engines share 2 cores
    trace_dir: Path | None = None               # PDTRACE_DIR for engines and router
    router: bool = True
    router_kind: str = "pdtrace"                # pdtrace (traced, ours) | vllm-router (vLLM's, see .vllm_router)
    router_timeout_s: float = 120.0             # per-request timeout in the router
    router_test_hooks: bool = False
    push_join_timeout_s: float = 60.0             # router: D must show a token this long after P answered (push)
    push_dispatch: str = "concurrent"           # router, push: "concurrent" (both legs at once) | "serial" (D after P answered)
    extra_env: dict = dataclasses.field(default_factory=dict)
    # per-role env on top of extra_env: {"prefill"|"decode"|"single"|"router": {VAR: value}}, e.g. a
    # test clock skew on D only ({"decode": {"PDTRACE_TEST_WALL_OFFSET_NS": "250000000"}})
    role_env: dict = dataclasses.field(default_factory=dict)
    extra_args: list = dataclasses.field(default_factory=list)  # appended to P/D engine command lines
    # per-role engine arguments after extra_args: {"prefill"|"decode": [arg, ...]}, e.g. P's prefill token
    # budget ({"prefill": ["--max-num-batched-tokens", "512"]}; benchmarks/compare_intervention.py)
    role_args: dict = dataclasses.field(default_factory=dict)
    cores: tuple[int, ...] | None = None        # default: 0..ncpu-1, round-robin

    def connector(self) -> str:
        return self.connector_class or CONNECTORS[self.mode]


def _engine_env(cfg: LabConfig, eng: EngineConfig, bootstrap: Path) -> dict[str, str]:
    # PDTRACE_DIR only from cfg.trace_dir: one in the caller's environment would switch the plugin on
    # in an untraced lab (--no-trace) and write into the caller's directory.
    env = {k: v for k, v in os.environ.items() if k != "PDTRACE_DIR"}
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cfg.run_dir / "cache" / eng.name),
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(eng.side_port),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "UCX_RCACHE_MAX_UNRELEASED": env.get("UCX_RCACHE_MAX_UNRELEASED", "1024"),
        ENV_SWITCH: str(cfg.prog_thread),
    })
    if eng.core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(eng.core)
        # vLLM's NIXL worker would move the forward thread to the machine's last core (both
        # engines on one core); keep it on the engine's own core (see .kvcore).
        env[KV_CORES_ENV] = str(eng.core)
    tls = PROFILE_UCX_TLS[cfg.profile]
    if tls:
        env["UCX_TLS"] = tls
    env["PYTHONPATH"] = os.pathsep.join([str(bootstrap)] + [p for p in [env.get("PYTHONPATH")] if p])
    if cfg.trace_dir:
        env["PDTRACE_DIR"] = str(cfg.trace_dir)
    env.update({k: str(v) for k, v in cfg.extra_env.items()})
    env.update({k: str(v) for k, v in cfg.role_env.get(eng.role, {}).items()})
    return env


def engine_command(cfg: LabConfig, eng: EngineConfig) -> list[str]:
    """The command line of one engine (``python -m vllm.entrypoints.openai.api_server ...``)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(cfg.model), "--served-model-name", "lab",
           "--host", HOST, "--port", str(eng.http_port),
           "--dtype", "bfloat16", "--enforce-eager", "--seed", "0",
           "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs)]
    if eng.role != "single":
        kv = {"kv_connector": cfg.connector(),
              "kv_role": stages.KV_ROLES[eng.role],
              "kv_buffer_device": "cpu", "engine_id": eng.engine_id}
        if cfg.connector_module:
            kv["kv_connector_module_path"] = cfg.connector_module
        if cfg.connector_extra:
            kv["kv_connector_extra_config"] = cfg.connector_extra
        cmd += ["--kv-transfer-config", json.dumps(kv)] + [str(a) for a in cfg.extra_args]
        cmd += [str(a) for a in cfg.role_args.get(eng.role, [])]
    return cmd


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class Lab:
    """A running P/D lab: engines (+ router). Start with ``with Lab(cfg) as lab:``.

    Attributes after :meth:`start`: ``prefills`` / ``decodes`` (lists of
    :class:`EngineConfig`), ``router_url``, ``start_s`` (name → seconds from
    spawn to healthy).
    """

    def __init__(self, cfg: LabConfig, single: bool = False):
        self.cfg = cfg
        self.single = single  # one plain engine, no connector, no router (the reference)
        self.procs: dict[str, object] = {}
        self.prefills: list[EngineConfig] = []
        self.decodes: list[EngineConfig] = []
        self.singles: list[EngineConfig] = []
        self.router_url: str | None = None
        self.router_port: int | None = None
        self.start_s: dict[str, float] = {}
        self._ports: list[int] = []

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> "Lab":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _cores(self) -> list[int | None]:
        if self.cfg.cores is not None:
            return list(self.cfg.cores)
        n = len(os.sched_getaffinity(0))
        return list(sorted(os.sched_getaffinity(0))) if n > 1 else [None]

    #: Starts tried when a port the lab picked was taken before the engine bound it.
    PORT_RETRIES = 3

    def start(self) -> None:
        """Spawn the engines (in parallel), wait for health, then start the router.

        If an engine or the router dies because one of its ports was taken in
        the meantime ("Address already in use" in its log), everything started
        so far is stopped and the lab starts again on new ports, up to
        :attr:`PORT_RETRIES` times. Raises :class:`LabStartError` (with the log
        tail) if an engine exits or misses ``health_timeout_s``; the caller (or
        ``__exit__``) stops the rest.
        """
        for attempt in range(1, self.PORT_RETRIES + 1):
            try:
                self._start_once()
                return
            except LabStartError:
                if attempt == self.PORT_RETRIES or not self._port_clash(attempt):
                    raise
                self.stop()
                self.prefills.clear(), self.decodes.clear(), self.singles.clear()
                self.start_s.clear()
                self.router_url = self.router_port = None

    def _port_clash(self, attempt: int) -> bool:
        """True if a log of this start says a port was taken; those logs are then kept as ``*.attempt<N>.log``."""
        logs = [f for f in (Path(self.cfg.run_dir) / "logs").glob("*.log") if ".attempt" not in f.name]
        clash = any("address already in use" in f.read_text(errors="replace").lower() for f in logs)
        if clash:
            for f in logs:
                f.rename(f.with_suffix(f".attempt{attempt}.log"))
        return clash

    def _start_once(self) -> None:
        """One start on freshly picked ports (see :meth:`start`)."""
        cfg = self.cfg
        cfg.run_dir = Path(cfg.run_dir)
        (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        bootstrap = cfg.run_dir / "bootstrap"
        bootstrap.mkdir(parents=True, exist_ok=True)
        (bootstrap / "sitecustomize.py").write_text(SITECUSTOMIZE)
        cores = self._cores()
        tag = cfg.run_dir.name.replace(" ", "_")[-40:]
        if self.single:
            roles = [("single", 0)]
        else:
            roles = [("prefill", i) for i in range(cfg.n_prefill)] + [("decode", i) for i in range(cfg.n_decode)]
        ports = procs.free_ports(2 * len(roles) + 1)
        self._ports = ports
        engines = []
        for k, (role, i) in enumerate(roles):
            eng = EngineConfig(name=f"{role}-{i}", role=role, core=cores[k % len(cores)],
                               http_port=ports[2 * k], side_port=ports[2 * k + 1],
                               engine_id=f"lab-{role}-{i}-{tag}")
            engines.append(eng)
            (self.singles if role == "single" else self.prefills if role == "prefill" else self.decodes).append(eng)
        t0 = {}
        for eng in engines:
            log = cfg.run_dir / "logs" / f"{eng.name}.log"
            (cfg.run_dir / "cache" / eng.name).mkdir(parents=True, exist_ok=True)
            vllmcache.seed(cfg.model, cfg.run_dir / "cache" / eng.name)
            t0[eng.name] = time.monotonic()
            self.procs[eng.name] = procs.spawn(engine_command(cfg, eng), _engine_env(cfg, eng, bootstrap), log)
        pending = {e.name: e for e in engines}
        deadline = time.monotonic() + cfg.health_timeout_s
        while pending:
            for name, eng in list(pending.items()):
                p = self.procs[name]
                if p.poll() is not None:
                    raise LabStartError(
                        f"engine {name} exited with code {p.returncode} before becoming healthy; "
                        f"log {cfg.run_dir / 'logs' / (name + '.log')}:\n{log_tail(cfg.run_dir / 'logs' / (name + '.log'))}")
                if http_ok(eng.url + "/health"):
                    self.start_s[name] = time.monotonic() - t0[name]
                    del pending[name]
                    vllmcache.keep(cfg.model, cfg.run_dir / "cache" / name)
            if pending and time.monotonic() > deadline:
                name = next(iter(pending))
                raise LabStartError(
                    f"engine {name} not healthy after {cfg.health_timeout_s:.0f} s; "
                    f"log tail:\n{log_tail(cfg.run_dir / 'logs' / (name + '.log'))}")
            time.sleep(0.5)
        if cfg.router and not self.single:
            self._start_router(ports[-1])

    def router_config(self) -> dict:
        """The JSON config the router process reads (see :mod:`.router`)."""
        c = self.cfg
        return {
            "mode": c.mode, "host": HOST, "port": self.router_port,
            "prefill": [{"url": e.url, "engine_id": e.engine_id, "host": HOST, "side_port": e.side_port,
                         "tp_size": 1} for e in self.prefills],
            "decode": [{"url": e.url, "engine_id": e.engine_id} for e in self.decodes],
            "timeout_s": c.router_timeout_s, "test_hooks": c.router_test_hooks,
            "push_join_timeout_s": c.push_join_timeout_s, "push_dispatch": c.push_dispatch,
        }

    def _start_router(self, port: int) -> None:
        self.router_port = port
        if self.cfg.router_kind != "pdtrace":
            self._start_foreign_router(port)
            return
        path = self.cfg.run_dir / "router.json"
        path.write_text(json.dumps(self.router_config(), indent=2))
        env = {k: v for k, v in os.environ.items() if k != "PDTRACE_DIR"}  # only cfg.trace_dir, as for engines
        if self.cfg.trace_dir:
            env["PDTRACE_DIR"] = str(self.cfg.trace_dir)
        env.update({k: str(v) for k, v in self.cfg.role_env.get("router", {}).items()})
        log = self.cfg.run_dir / "logs" / "router.log"
        t = time.monotonic()
        self.procs["router"] = procs.spawn(
            [sys.executable, "-m", "pdtrace.connector.lab.router", "--config", str(path)], env, log)
        self.router_url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 60
        while not http_ok(self.router_url + "/health"):
            if self.procs["router"].poll() is not None or time.monotonic() > deadline:
                raise LabStartError(f"router did not start; log:\n{log_tail(log)}")
            time.sleep(0.2)
        self.start_s["router"] = time.monotonic() - t

    def _start_foreign_router(self, port: int) -> None:
        """Start ``cfg.router_kind`` (``vllm-router``: :mod:`.vllm_router`), untraced: no ``PDTRACE_DIR``."""
        from . import vllm_router

        if self.cfg.router_kind != "vllm-router":
            raise ValueError(f"router_kind must be pdtrace or vllm-router, not {self.cfg.router_kind!r}")
        env = {k: v for k, v in os.environ.items() if k != "PDTRACE_DIR"}
        env["NO_COLOR"] = "1"  # plain log lines, no ANSI colour codes
        env.update({k: str(v) for k, v in self.cfg.role_env.get("router", {}).items()})
        log = self.cfg.run_dir / "logs" / "router.log"
        t = time.monotonic()
        try:
            self.procs["router"] = vllm_router.start([e.url for e in self.prefills], [e.url for e in self.decodes],
                                                     HOST, port, self.cfg.router_timeout_s, env, log)
        except RuntimeError as exc:
            raise LabStartError(str(exc)) from None
        self.router_url = f"http://{HOST}:{port}"
        self.start_s["router"] = time.monotonic() - t

    def restart_router(self, **overrides) -> None:
        """Stop the router and start it again on the same port with ``LabConfig`` fields changed.

        E.g. ``lab.restart_router(push_dispatch="serial")``: the engines keep running
        (and keep their NIXL connections), only the router's policy changes. The new
        router's ``/_lab/stats`` starts empty.
        """
        for k, v in overrides.items():
            if not hasattr(self.cfg, k):
                raise AttributeError(f"LabConfig has no field {k!r}")
            setattr(self.cfg, k, v)
        p = self.procs.pop("router", None)
        if p is not None:
            procs.stop_group(p)
        self._start_router(self.router_port)

    def flush_grace_s(self) -> float:
        """Seconds to let every traced process's writer flush before the lab stops (0 untraced).

        vLLM's API server answers SIGTERM by killing its EngineCore and worker processes
        at once ("stopping engine client mode=abort timeout=0s"), so their shutdown flush
        may never run: whatever they recorded in the last flush interval
        (``PDTRACE_FLUSH_INTERVAL_S``, default 1 s) would be lost — e.g. D's failure
        event of a request that failed just before the stop. Two intervals + 0.5 s.
        """
        if not self.cfg.trace_dir:
            return 0.0
        # the engines' own reading of their environment (the caller's, then extra_env on top)
        interval = config.from_env({**os.environ, **self.cfg.extra_env}).flush_interval_s
        return 2 * min(interval, 30.0) + 0.5

    def stop(self) -> None:
        """Stop every process this lab started (router first). Safe to call twice.

        Traced engines get :meth:`flush_grace_s` first, so their last records reach the store; then
        the host's sink (detached, it outlives them) is asked to write everything it holds
        (:func:`pdtrace.instrument.hostsink.sync`).
        """
        if any(n != "router" and p.poll() is None for n, p in self.procs.items()):
            time.sleep(self.flush_grace_s())
        for name in sorted(self.procs, key=lambda n: n != "router"):
            procs.stop_group(self.procs[name])
        self.procs.clear()
        if self.cfg.trace_dir:  # the host's sink outlives them: let it write what they sent before the store is read
            from pdtrace.instrument import hostsink

            hostsink.sync(self.cfg.trace_dir, timeout=30.0)

    # -- helpers for tests and the CLI -----------------------------------
    def pids(self) -> dict[str, int]:
        """name -> pid of each top-level process still tracked."""
        return {n: p.pid for n, p in self.procs.items()}

    def kill(self, name: str) -> None:
        """Stop one process (e.g. ``"decode-0"``) and its group right away (SIGKILL)."""
        p = self.procs.pop(name)
        procs.stop_group(p, term_timeout_s=0.0)

    def ports(self) -> list[int]:
        return list(self._ports)
