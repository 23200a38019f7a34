"""Decode stalls: D's step timeline with the connector time on the forward thread, and for a chosen
request, which other requests' handoffs (or prefills / recomputes) inflated its TPOT."""
from __future__ import annotations

import streamlit as st

from pdtrace.dashboard import charts, data, ui

t = ui.trace()
w = ui.window()
st.title("Decode stalls")
st.caption("A step's excess = its duration minus the median of recent clean steps of the same batch shape; "
           "the excess is shared among the step's causes (connector work on the forward thread, co-scheduled "
           "prefill or recompute tokens) in proportion to their time.")

engines = ui.q(t, data.decode_engines)
if not engines:
    st.info("No decode steps recorded in this trace (decode.step spans).")
    st.stop()
eng = st.selectbox("Decode engine", engines, key="stall_engine") if len(engines) > 1 else engines[0]
tot = ui.q(t, data.stall_totals, w, eng)
m = st.columns(4)
m[0].metric("Steps", f"{tot['steps']:,}")
m[1].metric("Stalled steps", f"{tot['stalled']:,}")
m[2].metric("Stall time (excess)", data.fmt_ms(tot["excess_ms"]))
m[3].metric("Connector on forward thread", data.fmt_ms(tot["connector_ms"]))
steps = ui.q(t, data.decode_steps, w, eng)
if len(steps) >= 20_000:
    st.caption("First 20,000 steps of the window shown; narrow the time window to see the rest.")
st.plotly_chart(charts.step_timeline(steps), width="stretch", key="steps")

st.subheader("Whose TPOT paid, and for whom")
n_req = ui.q(t, data.store_health)["requests"]
if not st.toggle("Rank requests by TPOT lost to others' work", value=n_req < 200_000, key="stall_rank",
                 help="Reads request_stalls over the window: several seconds on a store of a million requests."):
    st.stop()
worst = ui.q(t, data.worst_tpot, w)
if worst.empty or not (worst["stall_ms"].fillna(0) > 0).any():
    st.success("No request's TPOT was inflated by other requests' work in this window.")
    st.stop()
st.dataframe(worst.drop(columns=["rkey", "run_id"]), hide_index=True, width="stretch", key="worst",
             column_config={c: st.column_config.NumberColumn(format="%.2f") for c in worst.columns if c.endswith("_ms")})
victim = st.selectbox("Request", worst["request_id"].tolist(), key="victim",
                      format_func=lambda r: f"{r} — stalled {data.fmt_ms(float(worst.loc[worst.request_id == r, 'stall_ms'].iloc[0]))}")
vrow = worst[worst["request_id"] == victim].iloc[0]
cul = ui.q(t, data.stall_culprits, int(vrow["rkey"]))
st.markdown(f"**{victim}**: TPOT {data.fmt_ms(vrow.tpot_ms)}, of which {data.fmt_ms(vrow.stall_tpot_ms)} per token "
            f"is other requests' work (without it {data.fmt_ms(vrow.tpot_without_stalls_ms)}).")
st.dataframe(cul, hide_index=True, width="stretch", key="culprits",
             column_config={"share_ms": st.column_config.NumberColumn("stall caused (ms)", format="%.2f")})
if len(cul) and st.button(f"Open the top culprit {cul.iloc[0].culprit_request_id}", key="open_culprit"):
    ui.open_request(cul.iloc[0].culprit_request_id)
