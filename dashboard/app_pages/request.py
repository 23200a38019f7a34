"""Request explorer: one request's waterfall across router, prefill and decode (one lane per role,
engine and thread), its critical path, hidden time, events and the clock correction applied."""
from __future__ import annotations

import streamlit as st

from pdtrace.dashboard import charts, data, ui

t = ui.trace()
w = ui.window()

st.title("Request explorer")
qp = st.query_params
default_id = qp.get("request", "")
c1, c2 = st.columns([3, 2])
rid = c1.text_input("Request id (X-Request-Id)", value=default_id, key="req_id",
                    help="The router's request id; vLLM's cmpl-/chatcmpl- prefix and suffixes are stripped.")
with c2:
    slow = ui.q(t, data.slowest_requests, w, 20)
    pick = st.selectbox("…or one of the slowest in the window", [""] + slow["request_id"].tolist(), key="req_pick",
                        format_func=lambda r: r and f"{r} — TTFT " + data.fmt_ms(
                            float(slow.loc[slow.request_id == r, "ttft_ms"].iloc[0])))
if pick:
    rid = pick
if not rid:
    st.info("Enter a request id, pick one of the slowest, or click a request on the Overview.")
    st.stop()
if rid != qp.get("request"):
    st.query_params["request"] = rid
row = ui.q(t, data.request_row, rid)
if row is None and (fl := ui.q(t, data.in_flight_request, rid)) is not None:
    # nothing of it has ended yet (only open stages): no requests row, but it is stuck right now
    st.subheader(f"`{rid}` · {fl['mode']} · in flight")
    st.warning(f"**In flight**: stuck in `{fl['stage']}` on {fl['role']} `{fl['engine_id']}` for "
               f"{data.fmt_ms(fl['age_ms'])}, waiting for {fl['waits_for'] or 'an unknown input'}. No stage of it "
               "has ended yet; its open stages are drawn to the trace end (now).", icon=":material/hourglass_top:")
    fkey = int(fl["rkey"])
    spans = ui.q(t, data.request_spans, fkey)
    st.plotly_chart(charts.waterfall(spans, ui.q(t, data.request_segments, fkey), ui.q(t, data.request_events, fkey),
                                     int(spans["start_ns"].min()), None), width="stretch", key="waterfall")
    st.stop()
if row is None:
    near = ui.q(t, data.find_requests, rid)
    st.warning(f"No request `{rid}` in this trace." + (" Did you mean one of these?" if len(near) else ""))
    if len(near):
        st.dataframe(near, hide_index=True, key="near")
    st.stop()

rkey = int(row["rkey"])
complete = row["status"] == "complete"
st.subheader(f"`{rid}` · {row['mode']} · {row['status']}" + ("" if complete else f" — cause: {row['cause']}"))
m = st.columns(7)
m[0].metric("TTFT", data.fmt_ms(row["ttft_ms"]))
for i, c in enumerate(ui.CATEGORIES):
    m[i + 1].metric(c.capitalize(), data.fmt_ms(row.get(f"{c}_ms")))
m[5].metric("Hidden", data.fmt_ms(row.get("hidden_ms")), help="Stage time that ran off the critical path "
            "(the losing branch of a join): speeding it up would not lower TTFT.")
m[6].metric("TPOT", data.fmt_ms(row.get("tpot_ms")))
facts = [f"prompt {row['prompt_tokens']} tokens" if row.get("prompt_tokens") == row.get("prompt_tokens") else None,
         f"dominant stage **{row['dominant_stage']}**" if row.get("dominant_stage") else None,
         "**first contact** (handshake on this engine pair)" if row.get("first_contact") else None,
         f"P `{row['prefill_engine']}`" if row.get("prefill_engine") else None,
         f"D `{row['decode_engine']}`" if row.get("decode_engine") else None]
st.markdown(" · ".join(f for f in facts if f))
if row.get("ttft_source") == "engine":
    st.warning("**Router hop unseen**: no router record for this request, so its TTFT is the engines' own window "
               "(P's API server received it → D's API server wrote the first token chunk). The router's time "
               "before P and after D is not in it; its hop between the legs is `router.unseen`"
               + (f" ({data.fmt_ms(row['router_unseen_ms'])})" if row.get("router_unseen_ms") else "") + ".",
               icon=":material/visibility_off:")

spans = ui.q(t, data.request_spans, rkey)
segs = ui.q(t, data.request_segments, rkey)
evs = ui.q(t, data.request_events, rkey)
first_ns = int(row["first_token_ns"]) if complete and row.get("first_token_ns") == row.get("first_token_ns") else None
st.plotly_chart(charts.waterfall(spans, segs, evs, int(row["arrival_ns"]), first_ns), width="stretch",
                key="waterfall")

clock = ui.clock_corrections(ui.q(t, data.request_clock, rkey), spans)
if len(clock):
    parts = [f"`{r.clock_domain}` ({r.role}) shifted by {r.shift_ms:+,.3f} ms"
             + (f" (± {r.bound_ms:,.3f} ms)" if r.bound_ms == r.bound_ms else " (unbounded)")
             for r in clock.itertuples()]
    ref = ("the router clock" if row.get("ttft_source") != "engine"
           else "the reference prefill engine's clock (no router record)")
    st.info(f"**Clock correction applied**: times are shown on {ref}; " + "; ".join(parts)
            + ". A clock's shift is minus its estimated offset from the router's; the bound is how far the "
            "true offset may be from it (see the `clock_offsets` view).")
    st.dataframe(clock, hide_index=True, key="clock", column_config={
        c: st.column_config.NumberColumn(format="%.3f") for c in ("shift_ms", "offset_ms", "bound_ms")})
else:
    st.caption("No clock correction applied: every process's clock agrees with the router's.")

left, right = st.columns(2)
with left:
    st.markdown("**Critical path** (exclusive segments; they sum to TTFT)")
    st.dataframe(segs[["seq", "stage", "category", "dur_ms", "detail"]], hide_index=True, width="stretch",
                 key="segs", column_config={"dur_ms": st.column_config.NumberColumn(format="%.3f")})
with right:
    st.markdown("**Hidden time** (ran while the critical path was elsewhere)")
    hid = ui.q(t, data.request_hidden, rkey)
    if hid.empty:
        st.caption("None: nothing overlapped the critical path.")
    else:
        st.dataframe(hid, hide_index=True, width="stretch", key="hidden",
                     column_config={"hidden_ms": st.column_config.NumberColumn(format="%.3f")})
    st.markdown("**Events**")
    if evs.empty:
        st.caption("No events.")
    else:
        ev = evs.assign(ms=(evs["time_ns"] - int(row["arrival_ns"])) / 1e6)
        st.dataframe(ev[["event", "lane", "ms"]], hide_index=True, width="stretch", key="events",
                     column_config={"ms": st.column_config.NumberColumn("ms since arrival", format="%.3f")})
with st.expander("All spans of this request"):
    st.dataframe(spans.drop(columns=["attr_int", "attr_str"]), hide_index=True, width="stretch", key="spans")
