-- module: ttft_segments
-- requires: request_base, segment_culprits, intervals
-- materialize: _tt_req scratch
-- materialize: _tt_cand scratch
-- materialize: _tt_tree scratch
-- materialize: _tt_top scratch
-- materialize: _tt_kids scratch
-- materialize: _tt_owned scratch
-- materialize: ttft_segments request
--
-- Intermediate steps are materialized (scratch: for the refreshed requests
-- only, emptied after the refresh) because several later steps read them.
--
-- The TTFT critical path (DESIGN.md §2-3) as exclusive segments tiling
-- [arrival at the router, first token written], both on the router clock.
--
--  1. Candidates: a complete request's leaf stages (stages.owns_ttft), on
--     corrected times, clipped to [arrival, first token]. Pull: P's stages
--     are also clipped at the router's receipt of P's response
--     (request_base.prefill_response_ns): P's API server may still be
--     writing (prefill.frontend's out part ends late under load) while D
--     already runs the handoff, and that tail must not hide D's stages.
--  2. Slowest expected rank: per engine, the per-rank spans (tp_rank set) of
--     the rank whose per-rank work ends last stand for all ranks; the other
--     ranks' copies are hidden.
--  3. Join: the handoff starts at J = the first post-join stage (handoff.prep,
--     kv.transfer, kv.ready, decode.first_step). Before J, prefill and decode
--     engine stages are two branches (push: P computes while D registers).
--     The critical branch is the one whose last stage ends last (the input
--     that arrived last); the other branch's stages that overlap it are
--     hidden; stages that ended before it started (pull: P before D) stay.
--     J, the chain's end and the input instant I (rule 10): macro _handoff_join.
--  4. Flatten (Perfetto's startup breakdown): among top-level stages the one
--     ending last owns each instant ("latest end wins" = walking back from
--     the first token and following the last-arriving input), so each owns
--     one interval [start, min(end, earliest start of stages ending later)].
--     Children (handoff.* under handoff.prep, chunks) own their part of their
--     parent's interval the same way; the parent keeps the rest. Deeper
--     descendants are not split out (their parent owns their time).
--     Macro _latest_end_wins (module intervals), at each level.
--  5. Waits (router.wait) own only instants no stage covers; what remains is
--     an `unattributed` segment named by its neighbours. The instants no
--     stage covers: macro _uncovered (module intervals), also for a
--     parent's own time between its children.
--  Engine-clock window (request_base.ttft_source = 'engine': no router row):
--  the window is [P's API server received, D's API server wrote the first
--  token chunk] and the same steps apply. The router's hop between the legs
--  is not recorded but is not dropped: a pseudo-stage router.unseen (a wait,
--  like router.wait: it owns only instants no stage covers) spans
--     pull: [P's response written (prefill_response_ns), D's API server
--            received (decode_arrival_ns)]  -- the router got P's answer and
--            sent D's leg
--     push: [arrival, decode_arrival_ns]    -- D's leg on its way from the router
--  (span_id NULL). Its segments say "router hop unseen" in the breakdown.
--  Parent links (DESIGN.md §3 "Joins"): stages are joined to their request
--  by rkey (run, base request id, prompt index) and time, never by an
--  OpenTelemetry parent across processes. Step 4 nests a candidate under
--  its parent_span_id only when that parent is a candidate of the same
--  request and attempt, recorded by the same process (_process_key:
--  same role and host+pid; without a pid, same role and engine id), in the
--  same trace id (either NULL: no trace id recorded). Any other parent -- a
--  router's router.dispatch whose span id an engine took from
--  `traceparent`, the API server's span that EngineCore's stages took from
--  the request's trace headers, a span of another trace (split traces), a
--  span not in the store -- counts as no parent: the stage is top-level
--  (`parent_span_id` NULL in _tt_cand). Reports: ai-dynamo/dynamo#13345
--  (worker spans under kv_router.route_request), ai-dynamo/dynamo#7030
--  (decode leg in a separate trace), vllm-project/vllm#33272 (EngineCore's
--  spans parented to the API server's); tests/analysis/test_join_cases.py.
--  Two rules adjust candidates before 4 (in step 3's query):
--  6. kv.ready runs from the end of the request's kv.transfer (the kept,
--     slowest rank's) when it is recorded as starting later: DESIGN.md §2
--     defines it as transfer finished -> seen by the poll on every rank ->
--     promoted. Push: D starts it at the write-done notification, so the
--     notification's way and D's wait for its next poll are readiness
--     (coordination), not a gap.
--  7. D's chain before P's response (push; DESIGN.md §3: the handoff's path
--     runs join -> handoff.prep -> kv.transfer -> kv.ready ->
--     decode.first_step to the first token; P's response matters only as the
--     router's wait for it before streaming, bug case D). A P-branch stage
--     that is not a post-join stage and ends after the handoff started J
--     (P's API server writing its response: prefill.frontend's out part)
--     cannot own time before D's chain ends (the latest end of the post-join
--     stages): its start moves to that end (to its own end when it ends
--     earlier) and the cut part (clip_ns) counts as hidden. After D's chain
--     it is the router's other join input: latest end wins, as in 4.
--
--  8. Branches include the router's dispatch of each leg (router.dispatch
--     with router.leg = prefill | decode): a D leg dispatched together with
--     P's (push routers, SGLang-style dual dispatch) is D's input to the join
--     and races in 3; it no longer owns P's queue through "latest end wins".
--  9. Category by outcome (DESIGN.md §2): a candidate's category comes from
--     macro _outcome_category (module stages): a kv.transfer that failed or
--     moved 0 bytes is coordination.
-- 10. Causality (DESIGN.md §3 "Causality"): a consumer stage cannot be on the
--     path before its last input existed. The handoff's input instant I =
--     the later of P's KV ready (latest end of P's prefill.compute, kept
--     rank) and, push, the registration matched (latest end of
--     dest.register). Every post-join stage (and its children) starts no
--     earlier than I; the cut part (clip_ns) is hidden behind the producer's
--     chain, which owns those instants. J (step 3) is no earlier than I.
--     So D's READ or load posted while P still queued or computed is not
--     charged as transfer / coordination over P's time.
-- 11. Attempts (DESIGN.md §3 "Attempt"): after a router retry
--     (request_base.attempt_start_ns) the join J, the input instant I, the
--     chain end and the branches of step 3 are those of the attempt that
--     delivered the first token (its stages starting at or after the retry's
--     dispatch); earlier attempts' stages stay candidates like any other
--     (latest end wins), so their queue and compute are on the path as what
--     they were and the router's wait between attempts is router.wait or
--     unattributed (coordination).
--
-- 12. Handover (DESIGN.md §2: prefill.frontend / decode.frontend run "HTTP
--     received -> queued in EngineCore", prefill.queue / decode.queue
--     "queued -> ..."): vLLM stamps the queue's start (arrival_time) in the
--     API server's input processor, before the frontend's 'in' part hands
--     the request to EngineCore. On the same engine (or an API server
--     whose engine is unknown), request and attempt, a queue stage whose
--     start lies inside the frontend's 'in' part starts at that part's end
--     (its own end when earlier). The cut part was input processing, which
--     the frontend owns: it is not queue time and not hidden (clip_ns 0).
--
--   arrival                                                        first token
--   |dispatch|----- prefill.compute -----|                                  |
--   |dispatch|--------------- dest.register ---------------|prep|xfer|first_step|
--   => dispatch, dest.register, handoff.prep, kv.transfer, decode.first_step;
--      prefill.compute hidden (push, late registration: bug case H).

-- The process that wrote a row (see "Parent links" above), as a hash: its role and host+pid;
-- for a writer that records no pid (foreign or older), its role and engine id; NULL: unknown.
CREATE OR REPLACE MACRO _process_key(role, host, pid, engine_id) AS
    CASE WHEN pid IS NOT NULL THEN hash(role, host, pid)
         WHEN engine_id IS NOT NULL THEN hash(role, engine_id, 'engine') END;

CREATE OR REPLACE MACRO _post_join_stage(g) AS g IN ('handoff.prep', 'kv.transfer', 'kv.ready', 'decode.first_step');

-- The join rule (step 3 with rules 10 and 11): where each request's handoff
-- starts. `cands` (a table, view or CTE name) holds candidates with columns
-- rkey, stage, stage_group, branch, s0, e0 (ns, router clock) and
-- attempt_start_ns (request_base: the dispatch of the attempt that delivered
-- the first token, NULL without a retry); only stages starting at or after it
-- count. Returns one row per request that has a post-join stage
-- (_post_join_stage): join_ns = J, the later of the first post-join stage's
-- start and input_ns; chain_end_ns = latest end of a post-join stage;
-- xfer_end_ns = latest end of kv.transfer (NULL: none); input_ns = I (rule
-- 10), the later of P's KV ready (latest end of a prefill-branch
-- prefill.compute) and the latest end of dest.register (NULL: neither; pull
-- has no dest.register); att_ns = attempt_start_ns. All ns.
CREATE OR REPLACE MACRO _handoff_join(cands) AS TABLE
SELECT rkey, greatest(post_start_ns, input_ns) AS join_ns, chain_end_ns, xfer_end_ns, input_ns, att_ns
FROM (
    SELECT r.rkey,
           min(r.s0) FILTER (WHERE _post_join_stage(r.stage_group) AND r.s0 >= coalesce(r.attempt_start_ns, r.s0)) AS post_start_ns,
           max(r.e0) FILTER (WHERE _post_join_stage(r.stage_group) AND r.s0 >= coalesce(r.attempt_start_ns, r.s0)) AS chain_end_ns,
           max(r.e0) FILTER (WHERE r.stage = 'kv.transfer' AND r.s0 >= coalesce(r.attempt_start_ns, r.s0)) AS xfer_end_ns,
           greatest(max(r.e0) FILTER (WHERE r.branch = 'prefill' AND r.stage_group = 'prefill.compute'
                                            AND r.s0 >= coalesce(r.attempt_start_ns, r.s0)),
                    max(r.e0) FILTER (WHERE r.stage = 'dest.register' AND r.s0 >= coalesce(r.attempt_start_ns, r.s0))) AS input_ns,
           any_value(r.attempt_start_ns) AS att_ns
    FROM query_table(cands) r GROUP BY r.rkey
) WHERE post_start_ns IS NOT NULL;

