-- module: in_flight
-- requires: request_base
-- materialize: _flush_part file
-- materialize: _open_spans request
--
-- What is in flight now, and where each in-flight request is stuck (DESIGN.md
-- §4). The recorder writes, at every flush, an `open` row for each span open
-- at least PDTRACE_OPEN_AFTER_S (schema 1.1, pdtrace.instrument.schema): the
-- span's id, start, latest attributes (`wait.for`, `wait.expected`,
-- `wait.received`) and, as end_ns, the flush instant. An open span is over when
--   (a) a `span` row with its span_id exists (it ended, with its final times),
--   (b) its latest open row says open.state = 'abandoned' (dropped, no span row),
--   (c) a `span` row of the same request, attempt and stage name ended at or
--       after the open span's start (another process recorded the stage: D's
--       open dest.register is ended by P's row when the registration matched;
--       a frontend's 'in' part does not end the open frontend span, which lasts
--       until its 'out' part;
--       D's open handoff.prep by its worker's row when the READ was posted).
-- The trace end of a process is its last flush: the latest `stats` or
-- `clock` row it wrote. A request is in flight iff one of its open spans is not
-- over; its current stage is the open stage that owns time (a stage with a
-- category) that started last, else the latest-started open parent. age =
-- trace end of the process that holds that span - its start. Open rows never
-- reach `spans`/`events` (module spans reads record IN ('span', 'event')), so
-- no answer about a finished request changes.

-- Last flush of each process, per store file (partial maxima; merged below).
CREATE OR REPLACE VIEW _calc_flush_part AS
SELECT _file, domain, host, pid, role, engine_id, run_id, max(start_ns) AS last_flush_raw_ns
FROM _file_rows
WHERE record IN ('stats', 'clock')
GROUP BY ALL;
CREATE TABLE IF NOT EXISTS _mat_flush_part AS SELECT * FROM _calc_flush_part LIMIT 0;

CREATE OR REPLACE VIEW _flush_rows AS
SELECT domain, host, pid, role, engine_id, run_id, max(last_flush_raw_ns) AS start_ns,
       max(last_flush_raw_ns) AS end_ns
FROM _mat_flush_part GROUP BY ALL;

-- Each process's trace end on the router clock (ns since the Unix epoch).
CREATE OR REPLACE VIEW _process_trace_end AS
SELECT domain, host, pid, role, engine_id, run_id, c_start_ns AS trace_end_ns
FROM _clock_corrected('_flush_rows');

-- The open spans of the refreshed requests that are not over (rules a-c).
-- Open rows are few (spans open past PDTRACE_OPEN_AFTER_S): they are taken
-- first, and the scope's span rows are reduced to those rules (a) and (c) can
-- match -- the same span id, or the same request as an open row -- before the
-- two NOT EXISTS checks. The span rows are read only when there is an open
-- row: the cross join with one row of op (none when op is empty) ends their
-- scan at its first chunk (a finished store: 0.85 -> 0.14 s CPU for 100k
-- requests, BENCHMARKS.md "Cold cost of the attribution rules"); with open
-- rows it keeps every row and changes nothing.
CREATE OR REPLACE VIEW _calc_open_spans AS
WITH op AS MATERIALIZED (
    SELECT * FROM _clock_corrected('_records')
    WHERE record = 'open' AND rkey IN (SELECT rkey FROM _scope_keys)
), latest AS (
    SELECT arg_max(x, x.end_ns) AS r
    FROM (SELECT op AS x FROM op)
    GROUP BY x.span_id
), o AS (
    SELECT unnest(r) FROM latest
), sp AS MATERIALIZED (
    SELECT span_id, rkey, attempt, name, c_end_ns, coalesce(attr_str['frontend.part'], '') AS part
    FROM _clock_corrected('_records'), (SELECT 1 FROM op LIMIT 1) any_open
    WHERE record = 'span' AND rkey IN (SELECT rkey FROM _scope_keys)
      AND (rkey IN (SELECT rkey FROM op) OR span_id IN (SELECT span_id FROM op))
)
SELECT o.rkey, o.run_id, o.request_id, o.prompt_index, o.attempt, o.span_id, o.name AS stage,
       o.role, o.engine_id, o.tp_rank, o.host, o.pid, o.domain, o.connector,
       o.c_start_ns AS since_ns, o.c_end_ns AS as_of_ns,
       o.attr_str['wait.for'] AS wait_for,
       o.attr_int['wait.expected'] AS wait_expected,
       o.attr_int['wait.received'] AS wait_received,
       o.attr_str['request.mode'] AS mode_attr
