-- module: clock
-- requires: records
-- materialize: _clock_router_part file
-- materialize: _clock_engine_part file
-- materialize: _clock_event_part file
-- materialize: _clock_domain_part file
-- materialize: _clock_req_bounds changed
-- materialize: _clock_req_windows window
-- materialize: _clock_domain_map full
-- materialize: _clock_pair_est full
-- materialize: _domain_offsets full
--
-- Clock skew from causal pairs (DESIGN.md §3). A message sent at true time s
-- and received at true time r >= s, with clocks reading clock_X = true +
-- off_X, gives   off_dst - off_src <= recv_raw - sent_raw.   Messages in both
-- directions between two clocks bound d = off_b - off_a from both sides; a
-- handshake-style sample gives d = offset +- rtt/2 directly. Per clock pair and
-- window, from the direct evidence (_clock_pair_est):
--     lower = max(lower bounds), upper = min(upper bounds)
--     offset = clamp(best sample (lowest rtt), lower, upper)   if a sample exists
--            = clamp(0, lower, upper)                           otherwise
--              (the least correction that makes every observed order possible)
--     bound  = max(offset - lower, upper - offset)
--     if lower > upper (inconsistent: drift or a bad sample): offset = the
--     midpoint, bound = half the overlap, consistent = false.
-- Combining evidence across clocks (each domain's offset to the router, and
-- engine pair rows through the router): every piece of evidence is an interval
-- the true offset lies in (a causal pair: one side; a sample: point +- rtt/2,
-- valid for any split of the round trip); intervals combine by intersection.
-- A sample's point picks the estimate only when it lies inside the combined
-- interval and either is tighter than the other evidence or that evidence
-- excludes 0 (macro _clock_point_usable); otherwise the offset is
-- clamp(0, lower, upper): when the router<->engine round trips contain 0 (same
-- host, no skew) it is 0 +- bound, whatever a wider sample says.
-- Clock domains: the router is 'router', an engine is its engine_id (all its
-- processes share the host clock; the API server's rows carry it too, or are
-- mapped to it by _clock_domain_map). Every time is corrected to the router's
-- clock: corrected = raw - offset(domain); the router's offset is 0. Without
-- any router evidence (engine-clock windows), to the reference prefill
-- engine's clock instead (_clock_root): the same rules with that engine in
-- the router's place.

CREATE OR REPLACE MACRO _clamp(v, lo, hi) AS least(greatest(v, coalesce(lo, v)), coalesce(hi, v));
CREATE OR REPLACE MACRO _clock_estimate(lo, hi, point) AS
    CASE WHEN lo > hi THEN (lo + hi) // 2 ELSE _clamp(coalesce(point, 0), lo, hi) END;
CREATE OR REPLACE MACRO _clock_bound(lo, hi, est) AS
    CASE WHEN lo IS NULL OR hi IS NULL THEN NULL
         WHEN lo > hi THEN (lo - hi + 1) // 2
         ELSE greatest(est - lo, hi - est) END;

-- Whether a sample's point (from evidence of width point_width) picks the
-- estimate inside the combined interval [lo, hi], given the interval of the
-- evidence without a point [plain_lo, plain_hi] (NULL: unbounded side). A point
-- outside [lo, hi] proves its round trip was split unevenly, so it says nothing
-- about where inside the interval the offset is. A point inside is used unless
-- the point-less evidence admits 0 (no skew) and the sample is not tighter than
-- it: then the least correction, clamp(0, lo, hi), stands.
CREATE OR REPLACE MACRO _clock_point_usable(point, point_width, lo, hi, plain_lo, plain_hi) AS
    point IS NOT NULL
    AND point >= coalesce(lo, point) AND point <= coalesce(hi, point)
    AND (point_width < coalesce(plain_hi - plain_lo, 9223372036854775807)
         OR NOT (coalesce(plain_lo, 0) <= 0 AND coalesce(plain_hi, 0) >= 0));

-- The evidence, per store file (materialize kind 'file'): what each file's own
-- rows say, as partial aggregates that merge across files (min/max: a
-- request's rows may span a file rotation, and a record duplicated in two
-- files gives the same values twice), plus the single-row evidence with its
-- record_id (duplicate copies are skipped where it is used). A refresh reads
-- only the new files; everything below merges the parts.
-- Router and engine marks are kept per attempt (spans.attempt): a message pairs
-- a send and a receive of the same attempt only (see _clock_request_msgs).
-- disp_*_id_lo/hi: the smallest and largest record id of the attempt's
-- dispatches of a leg (equal: exactly one dispatch; merges across files, and a
-- duplicated record counts once).
-- Stages whose start can be another process's instant (DESIGN.md §3 "Clock
-- skew": evidence is a causal pair of messages between two clocks, so an
-- engine's receipt of its leg is the first start it stamped itself):
--   dest.register (P's row)  starts at D's block allocation (D's wall time from
--                            the registration payload, connector/traced/push.py)
--   handoff.prep, handoff.writer_queue, handoff.descriptors on P (push) start at
--                            max(KV ready, registration arrived), and the arrival
--                            can be D's send time (reg_arrival: D's wall clock)
-- They are never taken as the engine's receipt (_calc_clock_engine_part.first_start).
-- Events are never receipts either (first_start reads spans only).
CREATE OR REPLACE MACRO _clock_peer_stamped(role, name) AS
    name = 'dest.register'
    OR (role = 'prefill' AND name IN ('handoff.prep', 'handoff.writer_queue', 'handoff.descriptors'));

