-- module: request_events
-- requires: request_base
-- materialize: request_events request
--
-- One row per request and incident (DESIGN.md §2: failure and lifecycle events
-- are events on the request with their time and expected vs received rank
-- counts). Each TP rank of an engine reports the same failure itself (vLLM's
-- workers log and record it once per rank; e.g. aws-samples/aws-do-eks#84:
-- "each once per prefill TP rank (8/8)"), so the rows of one incident are
-- collapsed: an incident is (request, attempt, role, engine, event name,
-- lifecycle.cause), with the ranks that reported it counted. ranks_expected is
-- the largest rank count the events themselves state (kv.ranks_expected,
-- lifecycle.expected), else the number of ranks of that engine the request's
-- own records name (tp_rank), else 1 for an event recorded without a rank.
-- Incident kinds: request.abort, request.preempted, request.timeout,
-- kv.lease_expired, kv.ttl_expired, kv.post_failed, kv.transfer_failed,
-- kv.load_failed, notification.unmatched, response.tokenless, registration.timeout,
-- handshake.failed, router.leg_failed.

CREATE OR REPLACE VIEW _calc_request_events AS
WITH ev AS (
    SELECT * FROM _timed
    WHERE record = 'event' AND rkey IN (SELECT rkey FROM _scope_keys) AND name IN (
        'request.abort', 'request.preempted', 'request.timeout', 'kv.lease_expired', 'kv.ttl_expired',
        'kv.post_failed', 'kv.transfer_failed', 'kv.load_failed', 'notification.unmatched', 'response.tokenless',
        'registration.timeout', 'handshake.failed', 'router.leg_failed')
), ranks AS (
    -- ranks of each engine the request's records name
    SELECT rkey, engine_id, count(DISTINCT tp_rank) AS n
    FROM _timed
    WHERE rkey IN (SELECT DISTINCT rkey FROM ev) AND tp_rank IS NOT NULL AND engine_id IS NOT NULL
    GROUP BY ALL
), inc AS (
    SELECT rkey, any_value(run_id) AS run_id, any_value(request_id) AS request_id,
           any_value(prompt_index) AS prompt_index, attempt, role, engine_id, name::VARCHAR AS incident,
           coalesce(attr_str['lifecycle.cause'], attr_str['error.type']) AS reason,
           min(attr_str['lifecycle.phase']) AS phase,
           min(c_start_ns) AS first_ns, max(c_start_ns) AS last_ns,
           count(*) AS records,
           list(DISTINCT tp_rank ORDER BY tp_rank) FILTER (WHERE tp_rank IS NOT NULL) AS ranks,
           max(coalesce(attr_int['kv.ranks_expected'], attr_int['lifecycle.expected'])) AS expected_attr,
           bool_or(tp_rank IS NULL) AS unranked
    FROM ev
    GROUP BY rkey, attempt, role, engine_id, name, coalesce(attr_str['lifecycle.cause'], attr_str['error.type'])
)
SELECT i.run_id, i.request_id, i.prompt_index, i.attempt, i.incident, i.reason, i.phase, i.role, i.engine_id,
       i.first_ns, i.last_ns, (i.last_ns - i.first_ns) / 1e6 AS spread_ms,
       coalesce(len(i.ranks), 0) AS ranks_reported,
       greatest(coalesce(i.expected_attr, r.n, 1), coalesce(len(i.ranks), 0)) AS ranks_expected,
       i.ranks, i.records, i.rkey
FROM inc i LEFT JOIN ranks r ON r.rkey = i.rkey AND r.engine_id = i.engine_id;
CREATE TABLE IF NOT EXISTS _mat_request_events AS SELECT * FROM _calc_request_events LIMIT 0;
CREATE OR REPLACE VIEW _request_events_all AS SELECT * FROM _mat_request_events;
-- request_events: the rows of _request_events_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW request_events AS SELECT * FROM _request_events_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW request_events IS 'One row per request and incident (failure/lifecycle event kind, reason, engine, attempt), per-rank duplicates collapsed and the ranks counted.';
COMMENT ON COLUMN request_events.run_id IS 'deployment run id';
COMMENT ON COLUMN request_events.request_id IS 'base request id X';
COMMENT ON COLUMN request_events.prompt_index IS 'prompt index i';
COMMENT ON COLUMN request_events.attempt IS 'attempt number the incident belongs to (0 first dispatch)';
COMMENT ON COLUMN request_events.incident IS 'event name: request.abort | request.preempted | request.timeout | kv.lease_expired | kv.ttl_expired | kv.post_failed | kv.transfer_failed | kv.load_failed | notification.unmatched | response.tokenless | registration.timeout | handshake.failed | router.leg_failed';
COMMENT ON COLUMN request_events.reason IS 'the event''s lifecycle.cause (else error.type), e.g. post_failure, aborted_waiting_for_kv, timeout; NULL when none';
COMMENT ON COLUMN request_events.phase IS 'handoff phase the failure happened in (lifecycle.phase), NULL when not recorded';
COMMENT ON COLUMN request_events.role IS 'router | prefill | decode: who recorded the incident';
COMMENT ON COLUMN request_events.engine_id IS 'engine that recorded the incident (NULL: router)';
COMMENT ON COLUMN request_events.first_ns IS 'earliest report of the incident by any rank (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN request_events.last_ns IS 'latest report of the incident by any rank (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN request_events.spread_ms IS 'last_ns - first_ns: how far apart the ranks reported it (ms)';
COMMENT ON COLUMN request_events.ranks_reported IS 'distinct TP ranks that reported the incident (count; 0 for an event recorded without a rank)';
COMMENT ON COLUMN request_events.ranks_expected IS 'ranks that could report it: the count the events state (kv.ranks_expected / lifecycle.expected), else the engine''s ranks named by the request''s records, else 1 (count)';
COMMENT ON COLUMN request_events.ranks IS 'the reporting ranks (list of tp_rank)';
COMMENT ON COLUMN request_events.records IS 'event records collapsed into the row (count)';
COMMENT ON COLUMN request_events.rkey IS 'request join key';
