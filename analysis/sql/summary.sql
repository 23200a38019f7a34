-- module: summary
-- requires: ttft_breakdown, request_base
--
-- Summaries of ttft_breakdown and TPOT by mode, prompt-length bucket (prompt
-- tokens, and uncached prompt tokens), and arrival-rate window. Buckets are
-- powers of two: [2^k, 2^(k+1)). Shares are sum(category) / sum(TTFT) over the
-- group's complete requests, so they add up to 1.
--
-- comments-like: summary_by_mode -> summary_by_prompt_bucket, summary_by_uncached_bucket, summary_by_window

CREATE OR REPLACE MACRO _bucket_lo(n) AS
    CASE WHEN n IS NULL THEN NULL WHEN n < 1 THEN 0 ELSE (2 ** floor(log2(n)))::BIGINT END;

-- Public: the lower bound of the bucket of n tokens (the one definition above, by its public name).
CREATE OR REPLACE MACRO prompt_bucket_lo(n) AS _bucket_lo(n);
COMMENT ON MACRO prompt_bucket_lo IS 'prompt_bucket_lo(tokens) -> BIGINT: the lower bound lo of the power-of-two bucket [lo, 2*lo) holding a token count (0 for 0 tokens, NULL for NULL); summary_by_prompt_bucket.prompt_bucket_lo of a request';

-- Public: the label of the bucket of n tokens, for tables people read (the dashboard's buckets).
CREATE OR REPLACE MACRO prompt_bucket(n) AS
    CASE WHEN n IS NULL THEN 'unknown' WHEN n < 1 THEN '0'
         ELSE printf('%d-%d', _bucket_lo(n), 2 * _bucket_lo(n) - 1) END;
COMMENT ON MACRO prompt_bucket IS 'prompt_bucket(tokens) -> VARCHAR: the power-of-two bucket [lo, 2*lo) of a token count as ''lo-(2*lo-1)'' (e.g. ''256-511''); ''0'' for 0 tokens, ''unknown'' for NULL. The buckets of summary_by_prompt_bucket (prompt_bucket_lo) and pdtrace report';

CREATE OR REPLACE VIEW _summary_input AS
SELECT q.rkey, q.mode, q.arrival_ns, q.prompt_tokens, q.uncached_tokens,
       q.first_token_ns IS NOT NULL AS complete,
       b.ttft_ms, b.ttft_ns, b.queue_ns, b.compute_ns, b.transfer_ns, b.coordination_ns, b.unattributed_ns,
       b.hidden_ns,
       _tpot_ms(q.output_tokens, q.first_token_ns, q.last_token_ns, NULL, NULL) AS tpot_ms,  -- finished requests
       _bucket_lo(q.prompt_tokens) AS prompt_bucket, _bucket_lo(q.uncached_tokens) AS uncached_bucket,
       q.arrival_ns // _rate_window_ns() AS window_idx
FROM _req_base q LEFT JOIN _mat_ttft_breakdown b ON b.rkey = q.rkey
WHERE q.rkey NOT IN (SELECT rkey FROM _window_out);  -- the requests in the time window (all without one)

CREATE OR REPLACE MACRO _summary(k1, k2) AS TABLE
SELECT k1 AS key1, k2 AS key2,
       count(*) AS requests,
       count(*) FILTER (WHERE complete) AS complete,
       count(*) FILTER (WHERE NOT complete) AS incomplete,
       avg(ttft_ms) AS ttft_mean_ms,
       quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.9) AS ttft_p90_ms,
       quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms,
       avg(tpot_ms) AS tpot_mean_ms,
       quantile_cont(tpot_ms, 0.5) AS tpot_p50_ms, quantile_cont(tpot_ms, 0.9) AS tpot_p90_ms,
       quantile_cont(tpot_ms, 0.99) AS tpot_p99_ms,
       sum(queue_ns) / sum(ttft_ns) AS queue_share, sum(compute_ns) / sum(ttft_ns) AS compute_share,
       sum(transfer_ns) / sum(ttft_ns) AS transfer_share, sum(coordination_ns) / sum(ttft_ns) AS coordination_share,
       sum(unattributed_ns) / sum(ttft_ns) AS unattributed_share,
       quantile_cont(unattributed_ns / ttft_ns, 0.5) AS unattributed_p50_share,
       sum(hidden_ns) / sum(ttft_ns) AS hidden_share,
       min(arrival_ns) AS first_arrival_ns
FROM _summary_input
GROUP BY k1, k2;

