"""NIXL/UCX loopback bandwidth outside vLLM: two processes, one READ at a time, like a pull handoff.

The *target* process (the prefill side) registers a host buffer and waits; the
*initiator* (the decode side) registers its own, loads the target's agent
metadata and READs ``n`` blocks of ``block_bytes`` (``desc_bytes``-sized
descriptors; consecutive blocks, which NIXL merges, as on a fresh engine — or
shuffled), ``repeats`` times per size. The lab's vLLM CPU engines ask for 2
descriptors per block (K and V), hence the default 1 MiB descriptors for the
transfer-heavy profile's 2 MiB blocks. Both agents run NIXL's progress thread with the lab's ``pthrDelay``
(``PDTRACE_NIXL_PROG_THREAD`` µs, via :mod:`pdtrace.connector.lab.progthread`)
and the UCX transports given (``UCX_TLS``), so the number is the transport as
the lab's engines see it, minus vLLM.

:func:`measure` returns per size the NIXL-reported transfer durations
(``get_xfer_telemetry().xferDuration``, µs → s), the same quantity the traced
connectors record as ``kv.transfer``; :func:`fit` turns them into a line
``duration_s = fixed_s + bytes / bandwidth_Bps``.

Run alone: ``python tests/connector/nixlbw.py --tls tcp,self``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time


def _setup_env(tls: str | None, delay_us: int) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
    os.environ["PDTRACE_NIXL_PROG_THREAD"] = str(delay_us)
    from pdtrace.connector.lab import progthread
    progthread.install()


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, capture_telemetry=True, backends=["UCX"]))


def _target(conn, tls, delay_us, total_bytes) -> None:
    _setup_env(tls, delay_us)
    import numpy as np
    buf = np.ones(total_bytes, dtype=np.uint8)
    ag = _agent("bw-target")
    reg = ag.get_reg_descs([(buf.ctypes.data, total_bytes, 0, "")], "DRAM")
    ag.register_memory(reg)
    conn.send((ag.get_agent_metadata(), buf.ctypes.data))
    conn.recv()  # "done"
    ag.deregister_memory(reg)


def measure(sizes_blocks=(2, 4, 8, 16), block_bytes: int = 2 << 20, desc_bytes: int = 1 << 20,
            repeats: int = 5, tls: str | None = "tcp,self", delay_us: int = 100, seed: int = 0,
            shuffle: bool = False) -> dict:
    """READ ``n`` blocks of ``block_bytes`` (split in ``desc_bytes`` descriptors) for each ``n``.

    Returns {"tls", "block_bytes", "desc_bytes", "points": [(bytes, duration_s), ...]} where
    duration_s is NIXL's own transfer duration of one READ (s).
    """
    n_max = max(sizes_blocks)
    total = n_max * block_bytes
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    saved = {k: os.environ.get(k) for k in ("UCX_TLS", "PDTRACE_NIXL_PROG_THREAD")}
    _setup_env(tls, delay_us)  # the spawned child inherits this environment
    proc = ctx.Process(target=_target, args=(b, tls, delay_us, total), daemon=True)
    proc.start()
    points = []
    try:
        import numpy as np
        buf = np.zeros(total, dtype=np.uint8)
        ag = _agent("bw-initiator")
        reg = ag.get_reg_descs([(buf.ctypes.data, total, 0, "")], "DRAM")
        ag.register_memory(reg)
        if not a.poll(120):
            raise TimeoutError("NIXL bandwidth target did not start")
        meta, raddr = a.recv()
        peer = ag.add_remote_agent(meta)
        n_desc = total // desc_bytes
        local = ag.prep_xfer_dlist("NIXL_INIT_AGENT",
                                   [(buf.ctypes.data + i * desc_bytes, desc_bytes, 0) for i in range(n_desc)], "DRAM")
        remote = ag.prep_xfer_dlist(peer, [(raddr + i * desc_bytes, desc_bytes, 0) for i in range(n_desc)], "DRAM")
        rng = random.Random(seed)
        per_block = block_bytes // desc_bytes
        for rep in range(repeats + 1):
            for n in sizes_blocks:
                if shuffle:
                    blocks = rng.sample(range(n_max), n)
                else:  # consecutive blocks, as a fresh engine allocates them (NIXL merges them)
                    start = rng.randrange(0, n_max - n + 1)
                    blocks = list(range(start, start + n))
                idx = [blk * per_block + j for blk in blocks for j in range(per_block)]
                h = ag.make_prepped_xfer("READ", local, idx, remote, idx)
                st = ag.transfer(h)
                deadline = time.monotonic() + 120
                while st not in ("DONE", "ERR"):
                    st = ag.check_xfer_state(h)
                    if time.monotonic() > deadline:
                        raise TimeoutError("NIXL READ did not complete in 120 s")
                    time.sleep(0.0005)
                if st != "DONE":
                    raise RuntimeError(f"NIXL READ failed: {st}")
                tel = ag.get_xfer_telemetry(h)
                ag.release_xfer_handle(h)
                if rep > 0:  # the first round warms the endpoints up
                    points.append((n * block_bytes, tel.xferDuration / 1e6))
        ag.release_dlist_handle(local)
        ag.release_dlist_handle(remote)
        ag.remove_remote_agent(peer)
        ag.deregister_memory(reg)
    finally:
        try:
            a.send("done")
        except (BrokenPipeError, OSError):
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"tls": tls, "block_bytes": block_bytes, "desc_bytes": desc_bytes, "points": points}


def fit(points) -> tuple[float, float]:
    """Least-squares line through (bytes, seconds): (fixed_s, bandwidth in bytes/s)."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, 1.0 / slope


def median_bandwidth(points) -> float:
    """Median of bytes / duration over the points (bytes/s)."""
    return statistics.median(b / s for b, s in points)


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser()
    ap.add_argument("--tls", default="tcp,self", help="UCX_TLS ('' for UCX's default)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    r = measure(tls=a.tls or None, repeats=a.repeats)
    fixed, bw = fit(r["points"])
    print(json.dumps({"tls": r["tls"], "fixed_ms": fixed * 1e3, "bandwidth_GBps": bw / 1e9,
                      "median_GBps": median_bandwidth(r["points"]), "n": len(r["points"])}))
