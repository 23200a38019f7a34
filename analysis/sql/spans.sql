-- module: spans
-- requires: stages, clock
-- Every span and event once, with raw and skew-corrected times.
-- corrected = raw - offset(clock domain, window of the raw start), the offset
-- of the domain's clock relative to the router's (module clock; without any
-- router evidence, relative to the reference prefill engine's, _clock_root);
-- a domain without evidence in a window uses its whole-trace offset, and 0
-- without any.

-- The rows of the table or view named `rows` (columns domain, start_ns,
-- end_ns: raw ns) with their correction: clock_offset_ns, clock_bound_ns
-- (duration ns) and c_start_ns, c_end_ns (router clock, ns since the epoch).
CREATE OR REPLACE MACRO _clock_corrected(rows) AS TABLE
SELECT r.*,
       coalesce(w.offset_ns, a.offset_ns, 0) AS clock_offset_ns,
       CASE WHEN w.offset_ns IS NOT NULL THEN w.bound_ns ELSE a.bound_ns END AS clock_bound_ns,
       r.start_ns - coalesce(w.offset_ns, a.offset_ns, 0) AS c_start_ns,
       r.end_ns - coalesce(w.offset_ns, a.offset_ns, 0) AS c_end_ns
FROM query_table(rows) r
LEFT JOIN (SELECT * FROM _domain_offsets WHERE window_idx IS NOT NULL) w
       ON w.domain = r.domain AND w.window_idx = r.start_ns // _clock_window_ns()
LEFT JOIN (SELECT * FROM _domain_offsets WHERE window_idx IS NULL) a
       ON a.domain = r.domain;

CREATE OR REPLACE VIEW _timed AS
SELECT * FROM _clock_corrected('_records') WHERE record IN ('span', 'event');

-- kv.transfer spans a failure event marks (rule _outcome_category, module
-- stages): a kv.transfer_failed / kv.post_failed event on the span (span_id),
-- or on the request (no span_id) at the span's rank within [start, end] on
-- corrected times. Failure events are rare: the join is on rkey, per request.
CREATE OR REPLACE VIEW _kv_failed_spans AS
WITH ev AS (
    SELECT rkey, span_id, tp_rank, c_start_ns AS t FROM _timed
    WHERE record = 'event' AND name IN ('kv.transfer_failed', 'kv.post_failed') AND rkey IS NOT NULL
)
SELECT DISTINCT x.rkey, x.span_id
FROM _timed x JOIN ev ON ev.rkey = x.rkey
WHERE x.record = 'span' AND x.name = 'kv.transfer'
  AND (ev.span_id = x.span_id
       OR (ev.span_id IS NULL AND ev.tp_rank IS NOT DISTINCT FROM x.tp_rank
           AND ev.t BETWEEN x.c_start_ns AND x.c_end_ns));

CREATE OR REPLACE VIEW spans AS
SELECT t.record_id, t.trace_id, t.span_id, t.parent_span_id, t.run_id, t.request_id, t.prompt_index, t.attempt,
       t.role, t.engine_id, t.tp_rank, t.thread, t.name AS stage,
       _outcome_category(s.category, t.status_code, t.attr_int['kv.bytes'], t.attr_str['error.type'],
                         f.span_id IS NOT NULL) AS category,
       t.c_start_ns AS start_ns, t.c_end_ns AS end_ns, t.end_ns - t.start_ns AS dur_ns,
       t.start_ns AS raw_start_ns, t.end_ns AS raw_end_ns,
       t.domain AS clock_domain, t.clock_offset_ns, t.clock_bound_ns,
       t.status_code, t.status_message, t.attr_int, t.attr_float, t.attr_str,
       t.host, t.pid, t.connector, t.rkey
FROM _timed t LEFT JOIN stages s ON s.stage = t.name
LEFT JOIN _kv_failed_spans f ON f.rkey = t.rkey AND f.span_id = t.span_id
WHERE t.record = 'span';

CREATE OR REPLACE VIEW events AS
SELECT t.record_id, t.trace_id, t.span_id, t.run_id, t.request_id, t.prompt_index, t.attempt,
       t.role, t.engine_id, t.tp_rank, t.thread, t.name AS event,
       t.c_start_ns AS time_ns, t.start_ns AS raw_time_ns,
       t.domain AS clock_domain, t.clock_offset_ns, t.clock_bound_ns,
       t.attr_int, t.attr_float, t.attr_str, t.rkey
FROM _timed t
WHERE t.record = 'event';

COMMENT ON VIEW spans IS 'Every span once (duplicates by record_id removed), raw and skew-corrected times.';
COMMENT ON COLUMN spans.record_id IS 'unique record id (duplicates of a span share it)';
COMMENT ON COLUMN spans.trace_id IS 'W3C trace id (32 hex); NULL for per-step spans';
COMMENT ON COLUMN spans.span_id IS 'span id (uint64)';
COMMENT ON COLUMN spans.parent_span_id IS 'parent span id, NULL for a root or unparented stage';
COMMENT ON COLUMN spans.run_id IS 'deployment run id';
COMMENT ON COLUMN spans.request_id IS 'base request id X (vLLM prefix, index and 8-hex suffix stripped); NULL for per-step spans';
COMMENT ON COLUMN spans.prompt_index IS 'prompt index i of cmpl-X-i (0 otherwise)';
COMMENT ON COLUMN spans.attempt IS 'attempt number: 0 first dispatch, +1 per retry or local recompute';
COMMENT ON COLUMN spans.role IS 'router | prefill | decode';
COMMENT ON COLUMN spans.engine_id IS 'recording engine id (NULL for the router)';
COMMENT ON COLUMN spans.tp_rank IS 'tensor-parallel rank of a per-rank stage (NULL: scheduler/API/router)';
COMMENT ON COLUMN spans.thread IS 'recording thread name';
COMMENT ON COLUMN spans.stage IS 'stage name (see view stages)';
COMMENT ON COLUMN spans.category IS 'category of the stage: queue | compute | transfer | coordination; NULL for parents and unknown names; by outcome: a kv.transfer that failed (status error, error.type, a kv.transfer_failed / kv.post_failed event on it) or moved 0 bytes is coordination (DESIGN.md §2)';
COMMENT ON COLUMN spans.start_ns IS 'start corrected to the router clock (no router evidence: the reference prefill engine''s, view clock_domains) (ns since the Unix epoch)';
COMMENT ON COLUMN spans.end_ns IS 'end corrected to the router clock (or the reference engine''s) (ns since the Unix epoch)';
COMMENT ON COLUMN spans.dur_ns IS 'end - start (duration ns; the same raw or corrected)';
COMMENT ON COLUMN spans.raw_start_ns IS 'start as recorded on the writing process clock (ns since the Unix epoch)';
COMMENT ON COLUMN spans.raw_end_ns IS 'end as recorded (ns since the Unix epoch)';
COMMENT ON COLUMN spans.clock_domain IS 'clock the row was recorded on: ''router'' or the engine id';
COMMENT ON COLUMN spans.clock_offset_ns IS 'offset subtracted from raw times: domain clock minus router clock (or minus the reference engine''s clock) (duration ns)';
COMMENT ON COLUMN spans.clock_bound_ns IS 'uncertainty of clock_offset_ns (duration ns; NULL: unbounded or no evidence)';
COMMENT ON COLUMN spans.status_code IS 'OTLP status: 0 unset, 1 ok, 2 error';
COMMENT ON COLUMN spans.status_message IS 'error class and code';
COMMENT ON COLUMN spans.attr_int IS 'integer attributes (units per pdtrace.instrument.attributes)';
COMMENT ON COLUMN spans.attr_float IS 'float attributes';
COMMENT ON COLUMN spans.attr_str IS 'string attributes';
COMMENT ON COLUMN spans.host IS 'host of the recording process';
COMMENT ON COLUMN spans.pid IS 'process id of the recording process';
COMMENT ON COLUMN spans.connector IS 'KV connector class of the engine';
COMMENT ON COLUMN spans.rkey IS 'request join key: hash of (run_id, request_id, prompt_index); NULL for per-step spans';

COMMENT ON VIEW events IS 'Every event (instant) once, raw and skew-corrected time.';
COMMENT ON COLUMN events.record_id IS 'unique record id';
COMMENT ON COLUMN events.trace_id IS 'W3C trace id (32 hex)';
COMMENT ON COLUMN events.span_id IS 'span the event is on (NULL: on the request)';
COMMENT ON COLUMN events.run_id IS 'deployment run id';
COMMENT ON COLUMN events.request_id IS 'base request id X';
COMMENT ON COLUMN events.prompt_index IS 'prompt index i of cmpl-X-i (0 otherwise)';
COMMENT ON COLUMN events.attempt IS 'attempt number';
COMMENT ON COLUMN events.role IS 'router | prefill | decode';
COMMENT ON COLUMN events.engine_id IS 'recording engine id (NULL for the router)';
COMMENT ON COLUMN events.tp_rank IS 'tensor-parallel rank (NULL: not per-rank)';
COMMENT ON COLUMN events.thread IS 'recording thread name';
COMMENT ON COLUMN events.event IS 'event name (pdtrace.instrument.stages.EVENTS)';
COMMENT ON COLUMN events.time_ns IS 'instant corrected to the router clock (ns since the Unix epoch)';
COMMENT ON COLUMN events.raw_time_ns IS 'instant as recorded (ns since the Unix epoch)';
COMMENT ON COLUMN events.clock_domain IS 'clock the row was recorded on';
COMMENT ON COLUMN events.clock_offset_ns IS 'offset subtracted from the raw time (duration ns)';
COMMENT ON COLUMN events.clock_bound_ns IS 'uncertainty of clock_offset_ns (duration ns)';
COMMENT ON COLUMN events.attr_int IS 'integer attributes';
COMMENT ON COLUMN events.attr_float IS 'float attributes';
COMMENT ON COLUMN events.attr_str IS 'string attributes';
COMMENT ON COLUMN events.rkey IS 'request join key (see spans.rkey)';
