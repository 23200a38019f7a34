"""Plotly figures of the dashboard (renderers only: they take DataFrames from :mod:`.data`).

Colours are fixed per category everywhere (Okabe-Ito, colour-blind safe):
queue orange, compute blue, transfer green, coordination vermillion; time off
the critical path (hidden) is grey and hatched. Times on axes are UTC; ms on
value axes.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from pdtrace.instrument.stages import CATEGORIES

CATEGORY_COLORS = {"queue": "#E69F00", "compute": "#0072B2", "transfer": "#009E73", "coordination": "#D55E00"}
HIDDEN_COLOR = "#BBBBBB"
PARENT_COLOR = "#E5E5E5"
MODE_DASH = {"pull": "solid", "push": "dash"}
PCT_COLORS = {"p50": "#0072B2", "p90": "#E69F00", "p99": "#D55E00"}


def _layout(fig: go.Figure, height: int = 320, **kw) -> go.Figure:
    opts = dict(height=height, margin=dict(l=10, r=10, t=64, b=10), legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0,
                                                      traceorder="normal"),
                hovermode="x unified")
    opts.update(kw)
    fig.update_layout(**opts)
    return fig


def _ts(ns: pd.Series) -> pd.Series:
    return pd.to_datetime(ns.astype("int64"), unit="ns", utc=True)


def split_bar(shares: dict[str, float], title: str = "Where TTFT went") -> go.Figure:
    """One 100 % horizontal bar of the four category shares (fractions), labelled with percentages."""
    fig = go.Figure()
    for c in CATEGORIES:
        v = shares.get(c) or 0.0
        fig.add_bar(y=[""], x=[v * 100], orientation="h", name=c, marker_color=CATEGORY_COLORS[c],
                    text=[f"{c} {v * 100:.0f}%" if v >= 0.06 else ""], textposition="inside",
                    insidetextanchor="middle", textfont=dict(size=18, color="white"),
                    hovertemplate=f"{c}: %{{x:.1f}}% of TTFT<extra></extra>")
    fig.update_layout(barmode="stack", height=120, margin=dict(l=10, r=10, t=36, b=4), showlegend=False,
                      title=dict(text=title, font=dict(size=16)))
    fig.update_xaxes(range=[0, 100], ticksuffix="%", showgrid=False)
    return fig


def share_over_time(long: pd.DataFrame, mode: str | None = None, title: str = "") -> go.Figure:
    """Stacked area of each category's share of TTFT (%) per time bucket (``category_share_over_time``)."""
    df = long if mode is None else long[long["mode"] == mode]
    fig = go.Figure()
    for c in CATEGORIES:
        d = df[df["category"] == c].sort_values("bucket_ns")
        fig.add_scatter(x=_ts(d["bucket_ns"]), y=d["share"] * 100, name=c, stackgroup="one", mode="lines",
                        line=dict(width=0.5, color=CATEGORY_COLORS[c]), fillcolor=CATEGORY_COLORS[c],
                        customdata=d[["ms", "requests"]],
                        hovertemplate=f"{c}: %{{y:.1f}}%% (%{{customdata[0]:,.0f}} ms over %{{customdata[1]}} req)"
                                      "<extra></extra>".replace("%%", "%"))
    fig.update_yaxes(range=[0, 100], ticksuffix="%", title="share of TTFT")
    return _layout(fig, title=title or "TTFT share by category over time")


def share_by_bucket(long: pd.DataFrame, title: str = "") -> go.Figure:
    """Stacked bars of the category shares (%) per mode × prompt-length bucket (``category_share_by_bucket``)."""
    from . import data

    order = data.sorted_buckets(long["prompt_bucket"])
    fig = go.Figure()
    for c in CATEGORIES:
        d = long[long["category"] == c].copy()
        d["_o"] = d["prompt_bucket"].map({b: i for i, b in enumerate(order)})
        d = d.sort_values(["mode", "_o"])
        fig.add_bar(x=[d["mode"], d["prompt_bucket"]], y=d["share"] * 100, name=c, marker_color=CATEGORY_COLORS[c],
                    customdata=d[["mean_ms", "requests"]],
                    hovertemplate=f"{c}: %{{y:.1f}}%% · mean %{{customdata[0]:,.1f}} ms · %{{customdata[1]}} req"
                                  "<extra></extra>".replace("%%", "%"))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(range=[0, 100], ticksuffix="%", title="share of TTFT")
    fig.update_xaxes(title="mode / prompt tokens")
    return _layout(fig, title=title or "TTFT share by mode and prompt length", hovermode="closest")


