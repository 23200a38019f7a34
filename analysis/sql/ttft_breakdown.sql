-- module: ttft_breakdown
-- requires: ttft_segments
-- materialize: ttft_hidden request
-- materialize: ttft_breakdown request
--
-- Per request: TTFT split into categories from ttft_segments, so
--     queue_ns + compute_ns + transfer_ns + coordination_ns = ttft_ns exactly
-- (coordination includes unattributed), plus the hidden time: work of a
-- charged stage that ran while the critical path was elsewhere (the losing
-- branch of a join; DESIGN.md §3). Other TP ranks' copies of the critical
-- rank's stages are not counted as hidden.

CREATE OR REPLACE VIEW _calc_ttft_hidden AS
WITH c AS (
    SELECT c.* FROM _tt_cand c
    WHERE NOT c.is_filler
      AND NOT EXISTS (SELECT 1 FROM _tt_cand p WHERE p.rkey = c.rkey AND p.span_id = c.parent_span_id)
)
-- clip_ns: the part of a P stage cut off because D's handoff chain was on the path then (ttft_segments rule 7)
SELECT c.rkey, c.stage, sum((c.e0 - c.s0) + c.clip_ns - coalesce(t.oe - t.s0, 0))::BIGINT AS hidden_ns
FROM c LEFT JOIN _tt_top t ON t.rkey = c.rkey AND t.span_id = c.span_id
GROUP BY c.rkey, c.stage
HAVING sum((c.e0 - c.s0) + c.clip_ns - coalesce(t.oe - t.s0, 0)) > 0;

CREATE TABLE IF NOT EXISTS _mat_ttft_hidden AS SELECT * FROM _calc_ttft_hidden LIMIT 0;
CREATE OR REPLACE VIEW _ttft_hidden_all AS
SELECT q.run_id, q.request_id, q.prompt_index, h.stage::VARCHAR AS stage, h.hidden_ns, h.hidden_ns / 1e6 AS hidden_ms, h.rkey
FROM _mat_ttft_hidden h JOIN _req_base q ON q.rkey = h.rkey;
-- ttft_hidden: the rows of _ttft_hidden_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW ttft_hidden AS SELECT * FROM _ttft_hidden_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW ttft_hidden IS 'Per request and stage: time a charged stage ran off the critical path (hidden behind the last-arriving input).';
COMMENT ON COLUMN ttft_hidden.run_id IS 'deployment run id';
COMMENT ON COLUMN ttft_hidden.request_id IS 'base request id X';
COMMENT ON COLUMN ttft_hidden.prompt_index IS 'prompt index i';
COMMENT ON COLUMN ttft_hidden.stage IS 'stage name';
COMMENT ON COLUMN ttft_hidden.hidden_ns IS 'clipped stage time not on the critical path (duration ns)';
COMMENT ON COLUMN ttft_hidden.hidden_ms IS 'hidden_ns in ms';
COMMENT ON COLUMN ttft_hidden.rkey IS 'request join key';

