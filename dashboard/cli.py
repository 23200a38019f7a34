"""``pdtrace dashboard DIR``: serve the Streamlit dashboard for a trace directory.

Runs ``streamlit run`` on :mod:`pdtrace.dashboard.app` in this process's
place (exec), bound to 127.0.0.1 unless ``--host`` says otherwise. The
directory is handed to the app in ``PDTRACE_DASHBOARD_DIR``; it may not exist
yet (the dashboard waits for it) and new files are picked up as it grows.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

APP = Path(__file__).with_name("app.py")


def streamlit_argv(directory: Path, host: str, port: int) -> list[str]:
    """The ``python -m streamlit run`` command line serving the dashboard."""
    return [sys.executable, "-m", "streamlit", "run", str(APP),
            "--server.address", host, "--server.port", str(port), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--server.runOnSave", "false", "--client.toolbarMode", "minimal",
            "--theme.base", "light"]


@click.command("dashboard")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--port", default=8501, show_default=True, type=click.IntRange(1, 65535), help="TCP port to serve on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (the default serves this machine only).")
@click.option("--compare", "compare_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A second trace directory to preselect on the Push vs pull page.")
def dashboard(directory: Path, port: int, host: str, compare_dir: Path | None) -> None:
    """Serve the dashboard for trace DIRECTORY on http://HOST:PORT (Ctrl-C stops it)."""
    try:
        import plotly  # noqa: F401
        import streamlit  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"the dashboard needs the [dashboard] extra: pip install 'pdtrace[dashboard]' "
                                   f"({exc.name} is missing)") from exc
    env = dict(os.environ, PDTRACE_DASHBOARD_DIR=str(directory.expanduser().resolve()))
    if compare_dir is not None:
        env["PDTRACE_DASHBOARD_COMPARE_DIR"] = str(compare_dir.expanduser().resolve())
    if not directory.is_dir():
        click.echo(f"note: {directory} does not exist yet; the dashboard waits for it", err=True)
    click.echo(f"pdtrace dashboard: {directory} on http://{host}:{port}", err=True)
    argv = streamlit_argv(directory, host, port)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
