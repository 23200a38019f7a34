-- The tables the connection module fills (not a view module: run before the
-- modules, once per database; every statement is idempotent).
--   _dup_copies every copy of a record_id held by two or more files
--   _dup_drop   duplicate copies of records (same record_id in two files) to hide
--   _file_keys  request keys each absorbed file touches (incremental refresh)
--   _files      the files absorbed or skipped, with size and mtime
--   _stage_vocab / _event_vocab  loaded from pdtrace.instrument.stages

-- every (record_id, file) of a record that two or more absorbed files hold (kept
-- current incrementally: a refresh only looks up the new files' record ids)
CREATE TABLE IF NOT EXISTS _dup_copies (record_id UBIGINT, _file VARCHAR);
-- duplicate copies of a record (same record_id in a second file) that views skip:
-- every copy in _dup_copies but the one in the first file by name
CREATE TABLE IF NOT EXISTS _dup_drop (record_id UBIGINT, _file VARCHAR);
-- request keys (and ids a router row links to) per absorbed file: what a file touches
CREATE TABLE IF NOT EXISTS _file_keys (_file VARCHAR, rkey UBIGINT);
CREATE TABLE IF NOT EXISTS _files (
    path VARCHAR PRIMARY KEY, size BIGINT, mtime_ns BIGINT, rows BIGINT, ok BOOLEAN, reason VARCHAR, absorbed_at TIMESTAMP
);
CREATE TABLE IF NOT EXISTS _stage_vocab (stage VARCHAR, role VARCHAR, category VARCHAR, doc VARCHAR);
CREATE TABLE IF NOT EXISTS _event_vocab (event VARCHAR, doc VARCHAR);
-- Request keys a refresh recomputes (all keys on a cold build).
CREATE TABLE IF NOT EXISTS _scope_keys (rkey UBIGINT);
-- Request keys whose rows a refresh changed: the keys of the files added or
-- removed (all keys on a cold build); what `changed` materializations recompute.
CREATE TABLE IF NOT EXISTS _changed_keys (rkey UBIGINT);
-- Windows (window_idx) whose rows in a `changed` table a refresh changed (every
-- window on a cold build); what `window` materializations recompute.
CREATE TABLE IF NOT EXISTS _changed_windows (window_idx BIGINT);
-- The store files a refresh reads for the `file` materializations (every file
-- on a cold build), listed while they are refreshed: a `file` step may read an
-- earlier one's table for these files instead of _file_rows.
CREATE TABLE IF NOT EXISTS _read_files (_file VARCHAR);
-- Request keys outside the analysis's time window (pdtrace.analysis.window; empty
-- without one, refilled by every refresh): the request-level views and the
-- summaries leave them out (rows without a request key, such as an unjoined
-- coarse llm_request span, stay). Their rows stay in the _mat_ tables, where
-- another request's root cause or culprit may be found.
CREATE TABLE IF NOT EXISTS _window_out (rkey UBIGINT);
