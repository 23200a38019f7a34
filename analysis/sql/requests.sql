-- module: requests
-- requires: request_base, incomplete, stalls, request_flags
--
-- One row per request. TTFT only for complete requests (first token
-- written); TPOT = (last token - first token) / (output tokens - 1), both
-- tokens as the router wrote them. ttft_source (module request_base):
-- 'router' when the router recorded the request, else 'engine': the window
-- is P's API server receiving the request -> D's API server writing the
-- first token chunk (skew-corrected), the last token is D's API server's
-- last chunk written, and the router's hops are not in it (the one between
-- the legs is the pseudo-stage router.unseen in ttft_segments). output_tokens is the router's
-- gen_ai.usage.output_tokens when it recorded one, else D's count from its
-- request.finished event (latest attempt; module request_base). A
-- request with a first token but no last token is `hung`: it keeps its TTFT,
-- has no last token, and its hang (time since the first token until the router's
-- root ended or the last record) is reported in hang_ms. Its TPOT counts the
-- tokens it emitted (DESIGN.md §4): with no finish record, 1 + the ended
-- decode.step spans whose step.batch gave it decode tokens (emitted_tokens),
-- over the time from the first token to the end of the last of them; the rest
-- of the hang is request_stalls.open_stall_ms (module stalls).
-- wasted_compute_ms (DESIGN.md §3 Attempt): compute whose output did not feed
-- the delivered first token, the formula beside request_base.wasted_compute_ns.
-- flags: the notable facts of the request (module request_flags: one line per flag, its rule there).

CREATE OR REPLACE VIEW _requests_all AS
SELECT q.run_id, q.request_id, q.prompt_index, q.mode,
       q.prompt_tokens, q.cached_tokens, q.uncached_tokens, q.output_tokens,
       q.arrival_ns, q.first_token_ns, q.last_token_ns,
       (q.first_token_ns - q.arrival_ns) / 1e6 AS ttft_ms,
       _tpot_ms(q.output_tokens, q.first_token_ns, q.last_token_ns, ds.decode_steps, ds.last_decode_end_ns) AS tpot_ms,
       CASE WHEN q.first_token_ns IS NOT NULL THEN 'complete' ELSE 'incomplete' END AS status,
       i.cause, i.detail,
       q.first_token_ns IS NOT NULL AND q.last_token_ns IS NULL AS hung,
       CASE WHEN q.first_token_ns IS NOT NULL AND q.last_token_ns IS NULL
            THEN (greatest(coalesce(q.root_end_ns, q.first_token_ns), coalesce(q.engine_last_ns, q.first_token_ns))
                  - q.first_token_ns) / 1e6 END AS hang_ms,
       q.attempts, q.prefill_engine, q.decode_engine, q.first_contact, q.recomputed, q.ttft_source, q.trace_count, q.rkey,
       CASE WHEN q.first_token_ns IS NOT NULL AND q.last_token_ns IS NULL THEN 1 + coalesce(ds.decode_steps, 0)
            ELSE q.output_tokens END AS emitted_tokens,
       q.wasted_compute_ns / 1e6 AS wasted_compute_ms,
       coalesce(fl.flags, []::VARCHAR[]) AS flags
