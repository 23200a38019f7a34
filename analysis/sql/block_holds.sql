-- module: block_holds
-- requires: spans, request_base
--
-- KV blocks held for a handoff: P's blocks from KV ready to release
-- (prefill.block_hold) and D's blocks from reservation to first use
-- (decode.block_reserve). release_cause comes from kv.release_cause, else from
-- the request's events: a read_done notification on P -> notification,
-- kv.lease_expired -> expiry, request.abort -> abort, none -> never.
-- Flags:
--   missed_prefix_hit  D already held blocks of the prompt (kv.prefix_hit_blocks > 0)
--                      yet a transfer still moved blocks for it
--   held_without_read  P held blocks that no transfer read and no notification released
--   long_hold          held longer than _long_hold_ns()

CREATE OR REPLACE VIEW block_holds AS
WITH h AS (
    SELECT s.*, CASE s.stage WHEN 'prefill.block_hold' THEN 'prefill' ELSE 'decode' END AS side
    FROM spans s WHERE s.stage IN ('prefill.block_hold', 'decode.block_reserve')
), ev AS (
    SELECT rkey,
           bool_or(event = 'notification.received' AND role = 'prefill'
                   AND coalesce(attr_str['kv.notif_kind'], 'read_done') = 'read_done') AS p_notified,
           bool_or(event = 'kv.lease_expired') AS lease_expired,
           bool_or(event = 'request.abort') AS aborted
    FROM events WHERE rkey IN (SELECT rkey FROM h) GROUP BY rkey
), tr AS (
    SELECT rkey, count(*) AS transfers, sum(coalesce(attr_int['kv.blocks'], 0)) AS blocks_moved,
           sum(coalesce(attr_int['kv.bytes'], 0)) AS bytes_moved
    FROM spans WHERE stage = 'kv.transfer' GROUP BY rkey
), hit AS (
    SELECT rkey, max(attr_int['kv.prefix_hit_blocks']) AS prefix_hit_blocks
    FROM spans WHERE role = 'decode' AND attr_int['kv.prefix_hit_blocks'] IS NOT NULL GROUP BY rkey
)
SELECT h.run_id, h.request_id, h.prompt_index, h.side, h.engine_id, h.tp_rank,
       h.attr_int['kv.blocks'] AS blocks, h.start_ns, h.end_ns, h.dur_ns AS hold_ns, h.dur_ns / 1e6 AS hold_ms,
       coalesce(h.attr_str['kv.release_cause'],
                CASE WHEN h.side = 'decode' THEN 'used'
                     WHEN ev.p_notified THEN 'notification' WHEN ev.lease_expired THEN 'expiry'
                     WHEN ev.aborted THEN 'abort' ELSE 'never' END) AS release_cause,
       coalesce(tr.transfers, 0) AS transfers, coalesce(tr.blocks_moved, 0) AS blocks_moved,
       hit.prefix_hit_blocks,
       h.side = 'decode' AND coalesce(hit.prefix_hit_blocks, 0) > 0
           AND (coalesce(tr.blocks_moved, 0) > 0 OR coalesce(tr.bytes_moved, 0) > 0) AS missed_prefix_hit,
       h.side = 'prefill' AND coalesce(tr.transfers, 0) = 0
           AND coalesce(h.attr_str['kv.release_cause'], '') <> 'notification' AND NOT coalesce(ev.p_notified, false)
           AS held_without_read,
       h.dur_ns > _long_hold_ns() AS long_hold,
       h.rkey
FROM h LEFT JOIN ev ON ev.rkey = h.rkey LEFT JOIN tr ON tr.rkey = h.rkey LEFT JOIN hit ON hit.rkey = h.rkey;

COMMENT ON VIEW block_holds IS 'KV blocks held for handoffs: P from KV ready to release (and what released them), D from reservation to use; flags for missed prefix hits and holds nobody read.';
COMMENT ON COLUMN block_holds.run_id IS 'deployment run id';
COMMENT ON COLUMN block_holds.request_id IS 'base request id X';
COMMENT ON COLUMN block_holds.prompt_index IS 'prompt index i';
COMMENT ON COLUMN block_holds.side IS 'prefill (P holds blocks until released) | decode (D reserved blocks until used)';
COMMENT ON COLUMN block_holds.engine_id IS 'engine holding the blocks';
COMMENT ON COLUMN block_holds.tp_rank IS 'rank (NULL: scheduler-level hold)';
COMMENT ON COLUMN block_holds.blocks IS 'blocks held (count)';
COMMENT ON COLUMN block_holds.start_ns IS 'hold start (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN block_holds.end_ns IS 'hold end (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN block_holds.hold_ns IS 'hold duration (duration ns)';
COMMENT ON COLUMN block_holds.hold_ms IS 'hold_ns in ms';
COMMENT ON COLUMN block_holds.release_cause IS 'prefill: notification | expiry | abort | never; decode: used (or the recorded cause)';
COMMENT ON COLUMN block_holds.transfers IS 'kv.transfer spans of the request (count)';
COMMENT ON COLUMN block_holds.blocks_moved IS 'blocks those transfers moved (count)';
COMMENT ON COLUMN block_holds.prefix_hit_blocks IS 'blocks D already held for the prompt (count; NULL: not recorded)';
COMMENT ON COLUMN block_holds.missed_prefix_hit IS 'true if D held the blocks yet a transfer moved them again';
COMMENT ON COLUMN block_holds.held_without_read IS 'true if P held blocks no transfer read and nothing released by notification';
COMMENT ON COLUMN block_holds.long_hold IS 'true if held longer than analysis_settings.long_hold_ns';
COMMENT ON COLUMN block_holds.rkey IS 'request join key';
