"""Lab parts that need no engine: trace parsing and scaling, the model maker, the NIXL patch, process stop."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdtrace.connector.data import AZURE_CONV, MOONCAKE_CONV
from pdtrace.connector.lab import procs, workload
from pdtrace.connector.lab.model import ModelSpec, PROFILES


def test_format_detected_from_contents(tmp_path):
    a = tmp_path / "x.jsonl"  # misleading name: content decides
    a.write_text(AZURE_CONV.read_text().splitlines()[0] + "\n" + AZURE_CONV.read_text().splitlines()[1] + "\n")
    assert workload.detect_format(a) == "azure-csv"
    m = tmp_path / "y.csv"
    m.write_text(MOONCAKE_CONV.read_text().splitlines()[0] + "\n")
    assert workload.detect_format(m) == "mooncake-jsonl"
    bad = tmp_path / "z.txt"
    bad.write_text("hello,world\n")
    with pytest.raises(workload.WorkloadError):
        workload.detect_format(bad)


def test_azure_scaling_is_explicit_and_exact():
    w = workload.build("azure-conv", AZURE_CONV, vocab_size=2048, length_scale=0.25, rate_scale=2.0, max_requests=20)
    _, rows, n = workload.read_rows(AZURE_CONV)
    assert n == 19366 and len(w.requests) == 20
    for q, r in zip(w.requests, rows):
        assert len(q.prompt) == max(1, round(r.input_len * 0.25))
        assert q.max_tokens == max(1, round(r.output_len * 0.25))
        assert q.arrival_s == pytest.approx(r.arrival_s / 2.0)
        assert all(16 <= t < 2048 for t in q.prompt)
    s = w.summary()
    assert s["length_scale"] == 0.25 and s["rate_scale"] == 2.0


def test_too_long_requests_raise_instead_of_trimming():
    with pytest.raises(workload.WorkloadError, match="Nothing is trimmed"):
        workload.build("mooncake-conv", MOONCAKE_CONV, vocab_size=2048, length_scale=1.0, rate_scale=1.0,
                       max_requests=10, max_model_len=8192)


def test_mooncake_jitter_deterministic_and_prefixes_shared():
    kw = dict(vocab_size=2048, length_scale=0.05, rate_scale=1.0, max_requests=40)
    w1 = workload.build("mooncake-conv", MOONCAKE_CONV, seed=1, **kw)
    w2 = workload.build("mooncake-conv", MOONCAKE_CONV, seed=1, **kw)
    w3 = workload.build("mooncake-conv", MOONCAKE_CONV, seed=2, **kw)
    assert w1.requests == w2.requests and w1.jittered
    assert [r.arrival_s for r in w1.requests] != [r.arrival_s for r in w3.requests]
    arr = [r.arrival_s for r in w1.requests]
    assert arr == sorted(arr) and len(set(arr)) == len(arr)  # buckets spread
    # Hash id 0 (shared system prompt) starts almost every request: same leading block of tokens.
    blk = round(512 * 0.05)
    firsts = {tuple(r.prompt[:blk]) for r in w1.requests if len(r.prompt) >= blk}
    assert len(firsts) <= 3
    assert w1.summary()["shared_prefix_tokens_total"] > 0


def test_duration_cap():
    w = workload.build("azure-conv", AZURE_CONV, vocab_size=2048, length_scale=0.25, rate_scale=1.0,
                       max_duration_s=10.0)
    assert w.requests and all(r.arrival_s <= 10.0 for r in w.requests)


def test_model_spec_guards_head_dim_and_kv_bytes():
    with pytest.raises(ValueError, match="head_dim"):
        ModelSpec(hidden=64, heads=4)  # head_dim 16 kills the CPU engine
    assert PROFILES["default"].kv_bytes_per_token == 1024
    assert PROFILES["transfer-heavy"].kv_bytes_per_token == 16 * 1024
    assert PROFILES["default"].digest() == ModelSpec().digest() != ModelSpec(seed=1).digest()


def test_model_maker_deterministic(tmp_path):
    from pdtrace.connector.lab.model import make_model, model_info
    a = make_model("default", tmp_path / "a")
    b = make_model("default", tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    info = model_info(a)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["vocab_size"] == info["vocab_size"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] in (64, 128)
    assert "chat_template" in json.loads((a / "tokenizer_config.json").read_text()) or (a / "chat_template.jinja").exists()
    assert make_model("default", tmp_path / "a") == a  # cached


@pytest.mark.parametrize("setting,max_cpu", [("", 0.3), ("off", 0.3)])
def test_nixl_progress_thread_patch_stops_busy_polling(setting, max_cpu):
    pytest.importorskip("nixl")
    code = (
        "import time\n"
        "from pdtrace.connector.lab import progthread; progthread.install()\n"
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "a = nixl_agent('t', nixl_agent_config(num_threads=4, capture_telemetry=True))\n"
        "t0 = time.process_time(); time.sleep(2.0); print(time.process_time() - t0)\n")
    env = {"PDTRACE_NIXL_PROG_THREAD": setting, "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    cpu = float(r.stdout.strip().splitlines()[-1])
    assert cpu < max_cpu, f"agent used {cpu:.2f} CPU-s in 2 s with {setting or 'default'}"


def test_stop_group_leaves_no_orphans(tmp_path):
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "time.sleep(600)\n")
    p = procs.spawn([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, tmp_path / "x.log")
    deadline = time.monotonic() + 30
    while not (kids := procs.descendants(p.pid)):  # the child has started its own child
        assert p.poll() is None and time.monotonic() < deadline, "the child never started its child"
        time.sleep(0.05)
    procs.stop_group(p, term_timeout_s=2)  # returns once the group and every descendant are gone
    assert p.poll() is not None
    assert not any(k.is_running() and k.status() != "zombie" for k in kids)


def test_free_ports_distinct_and_unbound():
    ports = procs.free_ports(6)
    assert len(set(ports)) == 6 and not any(procs.port_is_bound(p) for p in ports)


def test_kv_core_patch_keeps_forward_thread_on_engine_core():
    """With PDTRACE_LAB_KV_CORES set, vLLM's NIXL worker pins the forward thread to that core, not the last one."""
    pytest.importorskip("vllm")
    code = (
        "import os\n"
        "from pdtrace.connector.lab import kvcore; assert kvcore.install()\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "print(CpuPlatform.discover_numa_topology())\n")
    env = {"PDTRACE_LAB_KV_CORES": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[[0]]"
    # Unset: nothing is patched.
    env.pop("PDTRACE_LAB_KV_CORES")
    r = subprocess.run([sys.executable, "-c", "from pdtrace.connector.lab import kvcore; print(kvcore.install())"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_sse_decoder_splits_events_across_chunks():
    from pdtrace.connector.sse import SSEDecoder
    d = SSEDecoder()
    assert d.feed(b'data: {"a": 1}\n\ndata: [DO') == [{"a": 1}]
    assert not d.done  # half of "[DONE]" is not the end
    assert d.feed(b'NE]\n\n: comment\n\ndata: {"b"') == []
    assert d.done
    assert d.feed(b': 2}\n\ndata: not json\n\n') == [{"b": 2}]


def test_router_push_dispatch_setting():
    """push_dispatch: 'concurrent' by default, 'serial' accepted, anything else refused at start; the
    launcher passes LabConfig.push_dispatch through to the router's config."""
    from pdtrace.connector.lab.launcher import Lab, LabConfig
    from pdtrace.connector.lab.router import Router

    base = {"mode": "push", "prefill": [{"url": "http://127.0.0.1:1", "engine_id": "p"}],
            "decode": [{"url": "http://127.0.0.1:2", "engine_id": "d"}]}
    assert Router(dict(base)).push_dispatch == "concurrent"
    assert Router(dict(base, push_dispatch="serial")).push_dispatch == "serial"
    with pytest.raises(ValueError, match="push_dispatch"):
        Router(dict(base, push_dispatch="sequential"))
    lab = Lab(LabConfig(model=Path("/nonexistent"), mode="push", push_dispatch="serial"))
    assert lab.router_config()["push_dispatch"] == "serial"


def test_untraced_lab_engines_get_no_pdtrace_dir_from_the_callers_environment(tmp_path, monkeypatch):
    """A PDTRACE_DIR exported by the caller must not reach an untraced lab's engines (the plugin would trace them
    and write into the caller's directory); a traced lab's engines get the lab's own directory."""
    from pdtrace.connector.lab.launcher import EngineConfig, LabConfig, _engine_env

    monkeypatch.setenv("PDTRACE_DIR", str(tmp_path / "callers-traces"))
    eng = EngineConfig(name="prefill-0", role="prefill", core=None)
    untraced = _engine_env(LabConfig(model=tmp_path, run_dir=tmp_path / "run"), eng, tmp_path / "boot")
    assert "PDTRACE_DIR" not in untraced
    traced = _engine_env(LabConfig(model=tmp_path, run_dir=tmp_path / "run", trace_dir=tmp_path / "run"), eng,
                         tmp_path / "boot")
    assert traced["PDTRACE_DIR"] == str(tmp_path / "run")


def test_role_args_reach_only_their_engine(tmp_path):
    """LabConfig.role_args (LabOptions.engine_args): P's prefill token budget goes on P's command line only
    (benchmarks/compare_intervention.py changes P's step length and must leave D as it was)."""
    from pdtrace.connector.lab.launcher import EngineConfig, LabConfig, engine_command

    cfg = LabConfig(model=tmp_path, run_dir=tmp_path / "run", mode="push",
                    role_args={"prefill": ["--max-num-batched-tokens", 512]})
    p = engine_command(cfg, EngineConfig(name="prefill-0", role="prefill", core=None, engine_id="p"))
    d = engine_command(cfg, EngineConfig(name="decode-0", role="decode", core=None, engine_id="d"))
    assert p[-2:] == ["--max-num-batched-tokens", "512"]
    assert "--max-num-batched-tokens" not in d


def test_modelinfo_seed_round_trip_takes_newer_entries_and_never_raises(tmp_path):
    """vLLM's model-inspection entries kept beside the model and copied into each new engine's cache root."""
    from pdtrace.connector.lab import vllmcache
    model = tmp_path / "lab" / "model-x"
    model.mkdir(parents=True)
    a, b = tmp_path / "run1" / "cache" / "prefill-0", tmp_path / "run2" / "cache" / "decode-0"
    assert vllmcache.seed(model, a) == 0 and not (a / "modelinfos").exists()  # nothing kept yet
    (a / "modelinfos").mkdir(parents=True)
    (a / "modelinfos" / "llama.json").write_text('{"hash": "h1"}')
    assert vllmcache.keep(model, a) == 1
    assert (tmp_path / "lab" / "vllm-modelinfos" / "llama.json").read_text() == '{"hash": "h1"}'
    assert vllmcache.keep(model, a) == 0  # the same bytes: nothing to copy
    assert vllmcache.seed(model, b) == 1
    assert (b / "modelinfos" / "llama.json").read_text() == '{"hash": "h1"}'
    (a / "modelinfos" / "llama.json").write_text('{"hash": "h2"}')  # vLLM rewrote it (a new source hash)
    assert vllmcache.keep(model, a) == 1
    assert (tmp_path / "lab" / "vllm-modelinfos" / "llama.json").read_text() == '{"hash": "h2"}'
    assert not list((tmp_path / "lab" / "vllm-modelinfos").glob(".*"))  # no temporary file left
    # a seed directory that cannot be used: a file in its place
    model2 = tmp_path / "ro" / "model-y"
    model2.mkdir(parents=True)
    (tmp_path / "ro" / "vllm-modelinfos").write_text("not a directory")
    assert vllmcache.seed(model2, b) == 0 and vllmcache.keep(model2, a) == 0


@pytest.mark.parametrize("term_timeout_s, sigterm", [(0.0, False), (5.0, True)])
def test_stop_group_with_no_term_timeout_sends_no_sigterm(tmp_path, monkeypatch, term_timeout_s, sigterm):
    """``Lab.kill`` is a crash: a SIGTERM before the SIGKILL, even microseconds before, can start vLLM's
    graceful shutdown (a clean ``abort`` end for every open stream). The signals sent to the real
    child's group are recorded on their way to the real ``os.killpg``."""
    import signal
    sent, real = [], procs.os.killpg
    monkeypatch.setattr(procs.os, "killpg", lambda pgid, sig: (sent.append(sig), real(pgid, sig)))
    p = procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"], {"PATH": "/usr/bin:/bin"},
                    tmp_path / "x.log")
    procs.stop_group(p, term_timeout_s=term_timeout_s)
    assert p.poll() is not None
    assert (signal.SIGTERM in sent) == sigterm and signal.SIGKILL in sent, sent
