"""Generate a synthetic span store for the analysis benchmark.

``python benchmarks/analysis_gen.py OUT_DIR [--requests 1000000] [--chunks 20]``
writes, per (process, time chunk), one store file built with DuckDB and cast
to :data:`pdtrace.instrument.schema.SCHEMA` (the recorder's exact schema and
version metadata). Half the requests are pull, half push; P and D run at
TP=2 (per-rank handoff.prep/kv.transfer); 0.1 % pay a first-contact
handshake; every 10th request also yields a decode.step span. About 19 rows
(17 spans, 2 events) per request: 1M requests -> ~19M rows.

``--tail N`` writes N more requests as one extra file set named ``new-*``
(for the "absorb one new file" measurement) into ``OUT_DIR/../<name>-tail``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import duckdb
import pyarrow as pa

from pdtrace.instrument import schema, store

T0 = 1_760_000_000_000_000_000
GAP_NS = 3_600_000  # one arrival every 3.6 ms: 1M requests in one hour
MS = 1_000_000

# Per request i: a = arrival; durations in ns from hash(i, k); cumulative
# times as columns; each span type one SELECT (role, engine, rank, name, start, end).
_REQ = """
CREATE OR REPLACE TEMP TABLE req AS
SELECT i, {T0} + (i * {GAP_NS})::BIGINT AS a,
       CASE WHEN i % 2 = 0 THEN 'pull' ELSE 'push' END AS mode,
       'p' || (i % 4) AS p, 'd' || ((i // 4) % 4) AS d,
       128 + (hash(i, 1) % 8000)::BIGINT AS prompt_tokens,
       (hash(i, 2) % 4)::BIGINT * 128 AS cached_tokens,
       16 + (hash(i, 3) % 256)::BIGINT AS output_tokens,
       (hash(i, 4) % (20 * {MS}))::BIGINT AS pq,
       (20 * {MS} + hash(i, 5) % (200 * {MS}))::BIGINT AS pc,
       (hash(i, 6) % (5 * {MS}))::BIGINT AS dq,
       CASE WHEN hash(i, 7) % 1000 = 0 THEN 1200 * {MS} ELSE {MS} // 2 END AS prep,
       (5 * {MS} + hash(i, 8) % (20 * {MS}))::BIGINT AS xfer,
       (hash(i, 9) % (25 * {MS}))::BIGINT AS ready,
       (20 * {MS} + hash(i, 10) % (10 * {MS}))::BIGINT AS fs,
       (hash(i, 11) % (300 * {MS}))::BIGINT AS reg
FROM range({lo}, {hi}) t(i);
CREATE OR REPLACE TEMP TABLE tl AS
SELECT *,
  a + {MS} AS p_in,                                  -- dispatch 1 ms
  a + 2 * {MS} AS p_q0,                              -- P frontend 1 ms
  a + 2 * {MS} + pq AS p_c0,
  a + 2 * {MS} + pq + pc AS p_c1,
  CASE WHEN mode = 'pull' THEN a + 4 * {MS} + pq + pc ELSE a + {MS} END AS d_in,   -- pull: P response 1 + D dispatch 1
  CASE WHEN mode = 'pull' THEN a + 5 * {MS} + pq + pc ELSE a + 2 * {MS} END AS d_q0,
  CASE WHEN mode = 'pull' THEN a + 5 * {MS} + pq + pc + dq ELSE a + 2 * {MS} + dq END AS d_q1
FROM req;
CREATE OR REPLACE TEMP TABLE tl2 AS
SELECT *,
  CASE WHEN mode = 'pull' THEN d_q1 ELSE greatest(p_c1, d_q1 + reg) END AS j0,   -- handoff.prep start
  CASE WHEN mode = 'pull' THEN d_q1 + prep ELSE greatest(p_c1, d_q1 + reg) + prep END AS x0
FROM tl;
CREATE OR REPLACE TEMP TABLE tl3 AS
SELECT *, x0 + xfer AS r0, x0 + xfer + ready AS f0, x0 + xfer + ready + fs AS f1, x0 + xfer + ready + fs + {MS} AS ft
FROM tl2;
"""

_SPANS = """
SELECT 'router' AS role, NULL AS eng, NULL::SMALLINT AS rank, 'router.request' AS name, a AS s, ft + 20 * {MS} AS e, 0 AS k, NULL::INT AS parent_k,
       MAP {{'gen_ai.usage.input_tokens': prompt_tokens, 'gen_ai.usage.output_tokens': output_tokens, 'request.num_cached_tokens': cached_tokens}} AS ai,
       MAP {{'request.mode': mode}} AS astr, i, mode FROM tl3
UNION ALL SELECT 'router', NULL, NULL, 'router.dispatch', a, p_in, 1, 0, NULL, MAP {{'router.leg': 'prefill'}}, i, mode FROM tl3
UNION ALL SELECT 'router', NULL, NULL, 'router.dispatch', CASE WHEN mode='pull' THEN d_in - {MS} ELSE a END, d_in, 2, 0, NULL, MAP {{'router.leg': 'decode'}}, i, mode FROM tl3
UNION ALL SELECT 'router', NULL, NULL, 'router.wait', p_in, CASE WHEN mode='pull' THEN d_in - {MS} ELSE ft END, 3, 0, NULL, MAP {{'router.leg': 'prefill'}}, i, mode FROM tl3
UNION ALL SELECT 'prefill', p, NULL, 'prefill.frontend', p_in, p_q0, 4, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'prefill', p, NULL, 'prefill.queue', p_q0, p_c0, 5, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'prefill', p, NULL, 'prefill.compute', p_c0, p_c1, 6, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'prefill', p, NULL, 'prefill.frontend', p_c1, p_c1 + {MS}, 7, NULL, NULL, NULL, i, mode FROM tl3 WHERE mode = 'pull'
UNION ALL SELECT 'decode', d, NULL, 'decode.frontend', d_in, d_q0, 8, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'decode', d, NULL, 'decode.queue', d_q0, d_q1, 9, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'decode', d, NULL, 'dest.register', d_q1, d_q1 + reg, 10, NULL, NULL, NULL, i, mode FROM tl3 WHERE mode = 'push'
UNION ALL SELECT CASE WHEN mode='pull' THEN 'decode' ELSE 'prefill' END, CASE WHEN mode='pull' THEN d ELSE p END, r.rank, 'handoff.prep', j0, x0, 11 + r.rank, NULL,
       MAP {{'kv.first_contact': (prep > 1000 * {MS})::INT::BIGINT}}, MAP {{'peer.engine_id': CASE WHEN mode='pull' THEN p ELSE d END}}, i, mode
       FROM tl3, (VALUES (0), (1)) r(rank)
UNION ALL SELECT CASE WHEN mode='pull' THEN 'decode' ELSE 'prefill' END, CASE WHEN mode='pull' THEN d ELSE p END, r.rank, 'kv.transfer', x0, r0 - r.rank * 200000, 13 + r.rank, NULL,
       MAP {{'kv.bytes': prompt_tokens * 65536, 'kv.descriptors': prompt_tokens // 16 * 28, 'kv.post_ns': 300000, 'kv.xfer_ns': xfer}},
       MAP {{'kv.op': CASE WHEN mode='pull' THEN 'READ' ELSE 'WRITE' END, 'peer.engine_id': CASE WHEN mode='pull' THEN p ELSE d END, 'kv.backend': 'UCX'}}, i, mode
       FROM tl3, (VALUES (0), (1)) r(rank)
UNION ALL SELECT 'decode', d, NULL, 'kv.ready', r0, f0, 15, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'decode', d, NULL, 'decode.first_step', f0, f1, 16, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'decode', d, NULL, 'decode.frontend', f1, ft, 17, NULL, NULL, NULL, i, mode FROM tl3
UNION ALL SELECT 'prefill', p, NULL, 'prefill.block_hold', p_c1, r0 + {MS}, 18, NULL, MAP {{'kv.blocks': prompt_tokens // 16}}, MAP {{'kv.release_cause': 'notification'}}, i, mode FROM tl3
"""

_ROWS = f"""
SELECT '{schema.SCHEMA_VERSION}' AS schema_version, rec AS record, record_id, trace_id, span_id, parent_span_id, name,
       1::TINYINT AS kind, s AS start_ns, e AS end_ns, 0::TINYINT AS status_code, NULL::VARCHAR AS status_message,
       rid AS request_id, 0 AS prompt_index, 0 AS attempt, rank AS tp_rank, 'MainThread' AS thread,
       coalesce(ai, MAP {{}}::MAP(VARCHAR, BIGINT)) AS attr_int, MAP {{}}::MAP(VARCHAR, DOUBLE) AS attr_float,
       coalesce(astr, MAP {{}}::MAP(VARCHAR, VARCHAR)) AS attr_str,
       'bench' AS run_id, 'pdtrace-' || role AS service_name, role, eng AS engine_id, 'bench-host' AS host,
       1 AS pid, '0.1.0' AS pdtrace_version, NULL::VARCHAR AS vllm_version,
       CASE WHEN role = 'router' THEN NULL WHEN mode = 'push' THEN 'TracedNixlPushConnector' ELSE 'TracedNixlPullConnector' END AS connector,
       NULL::VARCHAR AS config_hash, chunk, proc
FROM (
    SELECT 'span' AS rec, (i * 32 + k)::UBIGINT AS record_id, (i * 32 + k)::UBIGINT AS span_id,
           CASE WHEN parent_k IS NULL THEN NULL ELSE (i * 32 + parent_k)::UBIGINT END AS parent_span_id,
           md5(i::VARCHAR) AS trace_id, name, s, e, 'r' || i AS rid, rank, ai, astr, role, eng, mode,
           i // ? AS chunk, coalesce(eng, 'router') AS proc
    FROM ({_SPANS.format(MS=MS)})
    UNION ALL
    SELECT 'event', (i * 32 + 20)::UBIGINT, (i * 32)::UBIGINT, NULL, md5(i::VARCHAR), 'router.first_token', ft, ft, 'r' || i,
           NULL, NULL, NULL, 'router', NULL, mode, i // ?, 'router' FROM tl3
    UNION ALL
    SELECT 'event', (i * 32 + 21)::UBIGINT, (i * 32)::UBIGINT, NULL, md5(i::VARCHAR), 'router.last_token',
           ft + output_tokens * 20 * {MS}, ft + output_tokens * 20 * {MS}, 'r' || i, NULL, NULL, NULL, 'router', NULL, mode, i // ?, 'router' FROM tl3
    UNION ALL
    SELECT 'span', (i * 32 + 22)::UBIGINT, (i * 32 + 22)::UBIGINT, NULL, NULL, 'decode.step', ft, ft + 21 * {MS}, NULL,
           0::SMALLINT, MAP {{'step.id': i // 10}}, MAP {{'step.batch': 'r' || i || ':d1;r' || (i + 1) || ':d1'}},
           'decode', d, mode, i // ?, d FROM tl3 WHERE i % 10 = 0
)
"""


def generate(out: Path, lo: int, hi: int, chunks: int, prefix: str = "") -> int:
    """Write requests [lo, hi) as store files in ``out``; return rows written."""
    out.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute(_REQ.format(lo=int(lo), hi=int(hi), T0=T0, GAP_NS=GAP_NS, MS=MS))
    per_chunk = max(1, -(-(hi - lo) // chunks))
    con.execute(f"CREATE OR REPLACE TEMP TABLE rows AS {_ROWS}", [per_chunk] * 4)
    n = 0
    keys = con.execute("SELECT DISTINCT chunk, proc FROM rows ORDER BY ALL").fetchall()
    for chunk, proc in keys:
        tbl = con.sql(f"SELECT * EXCLUDE (chunk, proc) FROM rows WHERE chunk = {int(chunk)} AND proc = '{proc}'"
                      ).to_arrow_table()
        tbl = pa.Table.from_arrays([tbl.column(f.name).cast(f.type) for f in schema.SCHEMA], schema=schema.SCHEMA)
        store.write_table(out, tbl, name=f"{prefix}{proc}-{chunk:04d}.parquet")
        n += tbl.num_rows
    con.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--tail", type=int, default=2000, help="requests in the extra 'new file' set")
    a = ap.parse_args()
    t = time.perf_counter()
    n = generate(a.out, 0, a.requests, a.chunks)
    print(f"wrote {n:,} rows for {a.requests:,} requests to {a.out} in {time.perf_counter() - t:.1f} s")
    tail = a.out.parent / (a.out.name + "-tail")
    n = generate(tail, a.requests, a.requests + a.tail, 1, prefix="new-")
    print(f"wrote {n:,} rows for {a.tail:,} more requests to {tail}")


if __name__ == "__main__":
    main()