def percentiles_over_time(df: pd.DataFrame, metric: str, title: str) -> go.Figure:
    """p50/p90/p99 lines (ms) of ``metric`` ('ttft' or 'tpot') per time bucket, one dash per mode.

    With no value at all (e.g. TPOT when the trace records no output-token counts) the empty axes say so.
    """
    fig = go.Figure()
    col = f"{metric}_p50_ms"
    if df.empty or col not in df or df[col].isna().all():
        fig.add_annotation(text=f"No {metric.upper()} values in this window"
                           + (" (TPOT needs a request's output-token count, gen_ai.usage.output_tokens, "
                              "and at least 2 tokens)" if metric == "tpot" else ""),
                           xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font=dict(color="#555555"))
    for mode, d in df.groupby("mode", sort=True):
        for p in ("p50", "p90", "p99"):
            fig.add_scatter(x=_ts(d["bucket_ns"]), y=d[f"{metric}_{p}_ms"], mode="lines+markers",
                            name=f"{mode} {p}", line=dict(color=PCT_COLORS[p], dash=MODE_DASH.get(mode, "dot")),
                            marker=dict(size=4), hovertemplate=f"{mode} {p}: %{{y:,.1f}} ms<extra></extra>")
    fig.update_yaxes(title="ms", rangemode="tozero")
    return _layout(fig, height=360, title=title, margin=dict(l=10, r=10, t=40, b=10),
                   legend=dict(orientation="h", yanchor="top", y=-0.15, xanchor="left", x=0.0))


