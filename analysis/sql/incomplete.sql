-- module: incomplete
-- requires: request_base, in_flight
-- materialize: _engine_event_part file
-- materialize: _inc_rows scratch
-- materialize: _inc_own request
--
-- Requests without a first token, each with a cause (DESIGN.md §4): never
-- silently dropped. Two layers:
--   _inc_own (materialized per request: a refresh recomputes the keys in
--     _scope_keys) holds each request's OWN evidence: the failure/lifecycle
--     events of the request and of any id the router linked to it
--     (router.linked_request_id), the rank notifications D received, and the
--     instants the root-cause rules below need. Its `symptom` is the first
--     match of the request's own evidence.
--   incomplete_requests (a view over _inc_own, _req_base, the engine-level
--     events and each process's trace end; the incomplete requests are few)
--     resolves the ROOT cause across requests and engines, and the times that
--     depend on the trace end (which moves with every flush).
--
-- Symptom (own evidence), first match wins:
--   id_mismatch        the router sent the legs different request ids
--   false_timeout      a deadline was checked (request.timeout, kv.ttl_expired,
--                      kv.lease_expired, registration.timeout, or an abort whose
--                      lifecycle.cause names a timeout/expiry) after every
--                      expected rank's completion already existed: the rank's
--                      notification was received, or sent by the peer, or its
--                      kv.transfer ended with bytes, at or before the earliest
--                      deadline check -- even when an abort follows (order by
--                      time; sgl-project/sglang#34510: completion first, then
--                      the timeout)
--   post_failure       a NIXL post failed (kv.post_failed) on some rank
--   notification_failure the data moved but the completion message was not sent
--                      (kv.post_failed / kv.transfer_failed whose lifecycle.cause
--                      is notification_failed or registration_send_failed, or
--                      lifecycle.phase 'notification')
--   transfer_failure   a posted transfer failed (kv.transfer_failed; not one whose
--                      cause/phase is the release after the data moved)
--   handshake_failure  the NIXL handshake failed
--   abort              the request was aborted (request.abort not naming a timeout,
--                      or response.tokenless: an API server answered 2xx with no
--                      token, as vLLM does for a request its engine gave up on,
--                      vllm-project/vllm#57082) before the router failed it; an abort after the router's
--                      failure is its consequence (the client gave up or the router
--                      timed out and cancelled the legs), not the cause
--   leg_failed         (early) the router's first failure is no deadline (a client
--                      cancel, an upstream error) and precedes every engine failure
--                      event: the engines' later give-ups are its consequence
--   load_not_reported  D had allocated its blocks (decode.queue ended, or a D
--                      handoff stage exists), P's KV was ready, and then nothing:
--                      no transfer, no notification, no kv.ready, and no failure
--                      event on any engine -- the load was never reported, so
--                      the only evidence is the missing completion
--                      (vllm-project/vllm#56640, LMCache/LMCache#5047)
--   ttl_expired / lease_expired / registration_timeout
--   timeout            request.timeout, an abort naming a timeout, or a router
--                      leg failure of error.type 'timeout'
--   leg_failed         a router leg failed (router.leg_failed), after an engine's failure
--   no_decode_record   engine-clock request (no router row): P saw it, D did not
--   no_prefill_record  engine-clock request: D saw it, P did not
--   no_prefill_frontend engine-clock request: P's API server recorded no
--                      prefill.frontend, so the window has no start
--   no_router_record   router rows without the router's root span
--   in_progress        the router's root span is not written yet
--   no_first_token     none of the above; detail lists the stages seen
-- Reason attributes are read, not only names: lifecycle.cause (every failure
-- event) and lifecycle.phase (the handoff phase a failure happened in).
--
-- Root cause (incomplete_requests.cause), first match wins; root_request_id
-- names the request whose failure is the root (itself when it is its own, NULL
-- when the root is an engine: root_engine_id):
--   own symptom when it is a failure of the request itself (id_mismatch,
--     false_timeout, post_failure, notification_failure, transfer_failure,
--     handshake_failure): root = itself
--   thread_exited      a connector thread of the request's P or D engine exited
--     (engine.thread_exited, an engine-level event) at or before the request's
--     failure: every later request on that engine waits (sgl-project/sglang#27162)
--   slot_held_by_orphan the request waited in decode.queue (prefill.queue) and
--     never got its blocks, while another incomplete request held blocks on
--     that engine across the start of the wait (vllm-project/vllm#46283,
--     sgl-project/sglang#31800): root = the holder whose hold began first
--   blocked_by_earlier_request the request's completions are missing (k of N,
--     load_not_reported, or a deadline/abort without them) and it belongs to a
--     run of such requests on the same (P, D) engine pair, by arrival, with no
--     complete request of the pair between: root = the first of the run
--   else the own symptom, root = itself (NULL for in_progress / no_first_token,
--     whose root is unknown)
--
-- time_to_failure_ms runs from arrival to the failure the client saw
-- (DESIGN.md §4): the router's earliest router.leg_failed / router-side
-- request.timeout or request.abort, else the end of its root span (the last
-- byte written, with or without error); a request whose root is not written
-- (still open) runs to the router process's trace end (its last flush, module
-- in_flight's _process_trace_end). Engine-clock requests (no router): D's API
-- server ending its frontend span (D's API server answers the client; P's
-- answers the router), else the latest failure event, else the trace end of the
-- engines that saw it, else the last record.
--
-- orphan_wait_ms: a failure that reached one side only leaves the other side
-- waiting or holding blocks (DESIGN.md §4). From the first failure (the
-- earliest failure event on any process, or the client-seen failure if
-- earlier), for each engine side that was still in the request at that instant:
--   P holding: its KV was ready (prefill.block_hold start, else the end of
--     prefill.compute) and not yet released; it holds until the first release
--     after the failure (end of prefill.block_hold, kv.lease_expired, request.abort
--     on P, a read_done notification received or a write_done sent by P, a P
--     kv.transfer ending), else to P's trace end
--   D waiting: it had a record and had not given up; it waits until the first
--     give-up or release after the failure (kv.ttl_expired, request.timeout,
--     registration.timeout, request.finished, request.abort on D -- except an abort
--     while waiting for KV, lifecycle.cause aborted_waiting_for_kv, after which
--     vLLM holds the blocks until a completion arrives), else to D's trace end
-- orphan_wait_ms is the longest of the two (NULL when no side was left, or its
-- end is unknown: no flush recorded); orphan_side says which side.

-- Engine-level events (no request): per store file, read once (kind 'file').
CREATE OR REPLACE VIEW _calc_engine_event_part AS
SELECT _file, domain, host, pid, role, engine_id, run_id, name::VARCHAR AS name, thread, tp_rank,
       start_ns, start_ns AS end_ns, attr_str['lifecycle.cause'] AS reason
FROM _file_rows
WHERE record = 'event' AND name = 'engine.thread_exited';
CREATE TABLE IF NOT EXISTS _mat_engine_event_part AS SELECT * FROM _calc_engine_event_part LIMIT 0;

CREATE OR REPLACE VIEW _engine_events AS
SELECT * FROM _clock_corrected('_mat_engine_event_part');

CREATE OR REPLACE VIEW _inc_keys AS
SELECT rkey, rkey AS by_rkey FROM _req_base
WHERE first_token_ns IS NULL AND rkey IN (SELECT rkey FROM _scope_keys)
UNION ALL
SELECT l.rkey, l.by_rkey FROM _req_links l JOIN _req_base q ON q.rkey = l.by_rkey
WHERE q.first_token_ns IS NULL AND q.rkey IN (SELECT rkey FROM _scope_keys);

-- a request's rows, each with its reason read (deadline checks, release-phase failures);
-- scratch: computed once per refresh, read by the four steps below
CREATE OR REPLACE VIEW _calc_inc_rows AS
SELECT k.by_rkey AS rkey, t.*  EXCLUDE (rkey),
       coalesce(t.attr_str['lifecycle.cause'], '') AS reason,
       coalesce(t.attr_str['lifecycle.phase'], '') AS phase,
       t.record = 'event' AND (t.name IN ('request.timeout', 'kv.ttl_expired', 'kv.lease_expired', 'registration.timeout')
           OR (t.name = 'request.abort' AND (coalesce(t.attr_str['lifecycle.cause'], '') ILIKE '%timeout%'
                                             OR coalesce(t.attr_str['lifecycle.cause'], '') ILIKE '%expired%'
                                             OR coalesce(t.attr_str['lifecycle.cause'], '') ILIKE '%deadline%'))
           OR (t.name = 'router.leg_failed' AND coalesce(t.attr_str['error.type'], '') = 'timeout')) AS is_deadline,
       t.record = 'event' AND t.name IN ('kv.post_failed', 'kv.transfer_failed')
           AND (coalesce(t.attr_str['lifecycle.cause'], '') IN ('notification_failed', 'registration_send_failed')
                OR coalesce(t.attr_str['lifecycle.phase'], '') = 'notification') AS is_notif_failure,
       t.record = 'event' AND t.name = 'kv.transfer_failed'
           AND (coalesce(t.attr_str['lifecycle.cause'], '') = 'release_failed' OR coalesce(t.attr_str['lifecycle.phase'], '') = 'release')
           AS is_release_failure,
       t.record = 'event' AND t.name IN (
           'request.abort', 'request.timeout', 'kv.lease_expired', 'kv.ttl_expired', 'kv.post_failed',
           'kv.transfer_failed', 'registration.timeout', 'handshake.failed', 'router.leg_failed',
           'notification.unmatched', 'response.tokenless') AS is_failure
FROM _inc_keys k JOIN _timed t ON t.rkey = k.rkey;
CREATE TABLE IF NOT EXISTS _mat_inc_rows AS SELECT * FROM _calc_inc_rows LIMIT 0;
CREATE OR REPLACE VIEW _inc_rows AS SELECT * FROM _mat_inc_rows;

-- the earliest deadline check of each request by an engine (for false_timeout; the router's
-- own deadline after the KV arrived is a real timeout of the request, not a false one)
CREATE OR REPLACE VIEW _inc_deadline AS
SELECT rkey, min(c_start_ns) AS deadline_ns FROM _inc_rows WHERE is_deadline AND role IN ('prefill', 'decode')
GROUP BY rkey;

-- completion evidence per producer rank: notification received (peer.tp_rank), or
-- sent by the producer (its tp_rank), or a kv.transfer that ended with bytes
CREATE OR REPLACE VIEW _inc_completions AS
SELECT rkey, coalesce(attr_int['peer.tp_rank'], tp_rank, 0) AS rank, min(c_start_ns) AS done_ns
FROM _inc_rows
WHERE (record = 'event' AND name = 'notification.received'
       AND coalesce(attr_str['kv.notif_kind'], 'write_done') IN ('write_done', 'read_done'))
   OR (record = 'event' AND name = 'notification.sent'
       AND coalesce(attr_str['kv.notif_kind'], 'write_done') IN ('write_done', 'read_done'))
GROUP BY ALL
UNION ALL
SELECT rkey, coalesce(tp_rank, 0) AS rank, min(c_end_ns) AS done_ns
FROM _inc_rows
WHERE record = 'span' AND name = 'kv.transfer' AND status_code <> 2 AND coalesce(attr_int['kv.bytes'], 1) > 0
GROUP BY ALL;

CREATE OR REPLACE VIEW _inc_done_by_deadline AS
SELECT c.rkey, count(DISTINCT c.rank) AS ranks_done
FROM _inc_completions c JOIN _inc_deadline d ON d.rkey = c.rkey
WHERE c.done_ns <= d.deadline_ns
GROUP BY c.rkey;

CREATE OR REPLACE VIEW _inc_evidence AS
SELECT t.rkey,
       list(DISTINCT t.name ORDER BY t.name) FILTER (WHERE t.record = 'event') AS events,
       list(DISTINCT t.name ORDER BY t.name) FILTER (WHERE t.record = 'span') AS stages,
       max(t.c_start_ns) FILTER (WHERE t.is_failure) AS failure_ns,
       min(t.c_start_ns) FILTER (WHERE t.is_failure) AS first_failure_ns,
       arg_min(t.role, t.c_start_ns) FILTER (WHERE t.is_failure) AS first_failure_role,
       min(t.c_start_ns) FILTER (WHERE t.is_failure AND t.role = 'router') AS router_failure_ns,
       arg_min(t.is_deadline, t.c_start_ns) FILTER (WHERE t.is_failure AND t.role = 'router') AS router_failure_is_deadline,
       min(t.c_start_ns) FILTER (WHERE t.is_failure AND t.role IN ('prefill', 'decode')) AS engine_failure_ns,
       bool_or(t.is_notif_failure) AS has_notif_failure,
       bool_or(t.name = 'kv.transfer_failed' AND NOT t.is_notif_failure AND NOT t.is_release_failure) AS has_transfer_failure,
       bool_or(t.name = 'kv.post_failed' AND NOT t.is_notif_failure) AS has_post_failure,
       min(t.c_start_ns) FILTER (WHERE (t.name = 'request.abort' AND NOT t.is_deadline)
                                 OR t.name = 'response.tokenless') AS abort_ns,
       bool_or(t.name = 'request.abort' AND t.is_deadline) OR bool_or(t.name = 'router.leg_failed' AND t.is_deadline)
           AS has_timeout_reason,
       bool_or(t.role IN ('prefill', 'decode') AND t.name IN ('kv.post_failed', 'kv.transfer_failed', 'handshake.failed',
                                                              'notification.unmatched')) AS has_engine_failure,
       min(t.c_start_ns) FILTER (WHERE t.name = 'kv.post_failed') AS post_failed_ns,
       list(DISTINCT coalesce(t.tp_rank, t.attr_int['peer.tp_rank'])
            ORDER BY coalesce(t.tp_rank, t.attr_int['peer.tp_rank'])) FILTER (WHERE t.name = 'kv.post_failed') AS post_failed_ranks,
       max(coalesce(t.attr_int['kv.ranks_expected'], t.attr_int['lifecycle.expected'])) AS ranks_expected,
       list(DISTINCT t.attr_int['peer.tp_rank'] ORDER BY t.attr_int['peer.tp_rank'])
           FILTER (WHERE t.name = 'notification.received' AND coalesce(t.attr_str['kv.notif_kind'], 'write_done') = 'write_done'
                   AND t.attr_int['peer.tp_rank'] IS NOT NULL) AS ranks_notified,
       max(t.attr_int['lifecycle.received']) AS ranks_received_attr,
       min(t.attr_str['kv.ranks_missing']) AS ranks_missing_attr,
       max(t.c_start_ns) FILTER (WHERE t.name = 'notification.received') AS last_notification_ns,
       max(t.c_start_ns) FILTER (WHERE t.role = 'decode' AND t.name IN ('kv.ttl_expired', 'request.timeout',
           'registration.timeout', 'request.abort')) AS decode_gave_up_ns,
       max(t.c_start_ns) FILTER (WHERE t.name = 'request.timeout') AS timeout_ns,
       max(t.c_end_ns) AS last_seen_ns,
       min(t.attr_str['router.linked_request_id']) AS linked_request_id,
       arg_max(t.attr_str['lifecycle.cause'], t.c_start_ns) FILTER (WHERE t.attr_str['lifecycle.cause'] IS NOT NULL) AS lifecycle_cause,
       -- the processes that hold the request's rows (their trace ends are read in the view)
       list(DISTINCT {'domain': t.domain, 'host': t.host, 'pid': t.pid, 'role': t.role}
            ORDER BY {'domain': t.domain, 'host': t.host, 'pid': t.pid, 'role': t.role}) AS procs,
       -- P: KV ready, releases; D: first record, allocation, give-ups / releases
       coalesce(min(t.c_start_ns) FILTER (WHERE t.record = 'span' AND t.name = 'prefill.block_hold'),
                max(t.c_end_ns) FILTER (WHERE t.record = 'span' AND t.name = 'prefill.compute')) AS p_ready_ns,
       list(CASE WHEN t.record = 'span' AND t.name = 'prefill.block_hold' THEN t.c_end_ns ELSE t.c_start_ns END
            ORDER BY CASE WHEN t.record = 'span' AND t.name = 'prefill.block_hold' THEN t.c_end_ns ELSE t.c_start_ns END)
           FILTER (WHERE t.role = 'prefill' AND (
               (t.record = 'span' AND t.name IN ('prefill.block_hold', 'kv.transfer'))
               OR (t.record = 'event' AND t.name IN ('kv.lease_expired', 'request.abort'))
               OR (t.record = 'event' AND t.name = 'notification.received' AND t.attr_str['kv.notif_kind'] = 'read_done')
               OR (t.record = 'event' AND t.name = 'notification.sent'
                   AND coalesce(t.attr_str['kv.notif_kind'], 'write_done') = 'write_done'))) AS p_release_ts,
       min(t.c_start_ns) FILTER (WHERE t.role = 'decode') AS d_first_ns,
       list(t.c_start_ns ORDER BY t.c_start_ns) FILTER (WHERE t.role = 'decode' AND t.record = 'event' AND (
               t.name IN ('kv.ttl_expired', 'request.timeout', 'registration.timeout', 'request.finished')
               OR (t.name = 'request.abort' AND t.reason <> 'aborted_waiting_for_kv'))) AS d_end_ts,
       min(t.c_start_ns) FILTER (WHERE t.role = 'decode' AND t.name = 'request.abort' AND t.reason = 'aborted_waiting_for_kv')
           AS d_abort_waiting_ns,
       list(CASE WHEN t.record = 'span' THEN t.c_end_ns ELSE t.c_start_ns END
            ORDER BY CASE WHEN t.record = 'span' THEN t.c_end_ns ELSE t.c_start_ns END) FILTER (WHERE t.role = 'decode' AND (
               (t.record = 'event' AND t.name = 'notification.received')
               OR (t.record = 'span' AND t.name IN ('kv.transfer', 'kv.ready')))) AS d_completion_ts,
       max(t.c_end_ns) FILTER (WHERE t.record = 'span' AND t.name = 'decode.queue') AS d_queue_end_ns,
       min(t.c_start_ns) FILTER (WHERE t.role = 'decode' AND t.record = 'span'
                                 AND t.name IN ('dest.register', 'handoff.prep', 'kv.transfer', 'kv.ready')) AS d_handoff_ns,
       bool_or(t.role = 'decode' AND t.name IN ('kv.transfer', 'kv.ready', 'decode.first_step', 'notification.received'))
           AS d_has_completion,
       -- blocked in a queue: the queue stage is the last stage the engine recorded for the request
       min(t.c_start_ns) FILTER (WHERE t.record = 'span' AND t.name = 'decode.queue') AS d_queue_ns,
       bool_or(t.role = 'decode' AND t.record = 'span' AND t.name NOT IN ('decode.queue', 'decode.frontend'))
           AS d_past_queue,
       min(t.c_start_ns) FILTER (WHERE t.record = 'span' AND t.name = 'prefill.queue') AS p_queue_ns,
       bool_or(t.role = 'prefill' AND t.record = 'span' AND t.name NOT IN ('prefill.queue', 'prefill.frontend'))
           AS p_past_queue,
       max(t.c_end_ns) FILTER (WHERE t.record = 'span' AND t.name = 'decode.frontend'
                               AND coalesce(t.attr_str['frontend.part'], 'whole') IN ('out', 'whole')) AS d_frontend_end_ns
FROM _inc_rows t
GROUP BY t.rkey;

CREATE OR REPLACE VIEW _calc_inc_own AS
WITH e AS (
    SELECT q.*, e.* EXCLUDE (rkey),
           coalesce(len(e.ranks_notified), e.ranks_received_attr) AS ranks_received,
           coalesce(e.ranks_missing_attr,
                    CASE WHEN e.ranks_expected IS NOT NULL THEN
                        array_to_string(list_filter(range(e.ranks_expected::BIGINT),
                                                    lambda r: NOT list_contains(coalesce(e.ranks_notified, []), r)), ',')
                    END) AS ranks_missing,
           dl.deadline_ns, coalesce(db.ranks_done, 0) AS ranks_done_by_deadline,
           -- D's blocks allocated: decode.queue ended (unless cut short by the failure, with no D stage after it),
           -- else D's first handoff stage
           coalesce(CASE WHEN e.d_past_queue OR e.first_failure_ns IS NULL OR e.d_queue_end_ns < e.first_failure_ns
                         THEN e.d_queue_end_ns END, e.d_handoff_ns) AS d_alloc_ns
    FROM _req_base q LEFT JOIN _inc_evidence e ON e.rkey = q.rkey
    LEFT JOIN _inc_deadline dl ON dl.rkey = q.rkey
    LEFT JOIN _inc_done_by_deadline db ON db.rkey = q.rkey
    WHERE q.first_token_ns IS NULL AND q.rkey IN (SELECT rkey FROM _scope_keys)
), c AS (
    SELECT *,
        CASE
            WHEN linked_request_id IS NOT NULL OR len(linked_ids) > 0 THEN 'id_mismatch'
            WHEN deadline_ns IS NOT NULL AND ranks_done_by_deadline > 0
                 AND ranks_done_by_deadline >= coalesce(ranks_expected, 1)
                 AND NOT coalesce(has_post_failure, false) AND NOT coalesce(has_transfer_failure, false) THEN 'false_timeout'
            WHEN has_post_failure THEN 'post_failure'
            WHEN has_notif_failure THEN 'notification_failure'
            WHEN has_transfer_failure THEN 'transfer_failure'
            WHEN list_contains(events, 'handshake.failed') THEN 'handshake_failure'
            WHEN abort_ns < coalesce(router_failure_ns, abort_ns + 1) THEN 'abort'
            WHEN router_failure_ns IS NOT NULL AND NOT router_failure_is_deadline
                 AND router_failure_ns < coalesce(engine_failure_ns, router_failure_ns + 1) THEN 'leg_failed'
            WHEN d_alloc_ns IS NOT NULL AND p_ready_ns IS NOT NULL AND NOT d_has_completion
                 AND NOT coalesce(has_engine_failure, false) THEN 'load_not_reported'
            WHEN list_contains(events, 'kv.ttl_expired') THEN 'ttl_expired'
            WHEN list_contains(events, 'kv.lease_expired') THEN 'lease_expired'
            WHEN list_contains(events, 'registration.timeout') THEN 'registration_timeout'
            WHEN list_contains(events, 'request.timeout') OR has_timeout_reason THEN 'timeout'
            WHEN list_contains(events, 'router.leg_failed') THEN 'leg_failed'
            WHEN ttft_source = 'engine' AND NOT has_decode THEN 'no_decode_record'
            WHEN ttft_source = 'engine' AND NOT has_prefill THEN 'no_prefill_record'
            WHEN ttft_source = 'engine' AND NOT has_prefill_frontend THEN 'no_prefill_frontend'
            WHEN ttft_source = 'engine' THEN 'no_first_token'
            WHEN NOT has_router_record THEN 'no_router_record'
            WHEN root_end_ns IS NULL THEN 'in_progress'
            ELSE 'no_first_token'
        END AS symptom
    FROM e
)
SELECT run_id, request_id, prompt_index, mode, symptom,
       concat_ws('; ',
           CASE WHEN symptom = 'id_mismatch' THEN 'legs sent different ids: ' || request_id || ' vs '
                || coalesce(linked_request_id, array_to_string(linked_ids, ',')) END,
           CASE WHEN ranks_expected IS NOT NULL THEN ranks_received || '/' || ranks_expected || ' rank notifications'
                || CASE WHEN ranks_missing <> '' THEN ', missing rank ' || ranks_missing ELSE '' END END,
           CASE WHEN symptom = 'false_timeout' THEN ranks_done_by_deadline || ' rank completions existed before the deadline check' END,
           CASE WHEN symptom = 'load_not_reported' THEN 'D allocated its blocks; no transfer, notification or failure was ever reported' END,
           CASE WHEN decode_gave_up_ns IS NOT NULL AND last_notification_ns IS NOT NULL THEN
                'D waited ' || round((decode_gave_up_ns - last_notification_ns) / 1e6, 3) || ' ms after its last notification' END,
           CASE symptom WHEN 'no_decode_record' THEN 'no router record; P saw the request, D never did'
                        WHEN 'no_prefill_record' THEN 'no router record; D saw the request, P never did'
                        WHEN 'no_prefill_frontend' THEN 'no router record and no prefill.frontend span: the engine-clock window has no start'
                        END,
           CASE WHEN symptom = 'no_first_token' AND ttft_source = 'engine' THEN 'no router record; D''s API server wrote no token chunk' END,
           CASE WHEN symptom = 'no_first_token' THEN 'stages seen: ' || coalesce(array_to_string(stages, ','), 'none') END
       ) AS own_detail,
       failure_ns AS last_failure_ns, first_failure_ns, first_failure_role, router_failure_ns,
       ranks_expected, ranks_received, ranks_missing,
       (decode_gave_up_ns - last_notification_ns) / 1e6 AS waited_after_last_notification_ms,
       coalesce(linked_request_id, linked_ids[1]) AS linked_request_id,
       events, stages AS stages_seen, arrival_ns, ttft_source, root_end_ns, root_status, last_seen_ns,
       prefill_engine, decode_engine, procs,
       p_ready_ns, p_release_ts, d_first_ns, d_end_ts, d_abort_waiting_ns, d_completion_ts, d_alloc_ns,
       CASE WHEN d_queue_ns IS NOT NULL AND NOT coalesce(d_past_queue, false) AND d_alloc_ns IS NULL
            THEN d_queue_ns END AS d_blocked_since_ns,
       CASE WHEN p_queue_ns IS NOT NULL AND NOT coalesce(p_past_queue, false) THEN p_queue_ns END AS p_blocked_since_ns,
       d_frontend_end_ns,
       coalesce(ranks_received < ranks_expected, false) OR NOT coalesce(d_has_completion, false) AS completions_missing,
       rkey
FROM c;
CREATE TABLE IF NOT EXISTS _mat_inc_own AS SELECT * FROM _calc_inc_own LIMIT 0;

-- each incomplete request with its processes' trace ends and its failure instants
CREATE OR REPLACE VIEW _inc_timed AS
WITH pe AS (
    SELECT u.rkey, u.p.role AS role, max(e.trace_end_ns) AS trace_end_ns
    FROM (SELECT rkey, run_id, unnest(procs) AS p FROM _mat_inc_own) u
    JOIN _process_trace_end e ON e.domain = u.p.domain AND e.host IS NOT DISTINCT FROM u.p.host
         AND e.pid IS NOT DISTINCT FROM u.p.pid AND e.run_id IS NOT DISTINCT FROM u.run_id
    GROUP BY u.rkey, u.p.role
), te AS (
    SELECT rkey,
           max(trace_end_ns) FILTER (WHERE role = 'router') AS r_trace_end_ns,
           max(trace_end_ns) FILTER (WHERE role = 'prefill') AS p_trace_end_ns,
           max(trace_end_ns) FILTER (WHERE role = 'decode') AS d_trace_end_ns
    FROM pe GROUP BY rkey
), f AS (
    SELECT o.*, te.r_trace_end_ns, te.p_trace_end_ns, te.d_trace_end_ns,
           CASE WHEN o.ttft_source = 'router'
                THEN coalesce(o.router_failure_ns, o.root_end_ns, te.r_trace_end_ns, o.last_seen_ns)
                ELSE coalesce(o.d_frontend_end_ns, o.last_failure_ns,
                              greatest(te.p_trace_end_ns, te.d_trace_end_ns), o.last_seen_ns)
           END AS client_failure_ns,
           CASE WHEN o.ttft_source = 'router' THEN coalesce(o.router_failure_ns, o.root_end_ns) END AS client_seen_ns
    FROM _mat_inc_own o LEFT JOIN te ON te.rkey = o.rkey
), g AS (
    SELECT *, least(first_failure_ns, client_seen_ns) AS orphan_from_ns FROM f
), h AS (
    SELECT *,
           -- P still holding at the failure: KV ready before it, no release at or before it
           CASE WHEN orphan_from_ns IS NOT NULL AND coalesce(first_failure_role, 'router') <> 'prefill'
                     AND p_ready_ns <= orphan_from_ns
                     AND len(list_filter(coalesce(p_release_ts, []), lambda x: x <= orphan_from_ns)) = 0
                THEN coalesce(list_min(list_filter(coalesce(p_release_ts, []), lambda x: x > orphan_from_ns)), p_trace_end_ns)
           END AS p_orphan_end_ns,
           -- D still waiting at the failure: a record before it, no give-up at or before it
           CASE WHEN orphan_from_ns IS NOT NULL AND coalesce(first_failure_role, 'router') <> 'decode'
                     AND d_first_ns <= orphan_from_ns
                     AND len(list_filter(coalesce(d_end_ts, []), lambda x: x <= orphan_from_ns)) = 0
                THEN coalesce(list_min(list_filter(
                         list_concat(coalesce(d_end_ts, []),
                                     CASE WHEN d_abort_waiting_ns IS NOT NULL
                                          THEN list_filter(coalesce(d_completion_ts, []), lambda x: x > d_abort_waiting_ns)
                                          ELSE [] END),
                         lambda x: x > orphan_from_ns)), d_trace_end_ns)
           END AS d_orphan_end_ns,
           -- D's blocks held (for slot_held_by_orphan): allocation -> release / give-up, else D's trace end
           CASE WHEN d_alloc_ns IS NOT NULL THEN coalesce(list_min(list_filter(
                    list_concat(coalesce(d_end_ts, []),
                                CASE WHEN d_abort_waiting_ns IS NOT NULL
                                     THEN list_filter(coalesce(d_completion_ts, []), lambda x: x > d_abort_waiting_ns)
                                     ELSE [] END),
                    lambda x: x >= d_alloc_ns)), d_trace_end_ns, last_seen_ns) END AS d_hold_end_ns,
           CASE WHEN p_ready_ns IS NOT NULL THEN coalesce(list_min(list_filter(coalesce(p_release_ts, []),
                    lambda x: x >= p_ready_ns)), p_trace_end_ns, last_seen_ns) END AS p_hold_end_ns
    FROM g
)
SELECT * FROM h;

-- engine-level root: a connector thread of the request's engine exited before its failure
CREATE OR REPLACE VIEW _inc_thread_root AS
SELECT i.rkey, arg_min(x.engine_id, x.c_start_ns) AS root_engine_id, min(x.c_start_ns) AS exited_ns,
       arg_min(x.thread, x.c_start_ns) AS thread
FROM _inc_timed i JOIN _engine_events x
  ON x.run_id IS NOT DISTINCT FROM i.run_id AND x.engine_id IN (i.prefill_engine, i.decode_engine)
 AND x.name = 'engine.thread_exited' AND x.c_start_ns <= coalesce(i.first_failure_ns, i.client_failure_ns)
GROUP BY i.rkey;

-- slot held by an orphan: another incomplete request held blocks on the engine the request queued on
CREATE OR REPLACE VIEW _inc_slot_root AS
SELECT w.rkey, arg_min(h.request_id, h.hold_start_ns) AS root_request_id,
       arg_min(h.engine_id, h.hold_start_ns) AS root_engine_id
FROM (SELECT rkey, run_id, decode_engine AS engine_id, d_blocked_since_ns AS since_ns FROM _inc_timed
      WHERE d_blocked_since_ns IS NOT NULL
      UNION ALL
      SELECT rkey, run_id, prefill_engine, p_blocked_since_ns FROM _inc_timed WHERE p_blocked_since_ns IS NOT NULL) w
JOIN (SELECT rkey, run_id, request_id, decode_engine AS engine_id, d_alloc_ns AS hold_start_ns, d_hold_end_ns AS hold_end_ns
      FROM _inc_timed WHERE d_alloc_ns IS NOT NULL
      UNION ALL
      SELECT rkey, run_id, request_id, prefill_engine, p_ready_ns, p_hold_end_ns
      FROM _inc_timed WHERE p_ready_ns IS NOT NULL) h
  ON h.run_id IS NOT DISTINCT FROM w.run_id AND h.engine_id = w.engine_id AND h.rkey <> w.rkey
 AND h.hold_start_ns <= w.since_ns AND h.hold_end_ns > w.since_ns
GROUP BY w.rkey;

-- runs of requests with missing completions on one (P, D) engine pair, by arrival;
-- a complete request of the pair (or an incomplete one with its completions) ends a run
CREATE OR REPLACE VIEW _inc_run_root AS
WITH m AS (
    SELECT rkey, run_id, request_id, prefill_engine, decode_engine, arrival_ns FROM _inc_timed
    WHERE prefill_engine IS NOT NULL AND decode_engine IS NOT NULL AND completions_missing
), pairs AS (
    SELECT run_id, prefill_engine, decode_engine, min(arrival_ns) AS t0, max(arrival_ns) AS t1
    FROM m GROUP BY ALL HAVING count(*) > 1
), seq AS (
    SELECT q.rkey, q.run_id, q.request_id, q.prefill_engine, q.decode_engine, q.arrival_ns,
           m.rkey IS NOT NULL AS member
    FROM _req_base q JOIN pairs p ON q.run_id IS NOT DISTINCT FROM p.run_id
         AND q.prefill_engine = p.prefill_engine AND q.decode_engine = p.decode_engine
         AND q.arrival_ns BETWEEN p.t0 AND p.t1
    LEFT JOIN m ON m.rkey = q.rkey
), runs AS (
    SELECT *, sum(CASE WHEN member THEN 0 ELSE 1 END) OVER (
              PARTITION BY run_id, prefill_engine, decode_engine ORDER BY arrival_ns, request_id) AS run_no
    FROM seq
)
SELECT rkey, first_value(request_id) OVER (PARTITION BY run_id, prefill_engine, decode_engine, run_no
                                           ORDER BY arrival_ns, request_id) AS root_request_id,
       count(*) OVER (PARTITION BY run_id, prefill_engine, decode_engine, run_no) AS run_length
FROM runs WHERE member;

CREATE OR REPLACE VIEW _incomplete_requests_all AS
WITH r AS (
    SELECT i.*,
           tr.root_engine_id AS thread_engine_id, tr.exited_ns, tr.thread AS exited_thread,
           sr.root_request_id AS slot_root_id, sr.root_engine_id AS slot_engine_id,
           rr.root_request_id AS run_root_id, rr.run_length,
           CASE
               WHEN i.symptom IN ('id_mismatch', 'false_timeout', 'post_failure', 'notification_failure',
                                  'transfer_failure', 'handshake_failure') THEN i.symptom
               WHEN tr.rkey IS NOT NULL THEN 'thread_exited'
               WHEN sr.rkey IS NOT NULL THEN 'slot_held_by_orphan'
               WHEN rr.rkey IS NOT NULL AND rr.root_request_id <> i.request_id THEN 'blocked_by_earlier_request'
               ELSE i.symptom
           END AS cause
    FROM _inc_timed i
    LEFT JOIN _inc_thread_root tr ON tr.rkey = i.rkey
    LEFT JOIN _inc_slot_root sr ON sr.rkey = i.rkey
    LEFT JOIN _inc_run_root rr ON rr.rkey = i.rkey
)
SELECT run_id, request_id, prompt_index, mode, cause, symptom,
       CASE cause WHEN 'thread_exited' THEN NULL
                  WHEN 'slot_held_by_orphan' THEN slot_root_id
                  WHEN 'blocked_by_earlier_request' THEN run_root_id
                  WHEN 'in_progress' THEN NULL
                  WHEN 'no_first_token' THEN NULL
                  ELSE request_id END AS root_request_id,
       CASE cause WHEN 'thread_exited' THEN thread_engine_id
                  WHEN 'slot_held_by_orphan' THEN slot_engine_id END AS root_engine_id,
       concat_ws('; ',
           CASE cause WHEN 'thread_exited' THEN 'engine ' || thread_engine_id || '''s thread '
                           || coalesce(exited_thread, '?') || ' exited ' || round((exited_ns - arrival_ns) / 1e6, 3)
                           || ' ms after arrival'
                      WHEN 'slot_held_by_orphan' THEN 'waited for blocks on ' || slot_engine_id || ' held by orphaned request '
                           || slot_root_id
                      WHEN 'blocked_by_earlier_request' THEN 'completions missing in a run of ' || run_length
                           || ' requests on ' || prefill_engine || '->' || decode_engine || ', first: ' || run_root_id
           END,
           CASE WHEN cause <> symptom THEN 'own symptom: ' || symptom END,
           nullif(own_detail, ''),
           CASE WHEN greatest(p_orphan_end_ns, d_orphan_end_ns) > orphan_from_ns THEN
                CASE WHEN coalesce(d_orphan_end_ns, 0) >= coalesce(p_orphan_end_ns, 0) THEN 'D' ELSE 'P' END
                || ' kept ' || CASE WHEN coalesce(d_orphan_end_ns, 0) >= coalesce(p_orphan_end_ns, 0)
                                    THEN 'waiting' ELSE 'holding blocks' END
                || ' ' || round((greatest(p_orphan_end_ns, d_orphan_end_ns) - orphan_from_ns) / 1e6, 3)
                || ' ms after the failure' END
       ) AS detail,
       client_failure_ns AS failure_ns,
       (client_failure_ns - arrival_ns) / 1e6 AS time_to_failure_ms,
       CASE WHEN greatest(p_orphan_end_ns, d_orphan_end_ns) >= orphan_from_ns
            THEN (greatest(p_orphan_end_ns, d_orphan_end_ns) - orphan_from_ns) / 1e6 END AS orphan_wait_ms,
       CASE WHEN greatest(p_orphan_end_ns, d_orphan_end_ns) >= orphan_from_ns
            THEN CASE WHEN coalesce(d_orphan_end_ns, 0) >= coalesce(p_orphan_end_ns, 0) THEN 'decode' ELSE 'prefill' END
       END AS orphan_side,
       ranks_expected, ranks_received, ranks_missing,
       waited_after_last_notification_ms, linked_request_id,
       events, stages_seen, arrival_ns, ttft_source, rkey
FROM r;
-- incomplete_requests: the rows of _incomplete_requests_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW incomplete_requests AS SELECT * FROM _incomplete_requests_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW incomplete_requests IS 'Requests that got no first token, with a root cause and the evidence; they give no TTFT sample.';
COMMENT ON COLUMN incomplete_requests.run_id IS 'deployment run id';
COMMENT ON COLUMN incomplete_requests.request_id IS 'base request id X';
COMMENT ON COLUMN incomplete_requests.prompt_index IS 'prompt index i';
COMMENT ON COLUMN incomplete_requests.mode IS 'pull | push | unknown';
COMMENT ON COLUMN incomplete_requests.cause IS 'root cause: thread_exited | slot_held_by_orphan | blocked_by_earlier_request, else the own symptom (see symptom)';
COMMENT ON COLUMN incomplete_requests.symptom IS 'first match of the request''s own evidence: id_mismatch | false_timeout | post_failure | notification_failure | transfer_failure | handshake_failure | abort | load_not_reported | ttl_expired | lease_expired | registration_timeout | timeout | leg_failed | no_decode_record | no_prefill_record | no_prefill_frontend | no_router_record | in_progress | no_first_token';
COMMENT ON COLUMN incomplete_requests.root_request_id IS 'base request id of the request whose failure is the root (itself when the root is its own); NULL when the root is an engine (root_engine_id) or unknown (in_progress, no_first_token)';
COMMENT ON COLUMN incomplete_requests.root_engine_id IS 'engine whose state is the root: the engine whose connector thread exited (thread_exited), or where the orphan held the blocks (slot_held_by_orphan); else NULL';
COMMENT ON COLUMN incomplete_requests.detail IS 'human-readable evidence: root, own symptom, rank counts, missing ranks, waits, linked ids, orphan wait, stages seen';
COMMENT ON COLUMN incomplete_requests.failure_ns IS 'the failure the client saw: router''s earliest leg failure / timeout / abort, else its root span''s end, else (root not written) the router''s trace end; engine-clock: D''s API server''s frontend end, else the latest failure event, else the engines'' trace end (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN incomplete_requests.time_to_failure_ms IS 'failure_ns - arrival (ms)';
COMMENT ON COLUMN incomplete_requests.orphan_wait_ms IS 'time the other side kept waiting (D) or holding blocks (P) after the first failure, until it gave up / released or its trace end (ms); NULL when no side was left';
COMMENT ON COLUMN incomplete_requests.orphan_side IS 'prefill | decode: the side left waiting/holding longest (orphan_wait_ms); NULL when none';
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