CREATE OR REPLACE VIEW _calc_ttft_breakdown AS
-- one pass over the refreshed requests' segments: per (request, stage group), then per request
WITH per_group AS (
    SELECT s.rkey, s.stage_group,
           sum(s.dur_ns) AS d,
           sum(s.dur_ns) FILTER (WHERE s.category = 'queue') AS queue_ns,
           sum(s.dur_ns) FILTER (WHERE s.category = 'compute') AS compute_ns,
           sum(s.dur_ns) FILTER (WHERE s.category = 'transfer') AS transfer_ns,
           sum(s.dur_ns) FILTER (WHERE s.category = 'coordination') AS coordination_ns,
           sum(s.dur_ns) FILTER (WHERE s.stage = 'unattributed') AS unattributed_ns,
           sum(s.dur_ns) FILTER (WHERE s.stage IN (SELECT stage FROM stages WHERE is_step_boundary)) AS step_boundary_ns,
           sum(s.dur_ns) FILTER (WHERE s.stage = 'kv.ready') AS readiness_lag_ns,
           sum(s.dur_ns) FILTER (WHERE s.stage = 'router.wait') AS router_wait_ns,
           sum(s.dur_ns) FILTER (WHERE s.stage = 'router.unseen') AS router_unseen_ns,
           count(*) AS segments
    FROM _mat_ttft_segments s
    WHERE s.rkey IN (SELECT rkey FROM _scope_keys)
    GROUP BY s.rkey, s.stage_group
), seg AS (
    SELECT rkey,
           sum(d) AS total_ns,
           coalesce(sum(queue_ns), 0) AS queue_ns, coalesce(sum(compute_ns), 0) AS compute_ns,
           coalesce(sum(transfer_ns), 0) AS transfer_ns, coalesce(sum(coordination_ns), 0) AS coordination_ns,
           coalesce(sum(unattributed_ns), 0) AS unattributed_ns, coalesce(sum(step_boundary_ns), 0) AS step_boundary_ns,
           coalesce(sum(readiness_lag_ns), 0) AS readiness_lag_ns, coalesce(sum(router_wait_ns), 0) AS router_wait_ns,
           coalesce(sum(router_unseen_ns), 0) AS router_unseen_ns,
           sum(segments) AS segments,
           arg_max(stage_group, (d, stage_group)) AS dominant_stage, max(d) AS dominant_ns
    FROM per_group GROUP BY rkey
), hid AS (
    SELECT rkey, sum(hidden_ns)::BIGINT AS hidden_ns FROM _mat_ttft_hidden
    WHERE rkey IN (SELECT rkey FROM _scope_keys) GROUP BY rkey
)
SELECT q.run_id, q.request_id, q.prompt_index, q.mode,
       q.first_token_ns - q.arrival_ns AS ttft_ns,
       (q.first_token_ns - q.arrival_ns) / 1e6 AS ttft_ms,
       seg.queue_ns, seg.compute_ns, seg.transfer_ns, seg.coordination_ns, seg.unattributed_ns,
       coalesce(hid.hidden_ns, 0) AS hidden_ns,
       seg.queue_ns / 1e6 AS queue_ms, seg.compute_ns / 1e6 AS compute_ms, seg.transfer_ns / 1e6 AS transfer_ms,
       seg.coordination_ns / 1e6 AS coordination_ms, seg.unattributed_ns / 1e6 AS unattributed_ms,
       coalesce(hid.hidden_ns, 0) / 1e6 AS hidden_ms,
       seg.step_boundary_ns / 1e6 AS step_boundary_ms,
       seg.readiness_lag_ns / 1e6 AS readiness_lag_ms,
       seg.router_wait_ns / 1e6 AS router_wait_ms,
       seg.router_unseen_ns / 1e6 AS router_unseen_ms,
       seg.dominant_stage::VARCHAR AS dominant_stage, seg.dominant_ns / 1e6 AS dominant_ms,
       q.first_contact, q.recomputed,
       q.prompt_tokens, q.cached_tokens, q.uncached_tokens, q.output_tokens,
       q.arrival_ns, q.first_token_ns, q.prefill_engine, q.decode_engine, seg.segments::BIGINT AS segments, q.kv_descriptors,
       q.ttft_source, q.rkey,
       q.wasted_compute_ns / 1e6 AS wasted_compute_ms
FROM _req_base q
JOIN seg ON seg.rkey = q.rkey
LEFT JOIN hid ON hid.rkey = q.rkey;  -- seg holds only the refreshed requests