-- The refreshed complete requests (small; every later step joins it on rkey alone).
CREATE OR REPLACE VIEW _calc_tt_req AS
SELECT rkey, arrival_ns, first_token_ns, prefill_response_ns, run_id, request_id, prompt_index,
       ttft_source, mode, decode_arrival_ns, attempt_start_ns FROM _req_base
WHERE first_token_ns IS NOT NULL AND arrival_ns IS NOT NULL AND first_token_ns >= arrival_ns
  AND rkey IN (SELECT rkey FROM _scope_keys);
CREATE TABLE IF NOT EXISTS _mat_tt_req AS SELECT * FROM _calc_tt_req LIMIT 0;
CREATE OR REPLACE VIEW _tt_req AS SELECT * FROM _mat_tt_req;

-- The candidates. Three columns an attribute or event decides (rules 8, 9, 12) are read in this
-- one scan, for the stages they concern only (a CASE evaluates its branch on the matching rows
-- only, so the attribute maps are looked up for those rows): router.dispatch's leg (router.leg),
-- a kv.transfer's category by outcome (macro _outcome_category, module stages; the failure
-- events from _kv_failed_spans, looked up by an uncorrelated IN: a join would hash the
-- candidates, the big side, and EXISTS would group them) and fe_in, a frontend's 'in' part
-- (frontend.part = 'in'). A row without a span id takes none of them (its stage's own category,
-- its role's branch). (Read in this scan: a second scan joined on (rkey, span_id) costs more
-- than the scan itself, BENCHMARKS.md "Cold cost of the attribution rules".)
CREATE OR REPLACE VIEW _tt_all AS
SELECT t.* EXCLUDE (c_start_ns),
       greatest(t.c_start_ns, q.arrival_ns) AS s0,
       least(t.end_c, q.first_token_ns, CASE WHEN t.role = 'prefill' THEN q.prefill_response_ns END) AS e0,
       q.arrival_ns, q.first_token_ns, q.attempt_start_ns
