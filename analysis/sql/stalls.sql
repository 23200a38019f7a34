-- module: stalls
-- requires: spans, request_base, in_flight
-- materialize: _step_span_part file
-- materialize: _step_entry_part file
-- materialize: _open_step_part file
-- materialize: _step_baseline full
-- materialize: _req_decode_steps full
-- materialize: decode_stall_causes full
-- materialize: _stall_victims full
-- comments-like: decode_stall_causes (engine_id, step_id, start_ns, step_span_id) -> decode_stalls
-- comments-like: decode_stall_causes (engine_id, start_ns, step_span_id) -> decode_step_requests
--
-- Materialized (recomputed on every refresh that absorbs files: a step's
-- baseline depends on the steps before it on its engine), so the dashboard
-- reads tables, not the store's files.
--
-- Decode stalls (DESIGN.md §3: a step's excess over the median of recent
-- steps of the same batch shape with no connector work or prefill tokens,
-- shared among the step's causes). For each decode.step on an engine:
--   shape     = number of requests with decode tokens in the step (step.batch 'X:d1' entries)
--   handoff connector work = a connector.* child of the step (connector work
--               on the forward thread) that served a handoff: its
--               connector.request_ids names at least one request (the requests
--               whose KV it loaded or saved, or whose transfer it saw finish).
--               A child naming none is routine work -- vLLM calls
--               get_transfer_results / get_finished (connector.poll), and
--               start_load_kv / wait_for_save, on every step whether or not a
--               transfer is in flight -- and is part of every step's normal
--               cost, so it is neither "connector work" for cleanliness nor a
--               cause: DESIGN's "no connector work" means no handoff's work.
--   clean     = no handoff connector work, no prefill ('p') and no recompute
--               ('r') tokens in the step (routine connector work allowed)
--   load      = (batch_reqs, load_tokens): the requests in the step (every
--               entry of step.batch, decode, prefill or recompute: a newly
--               admitted request is one more sequence in the batch) and its
--               decode-equivalent scheduled tokens (decode tokens, plus 1 per
--               prefill/recompute entry: the one token such an entry adds as a
--               member of the batch; its other tokens are its own extra work,
--               the cause). For a clean step load = (shape, decode tokens).
--   baseline  = the step time its load costs on a clean step of the same
--               engine (DESIGN.md §3 "Decode stall"; issue 17 kind 8), the
--               first of these that exists (decode_stalls.baseline_rule):
--     'load_recent'  median of the last _stall_baseline_steps() clean steps of
--                    the same load before the step
--     'load'         median of all clean steps of the same load
--     'fit'          (only for a step no clean step of its load prices) the
--                    linear step-time model of the engine's last
--                    _stall_fit_steps() clean steps before the step (all its
--                    clean steps when none precede; moments from running
--                    integer sums, so no per-step window of the fit), at the load:
--                      t(n, T) = a + b_n * n + b_T * T
--                    least squares over those steps (n = batch_reqs, T =
--                    load_tokens); with n and T collinear (plain decode: T = n)
--                    or one of them constant, the fit is on the one that
--                    varies; not identifiable (every clean step has the same
--                    load): no fit. Negative predictions are cut to 0.
--     'shape_recent' / 'shape'  the median of clean steps with the step's
--                    decode requests and decode tokens alone (the rule before
--                    issue 17, kept as the last resort: a step whose load no
--                    clean step had and no fit reaches)
--   Source of the model: a decode step reads every weight once (a fixed cost)
--   plus each sequence's KV and does per-token compute, so on the memory-bound
--   decode side step time is affine in the batch's sequences and scheduled
--   tokens (roofline reasoning; measured as "14.85 ms fixed against 0.41 ms
--   per row", gittensor-ai-lab/sparkinfer#994; ITL rising with the decode batch
--   in P/D, sgl-project/sglang#12972). vLLM's scheduler bounds a step by its
--   token budget (max_num_batched_tokens) and sequence cap (max_num_seqs): the
--   same two quantities. A prefill chunk's tokens beyond its one
--   decode-equivalent token are compute-bound work the decode-fitted model does
--   not cover: they stay a cause (DESIGN.md §3; chunked-prefill bursts starving
--   decodes, FlashML-org/FreeToken#483, tenstorrent/vllm-tt-plugin#109).
--   A step whose duration its load explains has no excess: a batch that grew by
--   a newly admitted request is not a stall of its neighbours.
--   excess    = max(0, duration - baseline) for a step with a cause; 0 for a clean step
-- The excess is shared among the step's causes in proportion to their time:
--   handoff connector spans get their measured duration (split equally among
--   the request ids in connector.request_ids); the rest of the excess goes to
--   prefill/recompute entries in proportion to their tokens. When the
--   connector time alone exceeds the excess, it is scaled down to the excess.
--   Excess with no cause left to carry it is 'unexplained' (culprit NULL).
-- Every request decoding in the step waits for the whole step, so each victim
-- pays the whole excess, attributed to the culprits by share.

-- The engine steps and their connector.* children, per store file (materialize
-- kind 'file': a refresh reads only new files for them), raw times; duplicate
-- copies skipped in _step_span_rows.
CREATE OR REPLACE VIEW _calc_step_span_part AS
SELECT _file, record_id, span_id, parent_span_id, name, engine_id, domain, start_ns, end_ns,
       attr_int['step.id'] AS step_id, coalesce(attr_str['step.batch'], '') AS batch,
       attr_str['vllm.method'] AS method, coalesce(attr_str['connector.request_ids'], '') AS request_ids
FROM _file_rows
WHERE record = 'span' AND (name = 'decode.step' OR name LIKE 'connector.%');
CREATE TABLE IF NOT EXISTS _mat_step_span_part AS SELECT * FROM _calc_step_span_part LIMIT 0;
CREATE OR REPLACE VIEW _step_span_rows AS
SELECT * FROM _mat_step_span_part p
WHERE NOT _hidden_copy(p.record_id, p._file);

-- decode.step spans on the router clock (a span row without a valid end -- end
-- missing or before its start -- is an open step, view _open_steps, not a step)
CREATE OR REPLACE VIEW _steps AS
SELECT span_id, engine_id, c_start_ns AS start_ns, c_end_ns AS end_ns, end_ns - start_ns AS dur_ns, step_id, batch
FROM _clock_corrected('_step_span_rows') WHERE name = 'decode.step' AND end_ns >= start_ns;

-- The batch entries of each decode.step (step.batch 'X:p128;Y:d1;Z:r64'), one
-- row per (step, request): request_id (base id X), kind ('p' prefill, 'd'
-- decode, 'r' recompute) and tokens. Parsed once per store file (materialize
-- kind 'file', from the steps _step_span_part has just taken from the files
-- being read: the text parse is the costly part, and an absorb parses only the
-- new files); duplicate copies of a step skipped in _step_entries.
CREATE OR REPLACE VIEW _calc_step_entry_part AS
SELECT _file, record_id, span_id, engine_id, _base_request_id(mm.rid) AS request_id, mm.kind AS kind,
       mm.tok::BIGINT AS tokens
FROM (SELECT _file, record_id, span_id, engine_id,
             regexp_extract(e, '^(.*):([pdr])([0-9]+)$', ['rid', 'kind', 'tok']) AS mm
      -- the join to _read_files sits below the unnest: filtered after it, DuckDB
      -- split every kept step's text first (0.53 s vs 0.04 s per absorb at 1M requests)
      FROM (SELECT s.* FROM _mat_step_span_part s JOIN _read_files USING (_file)
            WHERE s.name = 'decode.step') AS s, unnest(string_split(batch, ';')) AS u(e)
      WHERE e <> '')
WHERE mm.rid <> '';
CREATE TABLE IF NOT EXISTS _mat_step_entry_part AS SELECT * FROM _calc_step_entry_part LIMIT 0;
CREATE OR REPLACE VIEW _step_entries AS
SELECT span_id, engine_id, request_id, kind, tokens FROM _mat_step_entry_part p
WHERE NOT _hidden_copy(p.record_id, p._file);

CREATE OR REPLACE VIEW _step_conn AS
SELECT s.span_id AS step_span_id, c.span_id, c.name AS stage, c.end_ns - c.start_ns AS dur_ns,
       c.method, c.request_ids,
       -- served a handoff: names at least one request (empty list entries ignored)
       regexp_matches(c.request_ids, '[^;]') AS served
-- (a child of the step only when recorded on the step's own engine: its scheduler records
-- the step and its workers the connector spans; DESIGN.md §3 "Joins": a parent link from
-- another process's or engine's span nests nothing)
FROM _steps s JOIN _step_span_rows c
  ON c.parent_span_id = s.span_id AND c.engine_id IS NOT DISTINCT FROM s.engine_id AND c.name LIKE 'connector.%';

CREATE OR REPLACE VIEW _step_stats AS
WITH e AS (
    SELECT span_id, count(*) FILTER (WHERE kind = 'd') AS shape,
           count(*) AS batch_reqs,
           coalesce(sum(tokens) FILTER (WHERE kind = 'd'), 0) AS decode_tokens,
           coalesce(sum(tokens) FILTER (WHERE kind = 'd'), 0) + count(*) FILTER (WHERE kind IN ('p', 'r'))
               AS load_tokens,
           coalesce(sum(tokens) FILTER (WHERE kind = 'p'), 0) AS prefill_tokens,
           coalesce(sum(tokens) FILTER (WHERE kind = 'r'), 0) AS recompute_tokens
    FROM _step_entries GROUP BY span_id
), c AS (
    SELECT step_span_id, sum(dur_ns) AS connector_ns,
           coalesce(sum(dur_ns) FILTER (WHERE served), 0) AS handoff_connector_ns,
           count(*) FILTER (WHERE served) AS handoff_spans
    FROM _step_conn GROUP BY step_span_id
)
SELECT s.*, coalesce(e.shape, 0) AS shape, coalesce(e.batch_reqs, 0) AS batch_reqs,
       coalesce(e.decode_tokens, 0) AS decode_tokens, coalesce(e.load_tokens, 0) AS load_tokens,
       coalesce(e.prefill_tokens, 0) AS prefill_tokens,
       coalesce(e.recompute_tokens, 0) AS recompute_tokens, coalesce(c.connector_ns, 0) AS connector_ns,
       coalesce(c.handoff_connector_ns, 0) AS handoff_connector_ns,
       coalesce(c.handoff_spans, 0) = 0 AND coalesce(e.prefill_tokens, 0) = 0
           AND coalesce(e.recompute_tokens, 0) = 0 AS clean
FROM _steps s LEFT JOIN e ON e.span_id = s.span_id LEFT JOIN c ON c.step_span_id = s.span_id;

CREATE OR REPLACE VIEW _calc_step_baseline AS
WITH clean AS (
    SELECT engine_id, batch_reqs, load_tokens, start_ns, dur_ns FROM _step_stats WHERE clean
), by_load AS (
    SELECT engine_id, batch_reqs, load_tokens, start_ns,
           median(dur_ns) OVER (PARTITION BY engine_id, batch_reqs, load_tokens ORDER BY start_ns
                                ROWS BETWEEN _stall_baseline_steps() - 1 PRECEDING AND CURRENT ROW) AS run_median
    FROM clean
), by_load_all AS (
    SELECT engine_id, batch_reqs, load_tokens, median(dur_ns) AS m FROM clean GROUP BY ALL
), base AS (
    SELECT s.*, l.run_median AS load_recent, la.m AS load_all
    FROM _step_stats s
    ASOF LEFT JOIN by_load l ON l.engine_id = s.engine_id AND l.batch_reqs = s.batch_reqs
                             AND l.load_tokens = s.load_tokens AND s.start_ns > l.start_ns
    LEFT JOIN by_load_all la ON la.engine_id = s.engine_id AND la.batch_reqs = s.batch_reqs
                             AND la.load_tokens = s.load_tokens
), need AS (
    -- steps no clean step of the same load prices: the fit, else the decode-only shape
    SELECT span_id, engine_id, start_ns, batch_reqs, load_tokens, shape, decode_tokens
    FROM base WHERE load_recent IS NULL AND load_all IS NULL
), cum AS (
    -- running sums over the engine's clean steps (exact integers); a window's sums are differences
    SELECT engine_id, start_ns, row_number() OVER w AS rn,
           sum(batch_reqs) OVER w AS sn, sum(load_tokens) OVER w AS sk, sum(dur_ns) OVER w AS sd,
           sum(batch_reqs * batch_reqs) OVER w AS snn, sum(load_tokens * load_tokens) OVER w AS skk,
           sum(batch_reqs * load_tokens) OVER w AS snk,
           sum(dur_ns * batch_reqs) OVER w AS sdn, sum(dur_ns * load_tokens) OVER w AS sdk
    FROM clean
    WINDOW w AS (PARTITION BY engine_id ORDER BY start_ns ROWS UNBOUNDED PRECEDING)
), tot AS (
    SELECT engine_id, count(*) AS rn, sum(batch_reqs) AS sn, sum(load_tokens) AS sk, sum(dur_ns) AS sd,
           sum(batch_reqs * batch_reqs) AS snn, sum(load_tokens * load_tokens) AS skk,
           sum(batch_reqs * load_tokens) AS snk, sum(dur_ns * batch_reqs) AS sdn, sum(dur_ns * load_tokens) AS sdk
    FROM clean GROUP BY engine_id
), win AS (
    -- the sums over the last _stall_fit_steps() clean steps before the step (all the engine's when none precede)
    SELECT n.span_id, n.batch_reqs, n.load_tokens,
           CASE WHEN c1.rn IS NULL THEN t.rn ELSE c1.rn - coalesce(c0.rn, 0) END AS k,
           CASE WHEN c1.rn IS NULL THEN t.sn ELSE c1.sn - coalesce(c0.sn, 0) END AS sn,
           CASE WHEN c1.rn IS NULL THEN t.sk ELSE c1.sk - coalesce(c0.sk, 0) END AS sk,
           CASE WHEN c1.rn IS NULL THEN t.sd ELSE c1.sd - coalesce(c0.sd, 0) END AS sd,
           CASE WHEN c1.rn IS NULL THEN t.snn ELSE c1.snn - coalesce(c0.snn, 0) END AS snn,
           CASE WHEN c1.rn IS NULL THEN t.skk ELSE c1.skk - coalesce(c0.skk, 0) END AS skk,
           CASE WHEN c1.rn IS NULL THEN t.snk ELSE c1.snk - coalesce(c0.snk, 0) END AS snk,
           CASE WHEN c1.rn IS NULL THEN t.sdn ELSE c1.sdn - coalesce(c0.sdn, 0) END AS sdn,
           CASE WHEN c1.rn IS NULL THEN t.sdk ELSE c1.sdk - coalesce(c0.sdk, 0) END AS sdk
    FROM need n
    ASOF LEFT JOIN cum c1 ON c1.engine_id = n.engine_id AND n.start_ns > c1.start_ns
    LEFT JOIN cum c0 ON c0.engine_id = n.engine_id AND c0.rn = c1.rn - _stall_fit_steps()
    LEFT JOIN tot t ON t.engine_id = n.engine_id
), mom AS (
    -- moments (population): means, variances, covariances of n = batch_reqs, T = load_tokens, t = duration
    SELECT span_id, batch_reqs, load_tokens, sn / k AS mn, sk / k AS mk, sd / k AS md,
           (snn - sn * sn / k) / k AS vn, (skk - sk * sk / k) / k AS vk, (snk - sn * sk / k) / k AS cnk,
           (sdn - sd * sn / k) / k AS cdn, (sdk - sd * sk / k) / k AS cdk
    FROM (SELECT span_id, batch_reqs, load_tokens, k::DOUBLE AS k, sn::DOUBLE AS sn, sk::DOUBLE AS sk,
                 sd::DOUBLE AS sd, snn::DOUBLE AS snn, skk::DOUBLE AS skk, snk::DOUBLE AS snk,
                 sdn::DOUBLE AS sdn, sdk::DOUBLE AS sdk
          FROM win WHERE k > 0)
), coef AS (
    -- least squares t = a + b_n n + b_T T (Cramer's rule); collinear or constant regressors: the one
    -- that varies alone; neither varies (or a variance below rounding): no fit
    SELECT *, vn * vk - cnk * cnk AS det,
           CASE WHEN vn > 1e-9 AND vk > 1e-9 AND vn * vk - cnk * cnk > 1e-9 * vn * vk
                     THEN (vk * cdn - cnk * cdk) / (vn * vk - cnk * cnk)
                WHEN vn > 1e-9 THEN cdn / vn
                WHEN vk > 1e-9 THEN 0.0 END AS b_n,
           CASE WHEN vn > 1e-9 AND vk > 1e-9 AND vn * vk - cnk * cnk > 1e-9 * vn * vk
                     THEN (vn * cdk - cnk * cdn) / (vn * vk - cnk * cnk)
                WHEN vn > 1e-9 THEN 0.0
                WHEN vk > 1e-9 THEN cdk / vk END AS b_T
    FROM mom
), fit AS (
    SELECT span_id, b_n, b_T,
           CASE WHEN b_n IS NOT NULL
                THEN greatest(md + b_n * (batch_reqs - mn) + b_T * (load_tokens - mk), 0) END AS fit_ns
    FROM coef
), shp AS (
    SELECT n.span_id, sh.run_median AS shape_recent, sa.m AS shape_all
    FROM need n
    ASOF LEFT JOIN by_load sh ON sh.engine_id = n.engine_id AND sh.batch_reqs = n.shape
                              AND sh.load_tokens = n.decode_tokens AND n.start_ns > sh.start_ns
    LEFT JOIN by_load_all sa ON sa.engine_id = n.engine_id AND sa.batch_reqs = n.shape
                             AND sa.load_tokens = n.decode_tokens
), pred AS (
    SELECT b.*, f.fit_ns, f.b_n, f.b_T, sh.shape_recent, sh.shape_all
    FROM base b LEFT JOIN fit f ON f.span_id = b.span_id LEFT JOIN shp sh ON sh.span_id = b.span_id
)
SELECT * EXCLUDE (load_recent, load_all, shape_recent, shape_all, b_n, b_T, fit_ns),
       round(coalesce(load_recent, load_all, fit_ns, shape_recent, shape_all))::BIGINT AS baseline_ns,
       CASE WHEN load_recent IS NOT NULL THEN 'load_recent' WHEN load_all IS NOT NULL THEN 'load'
            WHEN fit_ns IS NOT NULL THEN 'fit' WHEN shape_recent IS NOT NULL THEN 'shape_recent'
            WHEN shape_all IS NOT NULL THEN 'shape' END AS baseline_rule,
       b_n AS fit_per_req_ns, b_T AS fit_per_token_ns
FROM pred;
CREATE TABLE IF NOT EXISTS _mat_step_baseline AS SELECT * FROM _calc_step_baseline LIMIT 0;
CREATE OR REPLACE VIEW _step_baseline AS SELECT * FROM _mat_step_baseline;

-- One row per (step, cause): the cause's share of the step's excess.
CREATE OR REPLACE VIEW _calc_decode_stall_causes AS
WITH st AS (
    SELECT *, CASE WHEN clean OR baseline_ns IS NULL THEN 0 ELSE greatest(dur_ns - baseline_ns, 0) END AS excess_ns
    FROM _step_baseline
), conn AS (
    SELECT c.step_span_id, c.stage AS kind, c.method, nullif(_base_request_id(r.id), '') AS culprit,
           c.dur_ns / len(list_filter(string_split(c.request_ids, ';'), lambda x: x <> '')) AS t_ns
    FROM _step_conn c, unnest(string_split(c.request_ids, ';')) AS r(id)
    WHERE c.served AND r.id <> ''
), comp AS (
    SELECT span_id AS step_span_id, CASE kind WHEN 'p' THEN 'prefill' ELSE 'recompute' END AS kind,
           NULL::VARCHAR AS method, request_id AS culprit, tokens
    FROM _step_entries WHERE kind IN ('p', 'r')
), ctot AS (SELECT step_span_id, sum(t_ns) AS conn_ns FROM conn GROUP BY step_span_id),
   ktot AS (SELECT step_span_id, sum(tokens) AS tok FROM comp GROUP BY step_span_id),
causes AS (
    SELECT st.span_id, conn.kind, conn.method, conn.culprit,
           CASE WHEN ctot.conn_ns >= st.excess_ns THEN st.excess_ns * conn.t_ns / ctot.conn_ns
                ELSE conn.t_ns END AS share_ns
    FROM st JOIN conn ON conn.step_span_id = st.span_id JOIN ctot ON ctot.step_span_id = st.span_id
    WHERE st.excess_ns > 0
    UNION ALL
    SELECT st.span_id, comp.kind, NULL, comp.culprit,
           greatest(st.excess_ns - coalesce(ctot.conn_ns, 0), 0) * comp.tokens / ktot.tok
    FROM st JOIN comp ON comp.step_span_id = st.span_id JOIN ktot ON ktot.step_span_id = st.span_id
    LEFT JOIN ctot ON ctot.step_span_id = st.span_id
    WHERE st.excess_ns > 0
    UNION ALL
    SELECT st.span_id, 'unexplained', NULL, NULL, st.excess_ns - coalesce(ctot.conn_ns, 0)
    FROM st LEFT JOIN ctot ON ctot.step_span_id = st.span_id LEFT JOIN ktot ON ktot.step_span_id = st.span_id
    WHERE st.excess_ns > coalesce(ctot.conn_ns, 0) AND ktot.tok IS NULL
)
-- shares are whole ns (rounded): sums of them are exact, whatever order DuckDB aggregates in
SELECT st.engine_id, st.step_id, st.start_ns, causes.kind, causes.method, causes.culprit AS culprit_request_id,
       round(causes.share_ns)::BIGINT AS share_ns, round(causes.share_ns)::BIGINT / 1e6 AS share_ms,
       st.span_id AS step_span_id
FROM causes JOIN st ON st.span_id = causes.span_id
WHERE round(causes.share_ns) > 0;
CREATE TABLE IF NOT EXISTS _mat_decode_stall_causes AS SELECT * FROM _calc_decode_stall_causes LIMIT 0;
CREATE OR REPLACE VIEW decode_stall_causes AS SELECT * FROM _mat_decode_stall_causes;

CREATE OR REPLACE VIEW decode_stalls AS
WITH top AS (
    -- the largest cause (arg_max over one row order: culprit and kind from the same row); equal shares
    -- go to the larger culprit id, then kind, so the answer does not depend on row order
    SELECT step_span_id,
           arg_max({'c': culprit_request_id, 'k': kind}, (share_ns, coalesce(culprit_request_id, ''), kind)) AS top
    FROM decode_stall_causes GROUP BY step_span_id
)
SELECT b.engine_id, b.step_id, b.start_ns, b.end_ns, b.dur_ns, b.dur_ns / 1e6 AS dur_ms,
       b.shape, b.baseline_ns, b.baseline_ns / 1e6 AS baseline_ms,
       CASE WHEN b.clean OR b.baseline_ns IS NULL THEN 0 ELSE greatest(b.dur_ns - b.baseline_ns, 0) END AS excess_ns,
       CASE WHEN b.clean OR b.baseline_ns IS NULL THEN 0 ELSE greatest(b.dur_ns - b.baseline_ns, 0) END / 1e6 AS excess_ms,
       b.connector_ns, b.connector_ns / 1e6 AS connector_ms,
       b.handoff_connector_ns, b.handoff_connector_ns / 1e6 AS handoff_connector_ms,
       b.prefill_tokens, b.recompute_tokens, b.clean,
       t.top.c AS culprit_request_id, t.top.k AS culprit_kind, b.span_id AS step_span_id,
       b.batch_reqs, b.load_tokens, b.baseline_rule, b.fit_per_req_ns, b.fit_per_token_ns
FROM _step_baseline b LEFT JOIN top t ON t.step_span_id = b.span_id;

-- Engine steps that never ended (issue 17 kind 7): a decode.step the store
-- holds only as `open` rows (schema 1.1: the scheduler opens the step span when
-- it schedules the step; the writer records it at each flush while it stays open
-- PDTRACE_OPEN_AFTER_S or longer), not abandoned and with no span row of its id,
-- or a span row whose end is missing (NULL, or before its start). Such a step is
-- an engine-wide stall: every request in its batch waits for it, from its start
-- to the trace end of the process that holds it (its last flush, module
-- in_flight), never a row with no duration. Open rows per store file (kind 'file').
CREATE OR REPLACE VIEW _calc_open_step_part AS
SELECT _file, record_id, span_id, engine_id, domain, host, pid, run_id, start_ns, end_ns,
       attr_int['step.id'] AS step_id, coalesce(attr_str['step.batch'], '') AS batch,
       coalesce(attr_str['open.state'], 'open') AS state
FROM _file_rows
WHERE record = 'open' AND name = 'decode.step';
CREATE TABLE IF NOT EXISTS _mat_open_step_part AS SELECT * FROM _calc_open_step_part LIMIT 0;

CREATE OR REPLACE VIEW _open_step_rows AS
WITH latest AS (
    SELECT arg_max(x, x.end_ns) AS r
    FROM (SELECT p AS x FROM _mat_open_step_part p WHERE NOT _hidden_copy(p.record_id, p._file))
    GROUP BY x.span_id
), o AS (SELECT unnest(r) FROM latest)
SELECT span_id, engine_id, domain, host, pid, run_id, start_ns, end_ns, step_id, batch, 'open_row' AS evidence
FROM o
WHERE state <> 'abandoned'
  AND span_id NOT IN (SELECT span_id FROM _step_span_rows WHERE name = 'decode.step' AND end_ns >= start_ns)
UNION ALL
SELECT s.span_id, s.engine_id, s.domain, s.host, s.pid, s.run_id, s.start_ns, s.start_ns AS end_ns, s.step_id, s.batch,
       'no_end' AS evidence
FROM (SELECT r.*, f.host, f.pid, f.run_id FROM _step_span_rows r
      LEFT JOIN (SELECT DISTINCT _file, host, pid, run_id FROM _mat_flush_part) f USING (_file)) s
WHERE s.name = 'decode.step' AND (s.end_ns IS NULL OR s.end_ns < s.start_ns)
  AND s.span_id NOT IN (SELECT span_id FROM o);

CREATE OR REPLACE VIEW _open_steps AS
SELECT o.span_id, o.engine_id, o.step_id, o.batch, o.evidence, o.c_start_ns AS start_ns, o.c_end_ns AS as_of_ns,
       greatest(e.trace_end_ns, o.c_end_ns) AS trace_end_ns
FROM _clock_corrected('_open_step_rows') o
LEFT JOIN _process_trace_end e ON e.domain = o.domain AND e.host IS NOT DISTINCT FROM o.host
     AND e.pid IS NOT DISTINCT FROM o.pid AND e.run_id IS NOT DISTINCT FROM o.run_id;

CREATE OR REPLACE VIEW engine_stalls AS
WITH entries AS (
    SELECT span_id, _base_request_id(mm.rid) AS request_id
    FROM (SELECT span_id, regexp_extract(e, '^(.*):([pdr])([0-9]+)$', ['rid', 'kind', 'tok']) AS mm
          FROM _open_steps, unnest(string_split(batch, ';')) AS u(e) WHERE e <> '')
    WHERE mm.rid <> ''
), v AS (
    SELECT span_id, list(DISTINCT request_id ORDER BY request_id) AS victims, count(DISTINCT request_id) AS n
    FROM entries GROUP BY span_id
)
SELECT o.engine_id, o.step_id, o.start_ns, o.trace_end_ns, o.trace_end_ns - o.start_ns AS dur_ns,
       (o.trace_end_ns - o.start_ns) / 1e6 AS dur_ms, o.as_of_ns,
       coalesce(v.victims, []::VARCHAR[]) AS victim_request_ids, coalesce(v.n, 0) AS victims, o.evidence,
       o.span_id AS step_span_id
FROM _open_steps o LEFT JOIN v ON v.span_id = o.span_id;

-- Per request (base id X): the ended decode.step spans that scheduled it (all
-- kinds: its first token on D comes out of its first step, a 'p' entry) and
-- those with decode tokens -- one sampled token each: a hung request's emitted
-- tokens and TPOT when no finish record exists (issue 17 kind 7). With step
-- sampling (PDTRACE_STEP_SAMPLE < 1) only recorded steps count.
CREATE OR REPLACE VIEW _calc_req_decode_steps AS
SELECT e.request_id, count(*) FILTER (WHERE e.kind = 'd') AS decode_steps,
       max(s.end_ns) FILTER (WHERE e.kind = 'd') AS last_decode_end_ns,
       max(s.end_ns) AS last_step_end_ns
FROM _step_entries e JOIN _steps s ON s.span_id = e.span_id
GROUP BY e.request_id;
CREATE TABLE IF NOT EXISTS _mat_req_decode_steps AS SELECT * FROM _calc_req_decode_steps LIMIT 0;

-- Per victim request id: the stall excess other requests' work cost it, and the
-- top culprit: the request whose work (all kinds summed) cost it the most, with
-- that request's largest kind.
CREATE OR REPLACE VIEW _calc_stall_victims AS
WITH victims AS (
    SELECT e.request_id, c.culprit_request_id, c.kind, sum(c.share_ns) AS ns
    FROM _step_entries e JOIN decode_stall_causes c ON c.step_span_id = e.span_id
    WHERE e.kind = 'd' AND c.culprit_request_id IS DISTINCT FROM e.request_id
    GROUP BY ALL
), per_culprit AS (
    -- whole ns: decode_stall_causes.share_ns is whole ns, so these sums are exact whatever order DuckDB
    -- aggregates in (a DOUBLE sum is not: two builds of one store ranked tied victims differently); a
    -- tie in ns goes to the larger culprit id, so the top culprit does not depend on row order either
    SELECT request_id, culprit_request_id, sum(ns)::BIGINT AS ns, arg_max(kind, (ns, kind)) AS kind
    FROM victims GROUP BY ALL
)
SELECT request_id, sum(ns) AS stall_ns,
       arg_max(culprit_request_id, (ns, culprit_request_id)) FILTER (WHERE culprit_request_id IS NOT NULL) AS top_culprit,
       arg_max(kind, (ns, culprit_request_id)) FILTER (WHERE culprit_request_id IS NOT NULL) AS top_kind,
       max(ns) FILTER (WHERE culprit_request_id IS NOT NULL) AS top_ns
FROM per_culprit GROUP BY request_id;
CREATE TABLE IF NOT EXISTS _mat_stall_victims AS SELECT * FROM _calc_stall_victims LIMIT 0;

-- A hung request (first token, no last token; requests.hung) has no finish
-- record: its tokens are 1 + its decode steps (_req_decode_steps), its TPOT runs
-- from the first token to the end of its last decode step, and the rest of its
-- hang -- from its last emitted token or step to the trace end (the latest last
-- flush of the router and of its decode engine's processes) -- is open_stall,
-- reported apart from TPOT and stall.
CREATE OR REPLACE VIEW _request_stalls_all AS
WITH per AS (SELECT * FROM _mat_stall_victims),
te AS (
    SELECT run_id, role, engine_id, max(trace_end_ns) AS trace_end_ns FROM _process_trace_end GROUP BY ALL
), q AS (
    SELECT q.*, q.first_token_ns IS NOT NULL AND q.last_token_ns IS NULL AS hung,
           ds.decode_steps, ds.last_decode_end_ns, ds.last_step_end_ns,
           greatest(tr.trace_end_ns, td.trace_end_ns) AS trace_end_ns
    FROM _req_base q
    LEFT JOIN _mat_req_decode_steps ds ON ds.request_id = q.request_id
    LEFT JOIN te tr ON tr.role = 'router' AND tr.run_id IS NOT DISTINCT FROM q.run_id AND q.ttft_source = 'router'
    LEFT JOIN te td ON td.role = 'decode' AND td.engine_id = q.decode_engine
                   AND td.run_id IS NOT DISTINCT FROM q.run_id
    WHERE q.first_token_ns IS NOT NULL
), t AS (
    SELECT *,
           CASE WHEN hung THEN 1 + coalesce(decode_steps, 0) ELSE output_tokens END AS n_tokens,
           -- a hung request's decode time runs to the end of its last decode step, when that ended after
           -- the first token (as _tpot_ms: a step before it says nothing about the later tokens)
           CASE WHEN NOT hung THEN last_token_ns - first_token_ns
                WHEN last_decode_end_ns > first_token_ns THEN last_decode_end_ns - first_token_ns END AS decode_ns,
           CASE WHEN hung THEN greatest(first_token_ns, last_step_end_ns) END AS last_emit_ns
    FROM q
)
SELECT q.run_id, q.request_id, q.prompt_index, q.mode, q.output_tokens, q.arrival_ns,
       _tpot_ms(q.output_tokens, q.first_token_ns, q.last_token_ns, q.decode_steps, q.last_decode_end_ns) AS tpot_ms,
       coalesce(p.stall_ns, 0) AS stall_ns, coalesce(p.stall_ns, 0) / 1e6 AS stall_ms,
       coalesce(p.stall_ns, 0) / 1e6 / nullif(q.n_tokens - 1, 0) AS stall_tpot_ms,
       (q.decode_ns - coalesce(p.stall_ns, 0)) / 1e6 / nullif(q.n_tokens - 1, 0) AS tpot_without_stalls_ms,
       p.top_culprit AS top_culprit_request_id, p.top_kind AS top_culprit_kind, p.top_ns / 1e6 AS top_culprit_ms,
       q.hung, q.n_tokens AS emitted_tokens, q.last_emit_ns, q.trace_end_ns,
       CASE WHEN q.hung THEN greatest(q.trace_end_ns - q.last_emit_ns, 0) END AS open_stall_ns,
       CASE WHEN q.hung THEN greatest(q.trace_end_ns - q.last_emit_ns, 0) / 1e6 END AS open_stall_ms,
       q.rkey
FROM t q LEFT JOIN per p ON p.request_id = q.request_id;
-- request_stalls: the rows of _request_stalls_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW request_stalls AS SELECT * FROM _request_stalls_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

CREATE OR REPLACE VIEW decode_step_requests AS
SELECT e.span_id AS step_span_id, e.engine_id, b.start_ns, e.request_id,
       CASE e.kind WHEN 'd' THEN 'decode' WHEN 'p' THEN 'prefill' ELSE 'recompute' END AS kind, e.tokens
FROM _step_entries e JOIN _step_baseline b ON b.span_id = e.span_id;
COMMENT ON VIEW decode_step_requests IS 'Per decode step and request in its batch (step.batch): the tokens it was scheduled.';
COMMENT ON COLUMN decode_step_requests.request_id IS 'base request id X of the batch entry';
COMMENT ON COLUMN decode_step_requests.kind IS 'decode | prefill | recompute tokens';
COMMENT ON COLUMN decode_step_requests.tokens IS 'tokens of that kind scheduled for the request in the step (tokens)';

COMMENT ON VIEW decode_stall_causes IS 'Per stalled decode step and cause: the share of the step''s excess over its baseline.';
COMMENT ON COLUMN decode_stall_causes.engine_id IS 'decode engine id';
COMMENT ON COLUMN decode_stall_causes.step_id IS 'engine step counter (step.id)';
COMMENT ON COLUMN decode_stall_causes.start_ns IS 'step start (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN decode_stall_causes.kind IS 'connector.load | connector.poll | connector.save (work serving a handoff) | prefill | recompute | unexplained';
COMMENT ON COLUMN decode_stall_causes.method IS 'vLLM connector method for connector causes (vllm.method)';
COMMENT ON COLUMN decode_stall_causes.culprit_request_id IS 'request whose handoff/prefill/recompute caused it (NULL: unexplained)';
COMMENT ON COLUMN decode_stall_causes.share_ns IS 'share of the step''s excess, rounded to the ns (duration ns; the shares of a step add up to its excess within a few ns)';
COMMENT ON COLUMN decode_stall_causes.share_ms IS 'share_ns in ms';
COMMENT ON COLUMN decode_stall_causes.step_span_id IS 'span id of the decode.step';

COMMENT ON VIEW decode_stalls IS 'Per decode step: duration vs the baseline of its load (batch requests and scheduled tokens) on clean steps, connector time on the forward thread, top culprit.';
COMMENT ON COLUMN decode_stalls.end_ns IS 'step end (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN decode_stalls.dur_ns IS 'step duration (duration ns)';
COMMENT ON COLUMN decode_stalls.dur_ms IS 'dur_ns in ms';
COMMENT ON COLUMN decode_stalls.shape IS 'requests with decode tokens in the step (count)';
COMMENT ON COLUMN decode_stalls.baseline_ns IS 'what the step''s load (batch_reqs, load_tokens) costs on a clean step of the engine, by baseline_rule (duration ns)';
COMMENT ON COLUMN decode_stalls.batch_reqs IS 'requests in the step, all kinds: decode, prefill, recompute (count)';
COMMENT ON COLUMN decode_stalls.load_tokens IS 'decode-equivalent scheduled tokens: decode tokens + 1 per prefill/recompute entry (tokens)';
COMMENT ON COLUMN decode_stalls.baseline_rule IS 'load_recent | load (median of clean steps of the same load, recent or all) | fit (linear model a + b_n*batch_reqs + b_T*load_tokens of recent clean steps) | shape_recent | shape (median of clean steps with its decode requests alone)';
COMMENT ON COLUMN decode_stalls.fit_per_req_ns IS 'slope b_n of the engine''s linear step-time fit per request in the batch (duration ns; NULL: no fit)';
COMMENT ON COLUMN decode_stalls.fit_per_token_ns IS 'slope b_T of the fit per decode-equivalent token (duration ns; NULL: no fit)';
COMMENT ON COLUMN decode_stalls.baseline_ms IS 'baseline_ns in ms';
COMMENT ON COLUMN decode_stalls.excess_ns IS 'duration - baseline for a step with a cause, else 0 (duration ns)';
COMMENT ON COLUMN decode_stalls.excess_ms IS 'excess_ns in ms';
COMMENT ON COLUMN decode_stalls.connector_ns IS 'all connector work on the forward thread in the step, routine polling included (duration ns)';
COMMENT ON COLUMN decode_stalls.connector_ms IS 'connector_ns in ms';
COMMENT ON COLUMN decode_stalls.handoff_connector_ns IS 'connector work that served a handoff (connector.request_ids names a request): the stall cause part of connector_ns (duration ns)';
COMMENT ON COLUMN decode_stalls.handoff_connector_ms IS 'handoff_connector_ns in ms';
COMMENT ON COLUMN decode_stalls.prefill_tokens IS 'co-scheduled prefill tokens (tokens)';
COMMENT ON COLUMN decode_stalls.recompute_tokens IS 'recompute tokens (tokens)';
COMMENT ON COLUMN decode_stalls.clean IS 'true if the step had no connector work serving a handoff, no prefill and no recompute tokens (a baseline step; routine polling allowed)';
COMMENT ON COLUMN decode_stalls.culprit_request_id IS 'request with the largest share of the excess';
COMMENT ON COLUMN decode_stalls.culprit_kind IS 'kind of the largest cause (see decode_stall_causes.kind)';

COMMENT ON VIEW request_stalls IS 'Per request with a first token: TPOT over its emitted tokens, the part of it due to other requests'' handoffs, prefills or recomputes, and a hung request''s open stall.';
COMMENT ON COLUMN request_stalls.run_id IS 'deployment run id';
COMMENT ON COLUMN request_stalls.request_id IS 'base request id X';
COMMENT ON COLUMN request_stalls.prompt_index IS 'prompt index i';
COMMENT ON COLUMN request_stalls.mode IS 'pull | push | unknown';
COMMENT ON COLUMN request_stalls.output_tokens IS 'generated tokens (requests.output_tokens: router, else D''s request.finished) (tokens)';
COMMENT ON COLUMN request_stalls.arrival_ns IS 'request received by the router (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN request_stalls.tpot_ms IS '(last token - first token) / (output tokens - 1); hung: (end of its last decode step - first token) / decode steps (ms per token)';
COMMENT ON COLUMN request_stalls.stall_ns IS 'excess of stalled steps it decoded in, caused by other requests (duration ns; each culprit''s share rounded to the ns, so the sum is exact and the same in every build)';
COMMENT ON COLUMN request_stalls.stall_ms IS 'stall_ns in ms';
COMMENT ON COLUMN request_stalls.stall_tpot_ms IS 'stall_ns spread over its token intervals (emitted_tokens - 1) (ms per token)';
COMMENT ON COLUMN request_stalls.tpot_without_stalls_ms IS 'TPOT minus stall_tpot_ms (ms per token)';
COMMENT ON COLUMN request_stalls.top_culprit_request_id IS 'request whose work cost it the most';
COMMENT ON COLUMN request_stalls.top_culprit_kind IS 'kind of that work (connector.* | prefill | recompute)';
COMMENT ON COLUMN request_stalls.top_culprit_ms IS 'stall time from the top culprit, all its kinds (ms)';
COMMENT ON COLUMN request_stalls.hung IS 'true if the first token came but the last token never did (requests.hung)';
COMMENT ON COLUMN request_stalls.emitted_tokens IS 'tokens the TPOT counts: output_tokens; for a hung request 1 + its ended decode steps (tokens)';
COMMENT ON COLUMN request_stalls.last_emit_ns IS 'hung request: its last emitted token, the later of the first token and the end of its last ended step (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN request_stalls.trace_end_ns IS 'trace end for the request: the latest last flush of the router and of its decode engine''s processes (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN request_stalls.open_stall_ns IS 'hung request: trace_end_ns - last_emit_ns, the hang reported apart from TPOT (duration ns); NULL when not hung';
COMMENT ON COLUMN request_stalls.open_stall_ms IS 'open_stall_ns in ms';
COMMENT ON COLUMN request_stalls.rkey IS 'request join key';

COMMENT ON VIEW engine_stalls IS 'Decode steps that never ended (only open rows, or a span without an end): engine-wide stalls up to the trace end, with the requests of their batch.';
COMMENT ON COLUMN engine_stalls.engine_id IS 'decode engine id';
COMMENT ON COLUMN engine_stalls.step_id IS 'engine step counter (step.id)';
COMMENT ON COLUMN engine_stalls.start_ns IS 'step start (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN engine_stalls.trace_end_ns IS 'trace end of the process holding the step: its last flush (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN engine_stalls.dur_ns IS 'trace_end_ns - start_ns: how long the step has been stuck (duration ns)';
COMMENT ON COLUMN engine_stalls.dur_ms IS 'dur_ns in ms';
COMMENT ON COLUMN engine_stalls.as_of_ns IS 'flush instant of the step''s latest open row (its start for a span without an end) (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN engine_stalls.victim_request_ids IS 'base request ids in the step''s batch (step.batch), all kinds (list)';
COMMENT ON COLUMN engine_stalls.victims IS 'requests in the step''s batch (count)';
COMMENT ON COLUMN engine_stalls.evidence IS 'open_row (only open rows of the step) | no_end (a span row whose end is missing or before its start)';
COMMENT ON COLUMN engine_stalls.step_span_id IS 'span id of the decode.step';
