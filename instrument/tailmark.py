"""``pdtrace mark [--seconds N] [--before S] DIR``: mark a window in which tail retention keeps every request.

With ``PDTRACE_RETAIN=tail`` (:mod:`pdtrace.instrument.retention`) the host's sink writes only slow,
failed, marked and head-sampled requests. An operator who sees trouble marks a window: this command
appends ``[now - S, now + N]`` (wall-clock ns, the host's ``CLOCK_REALTIME``) as one JSON line to
``DIR/tail-marks.jsonl``; every sink writing into ``DIR`` reads the new lines at its next look (every
half second, :data:`pdtrace.instrument.retention.MARK_POLL_S`, while its loop is not busy writing: up to
about a flush interval) and keeps every request whose records overlap the window, and every engine step
in it. ``--before`` reaches back only as far as the sinks still hold undecided requests: those not ended
(up to ``PDTRACE_TAIL_HOLD_S`` idle) and, for requests already ended, about the grace after their end
(2 flush intervals + 0.25 s); an earlier request is decided already.
Sending SIGUSR1 to a sink process does the same with S = 30, N = 60. Light module: no pyarrow.
"""
from __future__ import annotations

import os
import time

import click

from .retention import add_mark, marks_path


@click.command("mark")
@click.argument("trace_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--seconds", type=click.FloatRange(0, 86400), default=60.0, show_default=True,
              help="length of the window from now on (s)")
@click.option("--before", type=click.FloatRange(0, 86400), default=30.0, show_default=True,
              help="start the window this long before now (s): requests the sinks still hold")
def mark(trace_dir: str, seconds: float, before: float) -> None:
    """Mark [now - BEFORE, now + SECONDS] in TRACE_DIR: tail retention keeps every request in it."""
    now = time.time_ns()
    start, end = now - int(before * 1e9), now + int(seconds * 1e9)
    try:
        add_mark(trace_dir, start, end, f"pdtrace mark (pid {os.getpid()})")
    except OSError as exc:
        raise click.ClickException(f"cannot write {marks_path(trace_dir)}: {exc.strerror or exc}") from exc
    click.echo(f"marked {before:g} s before to {seconds:g} s after now in {marks_path(trace_dir)} "
               f"(wall ns {start}..{end})")