FROM (
    -- each row's own columns, computed before the join with _tt_req (the join then carries no
    -- attribute map)
    SELECT t.rkey, t.span_id, t.parent_span_id, t.name::_stage_name AS stage,
           -- rule 9: category by outcome
           CASE WHEN t.name = 'kv.transfer' AND t.span_id IS NOT NULL
                THEN _outcome_category(s.category, t.status_code, t.attr_int['kv.bytes'], t.attr_str['error.type'],
                                       {'r': t.rkey, 's': t.span_id} IN (SELECT {'r': rkey, 's': span_id}
                                                                          FROM _kv_failed_spans))
                ELSE s.category END AS category,
           s.stage_group::_stage_name AS stage_group, s.is_filler,
           t.role, t.engine_id, t.tp_rank, t.attempt, t.c_end_ns AS end_c,
           _process_key(t.role, t.host, t.pid, t.engine_id) AS proc_key,
           CASE WHEN t.trace_id IS NOT NULL THEN hash(t.trace_id) END AS trace_key,
           -- the branch of a pre-join stage: its engine's role, but dest.register
           -- is D's branch whoever records it (its end is the match on P); a
           -- router.dispatch belongs to the branch of its leg (rule 8)
           CASE WHEN t.name = 'dest.register' THEN 'decode'
                WHEN t.name = 'router.dispatch' AND t.span_id IS NOT NULL
                     AND t.attr_str['router.leg'] IN ('prefill', 'decode')
                THEN t.attr_str['router.leg'] ELSE t.role END AS branch,
           -- rule 12: a frontend's 'in' part
           coalesce(t.name IN ('prefill.frontend', 'decode.frontend') AND t.span_id IS NOT NULL
                    AND t.attr_str['frontend.part'] = 'in', false) AS fe_in,
           t.c_start_ns
    FROM _timed t
    JOIN stages s ON s.stage = t.name
    WHERE t.record = 'span' AND s.owns_ttft
) t
JOIN _tt_req q ON q.rkey = t.rkey
WHERE t.c_start_ns <= q.first_token_ns AND t.end_c >= q.arrival_ns
  AND (t.role <> 'prefill' OR q.prefill_response_ns IS NULL OR t.c_start_ns <= q.prefill_response_ns)