def waterfall(spans: pd.DataFrame, segments: pd.DataFrame, events: pd.DataFrame,
              arrival_ns: int, first_token_ns: int | None) -> go.Figure:
    """A request's waterfall: one lane per role · engine · thread, the critical path on top.

    Lanes are those of the spans, then those of events on threads without a span.

    x is ms since the request's arrival at the router (router clock, after
    clock correction). Span bars are coloured by category; a span's time
    that is not on the critical path is drawn grey and hatched ('hidden'),
    parents (no category) light grey. The top lane 'critical path' shows the
    exclusive segments that tile [arrival, first token]. Events are markers.

    When a clock correction moved any span (``clock_offset_ns`` != 0), a note
    in the time axis' title names each corrected clock with the shift applied (ms,
    = -offset) and its bound (± ms), and each span's hover gives its raw
    (uncorrected) start beside the corrected one.
    """
    def rel(ns):
        return (ns.astype("int64") - arrival_ns) / 1e6

    lanes = ["critical path"] + list(dict.fromkeys(spans.sort_values("start_ns")["lane"]))
    fig = go.Figure()
    seen_legend: set[str] = set()
    # critical path lane
    for c in CATEGORIES:
        d = segments[segments["category"] == c]
        if d.empty:
            continue
        seen_legend.add(c)
        fig.add_bar(y=["critical path"] * len(d), base=rel(d["start_ns"]), x=d["dur_ms"], orientation="h",
                    marker=dict(color=CATEGORY_COLORS[c], line=dict(color="black", width=1)), name=c,
                    legendgroup=c, text=d["stage"], textposition="inside", insidetextanchor="middle",
                    customdata=d[["stage", "dur_ms", "detail"]].fillna(""),
                    hovertemplate="%{customdata[0]} · %{customdata[1]:,.2f} ms on the critical path"
                                  " %{customdata[2]}<extra>" + c + "</extra>")
    # span lanes: exposed part coloured, the rest hidden (leaf stages) or parent grey
    sp = spans.copy()
    sp["x0"] = rel(sp["start_ns"])
    sp["hidden_ms"] = (sp["dur_ms"] - sp["exposed_ms"]).clip(lower=0)
    sp["shift_ms"] = -sp["clock_offset_ns"].fillna(0).astype("int64") / 1e6
    sp["raw_x0"] = rel(sp["raw_start_ns"].fillna(sp["start_ns"]))
    for c in list(CATEGORIES) + [None]:
        d = sp[sp["category"] == c] if c else sp[sp["category"].isna()]
        if d.empty:
            continue
        color = CATEGORY_COLORS[c] if c else PARENT_COLOR
        on = d["exposed_ms"] > 0
        if c:
            fig.add_bar(y=d["lane"], base=d["x0"], x=d["dur_ms"], orientation="h", name=f"{c} (hidden/off path)",
                        legendgroup=c, showlegend=False,
                        marker=dict(color=[color if o else HIDDEN_COLOR for o in on],
                                    pattern=dict(shape=["" if o else "/" for o in on], fgcolor="#777777"),
                                    line=dict(color="black", width=[1.5 if o else 0 for o in on])),
                        text=d["stage"], textposition="inside", insidetextanchor="start",
                        customdata=d[["stage", "dur_ms", "exposed_ms", "hidden_ms", "span_id", "raw_x0",
                                      "shift_ms", "x0"]],
                        hovertemplate="%{customdata[0]} · %{customdata[1]:,.2f} ms; on critical path "
                                      "%{customdata[2]:,.2f} ms; off it %{customdata[3]:,.2f} ms<br>"
                                      "starts at %{customdata[7]:,.3f} ms (raw %{customdata[5]:,.3f} ms; clock shift "
                                      "%{customdata[6]:+,.3f} ms)<extra>" + c + "</extra>")
        else:
            fig.add_bar(y=d["lane"], base=d["x0"], x=d["dur_ms"], orientation="h", name="parent / step",
                        marker=dict(color=color, line=dict(color="#999999", width=0.5)), opacity=0.7,
                        text=d["stage"], textposition="inside", insidetextanchor="start",
                        customdata=d[["stage", "dur_ms", "raw_x0", "shift_ms", "x0"]],
                        hovertemplate="%{customdata[0]} · %{customdata[1]:,.2f} ms (not charged)<br>starts at "
                                      "%{customdata[4]:,.3f} ms (raw %{customdata[2]:,.3f} ms; clock shift "
                                      "%{customdata[3]:+,.3f} ms)<extra></extra>")
    fig.add_bar(y=[None], x=[None], name="hidden (off the critical path)", marker=dict(
        color=HIDDEN_COLOR, pattern=dict(shape="/", fgcolor="#777777")))
    if not events.empty:
        ev = events.copy()
        ev["x"] = rel(ev["time_ns"])
        # an event on a thread where the request has no span (e.g. D's push writer sending the registration)
        # gets its own lane: on the 'critical path' lane it would read as a critical-path event
        lanes += [ln for ln in dict.fromkeys(ev.sort_values("time_ns")["lane"]) if ln not in lanes]
        fig.add_scatter(x=ev["x"], y=ev["lane"], mode="markers+text", name="event",
                        marker=dict(symbol="diamond", size=11, color="black", line=dict(color="white", width=1)),
                        text=ev["event"], textposition="top center", textfont=dict(size=10),
                        hovertemplate="%{text} at %{x:,.2f} ms<extra></extra>")
    if first_token_ns is not None:
        fig.add_vline(x=(first_token_ns - arrival_ns) / 1e6, line=dict(color="black", dash="dot"),
                      annotation_text="first token", annotation_position="top")
    fig.update_layout(barmode="overlay", bargap=0.35)
    if first_token_ns is not None:  # the TTFT interval fills the view; double-click zooms out to the whole request
        ttft = (first_token_ns - arrival_ns) / 1e6
        fig.update_xaxes(range=[-0.02 * ttft, 1.12 * ttft])
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), title=None)
    note = clock_note(spans)  # second line of the axis title: where the reader looks for the time base
    fig.update_xaxes(title="ms since arrival at the router (router clock); double-click to see the whole request"
                     + (f"<br><span style='color:#8B4513'>{note}</span>" if note else ""))
    return _layout(fig, height=max(260, 60 + 44 * len(lanes) + (20 if note else 0)), hovermode="closest",
                   title="Waterfall (critical path outlined; grey hatched = hidden behind the critical path)")


def clock_note(spans: pd.DataFrame) -> str:
    """One line naming the clocks a correction moved, e.g. "clock-corrected: p0 (prefill) -250.000 ms ± 1.000 ms".

    From ``request_spans`` columns role, engine_id, clock_offset_ns, clock_bound_ns (ns): a span's
    clock is its engine id, else its role (the views' ``clock_domain``); the shift is -offset (ms), the
    bound the largest over the clock's spans (ms, '?' when unbounded). '' when nothing was moved.
    """
    if spans.empty or "clock_offset_ns" not in spans:
        return ""
    d = spans.assign(domain=spans["engine_id"].fillna(spans["role"]), off=spans["clock_offset_ns"].fillna(0))
    d = d[d["off"] != 0]
    if d.empty:
        return ""
    parts = []
    for dom, g in d.groupby("domain", sort=True):
        shifts = sorted(set((-g["off"] / 1e6).round(3)))
        shift = f"{shifts[0]:+,.3f} ms" if len(shifts) == 1 else f"{shifts[0]:+,.3f}..{shifts[-1]:+,.3f} ms"
        b = g["clock_bound_ns"].max()
        bound = "± ?" if pd.isna(b) else f"± {b / 1e6:,.3f} ms"
        parts.append(f"{dom} ({'/'.join(sorted(set(g['role'])))}) {shift} {bound}")
    return "clock-corrected to the router clock: " + "; ".join(parts)


