-- module: incomplete
-- requires: request_base
-- materialize: incomplete_requests request
--
-- Materialized per request (a refresh recomputes the keys in _scope_keys), so
-- `requests` and the dashboard read a table, not the store's files.
--
-- Requests without a first token, each with a cause (DESIGN.md §4): never
-- silently dropped. Evidence: the failure/lifecycle events of the request and
-- of any id the router linked to it (router.linked_request_id), and the
-- rank notifications D received. Causes, first match wins:
--   id_mismatch        the router sent the legs different request ids
--   post_failure       a NIXL post failed (kv.post_failed) on some rank
--   transfer_failure   a posted transfer failed (kv.transfer_failed)
--   handshake_failure  the NIXL handshake failed
--   abort              the request was aborted (request.abort)
--   false_timeout      a timeout fired although every expected rank had reported
--   ttl_expired / lease_expired / registration_timeout / timeout
--   leg_failed         a router leg failed (router.leg_failed)
--   no_decode_record   engine-clock request (no router row): P saw it, D did not
--   no_prefill_record  engine-clock request: D saw it, P did not
--   no_prefill_frontend engine-clock request: P's API server recorded no
--                      prefill.frontend, so the window has no start
--   no_router_record   router rows without the router's root span
--   in_progress        the router's root span is not written yet
--   no_first_token     none of the above; detail lists the stages seen

CREATE OR REPLACE VIEW _inc_keys AS
SELECT rkey, rkey AS by_rkey FROM _req_base
WHERE first_token_ns IS NULL AND rkey IN (SELECT rkey FROM _scope_keys)
UNION ALL
SELECT l.rkey, l.by_rkey FROM _req_links l JOIN _req_base q ON q.rkey = l.by_rkey
WHERE q.first_token_ns IS NULL AND q.rkey IN (SELECT rkey FROM _scope_keys);

CREATE OR REPLACE VIEW _inc_evidence AS
SELECT k.by_rkey AS rkey,
       list(DISTINCT t.name ORDER BY t.name) FILTER (WHERE t.record = 'event') AS events,
       list(DISTINCT t.name ORDER BY t.name) FILTER (WHERE t.record = 'span') AS stages,
       max(t.c_start_ns) FILTER (WHERE t.record = 'event' AND t.name IN (
           'request.abort', 'request.timeout', 'kv.lease_expired', 'kv.ttl_expired', 'kv.post_failed',
           'kv.transfer_failed', 'registration.timeout', 'handshake.failed', 'router.leg_failed',
           'notification.unmatched')) AS failure_ns,
       min(t.c_start_ns) FILTER (WHERE t.name = 'kv.post_failed') AS post_failed_ns,
       list(DISTINCT coalesce(t.tp_rank, t.attr_int['peer.tp_rank'])) FILTER (WHERE t.name = 'kv.post_failed') AS post_failed_ranks,
       max(coalesce(t.attr_int['kv.ranks_expected'], t.attr_int['lifecycle.expected'])) AS ranks_expected,
       list(DISTINCT t.attr_int['peer.tp_rank'] ORDER BY t.attr_int['peer.tp_rank'])
           FILTER (WHERE t.name = 'notification.received' AND coalesce(t.attr_str['kv.notif_kind'], 'write_done') = 'write_done'
                   AND t.attr_int['peer.tp_rank'] IS NOT NULL) AS ranks_notified,
       max(t.attr_int['lifecycle.received']) AS ranks_received_attr,
       any_value(t.attr_str['kv.ranks_missing']) FILTER (WHERE t.attr_str['kv.ranks_missing'] IS NOT NULL) AS ranks_missing_attr,
       max(t.c_start_ns) FILTER (WHERE t.name = 'notification.received') AS last_notification_ns,
       max(t.c_start_ns) FILTER (WHERE t.role = 'decode' AND t.name IN ('kv.ttl_expired', 'request.timeout',
           'registration.timeout', 'request.abort')) AS decode_gave_up_ns,
       max(t.c_start_ns) FILTER (WHERE t.name = 'request.timeout') AS timeout_ns,
       max(t.c_end_ns) AS last_seen_ns,
       any_value(t.attr_str['router.linked_request_id']) FILTER (WHERE t.attr_str['router.linked_request_id'] IS NOT NULL) AS linked_request_id,
       any_value(t.attr_str['lifecycle.cause']) FILTER (WHERE t.attr_str['lifecycle.cause'] IS NOT NULL) AS lifecycle_cause
