-- module: processes
-- requires: records
-- materialize: _process_part file
-- The processes that wrote into the store: one row per (run_id, host, pid),
-- with the resource columns and recorder counters of its last recorder.stats
-- row (written by its sink at every flush, instrument/schema.py record
-- 'stats'; counters cumulative since the process started,
-- instrument/writer.py stats()). What `pdtrace check` reports.

-- Per store file (materialize kind 'file'): each process's rows in that file,
-- as partial aggregates that merge across files (min/max/arg_max: a record
-- duplicated in a part and its segment gives the same values twice). `res`
-- is the resource and counters of the file's latest stats row; `res_any` of
-- its latest row of any kind (a process that wrote no stats row: stores built
-- by hand or from foreign spans).
CREATE OR REPLACE VIEW _calc_process_part AS
SELECT _file, run_id, host, pid,
       min(start_ns) FILTER (WHERE record = 'stats' AND name = 'recorder.stats') AS first_flush_ns,
       max(start_ns) FILTER (WHERE record = 'stats' AND name = 'recorder.stats') AS last_flush_ns,
       min(start_ns) AS first_record_ns,
       max(end_ns) AS last_record_ns,
       -- (the struct is built for the stats rows only: a CASE evaluates its branch on the matching rows,
       -- and FILTER alone would build it, with its 19 attribute lookups, for every row)
       arg_max(CASE WHEN record = 'stats' AND name = 'recorder.stats' THEN
               {role: role, engine_id: engine_id, service_name: service_name,
                pdtrace_version: pdtrace_version, vllm_version: vllm_version, connector: connector,
                config_hash: config_hash, activation: attr_str['pdtrace.activation'],
                sample: attr_float['recorder.sample'], step_sample: attr_float['recorder.step_sample'],
                recorded: attr_int['recorder.recorded'], dropped: attr_int['recorder.dropped'],
                written: attr_int['recorder.written'], write_errors: attr_int['recorder.write_errors'],
                export_errors: attr_int['recorder.export_errors'],
                dropped_attributes: attr_int['recorder.dropped_attributes'],
                writer_cpu_ns: attr_int['recorder.writer_cpu_ns'], sink_cpu_ns: attr_int['recorder.sink_cpu_ns'],
                hook_errors: attr_int['recorder.hook_errors'],
                hook_error_first: attr_str['recorder.hook_error_first'],
                tail_dropped: attr_int['recorder.tail_dropped'], tail_ttft_ms: attr_float['recorder.tail_ttft_ms'],
                tail_tpot_ms: attr_float['recorder.tail_tpot_ms'], tail_head: attr_float['recorder.tail_head']} END,
               start_ns)
           FILTER (WHERE record = 'stats' AND name = 'recorder.stats') AS res,
       arg_max({role: role, engine_id: engine_id, service_name: service_name,
                pdtrace_version: pdtrace_version, vllm_version: vllm_version, connector: connector,
                config_hash: config_hash}, end_ns) AS res_any
FROM _file_rows
GROUP BY _file, run_id, host, pid;
CREATE TABLE IF NOT EXISTS _mat_process_part AS SELECT * FROM _calc_process_part LIMIT 0;

CREATE OR REPLACE VIEW processes AS
WITH p AS (
    SELECT run_id, host, pid,
           min(first_flush_ns) AS first_flush_ns, max(last_flush_ns) AS last_flush_ns,
           min(first_record_ns) AS first_record_ns, max(last_record_ns) AS last_record_ns,
           arg_max(res, last_flush_ns) FILTER (WHERE res IS NOT NULL) AS res,
           arg_max(res_any, last_record_ns) AS res_any,
           count(DISTINCT _file) AS files
    FROM _mat_process_part
    GROUP BY run_id, host, pid
)
SELECT run_id, host, pid,
       coalesce(res.role, res_any.role) AS role,
       coalesce(res.engine_id, res_any.engine_id) AS engine_id,
       coalesce(res.service_name, res_any.service_name) AS service_name,
       coalesce(res.pdtrace_version, res_any.pdtrace_version) AS pdtrace_version,
       coalesce(res.vllm_version, res_any.vllm_version) AS vllm_version,
       coalesce(res.connector, res_any.connector) AS connector,
       coalesce(res.config_hash, res_any.config_hash) AS config_hash,
       CASE WHEN res IS NULL THEN NULL ELSE coalesce(res.activation, 'unknown') END AS activation,
       res.sample AS sample, res.step_sample AS step_sample,
       first_flush_ns, last_flush_ns, first_record_ns, last_record_ns,
       res.recorded AS recorded, res.dropped AS dropped, res.written AS written,
       res.write_errors AS write_errors, res.export_errors AS export_errors,
       res.dropped_attributes AS dropped_attributes,
       res.writer_cpu_ns AS writer_cpu_ns, res.sink_cpu_ns AS sink_cpu_ns,
       res.hook_errors AS hook_errors, res.hook_error_first AS hook_error_first,
       CASE WHEN res IS NULL THEN NULL WHEN res.tail_head IS NOT NULL THEN 'tail' ELSE 'all' END AS retain,
       res.tail_dropped AS tail_dropped, res.tail_ttft_ms AS tail_ttft_ms, res.tail_tpot_ms AS tail_tpot_ms,
       res.tail_head AS tail_head,
       files
FROM p;

