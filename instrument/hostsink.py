"""One sink per host and trace directory: its address, how a traced process reaches or starts it, finding it.

The sink (:mod:`pdtrace.instrument.sink`, ``python -m pdtrace.instrument.sink --dir DIR``) is one
process per host, user and trace directory, shared by every traced process that writes into that
directory (its *clients*). Light module: no pyarrow, imported by the writer thread of every traced
process.

Address: a Linux *abstract* Unix domain socket (no file: nothing to clean up after a SIGKILL, no
108-byte ``sun_path`` limit to mind for a long directory path, and it survives the trace
directory being removed or unwritable), named ``\\0pdtrace-sink-<uid>-<h>`` where ``<h>`` is the
first 32 hex digits of sha256 of the directory's real path. Abstract names belong to the network
namespace: processes in one container (or on the host) share a sink; another namespace gets its own.
The name cannot be taken twice (``bind`` fails with EADDRINUSE), so at most one sink runs per name;
a lock file (:func:`lock_path`, a POSIX record lock, ``fcntl.lockf``: owned by the process,
so a child forked while its parent holds it does not inherit it) keeps concurrent first
processes from each starting one. Abstract sockets have no permission bits: both ends check the peer's uid
(``SO_PEERCRED``) and refuse another user.

Start: :func:`connect` connects, or under the lock starts ``python -m pdtrace.instrument.sink
--dir DIR --by PID`` in a new session (``posix_spawn`` with ``setsid``: its own session and
process group, so a signal to the traced process's group does not reach it). That process binds the name, forks, and its parent
exits at once; the child (the sink) is reparented to init, so it outlives the process that started
it and no process is left to reap it. It exits when no client has been connected for
``PDTRACE_SINK_IDLE_S`` (after writing everything).

Wire format, both ways: frames of a 4-byte big-endian length then a pickle (:func:`frame`).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import struct
import sys
import tempfile
import time

#: Module of the sink process; other code (tests, benchmarks, the lab) finds it by this name in the cmdline.
MODULE = "pdtrace.instrument.sink"

#: Seconds :func:`connect` waits for the lock, for the started process to bind, and for the connection.
START_TIMEOUT_S = 10.0

_HDR = struct.Struct("!I")


def key(trace_dir: str | os.PathLike) -> str:
    """The sink's key for ``trace_dir``: ``<uid>-<32 hex digits of sha256(real path)>``."""
    real = os.path.realpath(os.fspath(trace_dir))
    return f"{os.getuid()}-{hashlib.sha256(real.encode()).hexdigest()[:32]}"


def address(trace_dir: str | os.PathLike) -> bytes:
    """The abstract socket address (bytes, leading NUL) of the sink of ``trace_dir`` for this user."""
    return b"\0pdtrace-sink-" + key(trace_dir).encode()


def lock_path(trace_dir: str | os.PathLike) -> str:
    """The lock file that serializes starting a sink for ``trace_dir`` (in the system temp directory)."""
    return os.path.join(tempfile.gettempdir(), f"pdtrace-sink-{key(trace_dir)}.lock")


def log_path(trace_dir: str | os.PathLike) -> str:
    """Where the sink process's own stderr goes (tracebacks; warnings go to the clients' logs)."""
    return os.path.join(tempfile.gettempdir(), f"pdtrace-sink-{key(trace_dir)}.log")


def frame(data: bytes) -> bytes:
    """One frame: the length of ``data`` (4 bytes, big endian), then ``data``."""
    return _HDR.pack(len(data)) + data


