"""Process helpers for the lab: free ports, process groups, stop-everything.

Every process the lab starts gets its own process group (``start_new_session``),
so stopping it reaches its children (vLLM's EngineCore) too. :func:`stop_group`
sends SIGTERM to the group, waits, then SIGKILLs the group *and* any
descendant that escaped it (found with psutil before the stop).
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil


#: Lowest port the lab hands out. Ports below the kernel's ephemeral range are
#: never given to a socket that binds port 0 or connects out, so a port picked
#: here cannot be taken by another process's outgoing connection or by vLLM's own
#: ``get_open_port`` (both draw from the ephemeral range) between the moment the
#: lab picks it and the moment the engine binds it. That race bit CI on
#: 2026-11-30: a side-channel port picked from the ephemeral range was already
#: in use when D's handshake listener bound it.
LAB_PORT_MIN = 20000
_FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)`` (inclusive); Linux's default if unreadable."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL


def _lab_range() -> range:
    """Ports the lab picks from: ``[LAB_PORT_MIN, ephemeral low)``, or above the range if that is empty."""
    low, high = ephemeral_range()
    if low - LAB_PORT_MIN >= 1000:
        return range(LAB_PORT_MIN, low)
    return range(high + 1, 65536)


def _try_hold(port: int, host: str) -> socket.socket | None:
    """A socket bound to ``host:port`` (no SO_REUSEADDR, so TIME_WAIT counts as taken), or None."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, outside the kernel's ephemeral range.

    Starts at a random offset in :func:`_lab_range` (so two labs started at the
    same moment rarely try the same ports) and holds each candidate bound until
    all ``n`` are found, so they are distinct. Raises ``RuntimeError`` if the
    range has fewer than ``n`` free ports.
    """
    span = _lab_range()
    start = random.SystemRandom().randrange(len(span))
    socks, ports = [], []
    try:
        for k in range(len(span)):
            if len(ports) == n:
                break
            port = span[(start + k) % len(span)]
            s = _try_hold(port, host)
            if s is not None:
                socks.append(s)
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise RuntimeError(f"only {len(ports)} of {n} ports free in {span.start}-{span.stop - 1} on {host}")
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now, outside the ephemeral range (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


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
    group and any surviving descendant, and reap ``proc``. With ``term_timeout_s``
    <= 0 no SIGTERM is sent: the group is SIGKILLed at once (a crash). A SIGTERM
    sent first, even microseconds before the SIGKILL, can start vLLM's graceful
    shutdown, which ends every open stream as an ``abort`` finish.
    """
    kids = descendants(proc.pid)
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # start_new_session: pgid == pid
    if term_timeout_s > 0:
        try:
            os.killpg(pgid, signal.SIGTERM)
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