CREATE OR REPLACE VIEW summary_by_mode AS
SELECT key1 AS mode, * EXCLUDE (key1, key2, first_arrival_ns) FROM _summary(mode, NULL::VARCHAR);
COMMENT ON VIEW summary_by_mode IS 'TTFT/TPOT percentiles and category shares by handoff mode.';
COMMENT ON COLUMN summary_by_mode.mode IS 'pull | push | unknown';
COMMENT ON COLUMN summary_by_mode.requests IS 'requests in the group (count)';
COMMENT ON COLUMN summary_by_mode.complete IS 'requests with a first token (count)';
COMMENT ON COLUMN summary_by_mode.incomplete IS 'requests without a first token (count)';
COMMENT ON COLUMN summary_by_mode.ttft_mean_ms IS 'mean TTFT (ms)';
COMMENT ON COLUMN summary_by_mode.ttft_p50_ms IS 'median TTFT (ms)';
COMMENT ON COLUMN summary_by_mode.ttft_p90_ms IS '90th percentile TTFT (ms)';
COMMENT ON COLUMN summary_by_mode.ttft_p99_ms IS '99th percentile TTFT (ms)';
COMMENT ON COLUMN summary_by_mode.tpot_mean_ms IS 'mean TPOT of the finished requests (requests.tpot_ms without the hung ones, which request_stalls reports; ms per token)';
COMMENT ON COLUMN summary_by_mode.tpot_p50_ms IS 'median TPOT (ms per token)';
COMMENT ON COLUMN summary_by_mode.tpot_p90_ms IS '90th percentile TPOT (ms per token)';
COMMENT ON COLUMN summary_by_mode.tpot_p99_ms IS '99th percentile TPOT (ms per token)';
COMMENT ON COLUMN summary_by_mode.queue_share IS 'queue time / TTFT over the group (fraction 0..1)';
COMMENT ON COLUMN summary_by_mode.compute_share IS 'compute time / TTFT (fraction 0..1)';
COMMENT ON COLUMN summary_by_mode.transfer_share IS 'transfer time / TTFT (fraction 0..1)';
COMMENT ON COLUMN summary_by_mode.coordination_share IS 'coordination time incl. unattributed / TTFT (fraction 0..1)';
COMMENT ON COLUMN summary_by_mode.unattributed_share IS 'unattributed time / TTFT (fraction 0..1)';
COMMENT ON COLUMN summary_by_mode.unattributed_p50_share IS 'median over requests of unattributed / TTFT (fraction 0..1)';
COMMENT ON COLUMN summary_by_mode.hidden_share IS 'hidden time / TTFT (fraction; can exceed 1 when branches overlap)';

CREATE OR REPLACE VIEW summary_by_prompt_bucket AS
SELECT key1 AS mode, key2 AS prompt_bucket_lo, * EXCLUDE (key1, key2, first_arrival_ns) FROM _summary(mode, prompt_bucket);
COMMENT ON VIEW summary_by_prompt_bucket IS 'TTFT/TPOT percentiles and category shares by mode and prompt-token bucket [lo, 2*lo).';
COMMENT ON COLUMN summary_by_prompt_bucket.prompt_bucket_lo IS 'bucket lower bound: prompt tokens in [lo, 2*lo) (tokens; NULL unknown)';

CREATE OR REPLACE VIEW summary_by_uncached_bucket AS
SELECT key1 AS mode, key2 AS uncached_bucket_lo, * EXCLUDE (key1, key2, first_arrival_ns) FROM _summary(mode, uncached_bucket);
COMMENT ON VIEW summary_by_uncached_bucket IS 'TTFT/TPOT percentiles and category shares by mode and uncached-prompt-token bucket [lo, 2*lo).';
COMMENT ON COLUMN summary_by_uncached_bucket.uncached_bucket_lo IS 'bucket lower bound: uncached prompt tokens in [lo, 2*lo) (tokens; NULL unknown)';

CREATE OR REPLACE VIEW summary_by_window AS
SELECT key1 AS mode, key2 * _rate_window_ns() AS window_start_ns, requests / (_rate_window_ns() / 1e9) AS arrival_rate_per_s, * EXCLUDE (key1, key2, first_arrival_ns) FROM _summary(mode, window_idx);
COMMENT ON VIEW summary_by_window IS 'TTFT/TPOT percentiles and category shares by mode and arrival window, with the arrival rate.';
COMMENT ON COLUMN summary_by_window.window_start_ns IS 'window start (ns since the Unix epoch, router clock); length analysis_settings.rate_window_ns';
COMMENT ON COLUMN summary_by_window.arrival_rate_per_s IS 'requests arriving in the window / window length (requests per s)';
