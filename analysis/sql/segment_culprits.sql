-- module: segment_culprits
-- requires: spans
-- materialize: _culprit_event_part file
-- materialize: _segment_culprits request
--
-- ttft_segments.culprit_request_id (issue 17 kind 10; DESIGN.md §4 "the root
-- cause may sit on another request"): for a queue segment, the other request
-- whose held resource it waited for. One row per waiting span (rkey, span_id)
-- of stage prefill.queue, decode.queue or handoff.writer_queue; every
-- ttft_segments row owned by that span takes it (joined on rkey, span_id).
-- The wait is the span's [start, end] (corrected clock). Its culprit is the
-- other request (another rkey) whose event ENDED the wait: the latest such
-- event inside (start, end] on the same engine (the writer: same engine and
-- rank), ties broken by kind in the order listed:
--   head_of_line  (prefill.queue, decode.queue) another request that queued
--                 earlier in the same queue (same stage, same engine, started
--                 before this wait) and was admitted during it: this request
--                 waited behind it (vllm-project/vllm#31731: a KV-heavy request
--                 at the head of the waiting queue blocks lighter ones behind it)
--   batch_slot    (prefill.queue) another request's prefill.compute (a chunk or
--                 the whole) ended: its slot / token budget was freed
--   kv_blocks     (decode.queue) another request's blocks on D were freed: it
--                 finished or was aborted (request.finished / request.abort on
--                 D) or its TTL expired (kv.ttl_expired on D)
--   writer        (handoff.writer_queue) the nixl-push-writer thread was busy
--                 with another request on that engine and rank: its
--                 handoff.descriptors / handoff.handshake / handoff.agent_load
--                 ended during the wait (push: one writer serves all requests)
-- No such event in the wait: NULL (the wait was for the engine step, not for
-- another request).
-- Materialized per waiting request (kind request). The waits are the waiting
-- request's own rows; the events that may end them are every store file's
-- (_culprit_event_part, kind file: read once per file), so the answer does
-- not depend on which files a refresh reads for the waiting request (a
-- batch of a large cold build, a Spark task, a file rotation between the two
-- requests' rows): the same culprit in one pass or in batches. An event
-- copied in two files (the recorder's compaction) is the same event twice:
-- the same culprit.

-- The events that can end a wait, per store file (raw clocks; corrected when read).
CREATE OR REPLACE VIEW _calc_culprit_event_part AS
SELECT _file, record, name::VARCHAR AS name, role, engine_id, tp_rank, rkey, request_id, domain, start_ns, end_ns
FROM _file_rows
WHERE rkey IS NOT NULL
  AND ((record = 'span' AND name IN ('prefill.queue', 'decode.queue', 'prefill.compute', 'handoff.descriptors',
                                     'handoff.handshake', 'handoff.agent_load'))
       OR (record = 'event' AND name IN ('request.finished', 'request.abort', 'kv.ttl_expired')));
CREATE TABLE IF NOT EXISTS _mat_culprit_event_part AS SELECT * FROM _calc_culprit_event_part LIMIT 0;

CREATE OR REPLACE VIEW _calc_segment_culprits AS
WITH w AS MATERIALIZED (
    -- the waits of the refreshed requests
    SELECT rkey, span_id, name AS stage, engine_id, tp_rank, c_start_ns AS start_ns, c_end_ns AS end_ns
    FROM _timed
    WHERE record = 'span' AND name IN ('prefill.queue', 'decode.queue', 'handoff.writer_queue')
      AND rkey IN (SELECT rkey FROM _scope_keys)
), r AS MATERIALIZED (
    -- every file's events on the waits' engines within the waits' time range (corrected clocks)
    SELECT record, name, role, engine_id, tp_rank, rkey, request_id, c_start_ns AS start_ns, c_end_ns AS end_ns
    FROM _clock_corrected('_mat_culprit_event_part')
    WHERE (engine_id IN (SELECT engine_id FROM w) OR (engine_id IS NULL AND (SELECT bool_or(engine_id IS NULL) FROM w)))
      AND c_end_ns >= (SELECT min(start_ns) FROM w) AND c_start_ns <= (SELECT max(end_ns) FROM w)
), e AS (
    -- wait stage it can end, engine, rank (writer only), request, instant, kind, tie order, queued-since
    SELECT name AS wait_stage, engine_id, NULL::SMALLINT AS tp_rank, rkey, request_id, end_ns AS t_ns,
           'head_of_line' AS kind, 0 AS prio, start_ns AS since_ns
    FROM r WHERE record = 'span' AND name IN ('prefill.queue', 'decode.queue')
    UNION ALL
    SELECT 'prefill.queue', engine_id, NULL, rkey, request_id, end_ns, 'batch_slot', 1, NULL
    FROM r WHERE record = 'span' AND name = 'prefill.compute' AND role = 'prefill'
    UNION ALL
    SELECT 'decode.queue', engine_id, NULL, rkey, request_id, start_ns, 'kv_blocks', 1, NULL
    FROM r WHERE record = 'event' AND role = 'decode' AND name IN ('request.finished', 'request.abort', 'kv.ttl_expired')
    UNION ALL
    SELECT 'handoff.writer_queue', engine_id, tp_rank, rkey, request_id, end_ns, 'writer', 1, NULL
    FROM r WHERE record = 'span' AND role = 'prefill'
      AND name IN ('handoff.descriptors', 'handoff.handshake', 'handoff.agent_load')
), wb AS (
    -- each wait once per 100 ms bucket it covers; an event sits in one bucket: the range join is a
    -- hash join on (stage, engine, rank, bucket), never a cross product of an engine's waits and events
    SELECT w.*, unnest(range(w.start_ns // 100000000, w.end_ns // 100000000 + 1)) AS bucket FROM w
), eb AS (
    SELECT e.*, e.t_ns // 100000000 AS bucket FROM e
)
SELECT rkey, span_id, c.r AS culprit_request_id, c.k AS culprit_kind, c.t AS culprit_ns FROM (
    SELECT w.rkey, w.span_id,
           -- one row: latest event, then kind order, then request id (deterministic)
           arg_max({'r': e.request_id, 'k': e.kind, 't': e.t_ns}, {'t': e.t_ns, 'p': -e.prio, 'r': e.request_id}) AS c
    FROM wb w JOIN eb e
      ON e.bucket = w.bucket AND e.wait_stage = w.stage AND e.engine_id IS NOT DISTINCT FROM w.engine_id
     AND e.tp_rank IS NOT DISTINCT FROM CASE WHEN w.stage = 'handoff.writer_queue' THEN w.tp_rank END
    WHERE e.t_ns > w.start_ns AND e.t_ns <= w.end_ns AND e.rkey <> w.rkey
      AND (e.kind <> 'head_of_line' OR e.since_ns < w.start_ns)
    GROUP BY w.rkey, w.span_id
);

CREATE TABLE IF NOT EXISTS _mat_segment_culprits AS SELECT * FROM _calc_segment_culprits LIMIT 0;
CREATE OR REPLACE VIEW _segment_culprits AS SELECT * FROM _mat_segment_culprits;

COMMENT ON VIEW _segment_culprits IS 'Per waiting span (prefill.queue, decode.queue, handoff.writer_queue): the other request whose event ended the wait, and which resource (see the module header).';
COMMENT ON COLUMN _segment_culprits.rkey IS 'request join key of the waiting request';
COMMENT ON COLUMN _segment_culprits.span_id IS 'the waiting span (ttft_segments.span_id)';
COMMENT ON COLUMN _segment_culprits.culprit_request_id IS 'base request id X of the request whose event ended the wait';
COMMENT ON COLUMN _segment_culprits.culprit_kind IS 'head_of_line | batch_slot | kv_blocks | writer';
COMMENT ON COLUMN _segment_culprits.culprit_ns IS 'instant of the culprit''s event (ns since the Unix epoch, router clock)';