UNION ALL
-- engine-clock window: the router's unseen hop (pseudo-stage router.unseen; see the header)
SELECT u.rkey, NULL::UBIGINT, NULL::UBIGINT, 'router.unseen'::_stage_name, s.category,
       s.stage_group::_stage_name, s.is_filler, 'router', NULL::VARCHAR, NULL::SMALLINT, 0, u.e0,
       NULL::UBIGINT, NULL::UBIGINT,
       'router', false, u.s0, u.e0, u.arrival_ns, u.first_token_ns, u.attempt_start_ns
FROM (SELECT rkey, arrival_ns, first_token_ns, attempt_start_ns,
             greatest(CASE WHEN mode = 'pull' THEN prefill_response_ns ELSE arrival_ns END, arrival_ns) AS s0,
             least(decode_arrival_ns, first_token_ns) AS e0
      FROM _tt_req WHERE ttft_source = 'engine') u
JOIN stages s ON s.stage = 'router.unseen'
WHERE u.e0 > u.s0;

-- Candidates after the rank and branch rules; `kept` = may own time.
CREATE OR REPLACE VIEW _calc_tt_cand AS
WITH allc AS MATERIALIZED (
    SELECT * FROM _tt_all
), par_ok AS (
    -- parent links kept: to a candidate of the same recorder and trace (header, "Parent links");
    -- one row per (request, parent, attempt, recorder, trace) of a child whose parent qualifies
    SELECT DISTINCT a.rkey, a.parent_span_id, a.attempt, a.proc_key, a.trace_key
    FROM allc a JOIN allc p
      ON p.rkey = a.rkey AND p.span_id = a.parent_span_id AND p.attempt = a.attempt AND p.proc_key = a.proc_key
    WHERE a.parent_span_id IS NOT NULL
      AND (a.trace_key IS NULL OR p.trace_key IS NULL OR a.trace_key = p.trace_key)
), ranks AS (
    SELECT rkey, engine_id, arg_max(tp_rank, (end_c, -tp_rank)) AS crit_rank
    FROM allc WHERE tp_rank IS NOT NULL
    GROUP BY rkey, engine_id
), handover AS (
    -- rule 12: a queue stage whose start lies inside its frontend's 'in' part (same role, engine
    -- (or the API server's engine unknown), attempt) starts when that part handed the request over
    SELECT q.rkey, q.span_id, max(f.e0) AS in_end_ns
    FROM allc f
    JOIN allc q ON f.fe_in AND q.rkey = f.rkey AND q.role = f.role AND q.attempt = f.attempt
     AND q.stage IN ('prefill.queue', 'decode.queue')
     AND (f.engine_id IS NULL OR q.engine_id IS NULL OR f.engine_id = q.engine_id)
     AND f.s0 <= q.s0 AND q.s0 < f.e0
    GROUP BY q.rkey, q.span_id
), ranked AS MATERIALIZED (
    -- (a parent link that does not qualify is dropped here: par_ok)
    SELECT a.* EXCLUDE (proc_key, trace_key, fe_in) REPLACE (
               CASE WHEN h.in_end_ns IS NOT NULL THEN least(h.in_end_ns, a.e0) ELSE a.s0 END AS s0,
               CASE WHEN k.rkey IS NOT NULL THEN a.parent_span_id END AS parent_span_id)
    FROM allc a LEFT JOIN ranks r ON r.rkey = a.rkey AND r.engine_id IS NOT DISTINCT FROM a.engine_id
    LEFT JOIN handover h ON h.rkey = a.rkey AND h.span_id = a.span_id
    LEFT JOIN par_ok k ON k.rkey = a.rkey AND k.parent_span_id = a.parent_span_id AND k.attempt = a.attempt
          AND k.proc_key = a.proc_key AND k.trace_key IS NOT DISTINCT FROM a.trace_key
    WHERE a.tp_rank IS NULL OR a.tp_rank = r.crit_rank
), j AS (
    SELECT * FROM _handoff_join('ranked')
), pre0 AS (
    SELECT ranked.* REPLACE (
               -- rule 6: kv.ready runs from the transfer's end; then rule 10: a
               -- post-join stage starts no earlier than its last input existed
               CASE WHEN _post_join_stage(ranked.stage_group)
                    THEN least(greatest(CASE WHEN ranked.stage = 'kv.ready' AND j.xfer_end_ns < ranked.s0
                                             THEN greatest(j.xfer_end_ns, ranked.arrival_ns) ELSE ranked.s0 END,
                                        j.input_ns), ranked.e0)
                    ELSE ranked.s0 END AS s0),
           -- rule 10's cut (hidden behind the producer's chain)
           CASE WHEN _post_join_stage(ranked.stage_group) AND j.input_ns > ranked.s0
                THEN least(j.input_ns, ranked.e0) - ranked.s0 ELSE 0 END AS causal_clip_ns,
           j.join_ns,
           -- rule 7: P's work after the handoff started that is not the handoff
           coalesce(ranked.branch = 'prefill' AND NOT _post_join_stage(ranked.stage_group)
                    AND ranked.e0 > j.join_ns AND ranked.s0 < j.chain_end_ns, false) AS p_late,
           j.chain_end_ns, j.att_ns
    FROM ranked LEFT JOIN j ON j.rkey = ranked.rkey
), pre AS MATERIALIZED (
    SELECT pre0.* EXCLUDE (p_late, chain_end_ns, causal_clip_ns) REPLACE (
               CASE WHEN p_late THEN least(chain_end_ns, e0) ELSE s0 END AS s0),
           CASE WHEN p_late THEN least(chain_end_ns, e0) - s0 ELSE causal_clip_ns END AS clip_ns,
           coalesce(pre0.branch IN ('prefill', 'decode') AND NOT _post_join_stage(pre0.stage_group)
                    AND pre0.e0 <= pre0.join_ns AND pre0.s0 >= coalesce(pre0.att_ns, pre0.s0), false) AS is_pre
    FROM pre0
), br AS (
    SELECT rkey, arg_max(branch, (e0, branch = 'prefill')) AS crit_role FROM pre WHERE is_pre GROUP BY rkey
), b0 AS (
    SELECT p.rkey, min(p.s0) AS b0 FROM pre p JOIN br ON br.rkey = p.rkey AND p.branch = br.crit_role
    WHERE p.is_pre GROUP BY p.rkey
)
SELECT pre.rkey, pre.span_id, pre.parent_span_id, pre.stage, pre.category, pre.stage_group, pre.is_filler,
       pre.role, pre.engine_id, pre.tp_rank, pre.attempt, pre.s0, pre.e0, pre.arrival_ns, pre.clip_ns,
       NOT coalesce(pre.is_pre AND pre.branch <> br.crit_role AND pre.e0 > b0.b0, false) AS kept
