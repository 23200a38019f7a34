"""Perturbation with a known answer: the transfer-heavy profile makes ``kv.transfer`` ≈ bytes ÷ bandwidth.

Benchmark-style (real engines, one traced pull lab, ≈ 3-4 min). The lab's
``transfer-heavy`` profile has 16 KiB of KV per token (2 MiB per 128-token
block, 16× the default model) and runs UCX over ``tcp,self``. The known answer
is the transport's bandwidth, measured **separately**, outside vLLM, with the
same NIXL/UCX stack (:mod:`nixlbw`: two processes, the lab's progress-thread
delay, READs of 2 MiB blocks in 1 MiB descriptors like the engines' K/V
descriptors), before each round of the lab's probes and after the last,
while the lab's engines sit idle beside it (same CPU contention as the probes).

Probes: ``REPEATS`` sequential requests (one at a time, so transfers do not
share the link) for each prompt length in ``PROMPT_TOKENS`` (2-16 blocks, 4-32
MiB), fresh random token prompts (no prefix-cache hit). Per size, the fastest
of the traced ``kv.transfer`` durations (NIXL's own transfer time, which is
what the span measures) and of the standalone READs: other processes' load
only adds time, and medians moved by 3x between runs on this machine. The
known answer is the *growth*: from 4 to 32 MiB, ``kv.transfer`` grows by
≈ 28 MiB ÷ the standalone bandwidth, and the slopes (s per byte = 1 /
bandwidth) of the lab's and the standalone per-size minima agree. Absolute durations are not compared: in the lab each READ also carries
a fixed cost the standalone loop does not have (intercepts of 14 and 22 ms in
two runs; likely D's polling: NIXL's duration ends when D's engine step checks
the handle, while the standalone loop polls every 0.5 ms).

Tolerance: a factor of 10 on the growth and on the slopes (it was 3; the
last paragraph says why it was widened). Why so wide: TCP on loopback is CPU-bound (kernel copies on both ends). In the lab
those copies share each engine's core with its forward and progress threads,
so the lab's READs were consistently slower than the standalone loop's: lab /
standalone bandwidth 0.59 (0.83 vs 1.41 GB/s) and 0.49 (0.84 vs 1.70 GB/s, a
CI run on an otherwise idle machine, growth ratio 2.02), then 1.03 (1.88 vs
1.82 GB/s, growth ratio 0.95) on the same idle machine 20 minutes later: a
factor-2 bound sat right on the spread. The standalone run alone
showed single 4 MiB READs taking 2.4-64 ms and 32 MiB READs 24-149 ms (latest
figures: BENCHMARKS.md "Connectors"). The default transport moves the same bytes ≈ 40× faster (≈ 20
GB/s standalone) and a post-only span would not grow at all, so a factor 3
still rejects a span that does not follow the transport.

Widened to a factor 10 on 2026-12-01: on that day's VM (an AVX2-only AMD
EPYC, 2-4x slower than before, 0.5-2 % steal time) the lab's 32 MiB READs
took 140-210 ms at their fastest against 31-46 ms standalone, growth ratios
4.2 (CI), 6.9 and 5.8 (the last with the recorder before the writer's
chunk-size and pause change, so not a cost of that change): the lab's CPU contention slows its READs far more
there. A factor 10 still rejects a span that follows the default transport
(≈ 20 GB/s standalone on the earlier VM: 14-18x the TCP bandwidth measured
on 2026-12-01) or does not grow with the bytes (post only).
"""
from __future__ import annotations

import random
import statistics

import pytest

import labtrace as lt
import nixlbw
from pdtrace.connector.lab.launcher import Lab
from pdtrace.connector.lab.model import model_info

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1200)]

