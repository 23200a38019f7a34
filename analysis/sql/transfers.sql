-- module: transfers
-- requires: spans, request_base
--
-- Per NIXL transfer (kv.transfer span, one per handle and rank). The span
-- runs from the post to post + NIXL's transfer duration; kv.post_ns is the
-- post's own duration. A transfer is descriptor-bound when posting takes more
-- than _descriptor_bound_share() of it. Source and destination follow the
-- operation: READ (pull) is recorded by D and reads from peer.engine_id;
-- WRITE (push) is recorded by P and writes to peer.engine_id.
-- first_contact: the transfer paid the first-contact handshake on its engine
-- pair. The traced connectors record the handshake as the request's
-- handoff.handshake (and handoff.agent_load) child of handoff.prep, and
-- kv.first_contact = 1 on handoff.prep / handoff.handshake, never on the
-- kv.transfer itself (pdtrace.connector.traced.pull / push). So a transfer
-- is first_contact when its own kv.first_contact = 1, or else when it is the
-- first transfer (earliest start) of the same request and attempt recorded by
-- the same engine and rank that recorded such a handshake stage (the handshake
-- runs where the NIXL handle is owned: D's worker in pull, P's writer in push)
-- with the same peer engine (when both name one). Works on existing stores.
-- Transport fallback (vLLM/NIXL over UCX silently using TCP or host staging
-- instead of RDMA / CUDA IPC: ai-dynamo/dynamo#1314, ai-dynamo/nixl#909,
-- ai-dynamo/nixl#57): `transport` is attr kv.transport (the transport the
-- backend used, e.g. 'rc_mlx5', 'cuda_ipc', 'tcp'; recorded when the
-- connector knows it); transport_fallback is true when kv.transport_fallback
-- = 1 or the transport is a slow one (_is_slow_transport: tcp, sockets,
-- cuda_copy / host staging, posix / sysv shared memory).

-- A transport name that means the backend fell back from RDMA / CUDA IPC / NVLink.
CREATE OR REPLACE MACRO _is_slow_transport(tr) AS
    regexp_matches(lower(coalesce(tr, '')), '(^|[^a-z])(tcp|sockets?|cuda_copy|posix|sysv|self)([^a-z]|$)');
-- The rules of transfers.transport_fallback and .descriptor_bound on a kv.transfer row's
-- attributes (shared with module request_flags).
CREATE OR REPLACE MACRO _transport_fallback(ai, a_s) AS
    coalesce(ai['kv.transport_fallback'] = 1, false) OR _is_slow_transport(a_s['kv.transport']);
CREATE OR REPLACE MACRO _descriptor_bound(post_ns, dur_ns) AS
    coalesce(post_ns > _descriptor_bound_share() * dur_ns, false);

CREATE OR REPLACE VIEW _transfers_all AS
WITH hs AS (
    -- the handshakes: (request, attempt, engine, rank) that paid first contact, with their peers
    -- ('' = peer not recorded); raw rows, only keys are read
    SELECT rkey, attempt, engine_id, tp_rank, list(DISTINCT coalesce(attr_str['peer.engine_id'], '')) AS peers
    FROM _records
    WHERE record = 'span' AND (name IN ('handoff.handshake', 'handoff.agent_load')
                               OR (name = 'handoff.prep' AND attr_int['kv.first_contact'] = 1))
    GROUP BY ALL
), t AS (
    SELECT s.*, coalesce(s.attr_str['kv.op'], CASE s.role WHEN 'decode' THEN 'READ' ELSE 'WRITE' END) AS op
    FROM spans s WHERE s.stage = 'kv.transfer'
), x AS (
    SELECT t.*,
           CASE WHEN op = 'READ' THEN t.attr_str['peer.engine_id'] ELSE t.engine_id END AS src_engine,
           CASE WHEN op = 'READ' THEN t.engine_id ELSE t.attr_str['peer.engine_id'] END AS dst_engine,
           coalesce(hs.rkey IS NOT NULL AND (t.attr_str['peer.engine_id'] IS NULL OR list_contains(hs.peers, '')
                                             OR list_contains(hs.peers, t.attr_str['peer.engine_id'])), false)
               AS hs_match
    FROM t LEFT JOIN hs ON hs.rkey = t.rkey AND hs.attempt = t.attempt
                       AND hs.engine_id IS NOT DISTINCT FROM t.engine_id AND hs.tp_rank IS NOT DISTINCT FROM t.tp_rank
)
SELECT run_id, request_id, prompt_index, op, engine_id, tp_rank, src_engine, dst_engine,
       attr_str['kv.backend'] AS backend,
       attr_int['kv.bytes'] AS bytes, attr_int['kv.descriptors'] AS descriptors, attr_int['kv.blocks'] AS blocks,
       start_ns, end_ns, dur_ns, dur_ns / 1e6 AS dur_ms,
       attr_int['kv.post_ns'] AS post_ns, attr_int['kv.post_ns'] / 1e6 AS post_ms,
       attr_int['kv.xfer_ns'] AS xfer_ns, attr_int['kv.xfer_ns'] / 1e6 AS xfer_ms,
       round(100.0 * attr_int['kv.post_ns'] / nullif(dur_ns, 0), 1) AS post_share_pct,
       _descriptor_bound(attr_int['kv.post_ns'], dur_ns) AS descriptor_bound,
       attr_int['kv.bytes'] / nullif(dur_ns, 0) AS bandwidth_gbps,
       -- (transfers starting at the same instant are ordered by end, request key and span id: a total order, so
       -- the answer does not depend on the plan; e.g. two requests' READs posted in one engine step)
       (start_ns - lag(end_ns) OVER (PARTITION BY src_engine, dst_engine, tp_rank
                                     ORDER BY start_ns, end_ns, rkey, span_id)) / 1e6 AS idle_before_ms,
       coalesce(attr_int['kv.first_contact'] = 1, false)
           OR (hs_match AND row_number() OVER (PARTITION BY rkey, attempt, engine_id, tp_rank, hs_match
                                               ORDER BY start_ns, span_id) = 1) AS first_contact,
       attr_str['kv.transport'] AS transport,
       _transport_fallback(attr_int, attr_str) AS transport_fallback,
       rkey, span_id
FROM x;
-- transfers: the rows of _transfers_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW transfers AS SELECT * FROM _transfers_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

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
COMMENT ON COLUMN transfers.idle_before_ms IS 'time since the previous transfer on the same engine pair and rank ended, transfers ordered by start, end, request key and span id (ms; negative: they overlap; NULL for the first)';
COMMENT ON COLUMN transfers.first_contact IS 'true if the transfer paid the first-contact handshake on its engine pair: its own kv.first_contact = 1, or the first transfer of the request and attempt on the engine and rank that recorded handoff.handshake / handoff.agent_load (or handoff.prep with kv.first_contact = 1) with the same peer';
COMMENT ON COLUMN transfers.transport IS 'transport the NIXL backend used (attr kv.transport, e.g. rc_mlx5, cuda_ipc, tcp; NULL: not recorded)';
COMMENT ON COLUMN transfers.transport_fallback IS 'true if the backend fell back to a slower transport: kv.transport_fallback = 1, or transport is tcp / sockets / cuda_copy / posix / sysv / self';
COMMENT ON COLUMN transfers.rkey IS 'request join key';
COMMENT ON COLUMN transfers.span_id IS 'span id of the kv.transfer';
