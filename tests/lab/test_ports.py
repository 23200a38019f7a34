"""The lab's ports: picked outside the kernel's ephemeral range, and a start that loses a port retries.

CI on 2026-11-30 failed because a side-channel port the lab had picked from the
ephemeral range was bound by someone else before D's handshake listener bound
it. The real-engine test below reads that clash reproduced for real by the
session's reference engine (``reference`` in ``tests/lab/conftest.py``: the port
is really taken by a socket the fixture holds; only the lab's *choice* of that
port is forced, by making the first pick return it) and checks the lab started
on new ports instead of failing; the engine answered the reference's requests
there.
"""
from __future__ import annotations

import socket

import pytest

from pdtrace.connector.lab import procs


def test_free_ports_outside_ephemeral_range_distinct_and_free():
    low, high = procs.ephemeral_range()
    ports = procs.free_ports(12)
    assert len(set(ports)) == 12
    assert all(not (low <= p <= high) for p in ports), (ports, low, high)
    assert all(p >= procs.LAB_PORT_MIN for p in ports)
    assert not any(procs.port_is_bound(p) for p in ports)


def test_free_ports_skips_a_taken_port():
    taken = socket.socket()
    taken.bind(("127.0.0.1", procs.free_port()))
    try:
        port = taken.getsockname()[1]
        # 200 picks from random offsets: the held port is never handed out
        assert all(port not in procs.free_ports(3) for _ in range(200))
    finally:
        taken.close()


def test_ephemeral_range_reads_proc_and_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert procs.ephemeral_range(str(f)) == (40000, 50000)
    assert procs.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


@pytest.mark.lab
def test_lab_restarts_on_new_ports_when_a_picked_port_is_taken(reference):
    """The session's reference engine (``tests/lab/conftest.py``) was started with its first port pick forced
    onto a port a socket really held: the lab started again on new ports and the engine served there."""
    ports = reference["ports"]
    assert len(ports["calls"]) == 2 and ports["calls"][0][0] == ports["taken"], ports
    assert ports["engine_port"] != ports["taken"] and ports["engine_port"] == ports["calls"][1][0], ports
    kept = list((ports["run_dir"] / "logs").glob("*.attempt1.log"))
    assert kept and "address already in use" in kept[0].read_text(errors="replace").lower()