CREATE TABLE IF NOT EXISTS _mat_ttft_breakdown AS SELECT * FROM _calc_ttft_breakdown LIMIT 0;
CREATE OR REPLACE VIEW _ttft_breakdown_all AS SELECT * FROM _mat_ttft_breakdown;
-- ttft_breakdown: the rows of _ttft_breakdown_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW ttft_breakdown AS SELECT * FROM _ttft_breakdown_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW ttft_breakdown IS 'Per complete request: TTFT by category (queue + compute + transfer + coordination = ttft, to the ns), hidden time, dominant stage.';
COMMENT ON COLUMN ttft_breakdown.run_id IS 'deployment run id';
COMMENT ON COLUMN ttft_breakdown.request_id IS 'base request id X';
COMMENT ON COLUMN ttft_breakdown.prompt_index IS 'prompt index i';
COMMENT ON COLUMN ttft_breakdown.mode IS 'handoff mode: pull | push | unknown';
COMMENT ON COLUMN ttft_breakdown.ttft_ns IS 'first token written - request received (duration ns): the router''s, or (ttft_source engine) D''s API server''s first token chunk - P''s API server''s receipt';
COMMENT ON COLUMN ttft_breakdown.ttft_ms IS 'ttft_ns in ms';
COMMENT ON COLUMN ttft_breakdown.queue_ns IS 'exposed queue time (duration ns)';
COMMENT ON COLUMN ttft_breakdown.compute_ns IS 'exposed compute time (duration ns)';
COMMENT ON COLUMN ttft_breakdown.transfer_ns IS 'exposed KV transfer time (duration ns)';
COMMENT ON COLUMN ttft_breakdown.coordination_ns IS 'exposed coordination time including unattributed (duration ns)';
COMMENT ON COLUMN ttft_breakdown.unattributed_ns IS 'part of coordination_ns no stage covers (duration ns)';
COMMENT ON COLUMN ttft_breakdown.hidden_ns IS 'charged-stage time off the critical path, summed over stages (duration ns)';
COMMENT ON COLUMN ttft_breakdown.queue_ms IS 'queue_ns in ms';
COMMENT ON COLUMN ttft_breakdown.compute_ms IS 'compute_ns in ms';
COMMENT ON COLUMN ttft_breakdown.transfer_ms IS 'transfer_ns in ms';
COMMENT ON COLUMN ttft_breakdown.coordination_ms IS 'coordination_ns in ms (including unattributed)';
COMMENT ON COLUMN ttft_breakdown.unattributed_ms IS 'unattributed_ns in ms';
COMMENT ON COLUMN ttft_breakdown.hidden_ms IS 'hidden_ns in ms';
COMMENT ON COLUMN ttft_breakdown.step_boundary_ms IS 'exposed waits on engine-step boundaries: handoff.step_wait + kv.ready (ms)';
COMMENT ON COLUMN ttft_breakdown.readiness_lag_ms IS 'exposed kv.ready: all ranks'' KV ready -> promoted by the scheduler (ms)';
COMMENT ON COLUMN ttft_breakdown.router_wait_ms IS 'exposed router.wait: the router awaiting a leg while no engine stage runs (ms)';
COMMENT ON COLUMN ttft_breakdown.router_unseen_ms IS 'exposed router.unseen (engine-clock window only): the router''s hop between P''s response and D''s request (pull) or before D''s leg arrived (push), not recorded (ms; part of coordination)';
COMMENT ON COLUMN ttft_breakdown.dominant_stage IS 'stage (rolled up to its DESIGN.md §2 stage) with the most exposed time';
COMMENT ON COLUMN ttft_breakdown.dominant_ms IS 'exposed time of dominant_stage (ms)';
COMMENT ON COLUMN ttft_breakdown.first_contact IS 'true if the handoff paid the first-contact cost (handshake) for its engine pair';
COMMENT ON COLUMN ttft_breakdown.recomputed IS 'true if the prompt was recomputed (load failure or preemption); recompute counts as compute';
COMMENT ON COLUMN ttft_breakdown.prompt_tokens IS 'prompt tokens (tokens)';
COMMENT ON COLUMN ttft_breakdown.cached_tokens IS 'prompt tokens from the prefix cache (tokens)';
COMMENT ON COLUMN ttft_breakdown.uncached_tokens IS 'prompt tokens computed (tokens)';
COMMENT ON COLUMN ttft_breakdown.output_tokens IS 'generated tokens (requests.output_tokens: router, else D''s request.finished) (tokens)';
COMMENT ON COLUMN ttft_breakdown.arrival_ns IS 'request received by the router, or (engine) by P''s API server (ns since the Unix epoch)';
COMMENT ON COLUMN ttft_breakdown.first_token_ns IS 'first token written by the router, or (engine) by D''s API server (ns since the Unix epoch)';
COMMENT ON COLUMN ttft_breakdown.prefill_engine IS 'prefill engine id';
COMMENT ON COLUMN ttft_breakdown.decode_engine IS 'decode engine id';
COMMENT ON COLUMN ttft_breakdown.segments IS 'number of ttft_segments rows (count)';
COMMENT ON COLUMN ttft_breakdown.kv_descriptors IS 'NIXL descriptors of the request''s kv.transfer spans, all ranks (count; NULL: no transfer)';
COMMENT ON COLUMN ttft_breakdown.ttft_source IS 'router | engine: whose clocks give the window (requests.ttft_source); engine: P''s API server received -> D''s API server wrote the first token chunk, router hops unseen';
COMMENT ON COLUMN ttft_breakdown.rkey IS 'request join key';
COMMENT ON COLUMN ttft_breakdown.wasted_compute_ms IS 'compute whose output did not feed the delivered first token: aborted/retried attempts'' prefill, P''s prefill whose KV D failed to load, a recompute preempted again (ms; requests.wasted_compute_ms). Such compute on the path is also in compute_ms';
