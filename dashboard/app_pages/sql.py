"""SQL: a read-only console over the same views, with every view's column docs."""
from __future__ import annotations

import streamlit as st

from pdtrace.analysis.sandbox import ReadOnlyError
from pdtrace.dashboard import data, ui

t = ui.trace()
st.title("SQL")
st.caption("Read-only (the analysis' rule, as in `pdtrace sql`): one query (SELECT, or EXPLAIN of one) at a time, "
           "over the analysis views; no file reads or writes outside the trace directory. "
           "Times are ns since the Unix epoch (router clock); durations in ns or ms as the column says.")
sql = st.text_area("Query", key="sql_text", height=140, value=(
    "SELECT mode, count(*) AS requests, round(quantile_cont(ttft_ms, 0.99), 1) AS ttft_p99_ms,\n"
    "       round(sum(coordination_ms) / sum(ttft_ms), 3) AS coordination_share\n"
    "FROM ttft_breakdown GROUP BY mode ORDER BY mode"))
if st.button("Run", type="primary", key="sql_run") or st.session_state.get("sql_ran"):
    st.session_state["sql_ran"] = True
    try:
        df, truncated = ui.console_query(t, sql)
    except ReadOnlyError as exc:  # the analysis' read-only rule refused it before it ran
        st.error(f"Refused: {exc}")
    except Exception as exc:  # duckdb errors (incl. file access DuckDB refused): they are the user's query
        st.error(f"{type(exc).__name__}: {exc}")
    else:
        st.dataframe(df, hide_index=True, width="stretch", key="sql_result")
        st.caption(f"{len(df):,} rows" + (f" (first {ui.CONSOLE_MAX_ROWS:,} shown)" if truncated else ""))

st.subheader("Views")
docs = ui.q(t, data.view_docs)
views = docs["view"].drop_duplicates().tolist()
view = st.selectbox("View", views, key="doc_view")
d = docs[docs["view"] == view]
st.markdown(f"**`{view}`** — {d['view_doc'].iloc[0] or ''}")
st.dataframe(d[["column", "type", "column_doc"]], hide_index=True, width="stretch", key="doc_cols")