FROM pre LEFT JOIN br ON br.rkey = pre.rkey LEFT JOIN b0 ON b0.rkey = pre.rkey;
CREATE TABLE IF NOT EXISTS _mat_tt_cand AS SELECT * FROM _calc_tt_cand LIMIT 0;
CREATE OR REPLACE VIEW _tt_cand AS SELECT * FROM _mat_tt_cand;

CREATE OR REPLACE VIEW _calc_tt_tree AS
SELECT c.*, p.span_id IS NOT NULL AS is_child, p.is_nested AS is_deep
FROM (SELECT * FROM _tt_cand WHERE kept) c
LEFT JOIN (
    SELECT k.rkey, k.span_id, pp.span_id IS NOT NULL AS is_nested
    FROM (SELECT * FROM _tt_cand WHERE kept) k
    LEFT JOIN (SELECT rkey, span_id FROM _tt_cand WHERE kept) pp
           ON pp.rkey = k.rkey AND pp.span_id = k.parent_span_id
) p ON p.rkey = c.rkey AND p.span_id = c.parent_span_id;
CREATE TABLE IF NOT EXISTS _mat_tt_tree AS SELECT * FROM _calc_tt_tree LIMIT 0;
CREATE OR REPLACE VIEW _tt_tree AS SELECT * FROM _mat_tt_tree;

