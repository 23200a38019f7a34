-- module: block_holds
-- requires: spans, request_base, in_flight
--
-- KV blocks held for a handoff: P's blocks from KV ready to release
-- (prefill.block_hold) and D's blocks from reservation to first use
-- (decode.block_reserve), plus the holds no span closes (DESIGN.md §4 "P's
-- blocks held until released, and by what (notification, expiry, abort,
-- never)"; issue 17 kind 9):
--   P, never released: a prefill.block_hold still open at the trace end (its
--     open rows, module in_flight, not over) runs to the trace end of the
--     process holding it (its last flush), release_cause 'never'; a
--     kv.lease_expired on P after its start ends it there ('expiry'). An abort
--     does not end it: vLLM ignores an abort of a P request whose blocks are
--     kept for the remote decode (vllm-project/vllm#25067) and only the lease
--     (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, vllm-project/vllm#20139) frees them.
--   D, freed without use: D allocated blocks (end of decode.queue, start of
--     D's dest.register / handoff.prep / handoff.step_wait / kv.ready, or of
--     such an open span) but never used them (no decode.block_reserve, no
--     decode.first_step). The hold runs from that allocation to
--       kv.ttl_expired on D                     -> 'expiry'
--       request.abort on D with its KV already arrived -> 'abort' (at the abort)
--       request.abort on D while its KV was still pending (no KV arrival at or
--         before the abort): vLLM keeps the blocks until the pending receive
--         finishes (vllm-project/vllm#32255, #46283), so it runs to the first
--         KV arrival after the abort (D's READ end, a write_done notification on
--         D, or a failed transfer / load on D) -> 'abort'; none ever -> 'never'
--       nothing                                  -> 'never'
--     A 'never' hold runs to D's trace end (its last flush; without one, the
--     request's last record on D).
-- release_cause of a span row comes from kv.release_cause, else from the
-- request's events: a read_done notification on P -> notification,
-- kv.lease_expired -> expiry, request.abort -> abort, none -> never.
-- prefix_hit_blocks (kv.prefix_hit_blocks) is the side's own: the largest on
-- the request's spans of that side's role (D's prefix cache on D's row only).
-- Flags:
--   missed_prefix_hit  D already held blocks of the prompt (kv.prefix_hit_blocks > 0)
--                      yet a transfer still moved blocks for it
--   held_without_read  P held blocks that no transfer read and no notification released
--   long_hold          held longer than _long_hold_ns()
--   transfer_after_release  a transfer of the request ended after the hold was
--                      released by expiry or abort: P side, D READ freed blocks
--                      (vllm-project/vllm#21570: P's timeout freed the blocks,
--                      D read them, wrong output); D side, P WROTE into freed blocks

CREATE OR REPLACE VIEW _block_holds_all AS
WITH r AS MATERIALIZED (
    -- the rows every step below reads, in one pass (spans and events, corrected times), with the
    -- attributes the steps read taken out of the maps (each for the rows that use it only: the
    -- copy keeps no map)
    SELECT record, name, role, engine_id, tp_rank, rkey, run_id, request_id, prompt_index,
           c_start_ns AS start_ns, c_end_ns AS end_ns,
           CASE WHEN name IN ('prefill.block_hold', 'decode.block_reserve', 'kv.transfer')
                THEN attr_int['kv.blocks'] END AS kv_blocks,
           CASE WHEN name = 'kv.transfer' THEN attr_int['kv.bytes'] END AS kv_bytes,
           CASE WHEN name = 'kv.transfer' THEN attr_str['kv.op'] END AS kv_op,
           CASE WHEN name IN ('prefill.block_hold', 'decode.block_reserve')
                THEN attr_str['kv.release_cause'] END AS kv_release_cause,
           CASE WHEN name = 'notification.received' THEN attr_str['kv.notif_kind'] END AS kv_notif_kind,
           attr_int['kv.prefix_hit_blocks'] AS kv_prefix_hit_blocks
    FROM _timed
    WHERE rkey IS NOT NULL
      AND (name IN ('prefill.block_hold', 'decode.block_reserve', 'decode.queue', 'dest.register', 'handoff.prep',
                    'handoff.step_wait', 'kv.ready', 'decode.first_step', 'kv.transfer',
                    'notification.received', 'kv.lease_expired', 'request.abort', 'kv.ttl_expired',
                    'kv.transfer_failed', 'kv.load_failed')
           OR attr_int['kv.prefix_hit_blocks'] IS NOT NULL)
), h0 AS (
    SELECT s.rkey, s.run_id, s.request_id, s.prompt_index, s.engine_id, s.tp_rank, s.kv_blocks AS blocks,
           s.start_ns, s.end_ns, s.kv_release_cause AS rec_cause,
           CASE s.name WHEN 'prefill.block_hold' THEN 'prefill' ELSE 'decode' END AS side, 'span' AS src
    FROM r s WHERE s.record = 'span' AND s.name IN ('prefill.block_hold', 'decode.block_reserve')
), evn AS (
    SELECT rkey, role, name AS event, start_ns AS time_ns, kv_notif_kind AS kind FROM r
    WHERE record = 'event' AND name IN ('notification.received', 'kv.lease_expired', 'request.abort', 'kv.ttl_expired',
                                        'kv.transfer_failed', 'kv.load_failed')
), ev AS (
    SELECT rkey,
           bool_or(event = 'notification.received' AND role = 'prefill'
                   AND coalesce(kind, 'read_done') = 'read_done') AS p_notified,
           bool_or(event = 'kv.lease_expired') AS lease_expired,
           bool_or(event = 'request.abort') AS aborted,
           min(time_ns) FILTER (WHERE event = 'kv.lease_expired' AND role = 'prefill') AS p_expired_ns,
           min(time_ns) FILTER (WHERE event = 'request.abort' AND role = 'decode') AS d_abort_ns,
           min(time_ns) FILTER (WHERE event = 'kv.ttl_expired' AND role = 'decode') AS d_ttl_ns
    FROM evn GROUP BY rkey
), dsp AS (
    -- D's own stages of a request: allocation, use, last record
    SELECT rkey, any_value(run_id) AS run_id, any_value(request_id) AS request_id,
           any_value(prompt_index) AS prompt_index, any_value(engine_id) AS engine_id,
           least(min(end_ns) FILTER (WHERE name = 'decode.queue'),
                 min(start_ns) FILTER (WHERE name IN ('dest.register', 'handoff.prep', 'handoff.step_wait', 'kv.ready')))
               AS alloc_ns,
           bool_or(name IN ('decode.block_reserve', 'decode.first_step')) AS used,
           max(end_ns) AS last_ns
    FROM r WHERE record = 'span' AND role = 'decode' GROUP BY rkey
), dopen AS (
    SELECT rkey, any_value(run_id) AS run_id, any_value(request_id) AS request_id,
           any_value(prompt_index) AS prompt_index, any_value(engine_id) AS engine_id,
           min(since_ns) FILTER (WHERE stage IN ('dest.register', 'handoff.prep', 'handoff.step_wait', 'kv.ready'))
               AS alloc_ns,
           max(trace_end_ns) AS trace_end_ns
    FROM in_flight_spans WHERE role = 'decode' GROUP BY rkey
), arrive AS (
    -- instants D's pending receive finished (or failed)
    SELECT rkey, end_ns AS t_ns FROM r WHERE record = 'span' AND name = 'kv.transfer' AND role = 'decode'
    UNION ALL
    SELECT rkey, time_ns FROM evn WHERE role = 'decode'
        AND ((event = 'notification.received' AND kind = 'write_done') OR event IN ('kv.transfer_failed', 'kv.load_failed'))
), dend AS (
    SELECT engine_id, max(trace_end_ns) AS trace_end_ns FROM _process_trace_end WHERE role = 'decode' GROUP BY engine_id
), dc AS (
    SELECT coalesce(d.rkey, o.rkey) AS rkey, coalesce(d.run_id, o.run_id) AS run_id,
           coalesce(d.request_id, o.request_id) AS request_id, coalesce(d.prompt_index, o.prompt_index) AS prompt_index,
           coalesce(d.engine_id, o.engine_id) AS engine_id,
           least(d.alloc_ns, o.alloc_ns) AS alloc_ns,
           greatest(d.last_ns, o.trace_end_ns) AS last_ns
    FROM dsp d FULL OUTER JOIN dopen o ON o.rkey = d.rkey
    WHERE NOT coalesce(d.used, false)
), dq AS (
    SELECT dc.*, ev.d_abort_ns, ev.d_ttl_ns,
           coalesce(max(a.t_ns) FILTER (WHERE a.t_ns <= ev.d_abort_ns) IS NULL, true) AS pending_at_abort,
           min(a.t_ns) FILTER (WHERE a.t_ns >= ev.d_abort_ns) AS arrival_after_abort
    FROM dc LEFT JOIN ev ON ev.rkey = dc.rkey LEFT JOIN arrive a ON a.rkey = dc.rkey
    WHERE dc.alloc_ns IS NOT NULL
    GROUP BY ALL
), dfree AS (
    SELECT dq.*,
           CASE WHEN d_ttl_ns >= alloc_ns AND (d_abort_ns IS NULL OR d_ttl_ns <= d_abort_ns) THEN 'expiry'
                WHEN d_abort_ns >= alloc_ns AND (NOT pending_at_abort OR arrival_after_abort IS NOT NULL) THEN 'abort'
                ELSE 'never' END AS cause
    FROM dq
), h AS (
    SELECT * FROM h0
    UNION ALL
    -- P's holds still open at the trace end
    SELECT o.rkey, o.run_id, o.request_id, o.prompt_index, o.engine_id, o.tp_rank, NULL::BIGINT,
           o.since_ns, CASE WHEN ev.p_expired_ns >= o.since_ns THEN ev.p_expired_ns ELSE o.trace_end_ns END,
           CASE WHEN ev.p_expired_ns >= o.since_ns THEN 'expiry' ELSE 'never' END, 'prefill', 'open'
    FROM in_flight_spans o LEFT JOIN ev ON ev.rkey = o.rkey
    WHERE o.stage = 'prefill.block_hold'
    UNION ALL
    -- D's blocks freed without use, or never freed
    SELECT f.rkey, f.run_id, f.request_id, f.prompt_index, f.engine_id, NULL::SMALLINT, NULL::BIGINT, f.alloc_ns,
           CASE f.cause WHEN 'expiry' THEN f.d_ttl_ns
                        WHEN 'abort' THEN CASE WHEN f.pending_at_abort THEN f.arrival_after_abort ELSE f.d_abort_ns END
                        ELSE greatest(coalesce(de.trace_end_ns, f.last_ns), f.last_ns, f.alloc_ns) END,
           f.cause, 'decode', 'derived'
    FROM dfree f LEFT JOIN dend de ON de.engine_id = f.engine_id
), tr AS (
    SELECT rkey, count(*) AS transfers, sum(coalesce(kv_blocks, 0)) AS blocks_moved,
           sum(coalesce(kv_bytes, 0)) AS bytes_moved,
           max(end_ns) FILTER (WHERE coalesce(kv_op, CASE role WHEN 'decode' THEN 'READ' ELSE 'WRITE' END) = 'READ')
               AS last_read_end_ns,
           max(end_ns) FILTER (WHERE coalesce(kv_op, CASE role WHEN 'decode' THEN 'READ' ELSE 'WRITE' END) = 'WRITE')
               AS last_write_end_ns
    FROM r WHERE record = 'span' AND name = 'kv.transfer' GROUP BY rkey
), hit AS (
    SELECT rkey, role, max(kv_prefix_hit_blocks) AS prefix_hit_blocks
    FROM r WHERE record = 'span' AND kv_prefix_hit_blocks IS NOT NULL GROUP BY rkey, role
), c AS (
    SELECT h.*,
           coalesce(h.rec_cause,
                    CASE WHEN h.side = 'decode' THEN 'used'
                         WHEN ev.p_notified THEN 'notification' WHEN ev.lease_expired THEN 'expiry'
                         WHEN ev.aborted THEN 'abort' ELSE 'never' END) AS release_cause,
           ev.p_notified
    FROM h LEFT JOIN ev ON ev.rkey = h.rkey
)
SELECT c.run_id, c.request_id, c.prompt_index, c.side, c.engine_id, c.tp_rank,
       c.blocks, c.start_ns, c.end_ns, c.end_ns - c.start_ns AS hold_ns, (c.end_ns - c.start_ns) / 1e6 AS hold_ms,
       c.release_cause,
       coalesce(tr.transfers, 0) AS transfers, coalesce(tr.blocks_moved, 0) AS blocks_moved,
       hit.prefix_hit_blocks,
       c.side = 'decode' AND coalesce(hit.prefix_hit_blocks, 0) > 0
           AND (coalesce(tr.blocks_moved, 0) > 0 OR coalesce(tr.bytes_moved, 0) > 0) AS missed_prefix_hit,
       c.side = 'prefill' AND coalesce(tr.transfers, 0) = 0
           AND coalesce(c.rec_cause, '') <> 'notification' AND NOT coalesce(c.p_notified, false)
           AS held_without_read,
       c.end_ns - c.start_ns > _long_hold_ns() AS long_hold,
       c.release_cause IN ('expiry', 'abort')
           AND coalesce(CASE c.side WHEN 'prefill' THEN tr.last_read_end_ns ELSE tr.last_write_end_ns END > c.end_ns, false)
           AS transfer_after_release,
       c.src AS source,
       c.rkey
FROM c LEFT JOIN tr ON tr.rkey = c.rkey LEFT JOIN hit ON hit.rkey = c.rkey AND hit.role = c.side;
-- block_holds: the rows of _block_holds_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW block_holds AS SELECT * FROM _block_holds_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW block_holds IS 'KV blocks held for handoffs: P from KV ready to release (and what released them, or never), D from reservation to use or to a release without use (abort, expiry, never); flags for missed prefix hits, holds nobody read and transfers after release.';
COMMENT ON COLUMN block_holds.run_id IS 'deployment run id';
COMMENT ON COLUMN block_holds.request_id IS 'base request id X';
COMMENT ON COLUMN block_holds.prompt_index IS 'prompt index i';
COMMENT ON COLUMN block_holds.side IS 'prefill (P holds blocks until released) | decode (D reserved blocks until used or freed)';
COMMENT ON COLUMN block_holds.engine_id IS 'engine holding the blocks';
COMMENT ON COLUMN block_holds.tp_rank IS 'rank (NULL: scheduler-level hold)';
COMMENT ON COLUMN block_holds.blocks IS 'blocks held (count; NULL: not recorded, e.g. a hold no span closed)';
COMMENT ON COLUMN block_holds.start_ns IS 'hold start (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN block_holds.end_ns IS 'hold end: the release, or for release_cause never the trace end of the holding process (its last flush) (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN block_holds.hold_ns IS 'hold duration (duration ns)';
COMMENT ON COLUMN block_holds.hold_ms IS 'hold_ns in ms';
COMMENT ON COLUMN block_holds.release_cause IS 'prefill: notification | expiry | abort | never; decode: used (or the recorded cause) | abort | expiry | never (freed without use, or still held at the trace end)';
COMMENT ON COLUMN block_holds.transfers IS 'kv.transfer spans of the request (count)';
COMMENT ON COLUMN block_holds.blocks_moved IS 'blocks those transfers moved (count)';
COMMENT ON COLUMN block_holds.prefix_hit_blocks IS 'blocks this side already held for the prompt: kv.prefix_hit_blocks on the request''s spans of this side''s role (count; NULL: not recorded on this side)';
COMMENT ON COLUMN block_holds.missed_prefix_hit IS 'true if D held the blocks yet a transfer moved them again';
COMMENT ON COLUMN block_holds.held_without_read IS 'true if P held blocks no transfer read and nothing released by notification';
COMMENT ON COLUMN block_holds.long_hold IS 'true if held longer than analysis_settings.long_hold_ns';
COMMENT ON COLUMN block_holds.transfer_after_release IS 'true if the hold was released by expiry or abort and a transfer of the request ended after that release (P: a READ of freed blocks; D: a WRITE into freed blocks)';
COMMENT ON COLUMN block_holds.source IS 'span (a prefill.block_hold / decode.block_reserve span) | open (a prefill.block_hold still open at the trace end) | derived (D blocks allocated, never used: from D''s stages and events)';
COMMENT ON COLUMN block_holds.rkey IS 'request join key';