FROM _req_base q LEFT JOIN _incomplete_requests_all i ON i.rkey = q.rkey
LEFT JOIN _mat_req_decode_steps ds ON ds.request_id = q.request_id
LEFT JOIN _request_flags fl ON fl.rkey = q.rkey;
-- requests: the rows of _requests_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW requests AS SELECT * FROM _requests_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW requests IS 'One row per request: mode, tokens, TTFT/TPOT, complete or incomplete with a cause.';
COMMENT ON COLUMN requests.run_id IS 'deployment run id';
COMMENT ON COLUMN requests.request_id IS 'base request id X';
COMMENT ON COLUMN requests.prompt_index IS 'prompt index i';
COMMENT ON COLUMN requests.mode IS 'handoff mode: pull | push | unknown';
COMMENT ON COLUMN requests.prompt_tokens IS 'prompt tokens (tokens)';
COMMENT ON COLUMN requests.cached_tokens IS 'prompt tokens served from the prefix cache (tokens)';
COMMENT ON COLUMN requests.uncached_tokens IS 'prompt tokens computed: prompt - cached (tokens)';
COMMENT ON COLUMN requests.output_tokens IS 'generated tokens: the router''s gen_ai.usage.output_tokens, else D''s request.finished count of the latest attempt (tokens)';
COMMENT ON COLUMN requests.arrival_ns IS 'request received: by the router (ttft_source router), by P''s API server (engine) (ns since the Unix epoch, corrected clock)';
COMMENT ON COLUMN requests.first_token_ns IS 'first token chunk written: by the router (ttft_source router), by D''s API server (engine) (ns since the Unix epoch); NULL if none';
COMMENT ON COLUMN requests.last_token_ns IS 'last token chunk written: by the router, or (engine) D''s API server''s last chunk (ns since the Unix epoch)';
COMMENT ON COLUMN requests.ttft_ms IS 'first_token - arrival (ms; router clock, or engine: P''s clock with D corrected to it); NULL for incomplete requests';
COMMENT ON COLUMN requests.tpot_ms IS '(last token - first token) / (output_tokens - 1), tokens as last_token_ns/first_token_ns (ms per token); hung: (end of its last decode step - first token) / its decode steps; NULL without output_tokens > 1 or a last token (hung: without decode steps)';
COMMENT ON COLUMN requests.emitted_tokens IS 'tokens the TPOT counts: output_tokens; for a hung request 1 + its ended decode steps (decode.step batches with decode tokens for it) (tokens)';
COMMENT ON COLUMN requests.status IS 'complete (first token written) | incomplete';
COMMENT ON COLUMN requests.cause IS 'cause of an incomplete request (see incomplete_requests.cause)';
COMMENT ON COLUMN requests.detail IS 'evidence for the cause';
COMMENT ON COLUMN requests.hung IS 'true if the first token came but the last token never did';
COMMENT ON COLUMN requests.hang_ms IS 'for a hung request: first token -> last record of the request (ms)';
COMMENT ON COLUMN requests.attempts IS 'dispatch attempts including local recomputes (count)';
COMMENT ON COLUMN requests.prefill_engine IS 'prefill engine id';
COMMENT ON COLUMN requests.decode_engine IS 'decode engine id';
COMMENT ON COLUMN requests.first_contact IS 'true if the handoff paid the first-contact handshake';
COMMENT ON COLUMN requests.recomputed IS 'true if the prompt was recomputed after a load failure or preemption';
COMMENT ON COLUMN requests.ttft_source IS 'whose clocks give the TTFT window (DESIGN.md §3): router (the router recorded the request) | engine (no router record: P''s API server received -> D''s API server wrote the first token chunk; router hops unseen)';
COMMENT ON COLUMN requests.trace_count IS 'distinct W3C trace ids among the request''s router, prefill and decode spans (count; 0: none recorded); > 1: the request''s spans sit in several traces (broken traceparent propagation), joined all the same by request id and time (DESIGN.md §3 "Joins")';
COMMENT ON COLUMN requests.rkey IS 'request join key';
COMMENT ON COLUMN requests.wasted_compute_ms IS 'compute whose output did not feed the delivered first token (ms; DESIGN.md §3 Attempt): sum of the leaf compute spans (prefill.compute, D''s local recompute, decode.first_step; per engine the slowest rank) that started before the latest reset at or before the first token on their side -- a router re-dispatch of P''s leg (both sides) or of D''s leg (D''s side), kv.load_failed, request.preempted; 0 without a reset (module request_base)';
COMMENT ON COLUMN requests.flags IS 'notable facts (LIST of VARCHAR, sorted; [] for none; rules in module request_flags): read_after_release (a READ ended after P freed the blocks by expiry/abort), write_after_release (a WRITE ended after D freed its blocks), blocks_never_released (a hold on either side still open at the trace end), missed_prefix_hit (D held the prompt''s blocks, a transfer moved them again), transport_fallback (a transfer on TCP / host staging instead of RDMA / CUDA IPC), descriptor_bound (posting descriptors took most of a transfer), first_contact (paid the first-contact handshake), recomputed (prompt recomputed after a load failure or preemption), hung_after_first_token (first token, no last token: requests.hung), wasted_compute (wasted_compute_ms > 0), split_trace (trace_count > 1), aborted_after_first_token (first token written, then D''s request.abort or the router''s decode_aborted / decode_failed: D gave the request up mid-stream, its engine often answering HTTP 200)';
