"""The ``pdtrace`` command: one click group, subcommands contributed by each part.

Subcommands are imported lazily so that ``pdtrace report`` never imports vLLM
and ``pdtrace --help`` stays fast.
"""
from __future__ import annotations

import importlib

import click

# subcommand name -> (module, attribute, one-line help)
_SUBCOMMANDS = {
    "lab": ("pdtrace.connector.cli", "lab", "Run the local P/D lab (real vLLM engines, router, trace replay)."),
    "report": ("pdtrace.analysis.cli", "report", "Print the TTFT breakdown summary of a trace directory."),
    "sql": ("pdtrace.analysis.cli", "sql", "Run read-only SQL over a trace directory's views."),
    "materialize": ("pdtrace.analysis.cli", "materialize",
                    "Analyse a trace directory once (DuckDB or Spark) into Parquet datasets and a database."),
    "check": ("pdtrace.analysis.cli", "check", "Check that tracing works: processes writing, drops, errors, clocks."),
    "dashboard": ("pdtrace.dashboard.cli", "dashboard", "Serve the Streamlit dashboard for a trace directory."),
    "collect": ("pdtrace.instrument.collect", "collect", "Receive OTLP/HTTP spans from routers and engines into a trace directory."),
    "mark": ("pdtrace.instrument.tailmark", "mark", "Mark a time window in which tail retention keeps every request."),
    "compact": ("pdtrace.instrument.compact", "compact_command",
                "Rewrite a trace directory's small files as large files in hourly partitions."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(_SUBCOMMANDS))

    def format_commands(self, ctx, formatter):
        # Listed from the static table: --help must not import vLLM or Streamlit.
        rows = [(name, _SUBCOMMANDS[name][2]) for name in sorted(_SUBCOMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in _SUBCOMMANDS:
            return cmd
        module, attr, _ = _SUBCOMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise click.ClickException(f"'pdtrace {name}' is unavailable: {exc}") from exc


@click.group(cls=_LazyGroup)
@click.version_option(package_name="pdtrace")
def main() -> None:
    """pdtrace: where did each request's time to first token go?"""


if __name__ == "__main__":  # pragma: no cover
    main()
