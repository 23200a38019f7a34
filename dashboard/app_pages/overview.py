"""Overview: where TTFT went (queue / compute / transfer / coordination), percentiles over time,
incomplete requests with causes, and the slowest requests (one click to their waterfall)."""
from __future__ import annotations

import streamlit as st

from pdtrace.dashboard import charts, data, ui

t = ui.trace()
w = ui.window()
h = ui.q(t, data.headline, w)

fl = ui.q(t, data.in_flight)
if not fl.empty:  # what is stuck right now comes first (DESIGN.md §4)
    st.title("In flight now")
    x_s = st.number_input("Stuck longer than (s)", min_value=0.0, value=10.0, step=1.0, key="stuck_s")
    stuck = fl[fl["age_ms"] >= x_s * 1000]
    c = st.columns(2)
    c[0].metric("In flight now", f"{len(fl):,}")
    c[1].metric(f"Stuck longer than {x_s:g} s", f"{len(stuck):,}")
    ev = st.dataframe(fl.drop(columns=["since_ns"]), hide_index=True, width="stretch", on_select="rerun",
                      selection_mode="single-row", key="in_flight_table",
                      column_config={"age_ms": st.column_config.NumberColumn(format="%.0f")})
    sel = ev.selection.rows if ev is not None else []
    if sel:
        ui.open_request(fl.iloc[sel[0]].request_id)
    st.caption("Requests not finished at the trace end (each process's last flush), oldest stage first: the "
               "stage each waits in, since how long, for what. Select a row to open its waterfall (open "
               "stages drawn to now).")

if ui.q(t, data.store_health)["requests"] == 0:  # only requests with nothing ended yet: in flight is all there is
    st.info("No request has ended a stage yet: the ones above are all the trace holds.")
    st.stop()

st.title("Where TTFT went")
if (note := data.engine_source_note(h["engine_source"], h["requests"])):
    st.warning(note + (f" Exposed router.unseen in the window: {data.fmt_ms(h['router_unseen_ms'])}."
                       if h["router_unseen_ms"] else ""), icon=":material/visibility_off:")
st.plotly_chart(charts.split_bar({c: h[f"share_{c}"] for c in ui.CATEGORIES},
                                 title=f"Share of TTFT over {h['complete']:,} complete requests in the window"),
                width="stretch", key="split")
st.markdown(" · ".join(f":{ui.CATEGORY_MD[c]}[**{c}** {ui.pct(h[f'share_{c}'])}]" for c in ui.CATEGORIES)
            + f" · unattributed (in coordination) {ui.pct(h['unattributed_share'])}")
cols = st.columns(7)
cols[0].metric("Requests", f"{h['requests']:,}")
cols[1].metric("Incomplete", f"{h['incomplete']:,}")
cols[2].metric("TTFT p50", data.fmt_ms(h["ttft_p50_ms"]))
cols[3].metric("TTFT p90", data.fmt_ms(h["ttft_p90_ms"]))
cols[4].metric("TTFT p99", data.fmt_ms(h["ttft_p99_ms"]))
cols[5].metric("TPOT p50", data.fmt_ms(h["tpot_p50_ms"]))
cols[6].metric("TPOT p99", data.fmt_ms(h["tpot_p99_ms"]))

rng = ui.q(t, data.time_range)
lo = w.start_ns if w.start_ns is not None else rng[0]
hi = w.end_ns if w.end_ns is not None else rng[1]
bucket = data.nice_bucket_ns(hi - lo)
shares = ui.q(t, data.category_share_over_time, w, bucket)
present = sorted(shares["mode"].dropna().unique()) if not shares.empty else []
left, right = st.columns(2)
with left:
    mode = None
    if len(present) > 1:
        mode = st.segmented_control("Mode", present, default=present[0], key="share_mode")
    st.plotly_chart(charts.share_over_time(shares, mode, title=f"TTFT share over time{' — ' + mode if mode else ''}"),
                    width="stretch", key="share_time")
with right:
    st.plotly_chart(charts.share_by_bucket(ui.q(t, data.category_share_by_bucket, w)), width="stretch",
                    key="by_bucket")

lat = ui.q(t, data.latency_over_time, w, bucket)
left, right = st.columns(2)
left.plotly_chart(charts.percentiles_over_time(lat, "ttft", "TTFT p50 / p90 / p99 (ms)"), width="stretch",
                  key="ttft_pct")
right.plotly_chart(charts.percentiles_over_time(lat, "tpot", "TPOT p50 / p90 / p99 (ms)"), width="stretch",
                   key="tpot_pct")
st.caption(f"Buckets of {bucket // 1_000_000_000} s of arrival time (UTC); solid = pull, dashed = push.")

st.subheader("Slowest requests")
slow = ui.q(t, data.slowest_requests, w, 20)
if slow.empty:
    st.info("No complete request in this window.")
else:
    top = slow.iloc[0]
    if st.button(f"Open the slowest request: {top.request_id} — TTFT {data.fmt_ms(top.ttft_ms)}, "
                 f"dominant stage {top.dominant_stage}", type="primary", key="open_slowest"):
        ui.open_request(top.request_id)
    ev = st.dataframe(
        slow.drop(columns=["run_id", "arrival_ns"]), hide_index=True, width="stretch",
        on_select="rerun", selection_mode="single-row", key="slow_table",
        column_config={c: st.column_config.NumberColumn(format="%.1f") for c in slow.columns if c.endswith("_ms")})
    sel = ev.selection.rows if ev is not None else []
    if sel:
        r = slow.iloc[sel[0]]
        ui.open_request(r.request_id)
    st.caption("Select a row to open its waterfall.")

st.subheader("Incomplete requests")
inc = ui.q(t, data.incomplete_by_cause, w)
if inc.empty:
    st.success("No incomplete request in this window.")
else:
    st.dataframe(inc, hide_index=True, width="stretch", key="inc_causes",
                 column_config={"median_time_to_failure_ms": st.column_config.NumberColumn(format="%.0f")})
    with st.expander("Incomplete requests, newest first"):
        st.dataframe(ui.q(t, data.incomplete_list, w), hide_index=True, width="stretch", key="inc_list")
