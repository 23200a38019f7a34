-- module: request_base
-- requires: spans
-- materialize: _req_link_part file
-- materialize: _req_base request
--
-- Materialized per request: a refresh recomputes the keys in _scope_keys.
--
-- One row per request. TTFT source (DESIGN.md §3), column ttft_source:
--   'router'  the router recorded the request (any router row): its root
--             (router.request) gives arrival and the first-token event, as
--             ever; engine rows add engines, tokens and flags.
--   'engine'  no router row (a router that writes no pdtrace spans): the
--             window is the engines' own, P's API server receiving the
--             request (earliest start of prefill.frontend, part 'in' or
--             'whole') -> D's API server writing the first token chunk (the
--             earliest `token` event on a decode.frontend span: span_id set;
--             EngineCore's own `token` event carries none), both on corrected
--             times (module clock: skew between P and D corrected as for the
--             router). It needs both: without P's frontend, or without D's
--             token, the request has no first token (incomplete, a cause).
--             The router's own time before P and after D lies outside the
--             window; its hop between the legs is the pseudo-stage
--             router.unseen (module ttft_segments), never dropped.
-- A request id seen only on engines is still a request unless a router span
-- links it to another id (router.linked_request_id: the legs were sent
-- different ids) -- then it belongs to the linking request.
-- prefill_response_ns (pull only): P's answer, after which P's leg is over for
-- the critical path. Router: the router's receipt of P's response, the end of
-- its prefill-leg router.wait (unless that wait ended in error: cut short, it
-- is not P's answer), else the start of its decode-leg router.dispatch -- both
-- of the attempt that delivered the first token (DESIGN.md §3 "Attempt": the
-- router's latest attempt, and in it the latest such span): an earlier,
-- aborted attempt's answer would drop the retry's prefill from the path.
-- attempt_start_ns: the router re-dispatched a leg (a retry: more than one
-- router.dispatch of the leg): the start of the latest prefill-leg dispatch,
-- else of the latest decode-leg one; NULL without a retry. Module
-- ttft_segments takes the handoff (join) from that attempt; TTFT still runs
-- from the original arrival through every attempt.
-- wasted_compute_ns (DESIGN.md §3 "Attempt"): compute whose output did not
-- feed the delivered first token. A reset discards the KV computed before it:
-- the router's re-dispatch of P's leg (attempt_start_ns: every side), of D's
-- leg only (D's side), and the engines' kv.load_failed (P's KV unused, D
-- recomputes) and request.preempted (the request's blocks freed). With R = the
-- latest reset at or before the first token (any reset when there is none)
-- for the span's side (P: every-side resets; D: all resets):
--     wasted_compute_ns = sum over engines of the slowest rank's
--         sum(dur) of leaf compute spans (stages.category 'compute':
--         prefill.compute chunks or whole, decode.first_step; D's local
--         recompute is prefill.compute on D) with corrected start < R
-- So an aborted or retried attempt's prefill, P's prefill whose KV D failed to
-- load, and a recompute preempted again count; the work after the last reset
-- (what produced the token) does not. 0 without a reset.
-- Engine: P's API server handing its response to the server, its `token`
-- event on prefill.frontend (the first body chunk; a pull prefill response is
-- one JSON body), else the latest end of prefill.frontend (part 'out' or
-- 'whole'; that end is taken after the app returns, late under load).
-- trace_count: distinct W3C trace ids among the request's router, prefill and
-- decode spans (0: none recorded); > 1 when the request's spans sit in several
-- traces (broken traceparent propagation). The joins never read it: a request is
-- joined by rkey and time (DESIGN.md §3 "Joins"), whatever its trace ids.
-- decode_arrival_ns: D's API server receiving the request (earliest start of
-- decode.frontend, part 'in' or 'whole'); the end of router.unseen.
-- output_tokens: the router's gen_ai.usage.output_tokens when it recorded one,
-- else D's: the request.finished event D's scheduler records when it finishes
-- a sampled request normally (gen_ai.usage.output_tokens = tokens D
-- generated), the largest value of the request's latest attempt that has one
-- (a re-dispatched or recomputed attempt generates its tokens anew).

-- Request keys that a router span names as its other leg's id (whole store,
-- never restricted by an incremental refresh): kept per store file
-- (materialize kind 'file'), so an absorb reads only the new files for them.
CREATE OR REPLACE VIEW _calc_req_link_part AS
SELECT DISTINCT _file, _request_key(run_id, attr_str['router.linked_request_id'], prompt_index) AS rkey,
       rkey AS by_rkey, attr_str['router.linked_request_id'] AS linked_id
FROM _file_rows
WHERE role = 'router' AND attr_str['router.linked_request_id'] IS NOT NULL
  AND attr_str['router.linked_request_id'] <> request_id;
CREATE TABLE IF NOT EXISTS _mat_req_link_part AS SELECT * FROM _calc_req_link_part LIMIT 0;
CREATE OR REPLACE VIEW _req_links AS SELECT DISTINCT rkey, by_rkey, linked_id FROM _mat_req_link_part;

CREATE OR REPLACE VIEW _calc_req_base AS
WITH rt AS (
    SELECT rkey,
           any_value(run_id) AS run_id, any_value(request_id) AS request_id, any_value(prompt_index) AS prompt_index,
           min(c_start_ns) FILTER (WHERE record = 'span' AND name = 'router.request') AS arrival_ns,
           max(c_end_ns) FILTER (WHERE record = 'span' AND name = 'router.request') AS root_end_ns,
           max(status_code) FILTER (WHERE record = 'span' AND name = 'router.request') AS root_status,
           min(c_start_ns) FILTER (WHERE record = 'event' AND name = 'router.first_token') AS first_token_ns,
           max(c_start_ns) FILTER (WHERE record = 'event' AND name = 'router.last_token') AS last_token_ns,
           min(attr_str['request.mode']) FILTER (WHERE name = 'router.request') AS mode,
           max(attr_int['gen_ai.usage.input_tokens']) AS prompt_tokens,
           max(attr_int['gen_ai.usage.output_tokens']) AS output_tokens,
           max(attr_int['request.num_cached_tokens']) AS cached_tokens,
           -- the linked ids and the trace ids: the least and the greatest; all of them (multi) only when
           -- they differ (a DISTINCT aggregate here would copy every router row once more)
           min(attr_str['router.linked_request_id']) AS linked_lo,
           max(attr_str['router.linked_request_id']) AS linked_hi,
           max(attempt) AS router_attempt,
           -- P's answer in the attempt that delivered the first token (the router's latest; struct
           -- max compares the attempt first, then the time: the latest D leg dispatched)
           coalesce((max({'a': attempt, 't': c_end_ns}) FILTER (WHERE record = 'span' AND name = 'router.wait'
                                           AND attr_str['router.leg'] = 'prefill' AND status_code <> 2)).t,
                    (max({'a': attempt, 't': c_start_ns}) FILTER (WHERE record = 'span' AND name = 'router.dispatch'
                                             AND attr_str['router.leg'] = 'decode')).t) AS p_response_ns,
           -- the router re-dispatched a leg (a retry): the latest dispatch's start (see the header)
           CASE WHEN count(*) FILTER (WHERE record = 'span' AND name = 'router.dispatch'
                                      AND attr_str['router.leg'] = 'prefill') > 1
                THEN (max({'a': attempt, 't': c_start_ns}) FILTER (WHERE record = 'span' AND name = 'router.dispatch'
                                                                    AND attr_str['router.leg'] = 'prefill')).t
           END AS p_redispatch_ns,
           CASE WHEN count(*) FILTER (WHERE record = 'span' AND name = 'router.dispatch'
                                      AND attr_str['router.leg'] = 'decode') > 1
                THEN (max({'a': attempt, 't': c_start_ns}) FILTER (WHERE record = 'span' AND name = 'router.dispatch'
                                                                    AND attr_str['router.leg'] = 'decode')).t
           END AS d_redispatch_ns,
           count(*) FILTER (WHERE record = 'span' AND name = 'router.request') > 0 AS has_root,
           min(trace_id) FILTER (WHERE record = 'span' AND trace_id IS NOT NULL) AS trace_lo,
           max(trace_id) FILTER (WHERE record = 'span' AND trace_id IS NOT NULL) AS trace_hi
    FROM _timed
    WHERE role = 'router' AND rkey IN (SELECT rkey FROM _scope_keys)
    GROUP BY rkey
), en AS (
    SELECT rkey,
           any_value(run_id) AS run_id, any_value(request_id) AS request_id, any_value(prompt_index) AS prompt_index,
           min(c_start_ns) AS first_ns, max(c_end_ns) AS last_ns,
           -- a request re-dispatched to another engine: the engine of its latest row (any_value would vary by run)
           arg_max(engine_id, c_start_ns) FILTER (WHERE role = 'prefill' AND engine_id IS NOT NULL) AS prefill_engine,
           arg_max(engine_id, c_start_ns) FILTER (WHERE role = 'decode' AND engine_id IS NOT NULL) AS decode_engine,
           max(attr_int['gen_ai.usage.input_tokens']) AS prompt_tokens,
           max(attr_int['request.num_cached_tokens']) AS cached_tokens,
           max(attempt) AS attempt,
           bool_or(name IN ('handoff.handshake', 'handoff.agent_load') OR attr_int['kv.first_contact'] = 1) AS first_contact,
           bool_or(name IN ('kv.load_failed', 'request.preempted')) AS recomputed,
           -- for wasted_compute_ns (see the header): the resets (the compute spans are read in w_spans,
           -- for the few requests with a reset only)
           list(c_start_ns ORDER BY c_start_ns) FILTER (WHERE record = 'event' AND name IN ('kv.load_failed', 'request.preempted'))
               AS reset_events,
           CASE WHEN bool_or(connector ILIKE '%push%') THEN 'push'
                WHEN bool_or(connector ILIKE '%nixl%') THEN 'pull' END AS connector_mode,
           bool_or(name = 'dest.register') AS saw_registration,
           bool_or(role = 'prefill') AS has_prefill, bool_or(role = 'decode') AS has_decode,
           -- the API servers' marks (engine-clock window; see the header)
           min(c_start_ns) FILTER (WHERE record = 'span' AND name = 'prefill.frontend'
                                   AND coalesce(attr_str['frontend.part'], 'whole') IN ('in', 'whole')) AS p_fe_in_ns,
           max(c_end_ns) FILTER (WHERE record = 'span' AND name = 'prefill.frontend'
                                 AND coalesce(attr_str['frontend.part'], 'whole') IN ('out', 'whole')) AS p_fe_out_ns,
           min(c_start_ns) FILTER (WHERE record = 'event' AND name = 'token' AND role = 'prefill'
                                   AND span_id IS NOT NULL) AS p_token_ns,
           min(c_start_ns) FILTER (WHERE record = 'span' AND name = 'decode.frontend'
                                   AND coalesce(attr_str['frontend.part'], 'whole') IN ('in', 'whole')) AS d_fe_in_ns,
           max(c_end_ns) FILTER (WHERE record = 'span' AND name = 'decode.frontend'
                                 AND coalesce(attr_str['frontend.part'], 'whole') IN ('out', 'whole')) AS d_fe_out_ns,
           min(c_start_ns) FILTER (WHERE record = 'event' AND name = 'token' AND role = 'decode'
                                   AND span_id IS NOT NULL) AS d_token_ns,
           sum(attr_int['kv.descriptors']) FILTER (WHERE record = 'span' AND name = 'kv.transfer') AS kv_descriptors,
           -- (attempt, tokens) compared in that order: the latest attempt's largest count
           (max({'a': attempt, 'v': attr_int['gen_ai.usage.output_tokens']})
                FILTER (WHERE record = 'event' AND name = 'request.finished' AND role = 'decode'
                        AND attr_int['gen_ai.usage.output_tokens'] IS NOT NULL)).v AS decode_output_tokens,
           -- the engines' trace ids: the least and the greatest (as in rt)
           min(trace_id) FILTER (WHERE record = 'span' AND trace_id IS NOT NULL) AS trace_lo,
           max(trace_id) FILTER (WHERE record = 'span' AND trace_id IS NOT NULL) AS trace_hi
    FROM _timed
    WHERE role IN ('prefill', 'decode') AND rkey IN (SELECT rkey FROM _scope_keys)
    GROUP BY rkey
), multi AS (
    -- the few requests with more than one linked id, or more than one trace id on the router's or
    -- the engines' side: their distinct ids, from their own rows (the rows rt and en read)
    SELECT rkey,
           count(DISTINCT trace_id) FILTER (WHERE record = 'span' AND trace_id IS NOT NULL) AS trace_count,
           list(DISTINCT attr_str['router.linked_request_id'] ORDER BY attr_str['router.linked_request_id'])
               FILTER (WHERE role = 'router' AND attr_str['router.linked_request_id'] IS NOT NULL) AS linked_ids
    FROM _records
    WHERE record IN ('span', 'event') AND role IN ('router', 'prefill', 'decode')
      AND rkey IN (SELECT rkey FROM rt WHERE trace_lo <> trace_hi OR linked_lo <> linked_hi
                   UNION ALL SELECT rkey FROM en WHERE trace_lo <> trace_hi)
    GROUP BY rkey
), linked AS (
    SELECT rkey FROM _req_links
), w_ft AS (
    -- wasted compute (see the header): each request's first token (as in the final SELECT) and resets
    SELECT coalesce(rt.rkey, en.rkey) AS rkey,
           CASE WHEN rt.rkey IS NOT NULL THEN rt.first_token_ns
                WHEN en.p_fe_in_ns IS NOT NULL THEN en.d_token_ns END AS ft,
           rt.p_redispatch_ns, rt.d_redispatch_ns, en.reset_events
    FROM rt FULL OUTER JOIN en ON rt.rkey = en.rkey
    WHERE rt.p_redispatch_ns IS NOT NULL OR rt.d_redispatch_ns IS NOT NULL OR len(en.reset_events) > 0
), w_reset AS (
    SELECT rkey, p_redispatch_ns AS t, true AS all_sides FROM w_ft WHERE p_redispatch_ns IS NOT NULL
    UNION ALL
    SELECT rkey, d_redispatch_ns, false FROM w_ft WHERE d_redispatch_ns IS NOT NULL
    UNION ALL
    SELECT rkey, unnest(reset_events), true FROM w_ft WHERE len(reset_events) > 0
), w_last AS (
    -- the latest reset before the first token: for every side, and for D's side
    SELECT f.rkey, max(r.t) FILTER (WHERE r.all_sides) AS reset_all_ns, max(r.t) AS reset_decode_ns
    FROM w_ft f JOIN w_reset r ON r.rkey = f.rkey AND (f.ft IS NULL OR r.t <= f.ft)
    GROUP BY f.rkey
), w_spans AS (
    -- the compute spans (the compute stages of pdtrace.instrument.stages) of a request with a reset:
    -- start (corrected), duration, side, engine, rank, ids
    SELECT f.rkey, {'s': t.c_start_ns, 'd': t.end_ns - t.start_ns, 'dec': t.role = 'decode', 'eng': t.engine_id,
                    'rank': t.tp_rank, 'sid': t.span_id, 'par': t.parent_span_id} AS c,
           l.reset_all_ns, l.reset_decode_ns
    FROM w_ft f JOIN w_last l ON l.rkey = f.rkey
    JOIN _timed t ON t.rkey = f.rkey
    WHERE t.record = 'span' AND t.name IN ('prefill.compute', 'decode.first_step') AND t.role IN ('prefill', 'decode')
), w_comp AS (
    -- leaf compute spans (a prefill.compute parent's chunks stand for it) started before the reset on their side
    SELECT c.rkey, c.c.eng AS engine_id, c.c.rank AS tp_rank, sum(c.c.d) AS dur_ns
    FROM w_spans c
    LEFT JOIN (SELECT DISTINCT rkey, c.par AS par FROM w_spans WHERE c.par IS NOT NULL) k
           ON k.rkey = c.rkey AND k.par = c.c.sid
    WHERE k.rkey IS NULL
      AND c.c.s < CASE WHEN c.c.dec THEN c.reset_decode_ns ELSE c.reset_all_ns END
    GROUP BY ALL
), w AS (
    -- per engine the slowest rank's (ranks run together), summed over engines
    SELECT rkey, sum(dur_ns)::BIGINT AS wasted_compute_ns
    FROM (SELECT rkey, engine_id, max(dur_ns) AS dur_ns FROM w_comp GROUP BY rkey, engine_id)
    GROUP BY rkey
)
SELECT coalesce(rt.rkey, en.rkey) AS rkey,
       coalesce(rt.run_id, en.run_id) AS run_id,
       coalesce(rt.request_id, en.request_id) AS request_id,
       coalesce(rt.prompt_index, en.prompt_index) AS prompt_index,
       coalesce(rt.mode, en.connector_mode, CASE WHEN en.saw_registration THEN 'push' END, 'unknown') AS mode,
       coalesce(rt.prompt_tokens, en.prompt_tokens) AS prompt_tokens,
       coalesce(rt.cached_tokens, en.cached_tokens) AS cached_tokens,
       coalesce(rt.prompt_tokens, en.prompt_tokens) - coalesce(rt.cached_tokens, en.cached_tokens, 0) AS uncached_tokens,
       coalesce(rt.output_tokens, en.decode_output_tokens) AS output_tokens,
       CASE WHEN rt.has_root THEN rt.arrival_ns
            WHEN rt.rkey IS NULL THEN coalesce(en.p_fe_in_ns, en.first_ns) ELSE en.first_ns END AS arrival_ns,
       CASE WHEN rt.rkey IS NOT NULL THEN rt.first_token_ns
            WHEN en.p_fe_in_ns IS NOT NULL THEN en.d_token_ns END AS first_token_ns,
       CASE WHEN rt.rkey IS NOT NULL THEN rt.last_token_ns
            WHEN en.p_fe_in_ns IS NOT NULL AND en.d_token_ns IS NOT NULL THEN en.d_fe_out_ns END AS last_token_ns,
       rt.root_end_ns, rt.root_status,
       greatest(coalesce(rt.router_attempt, 0), coalesce(en.attempt, 0)) + 1 AS attempts,
       en.prefill_engine, en.decode_engine,
       coalesce(en.first_contact, false) AS first_contact,
       coalesce(en.recomputed, false) AS recomputed,
       coalesce(rt.has_root, false) AS has_router_record,
       CASE WHEN rt.linked_lo = rt.linked_hi THEN [rt.linked_lo] ELSE mx.linked_ids END AS linked_ids,
       en.last_ns AS engine_last_ns,
       CASE WHEN coalesce(rt.mode, en.connector_mode) = 'pull'
            THEN CASE WHEN rt.rkey IS NOT NULL THEN rt.p_response_ns ELSE coalesce(en.p_token_ns, en.p_fe_out_ns) END
       END AS prefill_response_ns,
       en.kv_descriptors,
       CASE WHEN rt.rkey IS NOT NULL THEN 'router' ELSE 'engine' END AS ttft_source,
       en.d_fe_in_ns AS decode_arrival_ns,
       coalesce(en.has_prefill, false) AS has_prefill, coalesce(en.has_decode, false) AS has_decode,
       en.p_fe_in_ns IS NOT NULL AS has_prefill_frontend, en.d_token_ns IS NOT NULL AS has_decode_token,
       coalesce(rt.p_redispatch_ns, rt.d_redispatch_ns) AS attempt_start_ns,
       coalesce(w.wasted_compute_ns, 0) AS wasted_compute_ns,
       -- distinct trace ids among the router's and engines' spans (DESIGN.md §3 "Joins")
       (CASE WHEN mx.rkey IS NOT NULL THEN mx.trace_count
             ELSE (rt.trace_lo IS NOT NULL)::INTEGER
                  + (en.trace_lo IS NOT NULL AND en.trace_lo IS DISTINCT FROM rt.trace_lo)::INTEGER END)::INTEGER
           AS trace_count
FROM rt FULL OUTER JOIN en ON rt.rkey = en.rkey
LEFT JOIN w ON w.rkey = coalesce(rt.rkey, en.rkey)
LEFT JOIN multi mx ON mx.rkey = coalesce(rt.rkey, en.rkey)
WHERE NOT (rt.rkey IS NULL AND en.rkey IN (SELECT rkey FROM linked));

CREATE TABLE IF NOT EXISTS _mat_req_base AS SELECT * FROM _calc_req_base LIMIT 0;
CREATE OR REPLACE VIEW _req_base AS SELECT * FROM _mat_req_base;

-- TPOT (ms per token), the one definition (requests.tpot_ms, request_stalls.tpot_ms, the summaries): (last
-- token - first token) / (output_tokens - 1); hung after the first token (no last token): (end of its last
-- decode step - first token) / its decode steps, when that step ended after the first token (a step that
-- ended before the router wrote the first token says nothing about the tokens after it); NULL otherwise.
-- The summaries pass no decode steps: their TPOT is that of finished requests.
CREATE OR REPLACE MACRO _tpot_ms(output_tokens, first_token_ns, last_token_ns, decode_steps, last_decode_end_ns) AS
    CASE WHEN output_tokens > 1 AND last_token_ns IS NOT NULL
         THEN (last_token_ns - first_token_ns) / 1e6 / (output_tokens - 1)
         WHEN first_token_ns IS NOT NULL AND last_token_ns IS NULL AND decode_steps > 0
              AND last_decode_end_ns > first_token_ns
         THEN (last_decode_end_ns - first_token_ns) / 1e6 / decode_steps END;
