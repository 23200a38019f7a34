-- The tables the connection module fills (not a view module: run before the
-- modules, once per database; every statement is idempotent).
--   _raw        every record of every absorbed store file (duplicates kept,
--               _keep marks the one copy per record_id that views see)
--   _files      the files absorbed or skipped, with size and mtime
--   _stage_vocab / _event_vocab  loaded from pdtrace.instrument.stages

CREATE TABLE IF NOT EXISTS _raw (
    record VARCHAR, record_id UBIGINT, trace_id VARCHAR, span_id UBIGINT, parent_span_id UBIGINT,
    name VARCHAR, kind TINYINT, start_ns BIGINT, end_ns BIGINT, status_code TINYINT, status_message VARCHAR,
    request_id VARCHAR, request_id_raw VARCHAR, prompt_index INTEGER, attempt INTEGER, tp_rank SMALLINT, thread VARCHAR,
    attr_int MAP(VARCHAR, BIGINT), attr_float MAP(VARCHAR, DOUBLE), attr_str MAP(VARCHAR, VARCHAR),
    run_id VARCHAR, service_name VARCHAR, role VARCHAR, engine_id VARCHAR, host VARCHAR, pid INTEGER,
    vllm_version VARCHAR, connector VARCHAR, schema_version VARCHAR,
    rkey UBIGINT, domain VARCHAR, _file VARCHAR, _keep BOOLEAN
);
CREATE TABLE IF NOT EXISTS _files (
    path VARCHAR PRIMARY KEY, size BIGINT, mtime_ns BIGINT, rows BIGINT, ok BOOLEAN, reason VARCHAR, absorbed_at TIMESTAMP
);
CREATE TABLE IF NOT EXISTS _stage_vocab (stage VARCHAR, role VARCHAR, category VARCHAR, doc VARCHAR);
CREATE TABLE IF NOT EXISTS _event_vocab (event VARCHAR, doc VARCHAR);
-- Request keys a refresh recomputes (all keys on a cold build).
CREATE TABLE IF NOT EXISTS _scope_keys (rkey UBIGINT);