def step_timeline(steps: pd.DataFrame, victim_rkeys: set | None = None) -> go.Figure:
    """D's step durations over time (ms), split into baseline, connector work on the forward thread and
    other excess; uses the ``decode_stalls`` columns start_ns, dur_ms, baseline_ms, connector_ms, excess_ms.

    A step with a baseline: baseline (capped at the step), then connector time up to the excess, then the
    rest of the excess. A step without one (no clean step of its batch shape to compare with): its
    connector time, then the rest of the step as "step (no baseline)" -- the connector time on the
    forward thread is shown either way.
    """
    d = steps.copy()
    x = _ts(d["start_ns"])
    has_base = d["baseline_ms"].notna()
    conn_all = d["connector_ms"].fillna(0).clip(lower=0, upper=d["dur_ms"])
    base = d["baseline_ms"].where(has_base, 0).clip(upper=d["dur_ms"])
    conn = conn_all.where(~has_base, conn_all.clip(upper=d["dur_ms"] - base))
    other = (d["dur_ms"] - base - conn).clip(lower=0).where(has_base, 0)
    unknown = (d["dur_ms"] - conn).clip(lower=0).where(~has_base, 0)
    fig = go.Figure()
    fig.add_bar(x=x, y=base, name="baseline step", marker_color="#9ecae1")
    if (~has_base).any():
        fig.add_bar(x=x, y=unknown, name="step (no baseline)", marker_color="#d9d9d9")
    fig.add_bar(x=x, y=conn, name="connector on forward thread", marker_color=CATEGORY_COLORS["coordination"])
    fig.add_bar(x=x, y=other, name="other excess (prefill / recompute)", marker_color=CATEGORY_COLORS["compute"])
    fig.update_layout(barmode="stack", bargap=0)
    fig.update_yaxes(title="step duration (ms)")
    return _layout(fig, title="Decode engine steps")


def growth_bars(df: pd.DataFrame, label_col: str, title: str, color_col: str | None = None) -> go.Figure:
    """Horizontal bars of growth in percentage points of TTFT share, largest growth on top."""
    d = df.head(15).iloc[::-1]
    colors = [CATEGORY_COLORS.get(c, "#666666") for c in d[color_col]] if color_col else "#D55E00"
    fig = go.Figure(go.Bar(y=d[label_col], x=d["growth_pp"], orientation="h", marker_color=colors,
                           text=[f"{v:+.1f} pp" for v in d["growth_pp"]], textposition="outside", cliponaxis=False,
                           hovertemplate="%{y}: %{x:+.1f} percentage points<extra></extra>"))
    fig.update_xaxes(title="change of share of TTFT (percentage points)", zeroline=True)
    return _layout(fig, height=max(240, 40 + 28 * len(d)), title=title, hovermode="closest")


def compare_shares(a: pd.DataFrame, b: pd.DataFrame, name_a: str, name_b: str) -> go.Figure:
    """Mean ms per category per prompt bucket, two traces side by side (grouped by bucket, stacked by category)."""
    from . import data

    fig = go.Figure()
    for label, d in ((name_a, a), (name_b, b)):
        if d.empty:
            continue
        order = data.sorted_buckets(d["prompt_bucket"])
        for c in CATEGORIES:
            dc = d[d["category"] == c].copy()
            dc["_o"] = dc["prompt_bucket"].map({x: i for i, x in enumerate(order)})
            dc = dc.sort_values("_o")
            fig.add_bar(x=[dc["prompt_bucket"], [label] * len(dc)], y=dc["mean_ms"], name=c, legendgroup=c,
                        showlegend=label == name_a, marker_color=CATEGORY_COLORS[c],
                        hovertemplate=f"{label} {c}: %{{y:,.1f}} ms mean<extra></extra>")
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="mean TTFT per request (ms)")
    fig.update_xaxes(title="prompt tokens / trace")
    return _layout(fig, title="Mean TTFT split per prompt-length bucket", hovermode="closest")
