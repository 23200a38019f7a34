"""``pdtrace lab``: model → engines → router → replay → records and percentiles, in one call.

:func:`run_lab` does it all and stops every process it started (also on
errors and Ctrl-C). The run directory (default ``runs/<UTC timestamp>-<mode>/``)
holds ``run.json`` (configuration, scale factors, engine start times, summary),
``logs/`` (one log per engine and the router), ``client/requests.parquet``
(what the client saw) and, with tracing on, the router's and engines' span
files written by ``pdtrace.instrument``.

How the engines are traced (``--connector``, ``--trace/--no-trace``):

=====================  ===================================================================
``stock`` (default)    the production recipe: vLLM's stock serving command (stock connector
                       name, no module path, no ``--middleware``) plus ``PDTRACE_DIR``;
                       pdtrace's vLLM plugin traces the engines (``activation`` 'plugin')
``traced``             pdtrace's class names in ``--kv-transfer-config``
                       (``TracedNixl*Connector`` + ``kv_connector_module_path``) and
                       ``--middleware`` (``activation`` 'explicit')
``--no-trace``         no ``PDTRACE_DIR`` anywhere: nothing of pdtrace runs in the engines
                       (with ``stock``: vLLM exactly as shipped) or the router
=====================  ===================================================================

``--router vllm-router`` puts vLLM's own P/D router (:mod:`.vllm_router`) in
front of the engines instead of pdtrace's: it records no spans, so the
report's TTFT windows come from the engines' clocks (``ttft_source =
'engine'``), and the client's ``response_id`` joins its records to pdtrace's
request ids.

With tracing on, the run ends by printing the ``pdtrace report`` summary of
its directory (TTFT/TPOT by mode and prompt bucket, the
queue/compute/transfer/coordination shares, dominant stages, incomplete
requests, clock offsets); with ``--no-trace`` it says why there is no report.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from pdtrace.analysis import footprint
from pdtrace.instrument import config as instrument_config

from . import env as lab_env
from . import metrics, replay, workload
from .launcher import Lab, LabConfig
from .model import PROFILES, make_model, model_info

WORKLOADS = {"azure-conv": "AZURE_CONV", "mooncake-conv": "MOONCAKE_CONV"}
# Default length scale per trace format: CPU cannot serve 12k-token prompts quickly.
DEFAULT_LENGTH_SCALE = {"azure-csv": 0.25, "mooncake-jsonl": 0.05}
TRACED = {"pull": "TracedNixlPullConnector", "push": "TracedNixlPushConnector"}
#: ``--router``: pdtrace's traced router (default), or vLLM's ``vllm-router`` (records no spans).
ROUTERS = ("pdtrace", "vllm-router")


@dataclasses.dataclass
class LabOptions:
    mode: str = "pull"
    workload: str | None = "azure-conv"
    workload_file: Path | None = None
    max_requests: int = 20
    max_duration_s: float | None = None
    length_scale: float | None = None       # None: DEFAULT_LENGTH_SCALE[format]
    rate_scale: float = 1.0
    out: Path | None = None
    profile: str = "default"
    connector: str = "stock"                # stock | traced
    trace: bool = True                      # PDTRACE_DIR=<out> for router and engines
    seed: int = 0
    max_model_len: int = 8192
    warmup: bool = True
    request_timeout_s: float = 300.0
    progress: bool = True
    model_cache: Path | None = None
    check_env: bool = True
    role_env: dict = dataclasses.field(default_factory=dict)  # LabConfig.role_env: {role: {VAR: value}}
    engine_args: dict = dataclasses.field(default_factory=dict)  # LabConfig.role_args: {role: [engine arg, ...]}
    report: bool = True                     # print `pdtrace report` of the run directory at the end
    router: str = "pdtrace"                 # pdtrace (traced) | vllm-router (vLLM's, untraced; .vllm_router)
    inject: str | None = None               # PDTRACE_LAB_INJECT for engines and router (lab only; see .inject)
    push_dispatch: str = "concurrent"       # push: both legs at once | "serial" (D after P answered; .router)
    # called with the started Lab (engines healthy, warm-up done) just before the replay; what it returns
    # (a callable, or None) is called right after the replay (benchmarks attach a sampling profiler)
    on_replay: Callable[[object], Callable[[], None] | None] | None = None


def default_out(mode: str) -> Path:
    return Path("runs") / f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{mode}"


def resolve_workload(o: LabOptions) -> tuple[str, Path]:
    """(name, path) of the trace to replay; raises WorkloadError for an unknown name or missing file."""
    if o.workload_file is not None:
        p = Path(o.workload_file)
        if not p.is_file():
            raise workload.WorkloadError(f"--workload-file {p}: no such file")
        return p.stem, p
    from pdtrace.connector import data
    if o.workload not in WORKLOADS:
        raise workload.WorkloadError(f"unknown workload {o.workload!r}; choose from {sorted(WORKLOADS)}")
    return o.workload, getattr(data, WORKLOADS[o.workload])


class WarmupError(RuntimeError):
    """The untimed first request (first contact between P and D) did not complete."""


#: Client request id (``X-Request-Id``) of the i-th warm-up request; the router records it as
#: ``request.client_id`` on the request's ``router.request`` span, so the warm-up can be told apart in SQL.
WARMUP_CLIENT_ID = "pdtrace-lab-warmup-{}"


def _warmup(router_url: str, vocab: int, n: int, timeout_s: float = 300.0) -> float:
    """One short request per P/D pair through the router (pays first-contact handshakes); seconds taken.

    Each carries the client id :data:`WARMUP_CLIENT_ID`; it is traced like any
    other request, so the run's ``pdtrace report`` counts it.

    The first push request after start has been seen to stall 18-25 s (and once
    >300 s) on this 2-core machine under load (see BENCHMARKS.md "Lab"); a failed
    attempt is retried once, then :class:`WarmupError` is raised.
    """
    t = time.monotonic()
    for i in range(n):
        last = None
        for attempt in range(2):
            body = {"model": "lab", "prompt": [16 + (i * 7 + attempt + k) % (vocab - 16) for k in range(32)],
                    "max_tokens": 2, "ignore_eos": True}
            req = urllib.request.Request(router_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "X-Request-Id": WARMUP_CLIENT_ID.format(i)})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as r:
                    r.read()
                break
            except (OSError, urllib.error.URLError) as exc:  # HTTPError, timeouts, resets
                last = f"{type(exc).__name__} {getattr(exc, 'code', '')}".strip()
        else:
            raise WarmupError(f"the warm-up request failed twice ({last}); see the engine logs under logs/")
    return time.monotonic() - t


def router_overhead(rows: list[dict], ids: set[str]) -> dict:
    """p50/p99 (ms) of the router's own added latency over the given request ids (successful ones)."""
    xs = sorted(r["overhead_ns"] / 1e6 for r in rows if r["id"] in ids and r["overhead_ns"] >= 0 and r["status"] == 200)
    if not xs:
        return {"n": 0, "p50": None, "p99": None}
    return {"n": len(xs), "p50": replay._pct(xs, 0.5), "p99": replay._pct(xs, 0.99),
            "mean": statistics.fmean(xs)}


