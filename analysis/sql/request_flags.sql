-- module: request_flags
-- requires: request_base, block_holds, transfers
-- materialize: _request_flags request
--
-- requests.flags: the notable facts operators asked for in public reports,
-- one VARCHAR per fact, per request (DESIGN.md §7.6). A flag is ONE line
-- of _request_flag_rows below: `SELECT rkey, '<flag>' FROM <view> WHERE
-- <rule>`; add a flag by adding a line (and its rule to the list here and to
-- the COMMENT of requests.flags). The rules:
--   read_after_release   a READ of the request ended after P released its blocks
--                        by expiry or abort (block_holds.transfer_after_release,
--                        P side; vllm-project/vllm#21570: P's timeout freed the
--                        blocks D was still going to read)
--   write_after_release  a WRITE ended after D freed its blocks by expiry or abort
--                        (block_holds.transfer_after_release, D side)
--   blocks_never_released  a hold of the request was never released by the trace
--                        end, on either side (block_holds.release_cause = never;
--                        vllm-project/vllm#36958, #46283)
--   missed_prefix_hit    D already held blocks of the prompt and a transfer moved
--                        them again (block_holds.missed_prefix_hit;
--                        sgl-project/sglang#7990, vllm-project/vllm#18632)
--   transport_fallback   a transfer ran on a slower transport than RDMA / CUDA
--                        IPC (transfers.transport_fallback; ai-dynamo/dynamo#1314,
--                        ai-dynamo/nixl#909)
--   descriptor_bound     a transfer spent most of its time posting descriptors
--                        (transfers.descriptor_bound; vllm-project/vllm#50913)
--   first_contact        the handoff paid the first-contact handshake
--                        (request_base.first_contact; sgl-project/sglang#28737)
--   recomputed           the prompt was recomputed after a load failure or
--                        preemption (request_base.recomputed)
--   hung_after_first_token  first token written, last token never (the rule of
--                        requests.hung: first_token_ns set, last_token_ns NULL)
--   wasted_compute       compute that did not feed the delivered first token
--                        (request_base.wasted_compute_ns > 0: an aborted or
--                        retried attempt's prefill, a prefill whose KV D failed
--                        to load; DESIGN.md §7.3)
--   aborted_after_first_token  the first token was written and then D gave the
--                        request up: D's request.abort at or after the first
--                        token (EngineCore's, for vLLM's FINISHED_ABORTED: its
--                        engine aborted it, or its client went away), or the
--                        router's leg failure decode_aborted / decode_failed
--                        (vllm-project/vllm#57082 and #45520: engine shutdown,
--                        sleep or scale-down ends every open stream so, with
--                        HTTP 200 and [DONE] behind a router that relays it)
--   split_trace          the request's spans sit in more than one trace id
--                        (request_base.trace_count > 1: broken traceparent
--                        propagation; ai-dynamo/dynamo#7030, DESIGN.md §7.2)
-- flags lists them in alphabetical order, each once; [] for none.
-- Materialized per request (kind request): every rule reads only the request's
-- own rows (and each process's last flush), so a refresh recomputes the keys in
-- _scope_keys; block_holds and the kv.transfer rows are read once per refresh.

CREATE OR REPLACE VIEW _calc_request_flags AS
WITH bh AS MATERIALIZED (
    SELECT rkey, side, release_cause, missed_prefix_hit, transfer_after_release FROM _block_holds_all  -- (every request: not windowed)
    WHERE rkey IN (SELECT rkey FROM _scope_keys)
), xf AS MATERIALIZED (
    -- the two transfer rules' values (the copy keeps no attribute map)
    SELECT rkey, _transport_fallback(attr_int, attr_str) AS fallback,
           _descriptor_bound(attr_int['kv.post_ns'], end_ns - start_ns) AS bound FROM _timed
    WHERE record = 'span' AND name = 'kv.transfer' AND rkey IN (SELECT rkey FROM _scope_keys)
), q AS (
    SELECT * FROM _req_base WHERE rkey IN (SELECT rkey FROM _scope_keys)
), gave_up AS (
    -- the instants the request was given up (for aborted_after_first_token)
    SELECT rkey, c_start_ns AS t_ns FROM _timed
    WHERE record = 'event' AND rkey IN (SELECT rkey FROM _scope_keys)
      AND ((name = 'request.abort' AND role = 'decode')
           OR (name = 'router.leg_failed' AND attr_str['error.type'] IN ('decode_aborted', 'decode_failed')))
), flag_rows AS (
    -- one line per flag: SELECT rkey, '<flag>' FROM <rows> WHERE <rule>
              SELECT rkey, 'read_after_release' AS flag FROM bh WHERE side = 'prefill' AND transfer_after_release
    UNION ALL SELECT rkey, 'write_after_release' FROM bh WHERE side = 'decode' AND transfer_after_release
    UNION ALL SELECT rkey, 'blocks_never_released' FROM bh WHERE release_cause = 'never'
    UNION ALL SELECT rkey, 'missed_prefix_hit' FROM bh WHERE missed_prefix_hit
    UNION ALL SELECT rkey, 'transport_fallback' FROM xf WHERE fallback
    UNION ALL SELECT rkey, 'descriptor_bound' FROM xf WHERE bound
    UNION ALL SELECT rkey, 'first_contact' FROM q WHERE first_contact
    UNION ALL SELECT rkey, 'recomputed' FROM q WHERE recomputed
    UNION ALL SELECT rkey, 'hung_after_first_token' FROM q WHERE first_token_ns IS NOT NULL AND last_token_ns IS NULL
    UNION ALL SELECT rkey, 'wasted_compute' FROM q WHERE wasted_compute_ns > 0
    UNION ALL SELECT rkey, 'split_trace' FROM q WHERE trace_count > 1
    UNION ALL SELECT q.rkey, 'aborted_after_first_token' FROM q JOIN gave_up g ON g.rkey = q.rkey
              WHERE g.t_ns >= q.first_token_ns
)
SELECT rkey, list_sort(list(DISTINCT flag)) AS flags
FROM flag_rows WHERE rkey IS NOT NULL GROUP BY rkey;
CREATE TABLE IF NOT EXISTS _mat_request_flags AS SELECT * FROM _calc_request_flags LIMIT 0;
CREATE OR REPLACE VIEW _request_flags AS SELECT * FROM _mat_request_flags;
