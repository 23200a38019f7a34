-- The delta decomposition of mean TTFT between two runs (pdtrace report A --compare B; issue 17 part B).
--
-- Not a module of the library (no header; not loaded into a trace's
-- database): pdtrace.analysis.report.compare_delta runs it in a private
-- in-memory DuckDB connection holding two tables, compare_a and compare_b,
-- each with the rows of one run's ttft_stage_means view (compare.sql).
--
-- Per prompt bucket present in both runs (and scope 'all'), over the modes of
-- each run taken together (a run of one mode has one):
--     n_X           = complete requests of the bucket in run X
--     mean_X(s, c)  = exposed_X(s, c) / n_X          (0 when run X has no segment of (s, c))
--     delta_ms(s,c) = mean_B(s, c) - mean_A(s, c)
--     ttft_delta_ms = mean TTFT_B - mean TTFT_A = sum over (s, c) of delta_ms(s, c)
-- exactly (segments tile TTFT, DESIGN.md §3), so the parts add up to the
-- difference; positive: B spent longer in the stage. share_of_delta is
-- delta_ms / ttft_delta_ms (NULL when the means are equal), rank orders a
-- bucket's terms by |delta_ms| (largest first).

CREATE OR REPLACE MACRO ttft_stage_delta() AS TABLE
WITH na AS (
    SELECT scope, prompt_bucket_lo, sum(requests) AS n, sum(group_ttft_ns) AS t
    FROM (SELECT DISTINCT scope, mode, prompt_bucket_lo, requests, group_ttft_ns FROM compare_a) GROUP BY ALL
), nb AS (
    SELECT scope, prompt_bucket_lo, sum(requests) AS n, sum(group_ttft_ns) AS t
    FROM (SELECT DISTINCT scope, mode, prompt_bucket_lo, requests, group_ttft_ns FROM compare_b) GROUP BY ALL
), buckets AS (
    SELECT na.scope, na.prompt_bucket_lo, na.n AS n_a, nb.n AS n_b, na.t AS t_a, nb.t AS t_b
    FROM na JOIN nb ON nb.scope = na.scope AND nb.prompt_bucket_lo IS NOT DISTINCT FROM na.prompt_bucket_lo
), ea AS (
    SELECT scope, prompt_bucket_lo, stage, stage_group, category, sum(exposed_ns) AS e FROM compare_a GROUP BY ALL
), eb AS (
    SELECT scope, prompt_bucket_lo, stage, stage_group, category, sum(exposed_ns) AS e FROM compare_b GROUP BY ALL
), terms AS (
    SELECT coalesce(ea.scope, eb.scope) AS scope, coalesce(ea.prompt_bucket_lo, eb.prompt_bucket_lo) AS prompt_bucket_lo,
           coalesce(ea.stage, eb.stage) AS stage, coalesce(ea.stage_group, eb.stage_group) AS stage_group,
           coalesce(ea.category, eb.category) AS category, coalesce(ea.e, 0) AS e_a, coalesce(eb.e, 0) AS e_b
    FROM ea FULL JOIN eb ON eb.scope = ea.scope AND eb.prompt_bucket_lo IS NOT DISTINCT FROM ea.prompt_bucket_lo
                         AND eb.stage = ea.stage AND eb.category = ea.category
), d AS (
    SELECT b.scope, b.prompt_bucket_lo, t.stage, t.stage_group, t.category, b.n_a, b.n_b,
           t.e_a / b.n_a / 1e6 AS mean_a_ms, t.e_b / b.n_b / 1e6 AS mean_b_ms,
           t.e_b / b.n_b / 1e6 - t.e_a / b.n_a / 1e6 AS delta_ms,
           b.t_a / b.n_a / 1e6 AS ttft_mean_a_ms, b.t_b / b.n_b / 1e6 AS ttft_mean_b_ms,
           b.t_b / b.n_b / 1e6 - b.t_a / b.n_a / 1e6 AS ttft_delta_ms
    FROM buckets b JOIN terms t ON t.scope = b.scope AND t.prompt_bucket_lo IS NOT DISTINCT FROM b.prompt_bucket_lo
)
SELECT *, delta_ms / nullif(ttft_delta_ms, 0) AS share_of_delta,
       row_number() OVER (PARTITION BY scope, prompt_bucket_lo ORDER BY abs(delta_ms) DESC, stage, category) AS rank
FROM d
ORDER BY scope = 'bucket', prompt_bucket_lo NULLS FIRST, rank;
