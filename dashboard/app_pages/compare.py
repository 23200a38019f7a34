"""Push vs pull: two trace directories (or the two modes of one) side by side — the same
percentiles and category shares, per prompt-length bucket."""
from __future__ import annotations

import os

import pandas as pd
import streamlit as st

from pdtrace.instrument import config

from pdtrace.dashboard import charts, data, ui

t = ui.trace()
w = ui.window()
st.title("Push vs pull")

present = ui.q(t, data.modes)
choices = ["two modes of this trace", "another trace directory"]
how = st.radio("Compare", choices, horizontal=True, key="cmp_how",
               index=0 if len(present) > 1 else 1)
if how == choices[0]:
    if len(present) < 2:
        st.info(f"This trace holds one mode only ({', '.join(present) or 'none'}). Choose another trace directory.")
        st.stop()
    a_name, b_name = ("pull", "push") if {"pull", "push"} <= set(present) else tuple(present[:2])
    ta = tb = t
    wa = wb = w
    shares = ui.q(t, data.category_share_by_bucket, w)
    pct = ui.q(t, data.percentiles_by_bucket, w)
    sa, sb = shares[shares["mode"] == a_name], shares[shares["mode"] == b_name]
    pa, pb = pct[pct["mode"] == a_name], pct[pct["mode"] == b_name]
    ha, hb = ui.q(t, data.headline, w, a_name), ui.q(t, data.headline, w, b_name)
else:
    other = st.text_input("Other trace directory", key="cmp_dir",
                          value=config.raw(ui.ENV_COMPARE_DIR) or "")
    if not other:
        st.info("Enter a second trace directory (e.g. the push run of the same workload).")
        st.stop()
    tb = ui.open_trace(os.path.abspath(os.path.expanduser(other)))
    hb_health = ui.q(tb, data.store_health)
    if not tb.exists or hb_health["requests"] == 0:
        st.warning(f"`{other}` holds no readable requests."
                   + (" Skipped: " + ", ".join(f"`{os.path.basename(p)}` ({r})" for p, r in hb_health["skipped"])
                      if hb_health["skipped"] else ""))
        st.stop()
    a_name = f"{t.directory.name} ({'/'.join(present)})"
    b_name = f"{tb.directory.name} ({'/'.join(ui.q(tb, data.modes))})"
    sa, sb = ui.q(t, data.category_share_by_bucket, w), ui.q(tb, data.category_share_by_bucket)
    pa, pb = ui.q(t, data.percentiles_by_bucket, w), ui.q(tb, data.percentiles_by_bucket)
    ha, hb = ui.q(t, data.headline, w), ui.q(tb, data.headline)
    st.caption("The sidebar's time window applies to this trace; the other trace is shown whole.")

cols = st.columns(2)
for col, name, h in ((cols[0], a_name, ha), (cols[1], b_name, hb)):
    with col:
        st.subheader(name)
        st.plotly_chart(charts.split_bar({c: h[f"share_{c}"] for c in ui.CATEGORIES},
                                         title=f"Share of TTFT ({h['complete']:,} complete)"),
                        width="stretch", key=f"split_{name}")
        m = st.columns(4)
        m[0].metric("TTFT p50", data.fmt_ms(h["ttft_p50_ms"]))
        m[1].metric("TTFT p99", data.fmt_ms(h["ttft_p99_ms"]))
        m[2].metric("TPOT p50", data.fmt_ms(h["tpot_p50_ms"]))
        m[3].metric("Incomplete", f"{h['incomplete']:,}")

st.plotly_chart(charts.compare_shares(sa, sb, a_name, b_name), width="stretch", key="cmp_shares")

st.subheader("Percentiles per prompt-length bucket (ms)")
both = pd.concat([pa.assign(trace=a_name), pb.assign(trace=b_name)], ignore_index=True)
if not both.empty:
    order = {b: i for i, b in enumerate(data.sorted_buckets(both["prompt_bucket"]))}
    both["_o"] = both["prompt_bucket"].map(order)
    both = both.sort_values(["_o", "trace"]).drop(columns=["_o", "mode"])
    both = both[["prompt_bucket", "trace"] + [c for c in both.columns if c not in ("prompt_bucket", "trace")]]
st.dataframe(both, hide_index=True, width="stretch", key="cmp_pct",
             column_config={c: st.column_config.NumberColumn(format="%.1f") for c in both.columns if c.endswith("_ms")})
