"""Process helpers for the lab: free ports, process groups, stop-everything.

Every process the lab starts gets its own process group (``start_new_session``),
so stopping it reaches its children (vLLM's EngineCore) too. :func:`stop_group`
sends SIGTERM to the group, waits, then SIGKILLs the group *and* any
descendant that escaped it (found with psutil before the stop).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (held open together while picking)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def port_is_bound(port: int, host: str = "127.0.0.1") -> bool:
    """True if something still listens on (or holds) ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def spawn(cmd: list[str], env: dict[str, str], log_path: Path, cwd: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session (own process group), stdout+stderr to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab", buffering=0)
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
    finally:
        log.close()  # the child holds its own copy


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_group(proc: subprocess.Popen, term_timeout_s: float = 15.0) -> None:
    """Stop ``proc``'s process group and every descendant; never raises for gone processes.

    SIGTERM to the group, wait up to ``term_timeout_s`` seconds, then SIGKILL the
    group and any surviving descendant, and reap ``proc``.
    """
    kids = descendants(proc.pid)
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # start_new_session: pgid == pid
    for sig in (signal.SIGTERM,):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + term_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(k) for k in kids):
            break
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for k in kids:
        if _alive(k):
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - kernel would have to refuse SIGKILL
        pass
    psutil.wait_procs([k for k in kids if _alive(k)], timeout=5)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