-- Top-level owners: [s0, oe] with oe = min(e0, earliest start of stages ending later).
CREATE OR REPLACE VIEW _calc_tt_top AS
WITH top_level AS (SELECT * FROM _tt_tree WHERE NOT is_child AND NOT is_filler)
SELECT * RENAME (owned_end AS oe) FROM _latest_end_wins('top_level', rkey, s0, e0, span_id);
CREATE TABLE IF NOT EXISTS _mat_tt_top AS SELECT * FROM _calc_tt_top LIMIT 0;
CREATE OR REPLACE VIEW _tt_top AS SELECT * FROM _mat_tt_top;

-- Instants no top-level stage owns.
CREATE OR REPLACE VIEW _tt_gaps AS
WITH owners AS (SELECT rkey AS k, s0 AS s, oe AS e, arrival_ns AS lo, NULL AS label FROM _tt_top),
     windows AS (SELECT rkey AS k, arrival_ns AS lo, first_token_ns AS hi FROM _tt_req)
SELECT k AS rkey, gap_start AS gs, gap_end AS ge FROM _uncovered('owners', 'windows');

-- Waits own what they cover of the gaps (latest end wins among waits too).
CREATE OR REPLACE VIEW _tt_fill AS
WITH in_gaps AS (
    SELECT f.rkey, f.span_id, f.stage, f.stage_group, f.category, f.role, f.engine_id, f.tp_rank, f.attempt,
           greatest(g.gs, f.s0) AS fs, least(g.ge, f.e0) AS fe
    FROM _tt_gaps g JOIN (SELECT * FROM _tt_tree WHERE is_filler AND NOT is_child) f
      ON f.rkey = g.rkey AND f.s0 < g.ge AND f.e0 > g.gs
)
SELECT * RENAME (owned_end AS foe) FROM _latest_end_wins('in_gaps', rkey, fs, fe, span_id);

-- Children of owned top-level stages, flattened inside their parent's interval.
CREATE OR REPLACE VIEW _calc_tt_kids AS
WITH in_parent AS (
    SELECT k.rkey, k.span_id, k.stage, k.stage_group, k.category, k.role, k.engine_id, k.tp_rank, k.attempt,
           a.span_id AS parent_id, greatest(k.s0, a.s0) AS ks, least(k.e0, a.oe) AS ke
    FROM (SELECT * FROM _tt_tree WHERE is_child AND NOT coalesce(is_deep, false)) k
    JOIN _tt_top a ON a.rkey = k.rkey AND a.span_id = k.parent_span_id
    WHERE greatest(k.s0, a.s0) < least(k.e0, a.oe)
)
SELECT * RENAME (owned_end AS koe) FROM _latest_end_wins('in_parent', row(rkey, parent_id), ks, ke, span_id);
CREATE TABLE IF NOT EXISTS _mat_tt_kids AS SELECT * FROM _calc_tt_kids LIMIT 0;
CREATE OR REPLACE VIEW _tt_kids AS SELECT * FROM _mat_tt_kids;

