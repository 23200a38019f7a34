-- module: records
-- requires: settings
-- Reading store files in place, and the deduplicated record view every other
-- module starts from.

-- X from any vLLM id form (cmpl-X-i / chatcmpl-X, optional -xxxxxxxx internal
-- suffix); other ids unchanged. Mirrors pdtrace.instrument.ids.base_id.
CREATE OR REPLACE MACRO _base_request_id(rid) AS
    CASE WHEN rid LIKE 'cmpl-%' OR rid LIKE 'chatcmpl-%' THEN
        regexp_replace(regexp_replace(regexp_replace(rid, '-[0-9a-f]{8}$', ''),
                                      '^cmpl-(.+)-[0-9]+$', '\1'),
                       '^chatcmpl-', '')
    ELSE rid END;

-- The join key of a request: (run id, base request id, prompt index) hashed.
CREATE OR REPLACE MACRO _request_key(run_id, request_id, prompt_index) AS
    CASE WHEN request_id IS NULL THEN NULL
         ELSE hash(coalesce(run_id, ''), request_id, coalesce(prompt_index, 0)) END;

-- Clock domain of an engine-side row written without engine_id (an API-server
-- process from an older middleware): one per (role, host, run); module clock
-- maps it to the engine's domain when that is unambiguous (view clock_domains).
CREATE OR REPLACE MACRO _api_clock_domain(role, host, run_id) AS
    'api:' || role || '@' || coalesce(host, '?') || '/' || coalesce(run_id, '?');

-- True for a copy of a record that another file also holds and that is not the
-- visible one (listed in _dup_drop: all copies but the one in the first file by name).
CREATE OR REPLACE MACRO _hidden_copy(rid, in_file) AS
    EXISTS (SELECT 1 FROM _dup_drop d WHERE d.record_id = rid AND d._file = in_file);

-- Rows of _records from a list of checked store files. hive_partitioning = false:
-- a store in the fleet layout (date=/hour=/host= directories, instrument/layout.py) is
-- read by its files' own columns; DuckDB would otherwise take `host` (and add `date`,
-- `hour`) from the directory names whenever every listed file is under the same keys.
CREATE OR REPLACE MACRO _read_store(files) AS TABLE
SELECT record, record_id, trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns,
       status_code, status_message,
       _base_request_id(request_id) AS request_id, request_id AS request_id_raw,
       coalesce(prompt_index, 0) AS prompt_index, coalesce(attempt, 0) AS attempt, tp_rank, thread,
       attr_int, attr_float, attr_str,
       run_id, service_name, role, engine_id, host, pid, vllm_version, connector, schema_version,
       pdtrace_version, config_hash,
       _request_key(run_id, _base_request_id(request_id), coalesce(prompt_index, 0)) AS rkey,
       coalesce(engine_id,
                CASE WHEN role IN ('prefill', 'decode') THEN _api_clock_domain(role, host, run_id) END,
                role, 'unknown') AS domain,
       filename AS _file
FROM read_parquet(files, union_by_name = true, filename = true, hive_partitioning = false);

-- _records: every record once. Defined here over no files; the connection
-- module redefines it on each refresh over the current readable files:
--   SELECT * FROM _read_store([files]) anti-joined with _dup_drop
-- (the store's Parquet files are read in place, never copied into the cache; a cold build of a
-- small store reads them once into a temporary table for its own steps, analysis/files.py hold_rows).
CREATE OR REPLACE VIEW _records_empty AS
SELECT NULL::VARCHAR AS record, NULL::UBIGINT AS record_id, NULL::VARCHAR AS trace_id, NULL::UBIGINT AS span_id,
       NULL::UBIGINT AS parent_span_id, NULL::VARCHAR AS name, NULL::TINYINT AS kind, NULL::BIGINT AS start_ns,
       NULL::BIGINT AS end_ns, NULL::TINYINT AS status_code, NULL::VARCHAR AS status_message,
       NULL::VARCHAR AS request_id, NULL::VARCHAR AS request_id_raw, NULL::INTEGER AS prompt_index,
       NULL::INTEGER AS attempt, NULL::SMALLINT AS tp_rank, NULL::VARCHAR AS thread,
       NULL::MAP(VARCHAR, BIGINT) AS attr_int, NULL::MAP(VARCHAR, DOUBLE) AS attr_float,
       NULL::MAP(VARCHAR, VARCHAR) AS attr_str, NULL::VARCHAR AS run_id, NULL::VARCHAR AS service_name,
       NULL::VARCHAR AS role, NULL::VARCHAR AS engine_id, NULL::VARCHAR AS host, NULL::INTEGER AS pid,
       NULL::VARCHAR AS vllm_version, NULL::VARCHAR AS connector, NULL::VARCHAR AS schema_version,
       NULL::VARCHAR AS pdtrace_version, NULL::VARCHAR AS config_hash,
       NULL::UBIGINT AS rkey, NULL::VARCHAR AS domain, NULL::VARCHAR AS _file
WHERE false;
CREATE OR REPLACE VIEW _records AS SELECT * FROM _records_empty;
-- _file_rows: the rows of the files a refresh absorbs (all files on a cold
-- build), duplicates NOT hidden -- what `materialize: ... file` steps read
-- (loader); the connection module points it at those files.
CREATE OR REPLACE VIEW _file_rows AS SELECT * FROM _records_empty;

CREATE OR REPLACE VIEW store_files AS
SELECT path, ok, reason, size AS size_bytes, rows, mtime_ns FROM _files;

COMMENT ON VIEW store_files IS 'Store files seen: absorbed (ok) or skipped with the reason.';
COMMENT ON COLUMN store_files.path IS 'file path';
COMMENT ON COLUMN store_files.ok IS 'true if the file was read; false if skipped (truncated, empty, foreign, other major, corrupt data pages, unreadable)';
COMMENT ON COLUMN store_files.reason IS 'why the file was skipped (empty when ok)';
COMMENT ON COLUMN store_files.size_bytes IS 'file size when seen (bytes)';
COMMENT ON COLUMN store_files.rows IS 'records read from the file (count; NULL when skipped)';
COMMENT ON COLUMN store_files.mtime_ns IS 'file modification time when seen (ns since the Unix epoch)';
