-- module: compare
-- requires: summary, ttft_segments
--
-- Mean exposed time per critical-path stage, by prompt bucket: the terms of
-- a delta decomposition of mean TTFT between two runs (pdtrace report A
-- --compare B; issue 17 part B).
--
-- The segments of a complete request tile its TTFT exactly (DESIGN.md §3
-- "Critical path"), so over the n complete requests of a group
--     mean TTFT = sum(ttft_ns) / n = sum over (stage, category) of exposed_ns / n
-- where exposed_ns sums the stage's segments over the group's requests (a
-- request that has no segment of the stage contributes 0: the mean is over
-- all n requests, not over those that have the stage). Between two runs A and
-- B the difference of the means is then exactly the sum of the per-stage
-- differences:
--     mean_B - mean_A = sum over (stage, category) of (exposed_B / n_B - exposed_A / n_A)
-- Every leaf stage, router.wait, router.unseen (engine-clock windows) and
-- unattributed is a term, so nothing is left over. A stage's category is
-- kept apart (a kv.transfer that failed or moved no bytes is coordination,
-- DESIGN.md §2), so (stage, category) is the key. Buckets are
-- summary.sql's: prompt tokens in [lo, 2*lo) (_summary_input.prompt_bucket),
-- plus scope 'all' (every complete request of the mode).
--
-- The difference of two runs is computed by the table macro in
-- _compare_delta.sql (over two copies of this view's rows, one per run).

CREATE OR REPLACE VIEW ttft_stage_means AS
-- one pass over the segments per (mode, bucket); scope 'all' sums the bucket rows (a request is in one bucket)
WITH req AS (
    SELECT i.rkey, i.mode, i.prompt_bucket, i.ttft_ns
    FROM _summary_input i WHERE i.complete AND i.ttft_ns IS NOT NULL
), nb AS (
    SELECT mode, prompt_bucket, count(*) AS requests, sum(ttft_ns) AS ttft_ns FROM req GROUP BY ALL
), sb AS (
    SELECT r.mode, r.prompt_bucket, s.stage, s.stage_group, s.category,
           sum(s.dur_ns) AS exposed_ns, count(DISTINCT s.rkey) AS requests_with_stage
    FROM req r JOIN ttft_segments s ON s.rkey = r.rkey
    GROUP BY ALL
), n AS (
    SELECT 'bucket' AS scope, * FROM nb
    UNION ALL
    SELECT 'all', mode, NULL::BIGINT, sum(requests), sum(ttft_ns) FROM nb GROUP BY mode
), seg AS (
    SELECT 'bucket' AS scope, * FROM sb
    UNION ALL
    SELECT 'all', mode, NULL::BIGINT, stage, stage_group, category, sum(exposed_ns), sum(requests_with_stage)
    FROM sb GROUP BY mode, stage, stage_group, category
)
SELECT n.scope, n.mode, n.prompt_bucket AS prompt_bucket_lo, seg.stage, seg.stage_group, seg.category,
       n.requests::BIGINT AS requests, seg.requests_with_stage::BIGINT AS requests_with_stage,
       seg.exposed_ns::BIGINT AS exposed_ns,
       seg.exposed_ns / n.requests / 1e6 AS mean_exposed_ms,
       n.ttft_ns::BIGINT AS group_ttft_ns, n.ttft_ns / n.requests / 1e6 AS ttft_mean_ms
FROM n JOIN seg ON seg.scope = n.scope AND seg.mode = n.mode
               AND seg.prompt_bucket IS NOT DISTINCT FROM n.prompt_bucket;

COMMENT ON VIEW ttft_stage_means IS 'Per mode, prompt bucket and critical-path (stage, category): exposed time summed and per complete request; the mean_exposed_ms of a group add up to its ttft_mean_ms (the terms of pdtrace report --compare''s delta decomposition).';
COMMENT ON COLUMN ttft_stage_means.scope IS '''bucket'' (one prompt bucket) | ''all'' (every complete request of the mode; prompt_bucket_lo NULL)';
COMMENT ON COLUMN ttft_stage_means.mode IS 'pull | push | unknown';
COMMENT ON COLUMN ttft_stage_means.prompt_bucket_lo IS 'bucket lower bound: prompt tokens in [lo, 2*lo) (tokens; NULL: unknown, or scope all), as summary_by_prompt_bucket';
COMMENT ON COLUMN ttft_stage_means.stage IS 'leaf stage owning the segments (ttft_segments.stage: incl. router.wait, router.unseen, unattributed)';
COMMENT ON COLUMN ttft_stage_means.stage_group IS 'DESIGN.md §2 stage the leaf rolls up to (handoff.* -> handoff.prep)';
COMMENT ON COLUMN ttft_stage_means.category IS 'queue | compute | transfer | coordination (the segment''s, so it may depend on the outcome)';
COMMENT ON COLUMN ttft_stage_means.requests IS 'complete requests in the group (count): the divisor of every mean';
COMMENT ON COLUMN ttft_stage_means.requests_with_stage IS 'requests of the group with at least one segment of the stage (count)';
COMMENT ON COLUMN ttft_stage_means.exposed_ns IS 'sum of the stage''s segment durations over the group''s requests (duration ns)';
COMMENT ON COLUMN ttft_stage_means.mean_exposed_ms IS 'exposed_ns / requests (ms per request; 0 counted for requests without the stage); sums to ttft_mean_ms over the group';
COMMENT ON COLUMN ttft_stage_means.group_ttft_ns IS 'sum of the group''s TTFTs (duration ns) = sum of exposed_ns over its stages';
COMMENT ON COLUMN ttft_stage_means.ttft_mean_ms IS 'mean TTFT of the group (ms), = summary_by_prompt_bucket.ttft_mean_ms';
