-- module: records
-- requires: settings
-- Reading store files into _raw, and the deduplicated record view every other
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

-- Rows of _raw (minus _file/_keep) from a list of checked store files.
CREATE OR REPLACE MACRO _read_store(files) AS TABLE
SELECT record, record_id, trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns,
       status_code, status_message,
       _base_request_id(request_id) AS request_id, request_id AS request_id_raw,
       coalesce(prompt_index, 0) AS prompt_index, coalesce(attempt, 0) AS attempt, tp_rank, thread,
       attr_int, attr_float, attr_str,
       run_id, service_name, role, engine_id, host, pid, vllm_version, connector, schema_version,
       _request_key(run_id, _base_request_id(request_id), coalesce(prompt_index, 0)) AS rkey,
       coalesce(engine_id, role, 'unknown') AS domain,
       filename AS _file
FROM read_parquet(files, union_by_name = true, filename = true);

CREATE OR REPLACE VIEW _records AS
SELECT * EXCLUDE (_keep) FROM _raw WHERE _keep;

CREATE OR REPLACE VIEW store_files AS
SELECT path, ok, reason, size AS size_bytes, rows, mtime_ns FROM _files;

COMMENT ON VIEW store_files IS 'Store files seen: absorbed (ok) or skipped with the reason.';
COMMENT ON COLUMN store_files.path IS 'file path';
COMMENT ON COLUMN store_files.ok IS 'true if the file was read; false if skipped (truncated, empty, foreign, other major)';
COMMENT ON COLUMN store_files.reason IS 'why the file was skipped (empty when ok)';
COMMENT ON COLUMN store_files.size_bytes IS 'file size when seen (bytes)';
COMMENT ON COLUMN store_files.rows IS 'records read from the file (count; NULL when skipped)';
COMMENT ON COLUMN store_files.mtime_ns IS 'file modification time when seen (ns since the Unix epoch)';
