-- module: window_summary
-- requires: requests, ttft_breakdown, summary
--
-- Summaries over a window of request arrival chosen at query time (the dashboard's sidebar, or
-- `pdtrace sql`): TTFT/TPOT percentiles and each category's share of TTFT, as summary_by_mode and
-- summary_by_prompt_bucket give them for the whole trace. Every macro takes the window as
-- w_start, w_end: arrivals in [w_start, w_end) on the router clock (ns since the Unix epoch);
-- NULL leaves that end open. Percentiles are quantile_cont (linear interpolation); TPOT is
-- requests.tpot_ms; shares are sum(category) / sum(TTFT) over the requests with a breakdown, so
-- they add up to 1.

CREATE OR REPLACE MACRO _in_window(t, w_start, w_end) AS
    (w_start IS NULL OR t >= w_start) AND (w_end IS NULL OR t < w_end);

CREATE OR REPLACE MACRO window_summary(w_start, w_end, only_mode) AS TABLE
WITH q AS (
    SELECT count(*) AS requests,
           count(*) FILTER (WHERE status = 'complete') AS complete,
           count(*) FILTER (WHERE status <> 'complete') AS incomplete,
           quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.9) AS ttft_p90_ms,
           quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms,
           quantile_cont(tpot_ms, 0.5) AS tpot_p50_ms, quantile_cont(tpot_ms, 0.9) AS tpot_p90_ms,
           quantile_cont(tpot_ms, 0.99) AS tpot_p99_ms,
           count(*) FILTER (WHERE ttft_source = 'engine') AS engine_source
    FROM requests
    WHERE _in_window(arrival_ns, w_start, w_end) AND (only_mode IS NULL OR mode = only_mode)
), b AS (
    SELECT sum(ttft_ms) AS ttft, sum(queue_ms) AS queue, sum(compute_ms) AS compute,
           sum(transfer_ms) AS transfer, sum(coordination_ms) AS coordination,
           sum(unattributed_ms) AS unattributed, sum(router_unseen_ms) AS router_unseen
    FROM ttft_breakdown
    WHERE _in_window(arrival_ns, w_start, w_end) AND (only_mode IS NULL OR mode = only_mode)
)
SELECT q.*,
       b.queue / nullif(b.ttft, 0) AS queue_share, b.compute / nullif(b.ttft, 0) AS compute_share,
       b.transfer / nullif(b.ttft, 0) AS transfer_share, b.coordination / nullif(b.ttft, 0) AS coordination_share,
       b.unattributed / nullif(b.ttft, 0) AS unattributed_share,
       coalesce(b.router_unseen, 0)::DOUBLE AS router_unseen_ms
FROM q, b;
COMMENT ON MACRO TABLE window_summary IS 'window_summary(w_start, w_end, only_mode) -> one row over the requests arriving in [w_start, w_end) (ns, NULL: open) of mode only_mode (NULL: every mode): requests, complete, incomplete (counts); ttft_p50/p90/p99_ms and tpot_p50/p90/p99_ms (ms, ms per token; quantile_cont over the requests that have one); engine_source (count with requests.ttft_source = ''engine''); queue_share, compute_share, transfer_share, coordination_share, unattributed_share (fraction of the summed TTFT of the requests with a breakdown; NULL without one); router_unseen_ms (summed exposed router.unseen, ms)';

CREATE OR REPLACE MACRO _window_category_ms(w_start, w_end) AS TABLE
SELECT rkey, mode, prompt_tokens, arrival_ns, ttft_ms, category, ms
FROM (SELECT rkey, mode, prompt_tokens, arrival_ns, ttft_ms,
             queue_ms AS queue, compute_ms AS compute, transfer_ms AS transfer, coordination_ms AS coordination
      FROM ttft_breakdown WHERE _in_window(arrival_ns, w_start, w_end))
UNPIVOT INCLUDE NULLS (ms FOR category IN (queue, compute, transfer, coordination));

