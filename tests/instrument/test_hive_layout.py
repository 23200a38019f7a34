"""The fleet layout (PDTRACE_LAYOUT=hive): the sink writes into date=/hour=/host= partitions, and the
analysis reads such a store by its files' own columns, never by DuckDB's hive-partition detection.

Real recorder and sink processes, real files, real DuckDB.
"""
from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import duckdb
import pytest

import fleetkit
from pdtrace.instrument import config, layout, store

SPAN_HOSTS = "SELECT DISTINCT host FROM spans ORDER BY host"
PROCESSES = "SELECT run_id, host, pid, role FROM processes ORDER BY host, pid"
SPANS = "SELECT record_id, stage, host, pid, start_ns, end_ns, attr_int, attr_str FROM spans ORDER BY record_id"


def test_layout_setting(caplog):
    assert config.from_env({}).layout == "flat"
    assert config.from_env({"PDTRACE_LAYOUT": "hive"}).layout == "hive"
    assert config.from_env({"PDTRACE_LAYOUT": " Hive "}).layout == "hive"
    assert config.from_env({"PDTRACE_LAYOUT": "parted"}).layout == "flat"
    assert "PDTRACE_LAYOUT" in caplog.text
    assert config.VARIABLES["PDTRACE_LAYOUT"].default == "flat"


def test_partition_names():
    assert layout.partition(0, "gpu-a.example") == "date=1970-01-01/hour=00/host=gpu-a.example"
    assert layout.partition(1_750_000_000 * 10**9, "h/x=1 é") == "date=2025-06-15/hour=15/host=h%2Fx%3D1%20%C3%A9"
    assert layout.partition(None, None) == ("date=__HIVE_DEFAULT_PARTITION__/hour=__HIVE_DEFAULT_PARTITION__/"
                                            "host=__HIVE_DEFAULT_PARTITION__")


def _rehome(src: Path, dst: Path, part: str) -> None:
    """Copy every store file of ``src`` into ``dst/part/`` (same names)."""
    (dst / part).mkdir(parents=True)
    for p in store.store_files(src):
        shutil.copy2(p, dst / part / p.name)


def test_analysis_reads_the_rows_host_not_the_directory(tmp_path):
    """Every file under ``host=elsewhere/`` (DuckDB's auto-detection would apply it: every file under the
    same keys) while the rows say rtr-1, gpu-a, gpu-b: spans and processes keep the rows' own host, no
    date/hour column appears, and the report is the flat copy's."""
    a = tmp_path / "flat"
    fleetkit.build(a)
    b = tmp_path / "hive"
    _rehome(a, b, "date=2031-01-01/hour=07/host=elsewhere")
    # what DuckDB would do on its own: the directory's value wins over the file's column
    files = [str(p) for p in store.store_files(b)]
    assert duckdb.sql(f"SELECT DISTINCT host FROM read_parquet({files!r})").fetchall() == [("elsewhere",)]
    hosts = [(h,) for h in sorted(fleetkit.HOSTS.values())]
    assert fleetkit.table(b, SPAN_HOSTS) == fleetkit.table(a, SPAN_HOSTS) == hosts
    assert fleetkit.table(b, PROCESSES) == fleetkit.table(a, PROCESSES)
    assert {r[1] for r in fleetkit.table(b, PROCESSES)} == set(fleetkit.HOSTS.values())
    assert fleetkit.table(b, SPANS) == fleetkit.table(a, SPANS)
    from pdtrace.analysis import db

    with db.open_trace(b) as tr:
        cols = [d[0] for d in tr.con.execute("SELECT * FROM spans LIMIT 0").description]
    assert "date" not in cols and "hour" not in cols
    assert fleetkit.report_json(b) == fleetkit.report_json(a)


#: A traced process: one request's router, prefill and decode spans (real clock), then shutdown.
TRACED = """
import sys
from pdtrace.instrument import tracer
tracer.activate()
tracer.set_resource(role='router', engine_id=None)
for k in range(20):
    t = tracer.now()
    root = tracer.record('router.request', f'x{k}', t, t + 9_000_000, {'request.mode': 'pull'})
    tracer.record('router.dispatch', f'x{k}', t, t + 1_000_000)
    tracer.event('router.first_token', f'x{k}', span_id=root, time_ns=t + 6_000_000)
    assert tracer.force_flush(30)
assert tracer.shutdown(30)
"""


def _run(child, d: Path, **env):
    r = child(TRACED, {"PDTRACE_DIR": str(d), "PDTRACE_SINK_IDLE_S": "0.5", "PDTRACE_FLUSH_INTERVAL_S": "0.05",
                       "PDTRACE_ROTATE_S": "3600", **env})
    assert r.returncode == 0, r.stderr
    return store.store_files(d)


def test_hive_sink_writes_partitions_and_answers_as_flat(tmp_path, child):
    d = tmp_path / "hive"
    files = _run(child, d, PDTRACE_LAYOUT="hive")
    host = layout.escape(socket.gethostname())
    parts = {p.parent.relative_to(d).as_posix() for p in files}
    assert files and all(p.parent != d for p in files)
    for part in parts:  # date=YYYY-MM-DD/hour=HH/host=<this host> (two hours if the run crossed one)
        date, hour, h = part.split("/")
        assert date.startswith("date=") and len(date) == 15 and hour.startswith("hour=") and len(hour) == 7
        assert h == f"host={host}"
    assert len(parts) <= 2
    # the parts were merged at the end: one segment per partition, in it, and nothing else there
    assert len(files) == len(parts) and all("-s" in p.name and not store.is_part_file(p) for p in files)
    assert all(store.check_file(p).ok for p in files)
    assert not [p for p in d.rglob("*") if p.is_file() and p.name.startswith(".") and p.suffix == ".tmp"]
    # the same files flat: the same answer
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in files:
        shutil.copy2(p, flat / p.name)
    assert fleetkit.table(d, SPANS) == fleetkit.table(flat, SPANS)
    assert len(fleetkit.table(d, SPANS)) == 40
    assert fleetkit.table(d, PROCESSES) == fleetkit.table(flat, PROCESSES)
    assert fleetkit.report_json(d) == fleetkit.report_json(flat)


