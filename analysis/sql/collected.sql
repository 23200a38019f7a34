-- module: collected
-- requires: spans
--
-- Spans received by `pdtrace collect` (OTLP from routers and engines pdtrace
-- did not instrument; pdtrace.instrument.otlp_ingest documents the mapping),
-- and the collector's own counters. Every collected span carries
-- attr_str['otlp.join'], the rule that gave its request id ('none': no id
-- mapped -- the span is kept, with request_id NULL, and counted here).

CREATE OR REPLACE VIEW collected_spans AS
SELECT service_name, role, attr_str['otlp.join'] AS joined_by,
       count(*) AS spans,
       count(*) FILTER (WHERE request_id IS NULL) AS unjoined,
       count(DISTINCT rkey) AS requests,
       count(*) FILTER (WHERE name = 'router.request' AND attr_str['otlp.derived_from'] IS NOT NULL) AS router_roots
FROM _timed
WHERE record = 'span' AND (attr_str['otlp.join'] IS NOT NULL OR attr_str['otlp.derived_from'] IS NOT NULL)
GROUP BY ALL;

CREATE OR REPLACE VIEW collect_stats AS
SELECT host, pid,
       max(start_ns) AS time_ns,
       max(attr_int['collect.received_spans']) AS received_spans,
       max(attr_int['collect.written_spans']) AS written_spans,
       max(attr_int['collect.dropped_spans']) AS dropped_spans,
       max(attr_int['collect.bad_bodies']) AS bad_bodies,
       max(attr_int['collect.unjoined_spans']) AS unjoined_spans,
       max(attr_int['collect.dropped_attributes']) AS dropped_attributes,
       max(attr_int['collect.write_errors']) AS write_errors,
       max(attr_int['collect.skipped_pdtrace_spans']) AS skipped_pdtrace_spans
FROM _records
WHERE record = 'stats' AND name = 'collect.stats'
GROUP BY host, pid;

COMMENT ON VIEW collected_spans IS 'Spans pdtrace collect received, by sender and by how their request id was found (joined_by none = unjoined: kept, never dropped).';
COMMENT ON COLUMN collected_spans.service_name IS 'sender''s OpenTelemetry service.name (a derived router.request: the foreign router''s)';
COMMENT ON COLUMN collected_spans.role IS 'role given to the sender (router | prefill | decode | engine | pdtrace.role)';
COMMENT ON COLUMN collected_spans.joined_by IS 'rule that gave the request id: pdtrace.request_id | gen_ai.request.id | trace_id | x-request-id | none; NULL for the derived router.request rows';
COMMENT ON COLUMN collected_spans.spans IS 'spans (count)';
COMMENT ON COLUMN collected_spans.unjoined IS 'spans with no request id that maps (count)';
COMMENT ON COLUMN collected_spans.requests IS 'distinct requests the spans joined (count)';
COMMENT ON COLUMN collected_spans.router_roots IS 'router.request rows derived from foreign router roots with a first-token instant (count)';
COMMENT ON VIEW collect_stats IS 'Counters of each pdtrace collect process (cumulative, latest stats row).';
COMMENT ON COLUMN collect_stats.host IS 'host of the collector';
COMMENT ON COLUMN collect_stats.pid IS 'process id of the collector';
COMMENT ON COLUMN collect_stats.time_ns IS 'time of the latest stats row (ns since the Unix epoch, collector clock)';
COMMENT ON COLUMN collect_stats.received_spans IS 'spans received in decodable bodies (count)';
COMMENT ON COLUMN collect_stats.written_spans IS 'collected spans written (count)';
COMMENT ON COLUMN collect_stats.dropped_spans IS 'spans dropped: queue full or a failed write (count)';
COMMENT ON COLUMN collect_stats.bad_bodies IS 'request bodies refused: not decodable (400), too large (413), other content type (415) (count)';
COMMENT ON COLUMN collect_stats.unjoined_spans IS 'spans written without a request id (count)';
COMMENT ON COLUMN collect_stats.dropped_attributes IS 'foreign attributes dropped: not allowlisted or of the wrong type (count)';
COMMENT ON COLUMN collect_stats.write_errors IS 'failed file writes (count)';
COMMENT ON COLUMN collect_stats.skipped_pdtrace_spans IS 'spans of pdtrace''s own OTLP export, skipped: its processes write them to their store (count)';
