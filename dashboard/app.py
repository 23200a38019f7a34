"""Entry script of the pdtrace dashboard (``streamlit run``; started by ``pdtrace dashboard DIR``).

Declares the pages with ``st.navigation`` and renders the shared sidebar
(trace directory, follow toggle, time window) before running the chosen
page. Pages are thin: they take numbers from :mod:`pdtrace.dashboard.data`
and figures from :mod:`pdtrace.dashboard.charts`.
"""
from __future__ import annotations

import streamlit as st

from pdtrace.dashboard import ui

st.set_page_config(page_title="pdtrace — where waiting happens", page_icon=":material/timer:", layout="wide")

PAGES = [
    st.Page("app_pages/overview.py", title="Overview", icon=":material/monitoring:", default=True),
    st.Page("app_pages/request.py", title="Request explorer", icon=":material/waterfall_chart:"),
    st.Page("app_pages/compare.py", title="Push vs pull", icon=":material/compare_arrows:"),
    st.Page("app_pages/stalls.py", title="Decode stalls", icon=":material/pause_circle:"),
    st.Page("app_pages/changed.py", title="What changed", icon=":material/difference:"),
    st.Page("app_pages/sql.py", title="SQL", icon=":material/terminal:"),
]

page = st.navigation(PAGES)
ui.sidebar()
trace = ui.trace_or_stop()
st.session_state["_window"] = ui.window_picker(trace)
page.run()