PROMPT_TOKENS = (256, 512, 1024, 2048)  # → 2, 4, 8, 16 blocks of 2 MiB transferred (4-32 MiB)
REPEATS = 3
FACTOR = 10.0  # see the module docstring (Tolerance)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    model = lt.lab_model("transfer-heavy")
    info = model_info(model)
    run_dir = tmp_path_factory.mktemp("heavy")
    cfg = lt.traced_cfg(model, run_dir, trace=True, mode="pull", profile="transfer-heavy", router_timeout_s=300.0)
    block_bytes = lt.BLOCK_TOKENS * info["kv_bytes_per_token"]
    rng = random.Random(7)
    vocab = info["vocab_size"]
    out = {"dir": run_dir, "block_bytes": block_bytes, "kv_bytes_per_token": info["kv_bytes_per_token"]}
    with Lab(cfg) as lab:
        lt.warm_up(lab, [16 + rng.randrange(vocab - 16) for _ in range(300)])
        bench = lambda: nixlbw.measure(sizes_blocks=(2, 4, 8, 16), block_bytes=block_bytes,  # noqa: E731
                                       desc_bytes=block_bytes // 2, repeats=2, tls="tcp,self")
        pts = []
        ids = []
        for rep in range(REPEATS):  # interleaved: standalone READs, then one probe per size
            pts += bench()["points"]
            for n in PROMPT_TOKENS:
                ids.append(lt.one(lab, [16 + rng.randrange(vocab - 16) for _ in range(n)], max_tokens=2))
        pts += bench()["points"]
    out["standalone"] = pts
    out["ids"] = ids
    tr = lt.open_trace(run_dir)
    out["tr"] = tr
    yield out
    tr.close()


def _medians(points) -> dict[int, float]:
    by = {}
    for b, s in points:
        by.setdefault(b, []).append(s)
    return {b: statistics.median(v) for b, v in sorted(by.items())}


def _minima(points) -> dict[int, float]:
    """Per size, the fastest transfer: contention from other processes only adds time, so the
    minimum is the least-disturbed sample of the transport (medians moved 3x between runs)."""
    by = {}
    for b, s in points:
        by.setdefault(b, []).append(s)
    return {b: min(v) for b, v in sorted(by.items())}


def test_profile_moves_16x_bytes_per_token(heavy):
    assert heavy["kv_bytes_per_token"] == 16 * 1024
    lt.check_transfer_bytes(heavy["tr"], heavy["ids"], heavy["kv_bytes_per_token"])


def test_kv_transfer_follows_the_separately_measured_bandwidth(heavy):
    rows = heavy["tr"].query("SELECT request_id, bytes, xfer_ns, dur_ns FROM transfers")
    by = {r["request_id"]: r for r in rows}
    lab_pts = [(by[x]["bytes"], by[x]["dur_ns"] / 1e9) for x in heavy["ids"]]
    # the span is [post, post + NIXL's transfer duration]: its length is the NIXL duration
    assert all(abs(by[x]["dur_ns"] - by[x]["xfer_ns"]) <= 1000 for x in heavy["ids"])
    print("medians (ms): lab", {b >> 20: round(v * 1e3, 1) for b, v in _medians(lab_pts).items()},
          "standalone", {b >> 20: round(v * 1e3, 1) for b, v in _medians(heavy["standalone"]).items()})
    lab_med = _minima(lab_pts)
    sa_med = _minima(heavy["standalone"])
    fixed_sa, bw_sa = nixlbw.fit(list(sa_med.items()))
    fixed_lab, bw_lab = nixlbw.fit(list(lab_med.items()))
    expect = {b: max(fixed_sa, 0.0) + b / bw_sa for b in lab_med}  # the standalone line at the lab's sizes (printed)
    lines = [f"{b / 2**20:5.0f} MiB: kv.transfer min {lab_med[b] * 1e3:7.2f} ms, standalone line "
             f"{expect[b] * 1e3:7.2f} ms (bytes/bandwidth {b / bw_sa * 1e3:7.2f} ms)" for b in lab_med]
    lines += [f"standalone {b / 2**20:5.0f} MiB: min {v * 1e3:7.2f} ms" for b, v in sa_med.items()]
    print("\n".join(lines))
    print(f"bandwidth (slope of the per-size minima): standalone {bw_sa / 1e9:.3f} GB/s (fixed {fixed_sa * 1e3:.2f} ms), "
          f"lab kv.transfer {bw_lab / 1e9:.3f} GB/s (fixed {fixed_lab * 1e3:.2f} ms)")
    # the known answer is the growth: from the smallest to the largest transfer, kv.transfer grows by
    # ≈ (bytes difference) ÷ the separately measured bandwidth; and the slopes agree
    sizes = sorted(lab_med)
    grow = lab_med[sizes[-1]] - lab_med[sizes[0]]
    want = (sizes[-1] - sizes[0]) / bw_sa
    print(f"growth {sizes[0] / 2**20:.0f} -> {sizes[-1] / 2**20:.0f} MiB: kv.transfer +{grow * 1e3:.1f} ms, "
          f"bytes / bandwidth +{want * 1e3:.1f} ms (ratio {grow / want:.2f})")
    assert 1 / FACTOR <= grow / want <= FACTOR, (grow, want)
    assert 1 / FACTOR <= bw_lab / bw_sa <= FACTOR, (bw_lab, bw_sa)
