-- module: settings
-- requires:
-- Tunable constants of the analysis, one row. Views read them from here so a
-- query can see what was in force.

CREATE OR REPLACE MACRO _clock_window_ns() AS 60000000000::BIGINT;
CREATE OR REPLACE MACRO _rate_window_ns() AS 10000000000::BIGINT;
CREATE OR REPLACE MACRO _descriptor_bound_share() AS 0.5::DOUBLE;
CREATE OR REPLACE MACRO _stall_baseline_steps() AS 32;
CREATE OR REPLACE MACRO _stall_fit_steps() AS 512;
CREATE OR REPLACE MACRO _long_hold_ns() AS 30000000000::BIGINT;

CREATE OR REPLACE VIEW analysis_settings AS
SELECT _clock_window_ns() AS clock_window_ns,
       _rate_window_ns() AS rate_window_ns,
       _descriptor_bound_share() AS descriptor_bound_share,
       _stall_baseline_steps() AS stall_baseline_steps,
       _stall_fit_steps() AS stall_fit_steps,
       _long_hold_ns() AS long_hold_ns;

COMMENT ON VIEW analysis_settings IS 'Constants the analysis uses (one row).';
COMMENT ON COLUMN analysis_settings.clock_window_ns IS 'length of a clock-offset estimation window (duration ns)';
COMMENT ON COLUMN analysis_settings.rate_window_ns IS 'length of an arrival-rate window in summary_by_window (duration ns)';
COMMENT ON COLUMN analysis_settings.descriptor_bound_share IS 'a transfer is descriptor-bound when post time / transfer time exceeds this (fraction, 0..1)';
COMMENT ON COLUMN analysis_settings.stall_baseline_steps IS 'clean steps of the same batch shape in a decode-stall baseline (count)';
COMMENT ON COLUMN analysis_settings.stall_fit_steps IS 'recent clean steps of an engine in the linear step-time fit of a decode-stall baseline (count)';
COMMENT ON COLUMN analysis_settings.long_hold_ns IS 'a block hold longer than this is flagged long_hold (duration ns)';