FROM _inc_keys k JOIN _timed t ON t.rkey = k.rkey
GROUP BY k.by_rkey;

CREATE OR REPLACE VIEW _calc_incomplete_requests AS
WITH e AS (
    SELECT q.*, e.* EXCLUDE (rkey),
           coalesce(len(e.ranks_notified), e.ranks_received_attr) AS ranks_received,
           coalesce(e.ranks_missing_attr,
                    CASE WHEN e.ranks_expected IS NOT NULL THEN
                        array_to_string(list_filter(range(e.ranks_expected::BIGINT),
                                                    lambda r: NOT list_contains(coalesce(e.ranks_notified, []), r)), ',')
                    END) AS ranks_missing
    FROM _req_base q LEFT JOIN _inc_evidence e ON e.rkey = q.rkey
    WHERE q.first_token_ns IS NULL AND q.rkey IN (SELECT rkey FROM _scope_keys)
), c AS (
    SELECT *,
        CASE
            WHEN linked_request_id IS NOT NULL OR len(linked_ids) > 0 THEN 'id_mismatch'
            WHEN list_contains(events, 'kv.post_failed') THEN 'post_failure'
            WHEN list_contains(events, 'kv.transfer_failed') THEN 'transfer_failure'
            WHEN list_contains(events, 'handshake.failed') THEN 'handshake_failure'
            WHEN list_contains(events, 'request.abort') THEN 'abort'
            WHEN timeout_ns IS NOT NULL AND ranks_expected IS NOT NULL AND ranks_received >= ranks_expected
                 AND last_notification_ns <= timeout_ns THEN 'false_timeout'
            WHEN list_contains(events, 'kv.ttl_expired') THEN 'ttl_expired'
            WHEN list_contains(events, 'kv.lease_expired') THEN 'lease_expired'
            WHEN list_contains(events, 'registration.timeout') THEN 'registration_timeout'
            WHEN list_contains(events, 'request.timeout') THEN 'timeout'
            WHEN list_contains(events, 'router.leg_failed') THEN 'leg_failed'
            WHEN ttft_source = 'engine' AND NOT has_decode THEN 'no_decode_record'
            WHEN ttft_source = 'engine' AND NOT has_prefill THEN 'no_prefill_record'
            WHEN ttft_source = 'engine' AND NOT has_prefill_frontend THEN 'no_prefill_frontend'
            WHEN ttft_source = 'engine' THEN 'no_first_token'
            WHEN NOT has_router_record THEN 'no_router_record'
            WHEN root_end_ns IS NULL THEN 'in_progress'
            ELSE 'no_first_token'
        END AS cause
    FROM e
)
SELECT run_id, request_id, prompt_index, mode, cause,
       concat_ws('; ',
           CASE WHEN cause = 'id_mismatch' THEN 'legs sent different ids: ' || request_id || ' vs '
                || coalesce(linked_request_id, array_to_string(linked_ids, ',')) END,
           CASE WHEN ranks_expected IS NOT NULL THEN ranks_received || '/' || ranks_expected || ' rank notifications'
                || CASE WHEN ranks_missing <> '' THEN ', missing rank ' || ranks_missing ELSE '' END END,
           CASE WHEN decode_gave_up_ns IS NOT NULL AND last_notification_ns IS NOT NULL THEN
                'D waited ' || round((decode_gave_up_ns - last_notification_ns) / 1e6, 3) || ' ms after its last notification' END,
           CASE cause WHEN 'no_decode_record' THEN 'no router record; P saw the request, D never did'
                      WHEN 'no_prefill_record' THEN 'no router record; D saw the request, P never did'
                      WHEN 'no_prefill_frontend' THEN 'no router record and no prefill.frontend span: the engine-clock window has no start'
                      END,
           CASE WHEN cause = 'no_first_token' AND ttft_source = 'engine' THEN 'no router record; D''s API server wrote no token chunk' END,
           CASE WHEN cause = 'no_first_token' THEN 'stages seen: ' || coalesce(array_to_string(stages, ','), 'none') END
       ) AS detail,
       coalesce(failure_ns, root_end_ns, last_seen_ns) AS failure_ns,
       (coalesce(failure_ns, root_end_ns, last_seen_ns) - arrival_ns) / 1e6 AS time_to_failure_ms,
       ranks_expected, ranks_received, ranks_missing,
       (decode_gave_up_ns - last_notification_ns) / 1e6 AS waited_after_last_notification_ms,
       coalesce(linked_request_id, linked_ids[1]) AS linked_request_id,
       events, stages AS stages_seen, arrival_ns, ttft_source, rkey