def unframe(buf: bytearray) -> list[bytes]:
    """Remove every complete frame from the front of ``buf``; return their payloads, oldest first."""
    out, pos, n = [], 0, len(buf)
    while n - pos >= 4:
        (size,) = _HDR.unpack_from(buf, pos)
        if n - pos - 4 < size:
            break
        out.append(bytes(buf[pos + 4: pos + 4 + size]))
        pos += 4 + size
    if pos:
        del buf[:pos]
    return out


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def try_connect(trace_dir: str | os.PathLike, timeout: float) -> socket.socket | None:
    """A blocking socket connected to the running sink of ``trace_dir``, or None if none listens.

    Raises PermissionError when the name is held by another user's process.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(address(trace_dir))
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
        s.close()
        return None
    except OSError:
        s.close()
        raise
    _pid, uid = peer_cred(s)
    if uid != os.getuid():
        s.close()
        raise PermissionError(errno.EACCES, f"the sink name of this directory is held by uid {uid}")
    return s


def connect(trace_dir: str | os.PathLike, env: dict, timeout: float = START_TIMEOUT_S) -> tuple[socket.socket, bool]:
    """A socket connected to the sink of ``trace_dir``, starting one if none runs; and whether this call started it.

    ``env``: the environment of a sink this call starts (the caller's, without ``PDTRACE_DIR``
    and OpenMP binding: :func:`pdtrace.instrument.cpus.helper_env`); the sink reads its own
    settings from it (flush interval, rotation, idle time). It runs ``sys.executable``. Blocks the
    calling thread (never an engine thread: the writer's) up to about ``timeout`` s. Raises
    OSError when no sink can be reached or started.
    """
    s = try_connect(trace_dir, timeout)
    if s is not None:
        return s, False
    deadline = time.monotonic() + timeout
    lock_fd = -1
    try:
        try:
            lock_fd = os.open(lock_path(trace_dir), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            lock_fd = -1  # no lock (temp dir not writable): the bind still keeps a second sink out
        while lock_fd >= 0:
            try:
                # a POSIX record lock, not flock(2): a flock belongs to the open file, which a process
                # forked while its writer holds the lock shares, so the child waited on its own copy
                fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held by another process
                if time.monotonic() > deadline:
                    break  # a holder that hangs: go on without the lock
                time.sleep(0.02)
        s = try_connect(trace_dir, timeout)  # started by the lock's previous holder?
        if s is not None:
            return s, False
        code = _spawn(trace_dir, env, deadline)
        if code not in (0, 3):  # 3: another sink holds the name (it won a race): connect to it
            raise OSError(errno.ECHILD, f"the sink process exited with code {code} (see {log_path(trace_dir)})")
        while True:
            s = try_connect(trace_dir, max(0.1, deadline - time.monotonic()))
            if s is not None:
                return s, code == 0
            if time.monotonic() > deadline:
                raise OSError(errno.ECONNREFUSED, "the sink process started but does not listen")
            time.sleep(0.02)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)  # releases the lock


def _spawn(trace_dir: str | os.PathLike, env: dict, deadline: float) -> int:
    """Run ``python -m pdtrace.instrument.sink --dir DIR --by PID`` in a session of its own and wait for
    it to bind the name, fork the sink and exit; return its exit code.

    ``os.posix_spawn``, not ``subprocess.Popen``: Popen learns of a failed exec through a pipe that
    stays open in any process forked meanwhile (a traced process forking while its writer starts
    the sink: the child then held the parent's Popen, and the parent the start lock, until the
    child exited). stdin and stdout are /dev/null, stderr is :func:`log_path` (or /dev/null).
    Raises OSError when it cannot be started or does not exit in time (it is then killed).
    """
    args = [sys.executable, "-m", MODULE, "--dir", os.path.realpath(os.fspath(trace_dir)), "--by", str(os.getpid())]
    try:
        err = os.open(log_path(trace_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:
        err = os.open(os.devnull, os.O_WRONLY)
    try:
        pid = os.posix_spawn(sys.executable, args, env, setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_DUP2, err, 2)])
    finally:
        os.close(err)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
            raise OSError(errno.ETIMEDOUT, "the sink process did not start in time")
        time.sleep(0.005)


def bind(trace_dir: str | os.PathLike) -> socket.socket | None:
    """The sink's socket for ``trace_dir``, bound, not yet listening; None when another process holds the name.

    The sink calls ``listen`` after its fork, so that a client's ``SO_PEERCRED`` names the sink
    process itself (the kernel records the process that called ``listen``).
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(address(trace_dir))
    except OSError as exc:
        s.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return s


def find(trace_dir: str | os.PathLike | None = None) -> list[int]:
    """Pids of the running sink processes (of ``trace_dir`` only, if given), read from ``/proc``.

    A sink's cmdline is ``<python> -m pdtrace.instrument.sink --dir <real path> --by <pid>``.
    Zombies (empty cmdline) are not listed, nor the process that starts a sink (same cmdline, for the
    few ms before it forks and exits: it leads its own session, the sink it forks does not).
    """
    want = os.path.realpath(os.fspath(trace_dir)) if trace_dir is not None else None
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if MODULE not in args or "--dir" not in args:
            continue
        i = args.index("--dir")
        if want is None or (i + 1 < len(args) and args[i + 1] == want):
            try:
                with open(f"/proc/{name}/stat") as f:
                    session = int(f.read().rsplit(")", 1)[1].split()[3])
            except (OSError, ValueError, IndexError):
                continue
            if session != int(name):  # a session leader is the short-lived starter, before its fork
                out.append(int(name))
    return sorted(out)


def starter(pid: int) -> int | None:
    """The pid of the traced process that started sink ``pid`` (its ``--by`` argument), None if unknown."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        return int(args[args.index("--by") + 1])
    except (OSError, ValueError, IndexError):
        return None


def sync(trace_dir: str | os.PathLike, timeout: float = 10.0) -> bool:
    """Ask the running sink of ``trace_dir`` to write everything it holds now; wait for it.

    For a caller that has just stopped traced processes and reads the store next (the lab):
    the sink first takes in whatever its clients sent before they ended, writes one file and,
    when no client is left, merges the parts into a segment. True when done (or no sink runs);
    False on timeout or error.
    """
    import pickle

    try:
        s = try_connect(trace_dir, timeout)
    except OSError:
        return False
    if s is None:
        return True
    try:
        s.settimeout(timeout)
        s.sendall(frame(pickle.dumps(("sync",))))
        buf = bytearray()
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return False
            buf += chunk
            for m in unframe(buf):
                if pickle.loads(m)[0] == "synced":
                    return True
    except OSError:
        return False
    finally:
        s.close()
