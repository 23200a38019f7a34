-- module: stalls
-- requires: spans, request_base
-- materialize: _step_span_part file
-- materialize: _step_entry_part file
-- materialize: _step_baseline full
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
--   baseline  = median duration of the last _stall_baseline_steps() clean
--               steps of the same engine and shape before this step (the
--               median of all clean steps of that shape when none precede)
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

-- decode.step spans on the router clock
CREATE OR REPLACE VIEW _steps AS
SELECT span_id, engine_id, c_start_ns AS start_ns, c_end_ns AS end_ns, end_ns - start_ns AS dur_ns, step_id, batch
FROM _clock_corrected('_step_span_rows') WHERE name = 'decode.step';

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
           coalesce(sum(tokens) FILTER (WHERE kind = 'p'), 0) AS prefill_tokens,
           coalesce(sum(tokens) FILTER (WHERE kind = 'r'), 0) AS recompute_tokens
    FROM _step_entries GROUP BY span_id
), c AS (
    SELECT step_span_id, sum(dur_ns) AS connector_ns,
           coalesce(sum(dur_ns) FILTER (WHERE served), 0) AS handoff_connector_ns,
           count(*) FILTER (WHERE served) AS handoff_spans
    FROM _step_conn GROUP BY step_span_id
)
SELECT s.*, coalesce(e.shape, 0) AS shape, coalesce(e.prefill_tokens, 0) AS prefill_tokens,
       coalesce(e.recompute_tokens, 0) AS recompute_tokens, coalesce(c.connector_ns, 0) AS connector_ns,
       coalesce(c.handoff_connector_ns, 0) AS handoff_connector_ns,
       coalesce(c.handoff_spans, 0) = 0 AND coalesce(e.prefill_tokens, 0) = 0
           AND coalesce(e.recompute_tokens, 0) = 0 AS clean
FROM _steps s LEFT JOIN e ON e.span_id = s.span_id LEFT JOIN c ON c.step_span_id = s.span_id;

CREATE OR REPLACE VIEW _calc_step_baseline AS
WITH clean AS (
    SELECT engine_id, shape, start_ns,
           median(dur_ns) OVER (PARTITION BY engine_id, shape ORDER BY start_ns
                                ROWS BETWEEN _stall_baseline_steps() - 1 PRECEDING AND CURRENT ROW) AS run_median
    FROM _step_stats WHERE clean
), overall AS (
    SELECT engine_id, shape, median(dur_ns) AS m FROM _step_stats WHERE clean GROUP BY engine_id, shape
)
SELECT s.*, coalesce(c.run_median, o.m)::BIGINT AS baseline_ns
FROM _step_stats s
ASOF LEFT JOIN clean c ON c.engine_id = s.engine_id AND c.shape = s.shape AND s.start_ns > c.start_ns
LEFT JOIN overall o ON o.engine_id = s.engine_id AND o.shape = s.shape;
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
SELECT st.engine_id, st.step_id, st.start_ns, causes.kind, causes.method, causes.culprit AS culprit_request_id,
       causes.share_ns, causes.share_ns / 1e6 AS share_ms, st.span_id AS step_span_id
FROM causes JOIN st ON st.span_id = causes.span_id
WHERE causes.share_ns > 0;
CREATE TABLE IF NOT EXISTS _mat_decode_stall_causes AS SELECT * FROM _calc_decode_stall_causes LIMIT 0;
CREATE OR REPLACE VIEW decode_stall_causes AS SELECT * FROM _mat_decode_stall_causes;

CREATE OR REPLACE VIEW decode_stalls AS
WITH top AS (
    -- the largest cause (arg_max over one row order: culprit and kind from the same row)
    SELECT step_span_id, arg_max({'c': culprit_request_id, 'k': kind}, share_ns) AS top
    FROM decode_stall_causes GROUP BY step_span_id
)
SELECT b.engine_id, b.step_id, b.start_ns, b.end_ns, b.dur_ns, b.dur_ns / 1e6 AS dur_ms,
       b.shape, b.baseline_ns, b.baseline_ns / 1e6 AS baseline_ms,
       CASE WHEN b.clean OR b.baseline_ns IS NULL THEN 0 ELSE greatest(b.dur_ns - b.baseline_ns, 0) END AS excess_ns,
       CASE WHEN b.clean OR b.baseline_ns IS NULL THEN 0 ELSE greatest(b.dur_ns - b.baseline_ns, 0) END / 1e6 AS excess_ms,
       b.connector_ns, b.connector_ns / 1e6 AS connector_ms,
       b.handoff_connector_ns, b.handoff_connector_ns / 1e6 AS handoff_connector_ms,
       b.prefill_tokens, b.recompute_tokens, b.clean,
       t.top.c AS culprit_request_id, t.top.k AS culprit_kind, b.span_id AS step_span_id
