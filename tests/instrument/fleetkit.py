"""A small fleet store for the layout and compaction tests: requests over three UTC hours, three hosts,
many small files (as hosts' sinks leave them), one file mixing two hosts, one duplicate copy.

Requests are hand-built with tests/analysis/pdtrace_case_builder.py (so the report has real TTFT
breakdowns to compare); files are written with :func:`pdtrace.instrument.store.write_rows`.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
from pdtrace_case_builder import RUN, Case  # noqa: E402

from pdtrace.cli.main import main as cli_main  # noqa: E402
from pdtrace.instrument import store  # noqa: E402

#: host of each role's process (the rows' own host column)
HOSTS = {"router": "rtr-1", "prefill": "gpu-a", "decode": "gpu-b"}

#: requests, their arrival every 20 min: three UTC hours from the builder's T0 (2025-06-15 15:06:40 UTC)
N_REQUESTS = 9
GAP_MS = 20 * 60 * 1000


def _case() -> Case:
    c = Case()
    for k in range(N_REQUESTS):
        rid, t = f"q{k}", k * GAP_MS
        root = c.router_request(rid, t, t + 650 + k, "pull", first_token_ms=t + 600 + k)
        c.span("router", "router.dispatch", t, t + 3, rid=rid, parent=root, attrs={"router.leg": "prefill"})
        c.span("router", "router.wait", t + 3, t + 405, rid=rid, parent=root, attrs={"router.leg": "prefill"})
        c.span("prefill", "prefill.compute", t + 3, t + 403, rid=rid, engine="p0")
        c.span("prefill", "prefill.frontend", t + 403, t + 405, rid=rid, engine="p0")
        c.span("router", "router.dispatch", t + 405, t + 415, rid=rid, parent=root, attrs={"router.leg": "decode"})
        hp = c.span("decode", "handoff.prep", t + 415, t + 460, rid=rid, engine="d0", rank=0)
        c.span("decode", "handoff.step_wait", t + 415, t + 460, rid=rid, engine="d0", rank=0, parent=hp)
        c.span("decode", "kv.transfer", t + 460, t + 480 + k, rid=rid, engine="d0", rank=0)
        c.span("decode", "kv.ready", t + 480 + k, t + 540 + k, rid=rid, engine="d0")
        c.span("decode", "decode.first_step", t + 540 + k, t + 598 + k, rid=rid, engine="d0")
        c.span("decode", "decode.frontend", t + 598 + k, t + 600 + k, rid=rid, engine="d0")
    return c


def build(d: Path, chunk: int = 7, age_s: float = 3 * 86400) -> list[Path]:
    """Write the fleet store into ``d``: each process's rows in files of ``chunk`` rows (named like a sink's
    segments), one file holding rows of two hosts (the router's last 3, the decode engine's last 4), one
    duplicate copy (an old orphan part holding a segment's rows, as a sink killed between its merge's rename
    and its deletes leaves). Every file's mtime is set ``age_s`` seconds in the past. Returns the files."""
    d.mkdir(parents=True, exist_ok=True)
    out, mixed, seq = [], [], 0
    for (role, engine), rows in sorted(_case().rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        host = HOSTS[role]
        pid = {"router": 101, "prefill": 202, "decode": 303}[role]
        res = {"run_id": RUN, "role": role, "engine_id": engine, "host": host, "pid": pid,
               "service_name": f"pdtrace-{role}"}
        rows = sorted(rows, key=lambda r: r["start_ns"])
        if role in ("router", "decode"):
            n = 3 if role == "router" else 4
            rows, mixed = rows[:-n], mixed + [dict(r, **res) for r in rows[-n:]]
        for i in range(0, len(rows), chunk):
            seq += 1
            name = f"sink-{host.replace('-', '_')}-{pid}-20250615T150000-s{seq:06d}.parquet"
            out.append(store.write_rows(d, rows[i:i + chunk], resource=res, name=name))
    out.append(store.write_rows(d, mixed, name="manual-mixed-1.parquet"))
    dup = d / "sink-rtr_1-101-20250615T150000-p000001.parquet"  # an orphan part: the same records as out[0]
    shutil.copyfile(out[0], dup)
    out.append(dup)
    t = time.time() - age_s
    for p in out:
        os.utime(p, (t, t))
    return sorted(out)


def report_json(d: Path) -> dict:
    """``pdtrace report DIR --format json --no-cache`` parsed; skipped files' paths made relative to ``d``."""
    r = CliRunner().invoke(cli_main, ["report", str(d), "--format", "json", "--no-cache"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout if hasattr(r, "stdout") else r.output)
    for s in data.get("skipped_files") or []:
        s["path"] = os.path.relpath(s["path"], d)
    return data


def table(d: Path, sql: str) -> list[tuple]:
    """Rows of ``sql`` over the analysis of ``d`` (in memory, no cache)."""
    from pdtrace.analysis import db

    with db.open_trace(d) as tr:
        return [tuple(r.values()) for r in tr.query(sql)]
