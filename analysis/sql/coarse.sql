-- module: coarse
-- requires: spans
--
-- The coarse breakdown from stock vLLM spans alone (DESIGN.md §6: any router,
-- engines pdtrace did not instrument). vLLM's API server emits one
-- `llm_request` span per finished request when it runs with
-- --otlp-traces-endpoint (vllm/v1/engine/output_processor.py, do_tracing);
-- `pdtrace collect` stores it with its attributes (seconds, as vLLM sends
-- them; converted to ms here). Per engine span, from vLLM's request stats:
--   engine_ttft = first_token_latency      (API-server arrival -> first token)
--   queue       = scheduled_ts - queued_ts (waiting in EngineCore's queue)
--   prefill     = first_token_ts - scheduled_ts
--   decode      = last_token_ts - first_token_ts
--   other       = engine_ttft - queue - prefill: the API server (tokenize,
--                 hand-off to EngineCore) and output processing before the
--                 first token is counted; coordination.
-- It is coarse: no handoff stage is seen. On the prefill engine queue and
-- prefill are what they say (the prompt's forward passes). On a P/D decode
-- engine whose connector loads KV asynchronously (NIXL), vLLM records
-- SCHEDULED only when the KV has arrived (vllm/v1/core/sched/scheduler.py
-- skips a request while its KV fetch is in progress), so D's queue covers the
-- wait for blocks *and* the KV load from P (transfer and its coordination),
-- and D's prefill is its first decode step. The router hop is not in these
-- numbers (engine clocks only).

CREATE OR REPLACE VIEW _coarse_breakdown_all AS
SELECT run_id, request_id, prompt_index, role, engine_id,
       start_ns AS arrival_ns,
       attr_float['gen_ai.latency.time_to_first_token'] * 1e3 AS engine_ttft_ms,
       attr_float['gen_ai.latency.time_in_queue'] * 1e3 AS queue_ms,
       attr_float['gen_ai.latency.time_in_model_prefill'] * 1e3 AS prefill_ms,
       attr_float['gen_ai.latency.time_in_model_decode'] * 1e3 AS decode_ms,
       (attr_float['gen_ai.latency.time_to_first_token'] - attr_float['gen_ai.latency.time_in_queue']
        - attr_float['gen_ai.latency.time_in_model_prefill']) * 1e3 AS other_ms,
       attr_float['gen_ai.latency.e2e'] * 1e3 AS e2e_ms,
       attr_int['gen_ai.usage.prompt_tokens'] AS prompt_tokens,
       attr_int['gen_ai.usage.completion_tokens'] AS output_tokens,
       request_id IS NOT NULL AS joined,
       true AS coarse,
       record_id, rkey
FROM spans
WHERE stage = 'llm_request';
-- coarse_breakdown: the rows of _coarse_breakdown_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW coarse_breakdown AS SELECT * FROM _coarse_breakdown_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW coarse_breakdown IS 'Coarse per-engine breakdown from stock vLLM llm_request spans (pdtrace collect): queue / prefill / decode / other per request and engine; no handoff stages.';
COMMENT ON COLUMN coarse_breakdown.run_id IS 'deployment run id';
COMMENT ON COLUMN coarse_breakdown.request_id IS 'base request id X (from gen_ai.request.id); NULL when it did not map';
COMMENT ON COLUMN coarse_breakdown.prompt_index IS 'prompt index i of cmpl-X-i (0 otherwise)';
COMMENT ON COLUMN coarse_breakdown.role IS 'prefill | decode | engine (role not known: service.name names neither)';
COMMENT ON COLUMN coarse_breakdown.engine_id IS 'engine the span came from (pdtrace.engine_id, service.instance.id or service.name@host/pid)';
COMMENT ON COLUMN coarse_breakdown.arrival_ns IS 'request arrival at the engine''s API server (llm_request start; ns since the Unix epoch, corrected clock)';
COMMENT ON COLUMN coarse_breakdown.engine_ttft_ms IS 'vLLM''s time_to_first_token on this engine: API-server arrival -> first token (ms); not the router''s TTFT';
COMMENT ON COLUMN coarse_breakdown.queue_ms IS 'queued -> first scheduled in EngineCore (ms; queue; on a P/D decode engine it includes the KV load from P)';
COMMENT ON COLUMN coarse_breakdown.prefill_ms IS 'first scheduled -> first token (ms; compute; on a P/D decode engine the first decode step)';
COMMENT ON COLUMN coarse_breakdown.decode_ms IS 'first token -> last token (ms)';
COMMENT ON COLUMN coarse_breakdown.other_ms IS 'engine_ttft - queue - prefill: API server and output processing before the first token (ms; coordination)';
COMMENT ON COLUMN coarse_breakdown.e2e_ms IS 'API-server arrival -> request finished (ms)';
COMMENT ON COLUMN coarse_breakdown.prompt_tokens IS 'prompt tokens (tokens)';
COMMENT ON COLUMN coarse_breakdown.output_tokens IS 'tokens this engine generated (tokens; 1 on a P/D prefill engine)';
COMMENT ON COLUMN coarse_breakdown.joined IS 'true if the span mapped to a request id';
COMMENT ON COLUMN coarse_breakdown.coarse IS 'always true: engine-level numbers from vLLM''s own span, no pdtrace stage';
COMMENT ON COLUMN coarse_breakdown.record_id IS 'record id of the llm_request span';
COMMENT ON COLUMN coarse_breakdown.rkey IS 'request join key (see spans.rkey); NULL when the span did not map';