def test_flat_is_the_default(tmp_path, child):
    d = tmp_path / "flat"
    files = _run(child, d)
    assert files and all(p.parent == d for p in files)
    assert not [p for p in d.iterdir() if p.is_dir()]


@pytest.mark.parametrize("layout_", ["flat", "hive"])
def test_parts_of_a_running_sink_are_in_the_partition(tmp_path, child, layout_):
    """While the sink runs (rotation an hour away), its part files are in the partition already: a reader
    listing the store recursively (store.store_files, as the analysis does) sees them."""
    d = tmp_path / layout_
    listing = (f"import json\nfrom pdtrace.instrument import store\n"
               f"print(json.dumps([str(p) for p in store.store_files({str(d)!r})]))\n")
    r = child(TRACED.replace("assert tracer.shutdown(30)", listing + "assert tracer.shutdown(30)"),
              {"PDTRACE_DIR": str(d), "PDTRACE_SINK_IDLE_S": "0.5", "PDTRACE_FLUSH_INTERVAL_S": "0.05",
               "PDTRACE_ROTATE_S": "3600", "PDTRACE_LAYOUT": layout_})
    assert r.returncode == 0, r.stderr
    seen = [Path(p) for p in json.loads(r.stdout.strip().splitlines()[-1])]
    assert len(seen) >= 5 and all(store.is_part_file(p) for p in seen)
    assert all((p.parent == d) == (layout_ == "flat") for p in seen)


def test_a_new_hour_merges_the_previous_hours_parts_in_their_partition(tmp_path):
    """The sink's rule at an hour boundary: the first part of the new hour first has the parts held so far
    merged into one segment in *their* partition; a segment never spans two. The wall clock cannot be
    moved past an hour for real, so a Collector subclass names the partition (its ``_part_dir``); the
    rest -- a client, its clock and stats rows, the files -- is the real sink code in this process."""
    from pdtrace.instrument.sink import Collector, _Conn

    d = tmp_path / "store"
    cfg = config.Config(trace_dir=str(d), layout="hive", rotate_s=3600.0, anchor_interval_s=0.01)
    h09, h10 = "date=2026-12-06/hour=09/host=h", "date=2026-12-06/hour=10/host=h"

    class TwoHours(Collector):
        part = h09

        def _part_dir(self):
            return str(d / self.part)

    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        col = TwoHours(cfg, socket.socket(socket.AF_UNIX))
        c = _Conn(a)
        col.conns[a.fileno()] = c
        col._handle(c, ("init", cfg, {"role": "router", "host": "h", "pid": 7}, 7, "t", "explicit"))
        for _ in range(3):  # a clock anchor is due every 10 ms: each write is a part with rows
            time.sleep(0.02)
            col.write_part()
        first = store.store_files(d)
        assert len(first) == 3 and all(p.parent == d / h09 and store.is_part_file(p) for p in first)
        rows = duckdb.sql(f"SELECT count(*) FROM read_parquet({[str(p) for p in first]!r})").fetchall()[0][0]
        TwoHours.part = h10
        time.sleep(0.02)
        col.write_part()
        now = store.store_files(d)
        seg = [p for p in now if p.parent == d / h09]
        assert len(seg) == 1 and not store.is_part_file(seg[0]) and "-s" in seg[0].name
        assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{seg[0]}')").fetchall()[0][0] == rows
        later = [p for p in now if p.parent == d / h10]
        assert len(later) == 1 and store.is_part_file(later[0])
        c.final = True  # the client ends: the sink merges what it holds (one part: it stays as it is)
        col.write_part()
        assert {p.parent for p in store.store_files(d)} == {d / h09, d / h10}
    finally:
        a.close()
        b.close()


def test_compacting_a_sink_store_in_place_keeps_the_answer(tmp_path, child):
    """A real sink's hive store (two runs: two processes, their segments), compacted in place into the same
    partitions tree: spans, processes and the report are those of an untouched copy."""
    from pdtrace.instrument import compact

    d = tmp_path / "hive"
    _run(child, d, PDTRACE_LAYOUT="hive")
    _run(child, d, PDTRACE_LAYOUT="hive")
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    res = compact.compact(d, min_age_s=0)
    assert res.skipped == [] and res.young == [] and len(res.deleted) == len(store.store_files(copy))
    files = store.store_files(d)
    assert files and all(compact.OUTPUT_FILE.match(p.name) and store.check_file(p).ok for p in files)
    assert fleetkit.table(d, SPANS) == fleetkit.table(copy, SPANS)
    assert len(fleetkit.table(d, SPANS)) == 80
    assert fleetkit.table(d, PROCESSES) == fleetkit.table(copy, PROCESSES)
    assert fleetkit.report_json(d) == fleetkit.report_json(copy)