COMMENT ON VIEW processes IS 'One row per process that wrote into the store (run_id, host, pid): its resource and recorder counters as of its last recorder.stats row (its last flush).';
COMMENT ON COLUMN processes.run_id IS 'deployment run id (PDTRACE_RUN_ID; NULL when unset)';
COMMENT ON COLUMN processes.host IS 'host name of the process';
COMMENT ON COLUMN processes.pid IS 'process id';
COMMENT ON COLUMN processes.role IS 'router | prefill | decode | ... as of its last flush (NULL: never set)';
COMMENT ON COLUMN processes.engine_id IS 'vLLM engine id as of its last flush (NULL for the router)';
COMMENT ON COLUMN processes.service_name IS 'OpenTelemetry service.name, e.g. pdtrace-prefill-api for an API server';
COMMENT ON COLUMN processes.pdtrace_version IS 'pdtrace package version of the process';
COMMENT ON COLUMN processes.vllm_version IS 'vLLM version of the process (NULL if it did not import vLLM)';
COMMENT ON COLUMN processes.connector IS 'KV connector class of the engine (NULL for API servers and the router)';
COMMENT ON COLUMN processes.config_hash IS 'hash of the configuration that matters for comparisons (NULL if not recorded)';
COMMENT ON COLUMN processes.activation IS 'how tracing was switched on: plugin (vLLM plugin, PDTRACE_DIR only) | explicit (traced class names, middleware, router) | unknown (not recorded); NULL: no recorder.stats row';
COMMENT ON COLUMN processes.sample IS 'fraction of requests traced (PDTRACE_SAMPLE, 0..1) as recorded on its stats rows; NULL: not recorded';
COMMENT ON COLUMN processes.step_sample IS 'fraction of engine steps whose step spans are kept (PDTRACE_STEP_SAMPLE, 0..1); NULL: not recorded';
COMMENT ON COLUMN processes.first_flush_ns IS 'its first recorder.stats row (ns since the Unix epoch, the process''s own wall clock); NULL: none';
COMMENT ON COLUMN processes.last_flush_ns IS 'its last recorder.stats row: the last flush, i.e. the trace end for this process (ns since the Unix epoch, own wall clock); NULL: none';
COMMENT ON COLUMN processes.first_record_ns IS 'earliest start of any of its rows (ns since the Unix epoch, own wall clock)';
COMMENT ON COLUMN processes.last_record_ns IS 'latest end of any of its rows (ns since the Unix epoch, own wall clock)';
COMMENT ON COLUMN processes.recorded IS 'records offered to its recorder (= dropped + written + tail_dropped + pending), cumulative at its last flush (count)';
COMMENT ON COLUMN processes.dropped IS 'records dropped: buffer full, sink unreachable, or rows of failed writes (count, cumulative)';
COMMENT ON COLUMN processes.written IS 'records written to store files (count, cumulative)';
COMMENT ON COLUMN processes.write_errors IS 'failed file writes or merges of its sink (count, cumulative)';
COMMENT ON COLUMN processes.export_errors IS 'failed OTLP exports (count, cumulative)';
COMMENT ON COLUMN processes.dropped_attributes IS 'attributes dropped: key not allowlisted or value of the wrong type (count, cumulative)';
COMMENT ON COLUMN processes.writer_cpu_ns IS 'CPU of its pdtrace-writer thread since it started, as of its last flush (thread CPU clock, ns; background, not on an engine thread); NULL: not recorded';
COMMENT ON COLUMN processes.sink_cpu_ns IS 'CPU of the host''s sink process (one per host and trace directory, shared by every traced process there: the same sink on each row of a host) as of this process''s last flush (process CPU clock, ns; background); NULL: not recorded';
COMMENT ON COLUMN processes.hook_errors IS 'errors raised by pdtrace''s own code inside the process''s hooks (the traced connectors'' and API server''s, connector/traced/safety.py safe()) and swallowed there: the engine ran on, but those hook calls may have left records out (count, cumulative at its last flush; 0 on a healthy run); NULL: not recorded (no stats row, or a pdtrace that did not count them)';
COMMENT ON COLUMN processes.hook_error_first IS 'the first such error: ''<hook qualname>: <exception class>'' (names only, never the message); NULL: none (or not recorded)';
COMMENT ON COLUMN processes.retain IS 'retention of the host''s sink that wrote its last stats row: tail (PDTRACE_RETAIN=tail, module pdtrace.instrument.retention: only slow, failed, marked and head-sampled requests kept) | all; NULL: no recorder.stats row';
COMMENT ON COLUMN processes.tail_dropped IS 'tail retention: its records the sink dropped by decision (a fast request not head-sampled, a step of such requests only), not lost (count, cumulative); NULL without tail retention';
COMMENT ON COLUMN processes.tail_ttft_ms IS 'tail retention: the sink''s TTFT threshold (PDTRACE_TAIL_TTFT_MS, ms; 0: none); NULL without tail retention';
COMMENT ON COLUMN processes.tail_tpot_ms IS 'tail retention: the sink''s TPOT threshold (PDTRACE_TAIL_TPOT_MS, ms; 0: none); NULL without tail retention';
COMMENT ON COLUMN processes.tail_head IS 'tail retention: the fraction of the other requests kept anyway (PDTRACE_TAIL_HEAD, 0..1); NULL without tail retention';
COMMENT ON COLUMN processes.files IS 'readable store files holding its rows (count)';