FROM o
WHERE coalesce(o.attr_str['open.state'], 'open') <> 'abandoned'
  AND NOT EXISTS (SELECT 1 FROM sp s WHERE s.span_id = o.span_id)
  AND NOT EXISTS (SELECT 1 FROM sp s WHERE s.rkey = o.rkey AND s.attempt = o.attempt
                  AND s.name = o.name AND s.c_end_ns >= o.c_start_ns AND s.part <> 'in');
CREATE TABLE IF NOT EXISTS _mat_open_spans AS SELECT * FROM _calc_open_spans LIMIT 0;

CREATE OR REPLACE VIEW in_flight_spans AS
SELECT s.run_id, s.request_id, s.prompt_index, s.attempt, s.stage, st.category, s.role, s.engine_id, s.tp_rank,
       s.since_ns, greatest(coalesce(e.trace_end_ns, s.as_of_ns), s.as_of_ns) AS trace_end_ns,
       (greatest(coalesce(e.trace_end_ns, s.as_of_ns), s.as_of_ns) - s.since_ns) / 1e6 AS age_ms,
       s.wait_for, s.wait_expected, s.wait_received, s.as_of_ns, s.span_id, s.host, s.pid, s.rkey
FROM _mat_open_spans s
LEFT JOIN stages st ON st.stage = s.stage
LEFT JOIN _process_trace_end e ON e.domain = s.domain AND e.host IS NOT DISTINCT FROM s.host
     AND e.pid IS NOT DISTINCT FROM s.pid AND e.run_id IS NOT DISTINCT FROM s.run_id;

CREATE OR REPLACE VIEW _in_flight_all AS
WITH ranked AS (
    SELECT f.*, row_number() OVER (PARTITION BY f.rkey
                                   ORDER BY (f.category IS NOT NULL) DESC, f.since_ns DESC, f.stage) AS rn,
           list(f.stage ORDER BY f.since_ns) OVER (PARTITION BY f.rkey) AS open_stages
    FROM in_flight_spans f
), m AS (
    SELECT rkey, any_value(mode_attr) FILTER (WHERE mode_attr IS NOT NULL) AS mode_attr,
           min(connector) AS connector
    FROM _mat_open_spans GROUP BY rkey
)
SELECT r.run_id, r.request_id, r.prompt_index, r.attempt, r.stage, r.category, r.since_ns, r.age_ms,
       concat_ws(' ', r.wait_for,
                 CASE WHEN r.wait_expected IS NOT NULL
                      THEN coalesce(r.wait_received, 0) || ' of ' || r.wait_expected END) AS waits_for,
       r.wait_for, r.wait_expected, r.wait_received,
       r.engine_id, r.role, r.tp_rank,
       coalesce(nullif(q.mode, 'unknown'), m.mode_attr,
                CASE WHEN m.connector ILIKE '%push%' THEN 'push' WHEN m.connector ILIKE '%nixl%' THEN 'pull' END,
                'unknown') AS mode,
       r.open_stages, r.trace_end_ns, r.as_of_ns, r.rkey
