"""The lab's ports: picked outside the kernel's ephemeral range, and a start that loses a port retries.

CI on 2026-11-30 failed because a side-channel port the lab had picked from the
ephemeral range was bound by someone else before D's handshake listener bound
it. The real-engine test below reproduces that clash for real (the port is
really taken by a socket this test holds; only the lab's *choice* of that port
is forced, by making the first pick return it) and checks the lab starts on new
ports instead of failing.
"""
from __future__ import annotations

import socket
import urllib.request

import pytest

from pdtrace.connector.lab import procs
from pdtrace.connector.lab.launcher import Lab, LabConfig


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
@pytest.mark.timeout(900)
def test_lab_restarts_on_new_ports_when_a_picked_port_is_taken(lab_ready, model_dir, tmp_path, monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", procs.free_port()))
    held.listen()
    taken = held.getsockname()[1]
    real = procs.free_ports
    calls = []

    def first_pick_taken(n, host="127.0.0.1"):
        ports = real(n, host)
        if not calls:
            ports[0] = taken  # the single engine's HTTP port: really bound by `held`
        calls.append(list(ports))
        return ports

    monkeypatch.setattr(procs, "free_ports", first_pick_taken)
    try:
        with Lab(LabConfig(model=model_dir, run_dir=tmp_path, router=False), single=True) as lab:
            eng = lab.singles[0]
            assert eng.http_port != taken
            with urllib.request.urlopen(eng.url + "/health", timeout=30) as r:
                assert r.status == 200
    finally:
        held.close()
    assert len(calls) == 2 and calls[0][0] == taken
    kept = list((tmp_path / "logs").glob("*.attempt1.log"))
    assert kept and "address already in use" in kept[0].read_text(errors="replace").lower()