CREATE OR REPLACE MACRO category_shares_over_time(w_start, w_end, bucket_width_ns) AS TABLE
SELECT (arrival_ns // bucket_width_ns) * bucket_width_ns AS bucket_ns, mode, category,
       count(*) AS requests, sum(ms) AS ms, sum(ms) / nullif(sum(ttft_ms), 0) AS share
FROM _window_category_ms(w_start, w_end)
GROUP BY 1, 2, 3
ORDER BY bucket_ns, mode, list_position(['queue', 'compute', 'transfer', 'coordination'], category);
COMMENT ON MACRO TABLE category_shares_over_time IS 'category_shares_over_time(w_start, w_end, bucket_width_ns) -> per arrival bucket of bucket_width_ns (ns), mode and category (queue | compute | transfer | coordination): bucket_ns (bucket start, ns since the Unix epoch), requests (count with a breakdown), ms (the category summed, ms), share (ms / the bucket''s summed TTFT, fraction; NULL when that is 0). Requests arriving in [w_start, w_end) (NULL: open)';

CREATE OR REPLACE MACRO category_shares_by_prompt_bucket(w_start, w_end) AS TABLE
SELECT mode, prompt_bucket(prompt_tokens) AS prompt_bucket, category,
       count(*) AS requests, sum(ms) AS ms, sum(ms) / nullif(sum(ttft_ms), 0) AS share, sum(ms) / count(*) AS mean_ms
FROM _window_category_ms(w_start, w_end)
GROUP BY 1, 2, 3
ORDER BY mode, min(prompt_tokens) NULLS LAST, list_position(['queue', 'compute', 'transfer', 'coordination'], category);
COMMENT ON MACRO TABLE category_shares_by_prompt_bucket IS 'category_shares_by_prompt_bucket(w_start, w_end) -> per mode, prompt bucket (prompt_bucket(prompt_tokens)) and category: requests (count with a breakdown), ms (summed, ms), share (ms / the group''s summed TTFT, fraction), mean_ms (ms per request). Requests arriving in [w_start, w_end) (NULL: open)';

CREATE OR REPLACE MACRO percentiles_by_prompt_bucket(w_start, w_end) AS TABLE
SELECT mode, prompt_bucket(prompt_tokens) AS prompt_bucket, count(*) AS requests,
       quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.9) AS ttft_p90_ms,
       quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms,
       quantile_cont(tpot_ms, 0.5) AS tpot_p50_ms, quantile_cont(tpot_ms, 0.9) AS tpot_p90_ms,
       quantile_cont(tpot_ms, 0.99) AS tpot_p99_ms
FROM requests
WHERE status = 'complete' AND _in_window(arrival_ns, w_start, w_end)
GROUP BY ALL
ORDER BY mode, min(prompt_tokens);
COMMENT ON MACRO TABLE percentiles_by_prompt_bucket IS 'percentiles_by_prompt_bucket(w_start, w_end) -> per mode and prompt bucket (prompt_bucket(prompt_tokens)), complete requests arriving in [w_start, w_end) (NULL: open): requests (count), ttft_p50/p90/p99_ms (ms), tpot_p50/p90/p99_ms (ms per token); quantile_cont';

CREATE OR REPLACE MACRO stage_share_change(inc_start, inc_end, base_start, base_end) AS TABLE
WITH b AS (
    SELECT rkey, ttft_ns, _in_window(arrival_ns, inc_start, inc_end) AS inc,
           _in_window(arrival_ns, base_start, base_end) AS base
    FROM ttft_breakdown
    WHERE _in_window(arrival_ns, inc_start, inc_end) OR _in_window(arrival_ns, base_start, base_end)
), tot AS (
    SELECT sum(ttft_ns) FILTER (WHERE inc) AS ti, sum(ttft_ns) FILTER (WHERE base) AS tb,
           count(*) FILTER (WHERE inc) AS ni, count(*) FILTER (WHERE base) AS nb FROM b
), s AS (
    SELECT s.stage_group AS stage, any_value(s.category) AS category,
           coalesce(sum(s.dur_ns) FILTER (WHERE b.base), 0) / any_value(tot.tb) AS share_baseline,
           coalesce(sum(s.dur_ns) FILTER (WHERE b.inc), 0) / any_value(tot.ti) AS share_incident,
           coalesce(sum(s.dur_ns) FILTER (WHERE b.base), 0) / 1e6 / any_value(tot.nb) AS mean_ms_baseline,
           coalesce(sum(s.dur_ns) FILTER (WHERE b.inc), 0) / 1e6 / any_value(tot.ni) AS mean_ms_incident
    FROM ttft_segments s JOIN b USING (rkey), tot
    GROUP BY s.stage_group
)
SELECT stage, category, share_baseline, share_incident, mean_ms_baseline, mean_ms_incident,
       (coalesce(share_incident, 0) - coalesce(share_baseline, 0)) * 100 AS growth_pp
FROM s
ORDER BY growth_pp DESC, stage;
COMMENT ON MACRO TABLE stage_share_change IS 'stage_share_change(inc_start, inc_end, base_start, base_end) -> critical-path stages (ttft_segments.stage_group) ranked by how much their share of TTFT grew from the baseline window to the incident window (arrival, ns, NULL: open): stage, category, share_baseline, share_incident (the stage''s summed critical-path time / the window''s summed TTFT, fraction), mean_ms_baseline, mean_ms_incident (per request, ms), growth_pp (share_incident - share_baseline, percentage points)';
