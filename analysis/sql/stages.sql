-- module: stages
-- requires:
-- The stage vocabulary as a mapping table. `_stage_vocab(stage, role,
-- category, doc)` is loaded by the connection module from
-- pdtrace.instrument.stages.STAGES (one list for code, SQL and dashboard);
-- the flags below are the analysis' own reading of DESIGN.md §2.

CREATE OR REPLACE VIEW _stage_flags AS
SELECT * FROM (VALUES
    -- stage,                 stage_group,      filler, step_boundary, step_level
    ('router.wait',          'router.wait',     true,   false, false),
    ('router.unseen',        'router.unseen',   true,   false, false),
    ('handoff.step_wait',    'handoff.prep',    false,  true,  false),
    ('handoff.handshake',    'handoff.prep',    false,  false, false),
    ('handoff.agent_load',   'handoff.prep',    false,  false, false),
    ('handoff.descriptors',  'handoff.prep',    false,  false, false),
    ('handoff.writer_queue', 'handoff.prep',    false,  false, false),
    ('kv.ready',             'kv.ready',        false,  true,  false),
    ('connector.load',       'decode.step',     false,  false, true),
    ('connector.poll',       'decode.step',     false,  false, true),
    ('connector.save',       'decode.step',     false,  false, true),
    ('decode.step',          'decode.step',     false,  false, true),
    ('prefill.step',         'prefill.step',    false,  false, true)
) t(stage, stage_group, is_filler, is_step_boundary, is_step_level);

CREATE OR REPLACE VIEW stages AS
SELECT v.stage,
       v.role,
       v.category,
       v.category IS NOT NULL AND NOT coalesce(f.is_step_level, false) AND v.stage <> 'unattributed' AS owns_ttft,
       coalesce(f.stage_group, v.stage) AS stage_group,
       coalesce(f.is_filler, false) AS is_filler,
       coalesce(f.is_step_boundary, false) AS is_step_boundary,
       v.doc
FROM _stage_vocab v LEFT JOIN _stage_flags f USING (stage);

-- Category by outcome (DESIGN.md §2: "a kv.transfer that failed or moved no
-- bytes was waiting, not moving data, and counts as coordination"). The one
-- place the rule lives; spans.category and the TTFT candidates (module
-- ttft_segments) both call it. A transfer-category stage is a wait when
--   status_code = 2 (OTLP error), or kv_bytes = 0 (kv.bytes: nothing moved,
--   e.g. a full prefix hit's empty READ + notification: vllm#18632,
--   vllm-ascend#13897), or error_type is set (error.type: the recorder's
--   failure attribute), or failed_event (a kv.transfer_failed / kv.post_failed
--   event on the span, or on the request at the span's rank during it: view
--   _kv_failed_spans; vllm-ascend#7846: a Mooncake READ that timed out after 33 s).
-- Nested CASE: the attribute lookups run for transfer rows only.
CREATE OR REPLACE MACRO _outcome_category(category, status_code, kv_bytes, error_type, failed_event) AS
    CASE WHEN category IS DISTINCT FROM 'transfer' THEN category
         WHEN coalesce(status_code = 2, false) OR coalesce(kv_bytes = 0, false) OR error_type IS NOT NULL
              OR coalesce(failed_event, false) THEN 'coordination'
         ELSE category END;

-- Stage names as an ENUM (stored as a small integer): the critical path
-- (module ttft_segments) sorts and joins millions of candidate rows, and in
-- DuckDB's window sort a row carrying long strings costs ~3x one carrying
-- integers (BENCHMARKS.md "Analysis cold build"). Every stage and stage group
-- of the vocabulary, and 'unattributed'; casting another name raises, so only
-- rows joined with `stages` are cast.
CREATE OR REPLACE TYPE _stage_name AS ENUM (
    SELECT stage FROM _stage_vocab UNION SELECT stage_group FROM _stage_flags UNION SELECT 'unattributed' ORDER BY 1);

COMMENT ON VIEW stages IS 'Stage name -> category mapping (pdtrace.instrument.stages) with the flags the critical path uses.';
COMMENT ON COLUMN stages.stage IS 'stage (span) name, e.g. kv.transfer';
COMMENT ON COLUMN stages.role IS 'role that records the stage: router | prefill | decode (empty for unattributed)';
COMMENT ON COLUMN stages.category IS 'queue | compute | transfer | coordination; NULL for parents, which are never charged';
COMMENT ON COLUMN stages.owns_ttft IS 'true if the stage can own time on a request''s TTFT critical path (leaf request stage)';
COMMENT ON COLUMN stages.stage_group IS 'the DESIGN.md §2 stage a child rolls up to (handoff.* -> handoff.prep); itself otherwise';
COMMENT ON COLUMN stages.is_filler IS 'true for waits (router.wait, the pseudo-stage router.unseen) that own only time no other stage covers';
COMMENT ON COLUMN stages.is_step_boundary IS 'true for waits on an engine-step boundary (handoff.step_wait, kv.ready)';
COMMENT ON COLUMN stages.doc IS 'meaning of the stage (from -> to)';
