-- module: thread_cpu
-- requires: records
-- pdtrace's own CPU on each traced thread (the hot path), from the
-- `pdtrace.thread_cpu` stats rows that a process with PDTRACE_SELF_CPU=1 writes
-- at every flush, one per thread that ran a pdtrace hook
-- (pdtrace.instrument.selfcpu): cumulative cpu.pdtrace_ns (thread CPU clock
-- around every hook, less one calibrated clock read per hook), cpu.thread_ns
-- (the thread's whole CPU, less the self-measurement's two reads per hook),
-- cpu.hooks; cpu.read_cost_ns is the calibrated read.
--
-- A *window* is the interval between two consecutive rows of one thread (a row
-- is written at a flush, PDTRACE_FLUSH_INTERVAL_S, when the thread ran a hook
-- since the last; cpu.thread_ns is the thread's clock at the end of its last
-- hook, so a window runs from a last hook to the next flush's last hook). Only windows in which the thread
-- ran a hook count (`busy` windows): the thread's first row covers its whole
-- life before it (model loading, start-up) and windows without a hook are CPU
-- pdtrace did not touch, so both are left out; the share is therefore an upper
-- bound of pdtrace's share of the thread's CPU over the run.
-- hot_path_share = sum(pdtrace CPU) / sum(thread CPU) over the busy windows.

CREATE OR REPLACE VIEW _thread_cpu_rows AS
SELECT run_id, host, pid, role, service_name, thread, start_ns AS time_ns,
       attr_int['cpu.pdtrace_ns'] AS pdtrace_ns, attr_int['cpu.thread_ns'] AS thread_ns,
       attr_int['cpu.hooks'] AS hooks
FROM _records
WHERE record = 'stats' AND name = 'pdtrace.thread_cpu';

CREATE OR REPLACE VIEW thread_cpu_windows AS
SELECT run_id, host, pid, role, service_name, thread, time_ns,
       pdtrace_ns - lag(pdtrace_ns) OVER w AS pdtrace_ns,
       thread_ns - lag(thread_ns) OVER w AS thread_ns,
       hooks - lag(hooks) OVER w AS hooks
FROM _thread_cpu_rows
WINDOW w AS (PARTITION BY run_id, host, pid, thread ORDER BY time_ns)
QUALIFY lag(time_ns) OVER w IS NOT NULL;

CREATE OR REPLACE VIEW thread_cpu AS
SELECT run_id, host, pid, any_value(role) AS role, any_value(service_name) AS service_name, thread,
       count(*) FILTER (WHERE hooks > 0) AS busy_windows,
       sum(hooks) FILTER (WHERE hooks > 0) AS hooks,
       sum(pdtrace_ns) FILTER (WHERE hooks > 0) AS pdtrace_ns,
       sum(thread_ns) FILTER (WHERE hooks > 0) AS thread_ns,
       sum(pdtrace_ns) FILTER (WHERE hooks > 0)
           / nullif(sum(thread_ns) FILTER (WHERE hooks > 0), 0) AS hot_path_share,
       max(pdtrace_ns::DOUBLE / nullif(thread_ns, 0)) FILTER (WHERE hooks > 0) AS max_window_share
FROM thread_cpu_windows
GROUP BY run_id, host, pid, thread;

COMMENT ON VIEW thread_cpu_windows IS 'One row per flush window of each thread that ran a pdtrace hook (PDTRACE_SELF_CPU=1): what pdtrace and the thread used between two consecutive pdtrace.thread_cpu rows.';
COMMENT ON COLUMN thread_cpu_windows.run_id IS 'deployment run id (NULL when unset)';
COMMENT ON COLUMN thread_cpu_windows.host IS 'host name of the process';
COMMENT ON COLUMN thread_cpu_windows.pid IS 'process id';
COMMENT ON COLUMN thread_cpu_windows.role IS 'role of the process (prefill | decode | router | ...)';
COMMENT ON COLUMN thread_cpu_windows.service_name IS 'OpenTelemetry service.name (pdtrace-<role>-api: an API server; pdtrace-<role>: EngineCore)';
COMMENT ON COLUMN thread_cpu_windows.thread IS 'thread name (MainThread in EngineCore: scheduler and, at TP=1, the forward pass; the API server''s event loop: MainThread of the API-server process)';
COMMENT ON COLUMN thread_cpu_windows.time_ns IS 'end of the window: the flush that wrote the row (ns since the Unix epoch, own wall clock)';
COMMENT ON COLUMN thread_cpu_windows.pdtrace_ns IS 'pdtrace''s CPU on the thread in the window (thread CPU clock around every hook less one calibrated clock read per hook, ns)';
COMMENT ON COLUMN thread_cpu_windows.thread_ns IS 'the thread''s whole CPU in the window (thread CPU clock less the self-measurement''s two reads per hook, ns)';
COMMENT ON COLUMN thread_cpu_windows.hooks IS 'pdtrace hook calls on the thread in the window (count)';

COMMENT ON VIEW thread_cpu IS 'One row per traced thread (run_id, host, pid, thread) that ran a pdtrace hook: pdtrace''s hot-path CPU and its share of the thread''s CPU over the windows in which a hook ran (PDTRACE_SELF_CPU=1; pdtrace.instrument.selfcpu).';
COMMENT ON COLUMN thread_cpu.run_id IS 'deployment run id (NULL when unset)';
COMMENT ON COLUMN thread_cpu.host IS 'host name of the process';
COMMENT ON COLUMN thread_cpu.pid IS 'process id';
COMMENT ON COLUMN thread_cpu.role IS 'role of the process (prefill | decode | router | ...)';
COMMENT ON COLUMN thread_cpu.service_name IS 'OpenTelemetry service.name (pdtrace-<role>-api: an API server; pdtrace-<role>: EngineCore)';
COMMENT ON COLUMN thread_cpu.thread IS 'thread name';
COMMENT ON COLUMN thread_cpu.busy_windows IS 'flush windows in which the thread ran at least one pdtrace hook (count)';
COMMENT ON COLUMN thread_cpu.hooks IS 'pdtrace hook calls in those windows (count)';
COMMENT ON COLUMN thread_cpu.pdtrace_ns IS 'pdtrace''s CPU on the thread in those windows (thread CPU clock around every hook less one calibrated read per hook, ns)';
COMMENT ON COLUMN thread_cpu.thread_ns IS 'the thread''s whole CPU in those windows (thread CPU clock less the self-measurement''s two reads per hook, ns)';
COMMENT ON COLUMN thread_cpu.hot_path_share IS 'pdtrace_ns / thread_ns: pdtrace''s share of the thread''s CPU (0..1; slightly below 0 possible for trivial hooks after the read correction; NULL: no CPU)';
COMMENT ON COLUMN thread_cpu.max_window_share IS 'largest share of a single busy window (0..1)';