CREATE OR REPLACE VIEW _calc_clock_router_part AS
SELECT _file, rkey, attempt,
       min(end_ns) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'prefill') AS disp_p_end,
       min(end_ns) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'decode') AS disp_d_end,
       min(start_ns) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'decode') AS disp_d_start,
       -- P's response received (pdtrace's router: its router.wait on the prefill leg; not one cut short)
       min(end_ns) FILTER (WHERE name = 'router.wait' AND attr_str['router.leg'] = 'prefill'
                           AND coalesce(status_code, 0) <> 2) AS wait_p_end,
       min(record_id) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'prefill') AS disp_p_id_lo,
       max(record_id) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'prefill') AS disp_p_id_hi,
       min(record_id) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'decode') AS disp_d_id_lo,
       max(record_id) FILTER (WHERE name = 'router.dispatch' AND attr_str['router.leg'] = 'decode') AS disp_d_id_hi,
       min(start_ns) FILTER (WHERE name = 'router.first_token') AS first_token_ns,
       min(attr_str['request.mode']) FILTER (WHERE name = 'router.request') AS mode,
       any_value(domain) AS router_domain
FROM _file_rows
WHERE role = 'router' AND rkey IS NOT NULL AND record IN ('span', 'event')
GROUP BY _file, rkey, attempt;
CREATE TABLE IF NOT EXISTS _mat_clock_router_part AS SELECT * FROM _calc_clock_router_part LIMIT 0;