FROM ranked r
LEFT JOIN _req_base q ON q.rkey = r.rkey
LEFT JOIN m ON m.rkey = r.rkey
WHERE r.rn = 1;
-- in_flight: the rows of _in_flight_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW in_flight AS SELECT * FROM _in_flight_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW in_flight_spans IS 'Every open span not over as of its process''s last flush (one row per span; view in_flight picks one per request).';
COMMENT ON COLUMN in_flight_spans.run_id IS 'deployment run id';
COMMENT ON COLUMN in_flight_spans.request_id IS 'base request id X';
COMMENT ON COLUMN in_flight_spans.prompt_index IS 'prompt index i of cmpl-X-i (0 otherwise)';
COMMENT ON COLUMN in_flight_spans.attempt IS 'attempt number of the open span';
COMMENT ON COLUMN in_flight_spans.stage IS 'stage name of the open span (see view stages)';
COMMENT ON COLUMN in_flight_spans.category IS 'queue | compute | transfer | coordination; NULL for a parent stage';
COMMENT ON COLUMN in_flight_spans.role IS 'router | prefill | decode: the process that holds the open span';
COMMENT ON COLUMN in_flight_spans.engine_id IS 'engine that holds the open span (NULL: router)';
COMMENT ON COLUMN in_flight_spans.tp_rank IS 'tensor-parallel rank of a per-rank open span (NULL: not per rank)';
COMMENT ON COLUMN in_flight_spans.since_ns IS 'start of the open span (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN in_flight_spans.trace_end_ns IS 'trace end of the process holding the span: its last flush (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN in_flight_spans.age_ms IS 'trace_end_ns - since_ns: how long the stage has been open (ms)';
COMMENT ON COLUMN in_flight_spans.wait_for IS 'what the stage waits for (attribute wait.for): schedule, blocks, registration, read_post, read_done, write_done, engine';
COMMENT ON COLUMN in_flight_spans.wait_expected IS 'messages or ranks it waits for in all (count; NULL: not counted)';
COMMENT ON COLUMN in_flight_spans.wait_received IS 'of wait_expected, those received by the last flush (count)';
COMMENT ON COLUMN in_flight_spans.as_of_ns IS 'flush instant of the latest open row of the span (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN in_flight_spans.span_id IS 'the open span''s id (its span row, once it ends, has the same id)';
COMMENT ON COLUMN in_flight_spans.host IS 'host of the process holding the span';
COMMENT ON COLUMN in_flight_spans.pid IS 'process id of the process holding the span';
COMMENT ON COLUMN in_flight_spans.rkey IS 'request join key (see spans.rkey)';

COMMENT ON VIEW in_flight IS 'Requests not finished as of the trace end (each process''s last flush): where each is stuck, since when, waiting for what.';
COMMENT ON COLUMN in_flight.run_id IS 'deployment run id';
COMMENT ON COLUMN in_flight.request_id IS 'base request id X';
COMMENT ON COLUMN in_flight.prompt_index IS 'prompt index i of cmpl-X-i (0 otherwise)';
COMMENT ON COLUMN in_flight.attempt IS 'attempt number of the current stage';
COMMENT ON COLUMN in_flight.stage IS 'current stage: the open stage owning time that started last (else the latest open parent)';
COMMENT ON COLUMN in_flight.category IS 'category of the current stage: queue | compute | transfer | coordination; NULL for a parent';
COMMENT ON COLUMN in_flight.since_ns IS 'start of the current stage (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN in_flight.age_ms IS 'trace end of the process holding the stage - since_ns (ms)';
COMMENT ON COLUMN in_flight.waits_for IS 'what it waits for, as text: wait_for and "k of N" when counted (e.g. ''write_done 1 of 2'')';
COMMENT ON COLUMN in_flight.wait_for IS 'what the current stage waits for: schedule, blocks, registration, read_post, read_done, write_done, engine';
COMMENT ON COLUMN in_flight.wait_expected IS 'messages or ranks the current stage waits for in all (count)';
COMMENT ON COLUMN in_flight.wait_received IS 'of wait_expected, those received by the last flush (count)';
COMMENT ON COLUMN in_flight.engine_id IS 'engine holding the current stage (NULL: router)';
COMMENT ON COLUMN in_flight.role IS 'router | prefill | decode: the process holding the current stage';
COMMENT ON COLUMN in_flight.tp_rank IS 'tensor-parallel rank of the current stage (NULL: not per rank)';
COMMENT ON COLUMN in_flight.mode IS 'pull | push | unknown';
COMMENT ON COLUMN in_flight.open_stages IS 'every open stage of the request, by start (list)';
COMMENT ON COLUMN in_flight.trace_end_ns IS 'trace end of the process holding the current stage: its last flush (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN in_flight.as_of_ns IS 'flush instant of the current stage''s latest open row (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN in_flight.rkey IS 'request join key (see spans.rkey)';