-- A parent's own time: its interval minus its children's.
CREATE OR REPLACE VIEW _tt_parent_self AS
WITH kids AS (SELECT {'rkey': k.rkey, 'span_id': k.parent_id} AS k, k.ks AS s, k.koe AS e, a.s0 AS lo, NULL AS label
              FROM _tt_kids k JOIN _tt_top a ON a.rkey = k.rkey AND a.span_id = k.parent_id),
     parents AS (SELECT {'rkey': a.rkey, 'span_id': a.span_id} AS k, a.s0 AS lo, a.oe AS hi
                 FROM _tt_top a WHERE EXISTS (SELECT 1 FROM _tt_kids k WHERE k.rkey = a.rkey AND k.parent_id = a.span_id))
SELECT k.rkey AS rkey, k.span_id AS span_id, gap_start AS start_ns, gap_end AS end_ns FROM _uncovered('kids', 'parents');

CREATE OR REPLACE VIEW _calc_tt_owned AS
SELECT rkey, span_id, stage, stage_group, category, role, engine_id, tp_rank, attempt, s0 AS start_ns, oe AS end_ns
FROM _tt_top a WHERE NOT EXISTS (SELECT 1 FROM _tt_kids k WHERE k.rkey = a.rkey AND k.parent_id = a.span_id)
UNION ALL
SELECT rkey, span_id, stage, stage_group, category, role, engine_id, tp_rank, attempt, ks, koe FROM _tt_kids
UNION ALL
SELECT a.rkey, a.span_id, a.stage, a.stage_group, a.category, a.role, a.engine_id, a.tp_rank, a.attempt,
       p.start_ns, p.end_ns
FROM _tt_parent_self p JOIN _tt_top a ON a.rkey = p.rkey AND a.span_id = p.span_id
UNION ALL
SELECT rkey, span_id, stage, stage_group, category, role, engine_id, tp_rank, attempt, fs, foe FROM _tt_fill;
CREATE TABLE IF NOT EXISTS _mat_tt_owned AS SELECT * FROM _calc_tt_owned LIMIT 0;
CREATE OR REPLACE VIEW _tt_owned AS SELECT * FROM _mat_tt_owned;

-- Whatever nothing owns, named by its neighbours.
CREATE OR REPLACE VIEW _tt_unattributed AS
WITH owned AS (SELECT o.rkey AS k, o.start_ns AS s, o.end_ns AS e, q.arrival_ns AS lo, o.stage AS label
               FROM _tt_owned o JOIN _tt_req q ON q.rkey = o.rkey),
     windows AS (SELECT rkey AS k, arrival_ns AS lo, first_token_ns AS hi FROM _tt_req)
SELECT k AS rkey, gap_start AS start_ns, gap_end AS end_ns,
       'between ' || coalesce(prev_label, 'arrival') || ' and ' || coalesce(next_label, 'first token') AS detail
FROM _uncovered('owned', 'windows');

-- (the request's ids are joined after the numbering: strings in a window's rows slow its sort)
CREATE OR REPLACE VIEW _calc_ttft_segments AS
SELECT q.run_id, q.request_id, q.prompt_index, s.seq,
       s.stage, s.stage_group, s.category, s.start_ns, s.end_ns,
       s.end_ns - s.start_ns AS dur_ns, s.role, s.engine_id, s.tp_rank, s.attempt, s.span_id, s.detail, s.rkey
FROM (
    SELECT *, (row_number() OVER (PARTITION BY rkey ORDER BY start_ns, end_ns))::INTEGER AS seq
    FROM (
        SELECT rkey, stage, stage_group, category, start_ns, end_ns, role, engine_id, tp_rank, attempt, span_id,
               NULL::VARCHAR AS detail FROM _tt_owned
        UNION ALL
        SELECT rkey, 'unattributed'::_stage_name, 'unattributed'::_stage_name, 'coordination', start_ns, end_ns,
               NULL, NULL, NULL, NULL, NULL, detail
        FROM _tt_unattributed
    )
) s JOIN _tt_req q ON q.rkey = s.rkey;

