-- module: transfers
-- requires: spans, request_base
--
-- Per NIXL transfer (kv.transfer span, one per handle and rank). The span
-- runs from the post to post + NIXL's transfer duration; kv.post_ns is the
-- post's own duration. A transfer is descriptor-bound when posting takes more
-- than _descriptor_bound_share() of it. Source and destination follow the
-- operation: READ (pull) is recorded by D and reads from peer.engine_id;
-- WRITE (push) is recorded by P and writes to peer.engine_id.

CREATE OR REPLACE VIEW transfers AS
WITH t AS (
    SELECT s.*, coalesce(s.attr_str['kv.op'], CASE s.role WHEN 'decode' THEN 'READ' ELSE 'WRITE' END) AS op
    FROM spans s WHERE s.stage = 'kv.transfer'
), x AS (
    SELECT t.*,
           CASE WHEN op = 'READ' THEN t.attr_str['peer.engine_id'] ELSE t.engine_id END AS src_engine,
           CASE WHEN op = 'READ' THEN t.engine_id ELSE t.attr_str['peer.engine_id'] END AS dst_engine
    FROM t
)
SELECT run_id, request_id, prompt_index, op, engine_id, tp_rank, src_engine, dst_engine,
       attr_str['kv.backend'] AS backend,
       attr_int['kv.bytes'] AS bytes, attr_int['kv.descriptors'] AS descriptors, attr_int['kv.blocks'] AS blocks,
       start_ns, end_ns, dur_ns, dur_ns / 1e6 AS dur_ms,
       attr_int['kv.post_ns'] AS post_ns, attr_int['kv.post_ns'] / 1e6 AS post_ms,
       attr_int['kv.xfer_ns'] AS xfer_ns, attr_int['kv.xfer_ns'] / 1e6 AS xfer_ms,
       round(100.0 * attr_int['kv.post_ns'] / nullif(dur_ns, 0), 1) AS post_share_pct,
       coalesce(attr_int['kv.post_ns'] > _descriptor_bound_share() * dur_ns, false) AS descriptor_bound,
       attr_int['kv.bytes'] / nullif(dur_ns, 0) AS bandwidth_gbps,
       (start_ns - lag(end_ns) OVER (PARTITION BY src_engine, dst_engine, tp_rank ORDER BY start_ns)) / 1e6 AS idle_before_ms,
       coalesce(attr_int['kv.first_contact'] = 1, false) AS first_contact,
       rkey, span_id
FROM x;

COMMENT ON VIEW transfers IS 'Per NIXL transfer: bytes, descriptors, post and transfer time, bandwidth, descriptor-bound flag, idle time on the engine pair before it.';
COMMENT ON COLUMN transfers.run_id IS 'deployment run id';
COMMENT ON COLUMN transfers.request_id IS 'base request id X';
COMMENT ON COLUMN transfers.prompt_index IS 'prompt index i';
COMMENT ON COLUMN transfers.op IS 'READ (pull) | WRITE (push)';
COMMENT ON COLUMN transfers.engine_id IS 'engine that owns the NIXL handle and recorded the transfer';
COMMENT ON COLUMN transfers.tp_rank IS 'rank of the handle owner';
COMMENT ON COLUMN transfers.src_engine IS 'engine the KV comes from (prefill)';
COMMENT ON COLUMN transfers.dst_engine IS 'engine the KV goes to (decode)';
COMMENT ON COLUMN transfers.backend IS 'NIXL backend (e.g. UCX)';
COMMENT ON COLUMN transfers.bytes IS 'bytes moved (bytes)';
COMMENT ON COLUMN transfers.descriptors IS 'descriptor count';
COMMENT ON COLUMN transfers.blocks IS 'KV blocks moved (count)';
COMMENT ON COLUMN transfers.start_ns IS 'post start (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN transfers.end_ns IS 'transfer end (ns since the Unix epoch, router clock)';
COMMENT ON COLUMN transfers.dur_ns IS 'post start -> transfer end (duration ns)';
COMMENT ON COLUMN transfers.dur_ms IS 'dur_ns in ms';
COMMENT ON COLUMN transfers.post_ns IS 'NIXL post duration (duration ns)';
COMMENT ON COLUMN transfers.post_ms IS 'post_ns in ms';
COMMENT ON COLUMN transfers.xfer_ns IS 'NIXL''s own transfer duration (duration ns)';
COMMENT ON COLUMN transfers.xfer_ms IS 'xfer_ns in ms';
COMMENT ON COLUMN transfers.post_share_pct IS 'post_ns / dur_ns (percent, 1 decimal)';
COMMENT ON COLUMN transfers.descriptor_bound IS 'true when posting takes more than analysis_settings.descriptor_bound_share of the transfer';
COMMENT ON COLUMN transfers.bandwidth_gbps IS 'bytes / dur (GB/s = bytes per ns)';
COMMENT ON COLUMN transfers.idle_before_ms IS 'time since the previous transfer on the same engine pair and rank ended (ms; NULL for the first)';
COMMENT ON COLUMN transfers.first_contact IS 'true if the transfer paid the first-contact cost';
COMMENT ON COLUMN transfers.rkey IS 'request join key';
COMMENT ON COLUMN transfers.span_id IS 'span id of the kv.transfer';