def run_lab(o: LabOptions, echo=print) -> dict:
    """Run one lab end to end; returns the summary written to ``run.json``.

    Raises :class:`~pdtrace.connector.lab.env.LabEnvironmentError` (environment),
    :class:`~pdtrace.connector.lab.workload.WorkloadError` (trace or scale) or
    :class:`~pdtrace.connector.lab.launcher.LabStartError` (an engine did not
    start); every process started is stopped before this returns or raises.
    """
    if o.mode not in ("pull", "push"):
        raise ValueError(f"mode must be pull or push, not {o.mode!r}")
    if o.router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, not {o.router!r}")
    if o.profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, not {o.profile!r}")
    if o.check_env:
        lab_env.check(import_check=False)
    name, path = resolve_workload(o)
    fmt = workload.detect_format(path)
    length_scale = o.length_scale if o.length_scale is not None else DEFAULT_LENGTH_SCALE[fmt]
    model_dir = make_model(o.profile, o.model_cache)
    info = model_info(model_dir)
    wl = workload.build(name, path, vocab_size=info["vocab_size"], length_scale=length_scale,
                        rate_scale=o.rate_scale, max_requests=o.max_requests, max_duration_s=o.max_duration_s,
                        seed=o.seed, max_model_len=o.max_model_len)
    out = Path(o.out) if o.out else default_out(o.mode)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {out} is not empty; pick a new --out (a run never overwrites)")
    out.mkdir(parents=True, exist_ok=True)
    run_id = out.name
    echo(f"pdtrace lab: mode={o.mode} workload={name} ({wl.fmt}) requests={len(wl.requests)} "
         f"length_scale={length_scale} rate_scale={o.rate_scale} profile={o.profile} "
         f"(KV {info['kv_bytes_per_token']} B/token) connector={o.connector} router={o.router} out={out}")
    cfg = LabConfig(model=model_dir, mode=o.mode, run_dir=out, profile=o.profile,
                    max_model_len=o.max_model_len, trace_dir=(out.resolve() if o.trace else None),
                    router_timeout_s=o.request_timeout_s, role_env=dict(o.role_env), router_kind=o.router,
                    role_args={k: list(v) for k, v in o.engine_args.items()}, push_dispatch=o.push_dispatch)
    if o.trace and not instrument_config.self_cpu_given():
        # pdtrace's own CPU per engine thread, for the footprint line (two clock reads per hook)
        cfg.extra_env["PDTRACE_SELF_CPU"] = "1"
    if o.inject:
        from . import inject as lab_inject
        lab_inject.parse(o.inject)  # raises InjectSpecError before anything starts
        cfg.extra_env[lab_inject.ENV_SWITCH] = o.inject
        cfg.role_env["router"] = {**cfg.role_env.get("router", {}), lab_inject.ENV_SWITCH: o.inject}
    if o.connector == "traced":
        cfg.connector_class, cfg.connector_module = TRACED[o.mode], "pdtrace.connector.traced"
        cfg.extra_args = ["--middleware", "pdtrace.connector.traced.middleware.FrontendMiddleware"]
    summary: dict = {"run_id": run_id, "mode": o.mode, "profile": o.profile, "connector": cfg.connector(),
                     "activation": activation(o),
                     "connector_module": cfg.connector_module, "model": str(model_dir), "model_info": info,
                     "workload": wl.summary(), "vllm_build": f"{lab_env.VLLM_DIST}=={lab_env.VLLM_VERSION}",
                     "nixl_progress_thread": cfg.prog_thread, "router": o.router, "engine_args": cfg.role_args,
                     "push_dispatch": cfg.push_dispatch, "inject": o.inject or None}
    if o.router == "vllm-router":
        import importlib.metadata

        from . import vllm_router
        summary["router_build"] = f"{vllm_router.DIST}=={importlib.metadata.version(vllm_router.DIST)}"
    t_start = time.monotonic()
    with Lab(cfg) as lab:
        summary["engine_start_s"] = {k: round(v, 2) for k, v in lab.start_s.items()}
        summary["lab_start_s"] = round(time.monotonic() - t_start, 2)
        echo(f"engines healthy in {summary['lab_start_s']:.1f} s "
             f"({', '.join(f'{k} {v:.1f} s' for k, v in summary['engine_start_s'].items())})")
        if o.warmup:
            summary["warmup_s"] = round(_warmup(lab.router_url, info["vocab_size"],
                                                max(cfg.n_prefill, cfg.n_decode)), 3)
            echo(f"warm-up (first-contact handshake) {summary['warmup_s']:.2f} s")
        d_before = [metrics.prompt_tokens_by_source(e.url) for e in lab.decodes]
        after_replay = o.on_replay(lab) if o.on_replay is not None else None
        t_replay = time.monotonic()
        try:
            recs = asyncio.run(replay.replay(wl, lab.router_url, timeout_s=o.request_timeout_s, progress=o.progress))
        finally:
            if after_replay is not None:
                after_replay()
        summary["replay_wall_s"] = round(time.monotonic() - t_replay, 3)
        d_after = [metrics.prompt_tokens_by_source(e.url) for e in lab.decodes]
        rows = metrics.router_stats(lab.router_url) if o.router == "pdtrace" else []  # only ours has /_lab/stats
        helpers = footprint.sample_helpers(cfg.trace_dir, os.getpid()) if cfg.trace_dir else None  # alive
        run_s = time.monotonic() - t_start
    summary["decode_prompt_tokens_by_source"] = {
        k: sum(a[k] - b[k] for a, b in zip(d_after, d_before)) for k in d_after[0]}
    summary["client_records"] = replay.write_records(recs, out / "client", run_id)
    summary["client"] = replay.latency_summary(recs)
    ids = {r.router_request_id for r in recs if r.router_request_id}
    summary["router_overhead_ms"] = router_overhead(rows, ids)
    (out / "run.json").write_text(json.dumps(summary, indent=2, default=str))
    echo("")
    echo(replay.format_summary(summary["client"]))
    ro = summary["router_overhead_ms"]
    if ro["n"]:
        echo(f"router's own added latency: p50 {ro['p50']:.2f} ms  p99 {ro['p99']:.2f} ms  (n={ro['n']})")
    src = summary["decode_prompt_tokens_by_source"]
    echo(f"decode prompt tokens: computed locally {src['local_compute']:.0f}, from KV transfer "
         f"{src['external_kv_transfer']:.0f}, local prefix-cache hits {src['local_cache_hit']:.0f}")
    echo(f"scale factors: length x{length_scale}, rate x{o.rate_scale}; run directory: {out}")
    if o.report:
        if o.router != "pdtrace" and no_report_reason(o) is None:
            echo(f"{o.router} records no spans: the report's TTFT runs on the engines' clocks "
                 "(ttft_source engine: P's API server received -> D's API server wrote the first token), "
                 f"the router hop unseen; it counts the {len(recs)} replayed requests and the warm-up "
                 f"(whose id is {o.router}'s, not {WARMUP_CLIENT_ID.format('N')})")
        elif o.warmup and no_report_reason(o) is None:
            k = max(cfg.n_prefill, cfg.n_decode)
            echo(f"the report counts every request the router traced: the {len(recs)} replayed and the {k} "
                 f"warm-up request{'s' if k > 1 else ''} (client id {WARMUP_CLIENT_ID.format('N')}, which paid the "
                 "first-contact handshake)")
        summary["report"] = print_report(out, o, echo)
        (out / "run.json").write_text(json.dumps(summary, indent=2, default=str))
    if helpers is not None:
        summary["footprint"] = print_footprint(out, helpers, run_s, echo)
        (out / "run.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def print_footprint(out: Path, helpers, run_s: float, echo=print) -> dict | None:
    """Echo the ``pdtrace footprint:`` line of run directory ``out`` (:mod:`pdtrace.analysis.footprint`);
    return its figures, with the helper reading's pids and time. A failure is reported, never raised."""
    from pdtrace.analysis import footprint as fpm
    try:
        fp = fpm.of_run(out, helpers, run_s)
    except Exception as exc:  # noqa: BLE001 - the run is done
        echo(f"pdtrace footprint: failed ({type(exc).__name__}: {exc})")
        return None
    echo(fpm.line(fp))
    return {**dataclasses.asdict(fp), "helper_pids": helpers.pids, "helper_reading_time_s": helpers.time_s}


def activation(o: LabOptions) -> str | None:
    """How the engines' tracing is switched on: 'plugin' (stock command + PDTRACE_DIR), 'explicit'
    (pdtrace's class names and --middleware), None (--no-trace). The engines' ``recorder.stats`` rows
    carry the same word (``attr_str['pdtrace.activation']``)."""
    if not o.trace:
        return None
    return "explicit" if o.connector == "traced" else "plugin"


def no_report_reason(o: LabOptions) -> str | None:
    """Why this run has no pdtrace report (None: it has one)."""
    if not o.trace:
        return "tracing was off (--no-trace)"
    return None


def print_report(out: Path, o: LabOptions, echo=print) -> dict | None:
    """Echo the ``pdtrace report`` text of run directory ``out``; return its data (``report.collect``).

    Uses the same per-directory cache as ``pdtrace report DIR`` (so that command
    is fast afterwards). A failing analysis is reported, never raised: the run
    itself succeeded. Returns None when there is no report.
    """
    echo("")
    why = no_report_reason(o)
    if why is not None:
        echo(f"no pdtrace report: {why}")
        return None
    try:
        from pdtrace import analysis
        from pdtrace.analysis import report
        with analysis.open(out) as s:
            data = report.collect(s.cursor())
        for path, reason in s.skipped:
            echo(f"warning: skipped store file {path}: {reason}")
    except Exception as exc:  # noqa: BLE001 - the run is done; say what failed and how to retry
        echo(f"pdtrace report failed ({type(exc).__name__}: {exc}); retry with: pdtrace report {out}")
        return None
    echo(f"pdtrace report {out}")
    echo(report.render(data, str(out)))
    return data


def main_safe(o: LabOptions, echo=print) -> int:
    """Run and turn the expected failures into one clear message and exit code 2 (Ctrl-C: 130)."""
    from .launcher import LabStartError
    try:
        s = run_lab(o, echo)
    except KeyboardInterrupt:
        echo("interrupted; every lab process was stopped")
        return 130
    except (lab_env.LabEnvironmentError, workload.WorkloadError, LabStartError, WarmupError, FileExistsError,
            ValueError) as exc:
        echo(f"pdtrace lab: error: {exc}")
        return 2
    return 0 if s["client"]["failed"] == 0 else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_safe(LabOptions()))
