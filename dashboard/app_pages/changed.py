"""What changed: an incident window against a baseline window — stages and request attributes
ranked by how much their share of TTFT grew."""
from __future__ import annotations

import streamlit as st

from pdtrace.dashboard import charts, data, ui

t = ui.trace()
st.title("What changed")
st.caption("Share of TTFT = a stage's critical-path time (or the TTFT of requests with an attribute value) "
           "divided by all TTFT in the window. Growth is in percentage points (pp), incident minus baseline.")
c1, c2 = st.columns(2)
with c1:
    st.markdown("**Incident window**")
    inc = ui.window_picker(t, key="inc", label="Incident (arrival, UTC)", in_sidebar=False,
                           default_fraction=(0.5, 1.0))
with c2:
    st.markdown("**Baseline window**")
    base = ui.window_picker(t, key="base", label="Baseline (arrival, UTC)", in_sidebar=False,
                            default_fraction=(0.0, 0.5))

stg = ui.q(t, data.stage_share_change, inc, base)
att = ui.q(t, data.attribute_share_change, inc, base)
if stg.empty:
    st.info("No complete request in these windows.")
    st.stop()
top = stg.iloc[0]
st.markdown(f"### Largest growth: **{top.stage}** ({top.category}) "
            f"{top.share_baseline * 100:.1f}% → {top.share_incident * 100:.1f}% of TTFT "
            f"({top.growth_pp:+.1f} pp; {data.fmt_ms(top.mean_ms_baseline)} → "
            f"{data.fmt_ms(top.mean_ms_incident)} per request)")
left, right = st.columns(2)
left.plotly_chart(charts.growth_bars(stg, "stage", "Stages by growth of TTFT share", color_col="category"),
                  width="stretch", key="stage_growth")
att_l = att.assign(label=att["attribute"] + " = " + att["value"])
right.plotly_chart(charts.growth_bars(att_l, "label", "Attributes by growth of TTFT share"), width="stretch",
                   key="attr_growth")
fmt = {c: st.column_config.NumberColumn(format="%.3f") for c in ("share_baseline", "share_incident")}
fmt.update({c: st.column_config.NumberColumn(format="%.1f") for c in
            ("growth_pp", "mean_ms_baseline", "mean_ms_incident", "mean_ttft_ms_baseline", "mean_ttft_ms_incident")})
st.dataframe(stg, hide_index=True, width="stretch", key="stage_table", column_config=fmt)
st.dataframe(att, hide_index=True, width="stretch", key="attr_table", column_config=fmt)
