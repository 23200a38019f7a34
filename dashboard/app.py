"""Entry script of the pdtrace dashboard (``streamlit run``; started by ``pdtrace dashboard DIR``).

Declares the pages with ``st.navigation`` and renders the shared sidebar
(trace directory, follow toggle, time window) before running the chosen
page. Pages are thin: they take numbers from :mod:`pdtrace.dashboard.data`
and figures from :mod:`pdtrace.dashboard.charts`.
"""
from __future__ import annotations

import streamlit as st

from pdtrace.dashboard import ui

# No page_icon: a Material icon favicon is fetched from fonts.gstatic.com, and incidents may be offline.
st.set_page_config(page_title="pdtrace — where waiting happens", layout="wide")

PAGES = [
    st.Page("app_pages/overview.py", title="Overview", default=True),
    st.Page("app_pages/request.py", title="Request explorer"),
    st.Page("app_pages/compare.py", title="Push vs pull"),
    st.Page("app_pages/stalls.py", title="Decode stalls"),
    st.Page("app_pages/changed.py", title="What changed"),
    st.Page("app_pages/sql.py", title="SQL"),
]

page = st.navigation(PAGES)
ui.sidebar()
trace = ui.trace_or_stop()
st.session_state["_window"] = ui.window_picker(trace)
page.run()