FROM _step_baseline b LEFT JOIN top t ON t.step_span_id = b.span_id;

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
    SELECT request_id, culprit_request_id, sum(ns) AS ns, arg_max(kind, ns) AS kind
    FROM victims GROUP BY ALL
)
SELECT request_id, sum(ns) AS stall_ns,
       arg_max(culprit_request_id, ns) FILTER (WHERE culprit_request_id IS NOT NULL) AS top_culprit,
       arg_max(kind, ns) FILTER (WHERE culprit_request_id IS NOT NULL) AS top_kind,
       max(ns) FILTER (WHERE culprit_request_id IS NOT NULL) AS top_ns
FROM per_culprit GROUP BY request_id;
CREATE TABLE IF NOT EXISTS _mat_stall_victims AS SELECT * FROM _calc_stall_victims LIMIT 0;

CREATE OR REPLACE VIEW request_stalls AS
WITH per AS (SELECT * FROM _mat_stall_victims)
SELECT q.run_id, q.request_id, q.prompt_index, q.mode, q.output_tokens, q.arrival_ns,
       (q.last_token_ns - q.first_token_ns) / 1e6 / nullif(q.output_tokens - 1, 0) AS tpot_ms,
       coalesce(p.stall_ns, 0) AS stall_ns, coalesce(p.stall_ns, 0) / 1e6 AS stall_ms,
       coalesce(p.stall_ns, 0) / 1e6 / nullif(q.output_tokens - 1, 0) AS stall_tpot_ms,
       ((q.last_token_ns - q.first_token_ns) - coalesce(p.stall_ns, 0)) / 1e6 / nullif(q.output_tokens - 1, 0)
           AS tpot_without_stalls_ms,
       p.top_culprit AS top_culprit_request_id, p.top_kind AS top_culprit_kind, p.top_ns / 1e6 AS top_culprit_ms,
       q.rkey
FROM _req_base q LEFT JOIN per p ON p.request_id = q.request_id
WHERE q.first_token_ns IS NOT NULL;

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
COMMENT ON COLUMN decode_stall_causes.share_ns IS 'share of the step''s excess (duration ns)';
COMMENT ON COLUMN decode_stall_causes.share_ms IS 'share_ns in ms';
COMMENT ON COLUMN decode_stall_causes.step_span_id IS 'span id of the decode.step';

COMMENT ON VIEW decode_stalls IS 'Per decode step: duration vs baseline of clean steps of the same shape, connector time on the forward thread, top culprit.';
COMMENT ON COLUMN decode_stalls.end_ns IS 'step end (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN decode_stalls.dur_ns IS 'step duration (duration ns)';
COMMENT ON COLUMN decode_stalls.dur_ms IS 'dur_ns in ms';
COMMENT ON COLUMN decode_stalls.shape IS 'requests with decode tokens in the step (count)';
COMMENT ON COLUMN decode_stalls.baseline_ns IS 'median of recent clean steps of the same shape (duration ns)';
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

COMMENT ON VIEW request_stalls IS 'Per complete request: TPOT and the part of it due to other requests'' handoffs, prefills or recomputes.';
COMMENT ON COLUMN request_stalls.run_id IS 'deployment run id';
COMMENT ON COLUMN request_stalls.request_id IS 'base request id X';
COMMENT ON COLUMN request_stalls.prompt_index IS 'prompt index i';
COMMENT ON COLUMN request_stalls.mode IS 'pull | push | unknown';
COMMENT ON COLUMN request_stalls.output_tokens IS 'generated tokens (requests.output_tokens: router, else D''s request.finished) (tokens)';
COMMENT ON COLUMN request_stalls.arrival_ns IS 'request received by the router (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN request_stalls.tpot_ms IS '(last token - first token) / (output tokens - 1) (ms per token)';
COMMENT ON COLUMN request_stalls.stall_ns IS 'excess of stalled steps it decoded in, caused by other requests (duration ns)';
COMMENT ON COLUMN request_stalls.stall_ms IS 'stall_ns in ms';
COMMENT ON COLUMN request_stalls.stall_tpot_ms IS 'stall_ns spread over its token intervals (ms per token)';
COMMENT ON COLUMN request_stalls.tpot_without_stalls_ms IS 'TPOT minus stall_tpot_ms (ms per token)';
COMMENT ON COLUMN request_stalls.top_culprit_request_id IS 'request whose work cost it the most';
COMMENT ON COLUMN request_stalls.top_culprit_kind IS 'kind of that work (connector.* | prefill | recompute)';
COMMENT ON COLUMN request_stalls.top_culprit_ms IS 'stall time from the top culprit, all its kinds (ms)';
COMMENT ON COLUMN request_stalls.rkey IS 'request join key';