CREATE TABLE IF NOT EXISTS _mat_ttft_segments AS SELECT * FROM _calc_ttft_segments LIMIT 0;
-- (stored as _stage_name; shown as text)
-- culprit_request_id / culprit_kind: module segment_culprits (joined at query time: another request's rows)
CREATE OR REPLACE VIEW _ttft_segments_all AS
SELECT m.* REPLACE (m.stage::VARCHAR AS stage, m.stage_group::VARCHAR AS stage_group),
       cu.culprit_request_id, cu.culprit_kind
FROM _mat_ttft_segments m LEFT JOIN _segment_culprits cu ON cu.rkey = m.rkey AND cu.span_id = m.span_id;
-- ttft_segments: the rows of _ttft_segments_all of the requests in the analysis's time window (all without one;
-- table _window_out, pdtrace.analysis.window)
CREATE OR REPLACE VIEW ttft_segments AS SELECT * FROM _ttft_segments_all WHERE rkey IS NULL OR rkey NOT IN (SELECT rkey FROM _window_out);

COMMENT ON VIEW ttft_segments IS 'Exclusive critical-path segments tiling each complete request''s [arrival, first token written] (DESIGN.md §2-3): the router''s window, or without a router record the engines'' (requests.ttft_source = engine; the router''s hop between the legs is stage router.unseen).';
COMMENT ON COLUMN ttft_segments.run_id IS 'deployment run id';
COMMENT ON COLUMN ttft_segments.request_id IS 'base request id X';
COMMENT ON COLUMN ttft_segments.prompt_index IS 'prompt index i (0 otherwise)';
COMMENT ON COLUMN ttft_segments.seq IS 'position of the segment in time order, from 1';
COMMENT ON COLUMN ttft_segments.stage IS 'leaf stage owning the segment, ''router.unseen'' (engine-clock window: the router''s hop, not recorded), or ''unattributed''';
COMMENT ON COLUMN ttft_segments.stage_group IS 'DESIGN.md §2 stage the leaf rolls up to (handoff.* -> handoff.prep)';
COMMENT ON COLUMN ttft_segments.category IS 'queue | compute | transfer | coordination (unattributed counts as coordination)';
COMMENT ON COLUMN ttft_segments.start_ns IS 'segment start on the corrected clock: the router''s, or (engine-clock window) the reference prefill engine''s (ns since the Unix epoch)';
COMMENT ON COLUMN ttft_segments.end_ns IS 'segment end on the corrected clock (ns since the Unix epoch)';
COMMENT ON COLUMN ttft_segments.dur_ns IS 'end_ns - start_ns (duration ns); the segments of a request sum to its TTFT';
COMMENT ON COLUMN ttft_segments.role IS 'role of the owning stage (NULL for unattributed)';
COMMENT ON COLUMN ttft_segments.engine_id IS 'engine of the owning stage (NULL for router stages and unattributed)';
COMMENT ON COLUMN ttft_segments.tp_rank IS 'rank of a per-rank stage: the slowest expected rank (NULL if not per-rank)';
COMMENT ON COLUMN ttft_segments.attempt IS 'attempt of the owning stage';
COMMENT ON COLUMN ttft_segments.span_id IS 'span that owns the segment (NULL for unattributed and router.unseen)';
COMMENT ON COLUMN ttft_segments.detail IS 'for unattributed: ''between <previous stage> and <next stage>''';
COMMENT ON COLUMN ttft_segments.rkey IS 'request join key (see spans.rkey)';
COMMENT ON COLUMN ttft_segments.culprit_request_id IS 'for a wait (prefill.queue, decode.queue, handoff.writer_queue): base request id X of the other request whose held resource it waited for, the one whose event ended the wait (module segment_culprits); NULL otherwise or when no other request ended it';
COMMENT ON COLUMN ttft_segments.culprit_kind IS 'what the culprit held: head_of_line (queued ahead in the same queue) | batch_slot (P: its prefill ended) | kv_blocks (D: its blocks were freed) | writer (P''s push writer busy with it); NULL with culprit_request_id';