CREATE OR REPLACE VIEW _calc_clock_engine_part AS
SELECT _file, rkey, domain, role, attempt,
       -- the engine's receipt of its leg: its first own-stamped span start (_clock_peer_stamped)
       min(start_ns) FILTER (WHERE record = 'span' AND NOT _clock_peer_stamped(role, name)) AS first_start,
       max(end_ns) FILTER (WHERE record = 'span' AND name = 'prefill.compute') AS compute_end,
       max(end_ns) FILTER (WHERE record = 'span' AND name = 'decode.first_step') AS first_step_end,
       -- an API-server domain (rows without engine_id): mapped to its engine by _clock_domain_map
       bool_or(engine_id IS NULL) FILTER (WHERE record = 'span') AS api_domain,
       -- marks of the engine-only messages (requests without a router row; _clock_request_msgs)
       min(start_ns) FILTER (WHERE record = 'span' AND name IN ('prefill.frontend', 'decode.frontend')
                             AND coalesce(attr_str['frontend.part'], 'whole') IN ('in', 'whole')) AS fe_in_start,
       -- P's API server handed its response's first body chunk to the server (its `token` event on
       -- prefill.frontend; the span's own end comes after the app returns, late under load)
       min(start_ns) FILTER (WHERE record = 'event' AND name = 'token' AND span_id IS NOT NULL) AS fe_out_end,
       min(start_ns) FILTER (WHERE record = 'span' AND name = 'kv.transfer') AS post_start,
       max(end_ns) FILTER (WHERE record = 'span' AND name = 'kv.ready') AS ready_end,
       min(start_ns) FILTER (WHERE record = 'event' AND name = 'notification.received') AS notif_recv,
       bool_or(connector ILIKE '%push%' OR name IN ('dest.register', 'registration.received')) AS push_seen,
       bool_or(connector ILIKE '%nixl%') AS nixl_seen
FROM _file_rows
WHERE record IN ('span', 'event') AND role IN ('prefill', 'decode') AND rkey IS NOT NULL
GROUP BY _file, rkey, domain, role, attempt;
CREATE TABLE IF NOT EXISTS _mat_clock_engine_part AS SELECT * FROM _calc_clock_engine_part LIMIT 0;

-- registration/notification receipts, clock samples and (wall, monotonic) anchors
CREATE OR REPLACE VIEW _calc_clock_event_part AS
SELECT _file, record_id, record, name, domain, start_ns,
       attr_str['clock.peer_engine_id'] AS clock_peer, attr_str['peer.engine_id'] AS peer,
       attr_int['clock.send_ns'] AS send_ns, attr_int['clock.offset_ns'] AS sample_offset_ns,
       coalesce(attr_int['clock.rtt_ns'], attr_int['clock.rtt_bound_ns'], 0) AS sample_rtt_ns,
       coalesce(attr_str['clock.domain'], 'wall') AS sample_clock, attr_int['clock.mono_ns'] AS mono_ns
FROM _file_rows
WHERE (record = 'event' AND name IN ('registration.received', 'notification.received')
       AND attr_int['clock.send_ns'] IS NOT NULL)
   OR (record = 'event' AND name = 'clock.sample' AND attr_int['clock.offset_ns'] IS NOT NULL)
   OR (record = 'clock' AND attr_int['clock.mono_ns'] IS NOT NULL);
CREATE TABLE IF NOT EXISTS _mat_clock_event_part AS SELECT * FROM _calc_clock_event_part LIMIT 0;
CREATE OR REPLACE VIEW _clock_event_rows AS
SELECT * FROM _mat_clock_event_part e
WHERE NOT _hidden_copy(e.record_id, e._file);

-- engines per (role, host, run) and whether API-server rows without engine_id were seen
CREATE OR REPLACE VIEW _calc_clock_domain_part AS
SELECT _file, role, host, run_id,
       list(DISTINCT engine_id) FILTER (WHERE engine_id IS NOT NULL) AS engines,
       bool_or(engine_id IS NULL) AS api_rows
FROM _file_rows
WHERE role IN ('prefill', 'decode')
GROUP BY _file, role, host, run_id;
CREATE TABLE IF NOT EXISTS _mat_clock_domain_part AS SELECT * FROM _calc_clock_domain_part LIMIT 0;

-- API-server rows without engine_id (records.sql: domain _api_clock_domain(role,
-- host, run)) are on their engine's host clock: they take the engine's domain
-- when exactly one engine of that role recorded on that host in that run;
-- otherwise clock_domain is NULL (unresolved, listed in clock_domains).
CREATE OR REPLACE VIEW _calc_clock_domain_map AS
SELECT _api_clock_domain(role, host, run_id) AS domain,
       CASE WHEN len(engines) = 1 THEN engines[1] END AS clock_domain,
       len(engines)::BIGINT AS engines
FROM (SELECT role, host, run_id, list_distinct(flatten(list(engines))) AS engines, bool_or(api_rows) AS api_rows
      FROM _mat_clock_domain_part GROUP BY role, host, run_id)
WHERE api_rows;

CREATE TABLE IF NOT EXISTS _mat_clock_domain_map AS SELECT * FROM _calc_clock_domain_map LIMIT 0;
CREATE OR REPLACE VIEW _clock_domain_map AS SELECT * FROM _mat_clock_domain_map;

-- Per clock domain: wall minus monotonic from its processes' (wall, monotonic)
-- anchor rows (record 'clock'), the median over all anchors (ns). Exact in
-- integers: median() of BIGINT goes through DOUBLE (53 bits; an epoch-ns value
-- ~1.7e18 would lose up to 128 ns), so the median is taken of the differences
-- from the domain's smallest value (small, exact in DOUBLE) and added back;
-- an even count gives the two middle values' mean rounded down (ns).
CREATE OR REPLACE VIEW _clock_anchors AS
WITH a AS (
    SELECT domain, d, min(d) OVER (PARTITION BY domain) AS d0
    FROM (SELECT domain, start_ns - mono_ns AS d FROM _clock_event_rows WHERE record = 'clock')
)
SELECT domain, any_value(d0) + floor(median(d - d0))::BIGINT AS wall_minus_mono, count(*) AS anchors
FROM a
GROUP BY domain;

-- The router<->engine messages of the requests listed in the table or view
-- named `keys` (column rkey), one row per message: sent on src's clock,
-- received on dst's (raw ns), from the router and engine marks merged over the
-- request's files. An API-server domain is merged into its engine's
-- (_clock_domain_map); other domains are unchanged by the map.
-- Attempts (DESIGN.md §3 "Attempt"): a message pairs a send and a receive of
-- the same attempt and the same engine pair only. Marks are taken per
-- dispatch attempt: the router's attempts (without router rows, the prefill
-- engines'); an engine attempt the router never dispatched (D's or P's local
-- recompute after a preemption or failed load) continues the latest dispatch
-- attempt at or below it. Within a dispatch attempt a leg's messages are used
-- only when exactly one engine of that role has rows (else the send's
-- receiver is unknown: a retry to another engine that the engines did not
-- number) and, for the router's send, exactly one dispatch of the leg; the
-- first token is paired with the router's latest attempt only (the one that
-- delivered it). Pairing an attempt-0 receive with an attempt-1 send, or one
-- engine's receive with the send to another, gave multi-second fake offsets
-- (tests/analysis/test_attempt_cases.py).
-- A request without any router row (engine-clock window) gives P<->D
-- messages instead, each a causal order the handoff itself imposes:
--   frontend_hop (pull) P's API server handed its response to the server
--                (its `token` event: the first body chunk) before D's API
--                server received the request (decode.frontend 'in'/'whole'
--                start): any pull router needs P's kv_transfer_params before
--                it sends D's leg. (Not prefill.frontend's end: it is taken
--                after the app returns, which under load is after the router
--                already has the response and D runs -- seen 22 ms.)
--   read_done (pull)    D posted its READ (kv.transfer start) before P received
--                       D's notification (notification.received on P)
--   write_done (push)   P posted its WRITE (kv.transfer start on P) before D's
--                       kv.ready ended (D promotes only after the write-done
--                       notifications)
-- Requests with a router row never give these (their router<->engine
-- messages bound both engines already).
CREATE OR REPLACE MACRO _clock_request_msgs(keys) AS TABLE
WITH r AS (
    -- the router's marks per attempt; one_p / one_d: exactly one dispatch of the leg in the attempt
    SELECT rkey, attempt, min(disp_p_end) AS disp_p_end, min(disp_d_end) AS disp_d_end,
           min(disp_d_start) AS disp_d_start, min(wait_p_end) AS wait_p_end,
           min(disp_p_id_lo) = max(disp_p_id_hi) AS one_p, min(disp_d_id_lo) = max(disp_d_id_hi) AS one_d,
           min(disp_p_id_lo) IS NOT NULL AS has_p, min(disp_d_id_lo) IS NOT NULL AS has_d,
           min(first_token_ns) AS first_token_ns, any_value(mode) AS mode, any_value(router_domain) AS router_domain
    FROM _mat_clock_router_part
    WHERE rkey IN (SELECT rkey FROM query_table(keys))
    GROUP BY rkey, attempt
), rq AS (
    -- per request: the first token belongs to the router's latest attempt (the one that delivered it)
    SELECT rkey, max(attempt) AS last_attempt, min(first_token_ns) AS first_token_ns,
           any_value(mode) AS mode, any_value(router_domain) AS router_domain
    FROM r GROUP BY rkey
), e0 AS (
    SELECT p.rkey, p.attempt, coalesce(m.clock_domain, p.domain) AS domain, p.role,
           min(p.first_start) AS first_start, max(p.compute_end) AS compute_end,
           max(p.first_step_end) AS first_step_end,
           min(p.fe_in_start) AS fe_in_start, max(p.fe_out_end) AS fe_out_end, min(p.post_start) AS post_start,
           max(p.ready_end) AS ready_end, min(p.notif_recv) AS notif_recv,
           bool_or(p.push_seen) AS push_seen, bool_or(p.nixl_seen) AS nixl_seen
    FROM _mat_clock_engine_part p LEFT JOIN _clock_domain_map m ON m.domain = p.domain
    WHERE p.rkey IN (SELECT rkey FROM query_table(keys))
    GROUP BY p.rkey, p.attempt, coalesce(m.clock_domain, p.domain), p.role
), ma AS (
    -- the requests with an attempt other than 0 (a retry, a local recompute): the only ones whose
    -- engine attempts are mapped to dispatch attempts (e1) and whose legs are checked (leg_ok).
    -- In any other request every attempt is 0: e1 would map each e0 row to itself (ra = 0) and its
    -- group in e is that row alone, and leg_ok's check is e's own n_dom = 1 (pairs).
    SELECT rkey FROM r WHERE attempt <> 0
    UNION
    SELECT rkey FROM e0 WHERE attempt <> 0
), da AS (
    -- dispatch attempts: the router's; without router rows, the prefill engines'
    SELECT DISTINCT rkey, attempt FROM r
    UNION
    SELECT DISTINCT rkey, attempt FROM e0 WHERE role = 'prefill' AND rkey NOT IN (SELECT rkey FROM rq)
), e1 AS (
    -- an engine attempt the router never dispatched (a local recompute) continues the latest dispatch attempt before it
    -- (attempt 0 maps to 0 whatever the dispatch attempts: only the few later attempts are joined)
    SELECT *, 0 AS ra FROM e0 WHERE attempt = 0 AND rkey IN (SELECT rkey FROM ma)
    UNION ALL
    SELECT e0.*, coalesce(da.attempt, e0.attempt) AS ra
    FROM (SELECT * FROM e0 WHERE attempt <> 0) e0 ASOF LEFT JOIN da ON da.rkey = e0.rkey AND e0.attempt >= da.attempt
), e AS (
    -- n_dom: engines of the role in the dispatch attempt (more than one: the receiver of a send is unknown)
    SELECT *, count(*) OVER (PARTITION BY rkey, ra, role) AS n_dom FROM (
        SELECT rkey, attempt AS ra, domain, role, first_start, compute_end, first_step_end, fe_in_start,
               fe_out_end, post_start, ready_end, notif_recv, push_seen, nixl_seen
        FROM e0 WHERE rkey NOT IN (SELECT rkey FROM ma)
        UNION ALL
        SELECT rkey, ra, domain, role,
               min(first_start) AS first_start, max(compute_end) AS compute_end, max(first_step_end) AS first_step_end,
               min(fe_in_start) AS fe_in_start, max(fe_out_end) AS fe_out_end, min(post_start) AS post_start,
               max(ready_end) AS ready_end, min(notif_recv) AS notif_recv,
               bool_or(push_seen) AS push_seen, bool_or(nixl_seen) AS nixl_seen
        FROM e1 GROUP BY rkey, ra, domain, role)
), leg_ok AS (
    -- every router attempt that dispatched a leg has exactly one engine of that role: else the
    -- engines did not number the router's attempts (a retry merged into their attempt 0) and
    -- none of the request's messages of that role is used (requests in ma only, see there)
    SELECT a.rkey, a.role, bool_and(coalesce(e.n_dom, 0) = 1) AS ok
    FROM (SELECT rkey, attempt, 'prefill' AS role FROM r WHERE has_p AND rkey IN (SELECT rkey FROM ma)
          UNION ALL SELECT rkey, attempt, 'decode' FROM r WHERE has_d AND rkey IN (SELECT rkey FROM ma)) a
    LEFT JOIN e ON e.rkey = a.rkey AND e.ra = a.attempt AND e.role = a.role
    GROUP BY a.rkey, a.role
), pairs AS MATERIALIZED (
    SELECT e.*, rq.mode, rq.router_domain,
           CASE WHEN e.ra = rq.last_attempt THEN rq.first_token_ns END AS first_token_ns,
           CASE WHEN r.one_p THEN r.disp_p_end END AS disp_p_end,
           CASE WHEN r.one_p THEN r.wait_p_end END AS wait_p_end,
           CASE WHEN r.one_d THEN r.disp_d_end END AS disp_d_end,
           CASE WHEN coalesce(r.one_p, true) THEN r.disp_d_start END AS disp_d_start
    FROM e JOIN rq ON rq.rkey = e.rkey
    LEFT JOIN r ON r.rkey = e.rkey AND r.attempt = e.ra
    LEFT JOIN leg_ok o ON o.rkey = e.rkey AND o.role = e.role
    WHERE e.n_dom = 1 AND coalesce(o.ok, true)
), eo AS MATERIALIZED (
    -- engine-only requests: the P and the D engine of one dispatch attempt (one of each)
    SELECT p.rkey, p.domain AS p_dom, d.domain AS d_dom,
           NOT coalesce(p.push_seen OR d.push_seen, false) AND coalesce(p.nixl_seen OR d.nixl_seen, false) AS pull,
           coalesce(p.push_seen OR d.push_seen, false) AS push,
           p.fe_out_end AS p_fe_out_end, d.fe_in_start AS d_fe_in_start, d.post_start AS d_post_start,
           p.notif_recv AS p_notif_recv, p.post_start AS p_post_start, d.ready_end AS d_ready_end
    FROM e p JOIN e d ON d.rkey = p.rkey AND d.ra = p.ra AND p.role = 'prefill' AND d.role = 'decode'
    WHERE p.rkey NOT IN (SELECT rkey FROM rq) AND p.n_dom = 1 AND d.n_dom = 1
)
-- router -> engine: an engine cannot start a request before the router sent it
-- (receipt: the engine's first own-stamped span start, _clock_peer_stamped)
SELECT rkey, router_domain AS src, domain AS dst,
       CASE role WHEN 'prefill' THEN disp_p_end ELSE disp_d_end END AS sent_ns,
       first_start AS recv_ns, 'http_request' AS kind, NULL::BIGINT AS point_ns, NULL::BIGINT AS rtt_ns
FROM pairs
UNION ALL
-- prefill -> router: the earliest of three instants that each come after P's
-- last prefill.compute ended: the router's receipt of P's response (router.wait
-- on the prefill leg: P answers only after computing), pull's dispatch of D (only
-- after P's response), and the first token written to the client (P's KV is
-- computed first). In push the first token alone is loose: transfer, D's first
-- step and the stream on top (in a CI run on 2 loaded cores, 2026-12-07, it left
-- the router <-> P bound at 79 ms); P's response can also come after the first
-- token (P's API server stalled), so the earliest is taken, not the first present.
SELECT rkey, domain, router_domain, compute_end,
       least(wait_p_end, CASE WHEN mode = 'pull' THEN least(disp_d_start, first_token_ns) ELSE first_token_ns END),
       'http_response', NULL, NULL
FROM pairs WHERE role = 'prefill'
UNION ALL
-- decode -> router: the first token is sampled on D before the router writes it
SELECT rkey, domain, router_domain, first_step_end, first_token_ns, 'http_response', NULL, NULL
FROM pairs WHERE role = 'decode'
UNION ALL
-- engine-only requests (see above)
SELECT rkey, p_dom, d_dom, p_fe_out_end, d_fe_in_start, 'frontend_hop', NULL, NULL FROM eo WHERE pull
UNION ALL
SELECT rkey, d_dom, p_dom, d_post_start, p_notif_recv, 'read_done', NULL, NULL FROM eo WHERE pull
UNION ALL
SELECT rkey, p_dom, d_dom, p_post_start, d_ready_end, 'write_done', NULL, NULL FROM eo WHERE push;

-- Bounds on off(clock_b) - off(clock_a) from the messages in the table or view
-- named `msgs` (columns of _clock_request_msgs); the router always sorts first.
CREATE OR REPLACE MACRO _clock_bounds_of(msgs) AS TABLE
WITH m AS (
    SELECT *, (CASE WHEN src = 'router' THEN '' ELSE src END) > (CASE WHEN dst = 'router' THEN '' ELSE dst END) AS flip
    FROM query_table(msgs)
    WHERE src IS NOT NULL AND dst IS NOT NULL AND src <> dst AND recv_ns IS NOT NULL
      AND (kind = 'clock.sample' OR sent_ns IS NOT NULL)
)
SELECT rkey,
       CASE WHEN flip THEN dst ELSE src END AS clock_a,
       CASE WHEN flip THEN src ELSE dst END AS clock_b,
       recv_ns // _clock_window_ns() AS window_idx,
       kind,
       CASE WHEN kind = 'clock.sample' THEN (CASE WHEN flip THEN -point_ns ELSE point_ns END) - rtt_ns // 2
            WHEN flip THEN sent_ns - recv_ns END AS lower_ns,
       CASE WHEN kind = 'clock.sample' THEN (CASE WHEN flip THEN -point_ns ELSE point_ns END) + rtt_ns // 2
            WHEN NOT flip THEN recv_ns - sent_ns END AS upper_ns,
       CASE WHEN kind = 'clock.sample' THEN (CASE WHEN flip THEN -point_ns ELSE point_ns END) END AS point_ns,
       rtt_ns
FROM m;

-- Requests with engine rows in an API-server domain (rows without engine_id,
-- from an older middleware): their engine marks merge through the domain map,
-- which any refresh may change, so their messages are derived on each refresh
-- (_clock_msgs). Every other request's bounds are kept per request
-- (_clock_req_bounds, materialize kind 'changed': recomputed only when the
-- request's rows change).
CREATE OR REPLACE VIEW _clock_api_keys AS
SELECT DISTINCT rkey FROM _mat_clock_engine_part WHERE api_domain;
CREATE OR REPLACE VIEW _clock_changed_plain_keys AS
SELECT rkey FROM _changed_keys WHERE rkey NOT IN (SELECT rkey FROM _clock_api_keys);
CREATE OR REPLACE VIEW _clock_changed_msgs AS SELECT * FROM _clock_request_msgs('_clock_changed_plain_keys');
CREATE OR REPLACE VIEW _calc_clock_req_bounds AS SELECT * FROM _clock_bounds_of('_clock_changed_msgs');
CREATE TABLE IF NOT EXISTS _mat_clock_req_bounds AS SELECT * FROM _calc_clock_req_bounds LIMIT 0;

-- The kept bounds rolled up per clock pair, window and kind (materialize kind
-- 'window': recomputed only for the windows whose kept bounds changed):
-- lower_ns = the largest lower bound, upper_ns = the smallest upper bound
-- (duration ns, NULL when no bound has that side), n = bounds (count).
CREATE OR REPLACE VIEW _calc_clock_req_windows AS
SELECT clock_a, clock_b, window_idx, kind, max(lower_ns) AS lower_ns, min(upper_ns) AS upper_ns, count(*) AS n
FROM _mat_clock_req_bounds
WHERE window_idx IN (SELECT window_idx FROM _changed_windows)
GROUP BY clock_a, clock_b, window_idx, kind;
CREATE TABLE IF NOT EXISTS _mat_clock_req_windows AS SELECT * FROM _calc_clock_req_windows LIMIT 0;

-- The messages derived on each refresh: API-server-domain requests', the
-- engine<->engine messages and the samples (rkey NULL for the last two).
CREATE OR REPLACE VIEW _clock_msgs AS
SELECT * FROM _clock_request_msgs('_clock_api_keys')
UNION ALL
-- engine <-> engine messages carrying the sender's send time (registration, notifications)
SELECT NULL::UBIGINT, coalesce(clock_peer, peer), domain, send_ns, start_ns, name, NULL, NULL
FROM _clock_event_rows
WHERE record = 'event' AND name IN ('registration.received', 'notification.received')
UNION ALL
-- samples (e.g. the NIXL handshake's lowest-RTT estimate): peer clock minus own
-- clock, +- rtt/2. A sample between monotonic clocks (clock.domain =
-- 'monotonic') is converted through both domains' anchors:
--     wall offset = mono offset + (wall - mono)(peer) - (wall - mono)(own)
SELECT NULL::UBIGINT, s.domain, s.peer, NULL, s.start_ns, 'clock.sample',
       CASE WHEN s.cdomain = 'monotonic' THEN s.off + pa.wall_minus_mono - sa.wall_minus_mono ELSE s.off END,
       s.rtt
FROM (SELECT domain, clock_peer AS peer, start_ns, sample_offset_ns AS off, sample_rtt_ns AS rtt,
             sample_clock AS cdomain
      FROM _clock_event_rows
      WHERE record = 'event' AND name = 'clock.sample') s
LEFT JOIN _clock_anchors sa ON sa.domain = s.domain
LEFT JOIN _clock_anchors pa ON pa.domain = s.peer
WHERE s.cdomain <> 'monotonic' OR (sa.wall_minus_mono IS NOT NULL AND pa.wall_minus_mono IS NOT NULL);

-- Every bound: the kept per-request ones and those derived on this refresh.
CREATE OR REPLACE VIEW _clock_bounds AS
SELECT * EXCLUDE (rkey) FROM _mat_clock_req_bounds
UNION ALL
SELECT * EXCLUDE (rkey) FROM _clock_bounds_of('_clock_msgs');

-- Per clock pair: one row per window, plus one (window_idx NULL) for the whole
-- trace, from the kept bounds' roll-ups (each stands for n bounds of one kind:
-- max/min/count merge exactly) and the bounds derived on this refresh.
CREATE OR REPLACE VIEW _calc_clock_pair_est AS
WITH ev AS (
    SELECT clock_a, clock_b, window_idx, kind, lower_ns, upper_ns, NULL::BIGINT AS point_ns, NULL::BIGINT AS rtt_ns, n
    FROM _mat_clock_req_windows
    UNION ALL
    SELECT clock_a, clock_b, window_idx, kind, lower_ns, upper_ns, point_ns, rtt_ns, 1
    FROM _clock_bounds_of('_clock_msgs')
), agg AS (
    SELECT clock_a, clock_b, window_idx,
           max(lower_ns) AS lo, min(upper_ns) AS hi,
           arg_min(point_ns, rtt_ns) FILTER (WHERE point_ns IS NOT NULL) AS point,
           -- the messages alone, and the best sample's own interval (point +- rtt/2)
           max(lower_ns) FILTER (WHERE kind <> 'clock.sample') AS msg_lo,
           min(upper_ns) FILTER (WHERE kind <> 'clock.sample') AS msg_hi,
           arg_min(lower_ns, rtt_ns) FILTER (WHERE point_ns IS NOT NULL) AS sample_lo,
           arg_min(upper_ns, rtt_ns) FILTER (WHERE point_ns IS NOT NULL) AS sample_hi,
           coalesce(sum(n) FILTER (WHERE kind <> 'clock.sample'), 0)::BIGINT AS messages,
           coalesce(sum(n) FILTER (WHERE kind = 'clock.sample'), 0)::BIGINT AS samples,
           string_agg(DISTINCT kind, ',' ORDER BY kind) AS sources
    FROM ev
    GROUP BY GROUPING SETS ((clock_a, clock_b, window_idx), (clock_a, clock_b))
)
SELECT *, _clock_estimate(lo, hi, point) AS est,
       _clock_bound(lo, hi, _clock_estimate(lo, hi, point)) AS bound
FROM agg;

CREATE TABLE IF NOT EXISTS _mat_clock_pair_est AS SELECT * FROM _calc_clock_pair_est LIMIT 0;
CREATE OR REPLACE VIEW _clock_pair_est AS SELECT * FROM _mat_clock_pair_est;

-- Offset of each clock domain relative to the router, per window and overall
-- (window_idx NULL): intersect the direct router<->X bounds with one-hop
-- bounds router<->Y<->X (a one-hop candidate's point: X's sample from Y plus
-- Y's estimate); the point of the tightest candidate that has one is used when
-- _clock_point_usable, else clamp(0, lower, upper).
CREATE OR REPLACE VIEW _clock_dir AS
SELECT clock_a AS a, clock_b AS b, window_idx, lo, hi, point, est, msg_lo, msg_hi, sample_lo, sample_hi
FROM _clock_pair_est
UNION ALL
SELECT clock_b, clock_a, window_idx, -hi, -lo, -point, -est, -msg_hi, -msg_lo, -sample_hi, -sample_lo
FROM _clock_pair_est;

-- The reference clock every time is corrected to (one row, column domain):
-- the router's when any router<->engine evidence exists, else (engine-clock
-- windows only: a router that writes no spans; DESIGN.md §3 TTFT source) the
-- prefill engine with the smallest id among the engines with evidence, so
-- that P and D are still corrected against each other from the engine pair
-- evidence (registrations, notifications, handshake samples, and the
-- engine-only messages of _clock_request_msgs). Engines not linked to the
-- reference by evidence (directly or through one engine) keep offset 0.
CREATE OR REPLACE VIEW _clock_root AS
SELECT coalesce(
    (SELECT 'router' WHERE EXISTS (SELECT 1 FROM _clock_pair_est WHERE clock_a = 'router')),
    (SELECT min(d) FROM (SELECT unnest(engines) AS d FROM _mat_clock_domain_part WHERE role = 'prefill')
     WHERE d IN (SELECT clock_a FROM _clock_pair_est UNION SELECT clock_b FROM _clock_pair_est)),
    'router') AS domain;

CREATE OR REPLACE VIEW _calc_domain_offsets AS
WITH root AS (
    SELECT domain AS r FROM _clock_root
), hop AS (
    SELECT y.b, y.window_idx, r.lo AS r_lo, r.hi AS r_hi, r.est AS r_est,
           y.msg_lo, y.msg_hi, y.sample_lo, y.sample_hi, y.point
    FROM _clock_dir r JOIN _clock_dir y
      ON r.a = (SELECT r FROM root) AND y.a = r.b AND y.b <> (SELECT r FROM root)
     AND r.window_idx IS NOT DISTINCT FROM y.window_idx
), cand AS (
    SELECT b AS domain, window_idx, lo, hi, point FROM _clock_dir WHERE a = (SELECT r FROM root)
    UNION ALL
    -- one hop through Y: Y's router bounds plus Y<->X's messages (no point), and
    -- plus Y<->X's best sample (its point added to Y's estimate), judged apart
    SELECT h.b, h.window_idx, h.r_lo + h.msg_lo, h.r_hi + h.msg_hi, NULL
    FROM hop h WHERE h.msg_lo IS NOT NULL OR h.msg_hi IS NOT NULL
    UNION ALL
    SELECT h.b, h.window_idx, h.r_lo + h.sample_lo, h.r_hi + h.sample_hi, h.r_est + h.point
    FROM hop h WHERE h.point IS NOT NULL
), agg AS (
    SELECT domain, window_idx, max(lo) AS lo, min(hi) AS hi,
           max(lo) FILTER (WHERE point IS NULL) AS plain_lo, min(hi) FILTER (WHERE point IS NULL) AS plain_hi,
           arg_min(point, coalesce(hi - lo, 9223372036854775807)) FILTER (WHERE point IS NOT NULL) AS point,
           min(coalesce(hi - lo, 9223372036854775807)) FILTER (WHERE point IS NOT NULL) AS point_width
    FROM cand GROUP BY domain, window_idx
), pick AS (
    SELECT domain, window_idx, lo, hi,
           CASE WHEN _clock_point_usable(point, point_width, lo, hi, plain_lo, plain_hi) THEN point END AS point
    FROM agg
), solved AS (
    SELECT domain, window_idx, _clock_estimate(lo, hi, point) AS offset_ns,
           _clock_bound(lo, hi, _clock_estimate(lo, hi, point)) AS bound_ns
    FROM pick
)
SELECT * FROM solved
UNION ALL
-- API-server domains mapped to their engine take the engine's offsets
SELECT m.domain, s.window_idx, s.offset_ns, s.bound_ns
FROM _clock_domain_map m JOIN solved s ON s.domain = m.clock_domain
UNION ALL
SELECT 'router', NULL, 0, 0
UNION ALL
-- an engine as the reference (no router evidence): offset 0 by definition
SELECT r, NULL, 0, 0 FROM root WHERE r <> 'router';

CREATE TABLE IF NOT EXISTS _mat_domain_offsets AS SELECT * FROM _calc_domain_offsets LIMIT 0;
CREATE OR REPLACE VIEW _domain_offsets AS SELECT * FROM _mat_domain_offsets;

-- Engine pair rows (a, b both engines) also intersect the bounds derived
-- through the router: off_b - off_a lies in [lo(router,b) - hi(router,a),
-- hi(router,b) - lo(router,a)]. The estimate is the pair's sample when
-- _clock_point_usable (against the router-derived interval), else the
-- difference of the two domains' offsets (_domain_offsets), clamped to the
-- combined interval.
CREATE OR REPLACE VIEW _clock_pair_combined AS
WITH j AS (
    SELECT p.*,
           rb.lo - ra.hi AS via_lo, rb.hi - ra.lo AS via_hi,
           ob.offset_ns - oa.offset_ns AS via_est
    FROM _clock_pair_est p
    LEFT JOIN _clock_pair_est ra ON p.clock_a <> 'router' AND ra.clock_a = 'router' AND ra.clock_b = p.clock_a
         AND ra.window_idx IS NOT DISTINCT FROM p.window_idx
    LEFT JOIN _clock_pair_est rb ON p.clock_a <> 'router' AND rb.clock_a = 'router' AND rb.clock_b = p.clock_b
         AND rb.window_idx IS NOT DISTINCT FROM p.window_idx
    LEFT JOIN _domain_offsets oa ON p.clock_a <> 'router' AND oa.domain = p.clock_a
         AND oa.window_idx IS NOT DISTINCT FROM p.window_idx
    LEFT JOIN _domain_offsets ob ON p.clock_a <> 'router' AND ob.domain = p.clock_b
         AND ob.window_idx IS NOT DISTINCT FROM p.window_idx
), c AS (
    SELECT *,
           CASE WHEN via_lo IS NULL THEN lo WHEN lo IS NULL THEN via_lo ELSE greatest(lo, via_lo) END AS c_lo,
           CASE WHEN via_hi IS NULL THEN hi WHEN hi IS NULL THEN via_hi ELSE least(hi, via_hi) END AS c_hi,
           (via_lo IS NOT NULL OR via_hi IS NOT NULL) AS via
    FROM j
), pick AS (
    SELECT *,
           CASE WHEN NOT via THEN point
                WHEN _clock_point_usable(point, coalesce(sample_hi - sample_lo, 9223372036854775807), c_lo, c_hi,
                                         CASE WHEN msg_lo IS NULL THEN via_lo WHEN via_lo IS NULL THEN msg_lo
                                              ELSE greatest(msg_lo, via_lo) END,
                                         CASE WHEN msg_hi IS NULL THEN via_hi WHEN via_hi IS NULL THEN msg_hi
                                              ELSE least(msg_hi, via_hi) END)
                     THEN point
                ELSE via_est END AS c_point
    FROM c
)
SELECT clock_a, clock_b, window_idx, c_lo AS lo, c_hi AS hi, messages, samples,
       CASE WHEN via THEN concat_ws(',', sources, 'via_router') ELSE sources END AS sources,
       CASE WHEN via THEN _clock_estimate(c_lo, c_hi, c_point) ELSE est END AS est,
       CASE WHEN via THEN _clock_bound(c_lo, c_hi, _clock_estimate(c_lo, c_hi, c_point)) ELSE bound END AS bound
FROM pick;

CREATE OR REPLACE VIEW clock_offsets AS
SELECT clock_a, clock_b,
       window_idx * _clock_window_ns() AS window_start_ns,
       est AS offset_ns, est / 1e6 AS offset_ms,
       bound AS bound_ns, bound / 1e6 AS bound_ms,
       lo AS lower_ns, hi AS upper_ns,
       coalesce(lo <= hi, true) AS consistent,
       messages, samples, sources
FROM _clock_pair_combined;

COMMENT ON VIEW clock_offsets IS 'Clock offset per pair of clocks (router, engines) and window, from causal pairs and samples (engine pairs also through the router); offset = clock_b - clock_a.';
COMMENT ON COLUMN clock_offsets.clock_a IS 'first clock: ''router'' or an engine id (the router always sorts first)';
COMMENT ON COLUMN clock_offsets.clock_b IS 'second clock: an engine id';
COMMENT ON COLUMN clock_offsets.window_start_ns IS 'start of the estimation window (ns since the Unix epoch, receiver clock); NULL: the whole trace';
COMMENT ON COLUMN clock_offsets.offset_ns IS 'estimated clock_b minus clock_a (duration ns; positive: b reads later)';
COMMENT ON COLUMN clock_offsets.offset_ms IS 'offset_ns in ms';
COMMENT ON COLUMN clock_offsets.bound_ns IS 'uncertainty: the true offset is within offset +- bound (duration ns); NULL when one side is unbounded';
COMMENT ON COLUMN clock_offsets.bound_ms IS 'bound_ns in ms';
COMMENT ON COLUMN clock_offsets.lower_ns IS 'largest lower bound on the offset from causal pairs, samples and (engine pairs) the router (duration ns)';
COMMENT ON COLUMN clock_offsets.upper_ns IS 'smallest upper bound on the offset (duration ns)';
COMMENT ON COLUMN clock_offsets.consistent IS 'false when the bounds contradict each other (lower > upper): drift or a bad sample';
COMMENT ON COLUMN clock_offsets.messages IS 'causal messages used (router<->engine HTTP, registrations, notifications) (count)';
COMMENT ON COLUMN clock_offsets.samples IS 'direct offset samples used, e.g. the handshake estimate (count)';
COMMENT ON COLUMN clock_offsets.sources IS 'kinds of evidence, comma-separated; via_router: an engine pair''s bounds derived through both engines'' router bounds';


CREATE OR REPLACE VIEW clock_domains AS
SELECT domain, domain AS offset_domain,
       CASE WHEN domain = 'router' THEN 'router' WHEN domain = (SELECT domain FROM _clock_root) THEN 'reference'
            ELSE 'measured' END AS status,
       NULL::BIGINT AS engines
FROM (SELECT DISTINCT domain FROM _domain_offsets)
WHERE domain NOT IN (SELECT domain FROM _clock_domain_map)
UNION ALL
SELECT domain, clock_domain, CASE WHEN clock_domain IS NOT NULL THEN 'inherited' ELSE 'unresolved' END, engines
FROM _clock_domain_map;

COMMENT ON VIEW clock_domains IS 'Clock domains and where each one''s offset comes from; status ''unresolved'' flags API-server rows without engine_id whose engine is ambiguous (their correction has no engine evidence).';
COMMENT ON COLUMN clock_domains.domain IS 'clock domain of rows (spans.clock_domain): ''router'', an engine id, or api:<role>@<host>/<run> for API-server rows without engine_id';
COMMENT ON COLUMN clock_domains.offset_domain IS 'domain whose offset corrects the rows (the engine for an inherited API-server domain); NULL: unresolved';
COMMENT ON COLUMN clock_domains.status IS 'router | reference (no router evidence: the engine every time is corrected to) | measured (own evidence) | inherited (API server on its engine''s host clock) | unresolved (0 or more than 1 engine of that role on that host and run)';
COMMENT ON COLUMN clock_domains.engines IS 'for an API-server domain: engines of that role recorded on that host in that run (count)';