FROM c;

CREATE TABLE IF NOT EXISTS _mat_incomplete_requests AS SELECT * FROM _calc_incomplete_requests LIMIT 0;
CREATE OR REPLACE VIEW incomplete_requests AS SELECT * FROM _mat_incomplete_requests;

COMMENT ON VIEW incomplete_requests IS 'Requests that got no first token, with a cause and the evidence; they give no TTFT sample.';
COMMENT ON COLUMN incomplete_requests.run_id IS 'deployment run id';
COMMENT ON COLUMN incomplete_requests.request_id IS 'base request id X';
COMMENT ON COLUMN incomplete_requests.prompt_index IS 'prompt index i';
COMMENT ON COLUMN incomplete_requests.mode IS 'pull | push | unknown';
COMMENT ON COLUMN incomplete_requests.cause IS 'why: id_mismatch | post_failure | transfer_failure | handshake_failure | abort | false_timeout | ttl_expired | lease_expired | registration_timeout | timeout | leg_failed | no_decode_record | no_prefill_record | no_prefill_frontend | no_router_record | in_progress | no_first_token';
COMMENT ON COLUMN incomplete_requests.detail IS 'human-readable evidence: rank counts, missing ranks, waits, linked ids, stages seen';
COMMENT ON COLUMN incomplete_requests.failure_ns IS 'time of the last failure event (else the root''s end, else the last record) (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN incomplete_requests.time_to_failure_ms IS 'failure_ns - arrival (ms)';
COMMENT ON COLUMN incomplete_requests.ranks_expected IS 'producer ranks whose completion was expected (count)';
COMMENT ON COLUMN incomplete_requests.ranks_received IS 'ranks whose write-done notification arrived (count)';
COMMENT ON COLUMN incomplete_requests.ranks_missing IS 'missing ranks, comma-separated';
COMMENT ON COLUMN incomplete_requests.waited_after_last_notification_ms IS 'time D kept waiting after its last notification before giving up (ms)';
COMMENT ON COLUMN incomplete_requests.linked_request_id IS 'the other leg''s request id when the router sent different ids';
COMMENT ON COLUMN incomplete_requests.events IS 'event names seen for the request (list)';
COMMENT ON COLUMN incomplete_requests.stages_seen IS 'stage names seen for the request (list)';
COMMENT ON COLUMN incomplete_requests.arrival_ns IS 'request received: by the router (ttft_source router), else by P''s API server, else the request''s first record (ns since the Unix epoch, corrected clock)';
COMMENT ON COLUMN incomplete_requests.ttft_source IS 'router | engine: whose clock the request''s window would come from (requests.ttft_source)';
COMMENT ON COLUMN incomplete_requests.rkey IS 'request join key';
