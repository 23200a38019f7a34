"""``--router vllm-router`` parts that need no engine: its command line, the pin, the client-side join key."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdtrace.connector.lab import env, replay, vllm_router
from pdtrace.connector.lab.launcher import Lab, LabConfig, LabStartError
from pdtrace.connector.lab.run import LabOptions, run_lab


def test_command_is_pd_nixl_over_every_engine():
    cmd = vllm_router.command(["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://127.0.0.1:3"],
                              "127.0.0.1", 4, 5, 299.6)
    assert cmd[:3] == [sys.executable, "-m", "vllm_router.launch_router"]
    joined = " ".join(cmd)
    for part in ("--vllm-pd-disaggregation", "--kv-connector nixl", "--host 127.0.0.1 --port 4",
                 "--prometheus-host 127.0.0.1 --prometheus-port 5", "--request-timeout-secs 300",
                 "--disable-retries", "--prefill http://127.0.0.1:1 --prefill http://127.0.0.1:2",
                 "--decode http://127.0.0.1:3"):
        assert part in joined, part
    with pytest.raises(ValueError, match="prefill and one decode"):
        vllm_router.command([], ["http://127.0.0.1:3"], "127.0.0.1", 4, 5, 10)


def test_command_is_accepted_by_the_installed_router():
    """The installed vllm-router parses the lab's arguments (its own parser; nothing is started)."""
    pytest.importorskip("vllm_router")
    cmd = vllm_router.command(["http://127.0.0.1:1"], ["http://127.0.0.1:3"], "127.0.0.1", 4, 5, 10)
    code = ("import sys; from vllm_router.launch_router import parse_router_args; "
            "a = parse_router_args(sys.argv[1:]); print(a.vllm_pd_disaggregation, a.prefill_urls, a.decode_urls)")
    r = subprocess.run([sys.executable, "-c", code, *cmd[3:]], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "True" and "http://127.0.0.1:1" in r.stdout and "http://127.0.0.1:3" in r.stdout


def test_pinned_in_setup_and_checked():
    """The pin the lab starts (vllm_router.VERSION) is the one its setup installs and its check wants."""
    assert f"{vllm_router.DIST}=={vllm_router.VERSION}" in env.setup_commands("python")[0]
    found = [p.what for p in env.problems(import_check=False) if vllm_router.DIST in p.what]
    installed = env._version(vllm_router.DIST)
    assert (found == []) == (installed == vllm_router.VERSION), (found, installed)


@pytest.mark.parametrize("response_id, want", [
    ("cmpl-___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_0123456789abcdef0123456789abcdef",
     "___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_0123456789abcdef0123456789abcdef"),
    ("cmpl-pdtrace-00ff00ff00ff00ff", "pdtrace-00ff00ff00ff00ff"),
    ("chatcmpl-abc", "abc"),
    ("other-id", "other-id"),
    ("", ""),
])
def test_engine_request_id_from_response_id(response_id, want):
    assert replay.engine_request_id(response_id) == want


def test_unknown_router_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="router must be one of"):
        run_lab(LabOptions(router="nginx", out=tmp_path / "r", check_env=False))
    assert not (tmp_path / "r").exists()
    lab = Lab(LabConfig(model=tmp_path, run_dir=tmp_path / "x", router_kind="nginx"))
    with pytest.raises(ValueError, match="router_kind"):
        lab._start_foreign_router(1)


def test_start_failure_names_the_log(tmp_path, monkeypatch):
    """A router whose engines never answer is a LabStartError carrying its log, and its process is gone.

    Real vllm-router, no engines (nothing listens on the two ports): it waits for
    its workers and never reports healthy within the (shortened) start timeout.
    """
    pytest.importorskip("vllm_router")
    from pdtrace.connector.lab import procs
    from pdtrace.connector.lab.launcher import EngineConfig

    monkeypatch.setattr(vllm_router, "START_TIMEOUT_S", 3.0)
    lab = Lab(LabConfig(model=tmp_path, run_dir=tmp_path, router_kind="vllm-router"))
    (tmp_path / "logs").mkdir()
    p_port, d_port, r_port = procs.free_ports(3)
    lab.prefills = [EngineConfig("prefill-0", "prefill", None, http_port=p_port)]
    lab.decodes = [EngineConfig("decode-0", "decode", None, http_port=d_port)]
    with pytest.raises(LabStartError, match="vllm-router did not become healthy") as ei:
        lab._start_foreign_router(r_port)
    assert str(tmp_path / "logs" / "router.log") in str(ei.value)
    assert "router" not in lab.procs
    assert not procs.port_is_bound(r_port)


def test_cli_offers_the_routers():
    from click.testing import CliRunner

    from pdtrace.connector.cli import lab
    r = CliRunner().invoke(lab, ["--router", "nginx"])
    assert r.exit_code == 2 and "'pdtrace', 'vllm-router'" in r.output, r.output
    assert "--router [pdtrace|vllm-router]" in CliRunner().invoke(lab, ["--help"]).output
