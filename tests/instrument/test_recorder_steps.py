"""The recorder's per-engine-step calls (issue 18's cheaper step path) write what their slower equivalents wrote."""
import duckdb

from test_recorder import _tracer


def _rows(d):
    return duckdb.sql(f"select span_id, name, record, start_ns, end_ns, attr_int, attr_str, attempt, tp_rank, "
                      f"parent_span_id, thread, status_code from read_parquet('{d}/*.parquet') "
                      f"where record = 'span' order by span_id").fetchall()


def test_end_extra_writes_the_row_end_writes_with_the_attributes_merged(tmp_path):
    """A step span closed by ``end_extra`` (its open attributes, then more, no dict merge) is the row
    ``end(attrs=...)`` writes for the same span: name, times, every attribute, parent, thread."""
    t = _tracer(tmp_path)
    t0 = t.now()
    attrs = {"step.id": 7, "step.num_reqs": 2, "step.prefill_tokens": 0, "step.decode_tokens": 2,
             "step.recompute_tokens": 0, "step.batch": "A:d1;B:d1"}
    keys = ("step.idle_before", "step.pdtrace_cpu_ns", "step.thread_cpu_ns")
    vals = (3, 4_100, 1_500_000)
    a = t.start("decode.step", None, t0, attrs=attrs, span_id=t.new_id())
    b = t.start("decode.step", None, t0, attrs=attrs, span_id=t.new_id())
    t.end(a, end_ns=t0 + 2_000_000, attrs=dict(zip(keys, vals)))
    assert t.end_extra(b, t0 + 2_000_000, keys, vals) is True
    assert attrs == {"step.id": 7, "step.num_reqs": 2, "step.prefill_tokens": 0, "step.decode_tokens": 2,
                     "step.recompute_tokens": 0, "step.batch": "A:d1;B:d1"}  # read, never changed
    assert a not in t._open and b not in t._open
    assert t.end_extra(b, t0 + 3_000_000, keys, vals) is False  # closed already: nothing written
    assert t.end_extra(12345, t0, keys, vals) is False          # never opened
    assert t.shutdown()
    rows = _rows(tmp_path)
    assert [r[0] for r in rows] == sorted([a, b])
    ra, rb = rows
    assert ra[1:] == rb[1:]
    assert ra[4] - ra[3] == 2_000_000
    assert ra[5] == {"step.id": 7, "step.num_reqs": 2, "step.prefill_tokens": 0, "step.decode_tokens": 2,
                     "step.recompute_tokens": 0, "step.idle_before": 3, "step.pdtrace_cpu_ns": 4_100,
                     "step.thread_cpu_ns": 1_500_000}
    assert ra[6] == {"step.batch": "A:d1;B:d1"}


def test_step_span_id_is_a_fresh_id_on_kept_steps_only(tmp_path):
    """``step_span_id`` = ``new_id() if step_sampled(step) else 0``: every k-th step, distinct ids; 0 when off."""
    t = _tracer(tmp_path, PDTRACE_STEP_SAMPLE=0.25)
    ids = [t.step_span_id(s) for s in range(12)]
    assert [s for s, i in enumerate(ids) if i] == [s for s in range(12) if t.step_sampled(s)] == [0, 4, 8]
    kept = [i for i in ids if i]
    assert len(set(kept)) == 3 and kept == sorted(kept)
    t.shutdown()
    assert t.step_span_id(0) == 0  # tracing off
