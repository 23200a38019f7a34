"""Request explorer on a store whose prefill clock is skewed: the correction is shown and the waterfall uses it.

Two hand-built pull stores from the same seed (same true times): in one every
clock agrees, in the other P's wall clock reads 250 ms ahead of D's and the
router's, and D's NIXL handshake recorded a clock sample (see
``storegen.build_store(p_clock_ahead_ms=...)``). The analysis estimates P's
offset from the sample (converted through both processes' clock anchors) and
the router<->engine HTTP bounds; the request page must say so (offset and
bound, as the views give them) and draw P's spans at their corrected times,
i.e. where the unskewed store draws them, not 250 ms late.
"""
from __future__ import annotations

import json

import pytest

from storegen import build_store

from pdtrace.instrument.stages import CATEGORIES

SKEW_MS = 250.0
N = 12


def _arr(v):
    if isinstance(v, dict) and "bdata" in v:
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v) if v is not None else []


def _waterfall(at) -> dict:
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return next(f for f in figs if "Waterfall" in f["layout"]["title"]["text"])


def _bars_by_stage(fig, raw: bool = False) -> dict[tuple[str, str], float]:
    """{(lane, stage): bar start in ms since arrival} of the waterfall's span bars (``raw``: the raw start
    the hover shows, ms since arrival)."""
    out = {}
    for tr in fig["data"]:
        if tr.get("type") != "bar" or not tr.get("text") or tr.get("name") in CATEGORIES:
            continue
        raws = [row[-3] if len(row) == 8 else row[2] for row in tr["customdata"]] if raw else _arr(tr["base"])
        for lane, stage, x in zip(_arr(tr["y"]), _arr(tr["text"]), raws):
            out[(lane, stage)] = x
    return out


@pytest.fixture(scope="module")
def skew_stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("skew")
    kw = dict(n_requests=N, mode="pull", seed=11, incident=None, n_incomplete=0)
    return {"skewed": build_store(root / "skewed", p_clock_ahead_ms=SKEW_MS, **kw),
            "aligned": build_store(root / "aligned", p_clock_ahead_ms=0.0, **kw)}


def test_views_estimate_the_skew_from_the_handshake_sample(views, skew_stores):
    """Precondition: the analysis finds P 250 ms ahead, within its bound, from the sample."""
    tr = views(skew_stores["skewed"])
    est = tr.query("""SELECT offset_ns, bound_ns, samples FROM clock_offsets
                      WHERE clock_a = 'd0' AND clock_b = 'p0' AND window_start_ns IS NULL""")
    assert len(est) == 1 and est[0]["samples"] == 1
    assert abs(est[0]["offset_ns"] - SKEW_MS * 1e6) <= 1_000  # anchors' wall-minus-monotonic medians (ns)
    p = tr.query("SELECT DISTINCT clock_offset_ns, clock_bound_ns FROM spans WHERE clock_domain = 'p0'")
    assert len(p) == 1
    assert abs(p[0]["clock_offset_ns"] - SKEW_MS * 1e6) <= p[0]["clock_bound_ns"] <= 1_000_000


def test_request_page_shows_the_correction_and_draws_corrected_times(app, views, skew_stores):
    tr = views(skew_stores["skewed"])
    rid = tr.query("SELECT request_id FROM requests ORDER BY arrival_ns LIMIT 1 OFFSET 3")[0]["request_id"]
    at = app(skew_stores["skewed"], "app_pages/request.py", {"request": rid})
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]

    # the note names every corrected clock with the shift applied and its bound, as the views give them
    doms = tr.query("""SELECT clock_domain, any_value(clock_offset_ns) AS off, max(clock_bound_ns) AS bound
                       FROM spans WHERE request_id = ? AND clock_offset_ns <> 0 GROUP BY 1 ORDER BY 1""", [rid])
    assert "p0" in [d["clock_domain"] for d in doms]
    note = " ".join(i.value for i in at.info if "Clock correction applied" in i.value)
    assert note, [i.value for i in at.info]
    for d in doms:
        assert f"`{d['clock_domain']}`" in note
        assert f"shifted by {-d['off'] / 1e6:+,.3f} ms (± {d['bound'] / 1e6:,.3f} ms)" in note, note
    assert "shifted by -250.000 ms (± 1.000 ms)" in note
    clock = next(x.value for x in at.dataframe if "shift_ms" in x.value.columns)
    row = clock[clock["clock_domain"] == "p0"].iloc[0]
    assert row["shift_ms"] == pytest.approx(-SKEW_MS, abs=1e-3)
    assert row["bound_ms"] == pytest.approx(1.0, abs=1e-3)
    assert row["role"] == "prefill"

    # the waterfall says which lanes were shifted, and draws P's spans at corrected times: where the
    # unskewed store (same true times) draws them, within the bound, not 250 ms later
    fig = _waterfall(at)
    axis = fig["layout"]["xaxis"]["title"]["text"]
    assert "clock-corrected" in axis and "p0 (prefill) -250.000 ms ± 1.000 ms" in axis, axis
    at0 = app(skew_stores["aligned"], "app_pages/request.py", {"request": rid})
    bars, bars0 = _bars_by_stage(fig), _bars_by_stage(_waterfall(at0))
    p_bars = {k: v for k, v in bars.items() if k[0].startswith("prefill")}
    assert {"prefill.queue", "prefill.compute"} <= {s for _, s in p_bars}
    for k, x in p_bars.items():
        assert x == pytest.approx(bars0[k], abs=1.0), k  # bound: 1 ms
        assert x < bars0[k] + SKEW_MS / 2, k  # a raw (uncorrected) time would sit 250 ms later
    # the raw start is kept beside the corrected one (hover): raw - corrected = the skew
    raws = _bars_by_stage(fig, raw=True)
    for k, x in p_bars.items():
        assert raws[k] - x == pytest.approx(SKEW_MS, abs=1e-3), k
    raw = tr.query("""SELECT min(raw_start_ns - start_ns) AS lo, max(raw_start_ns - start_ns) AS hi
                      FROM spans WHERE request_id = ? AND clock_domain = 'p0'""", [rid])[0]
    assert raw["lo"] == raw["hi"] and abs(raw["lo"] - SKEW_MS * 1e6) <= 1_000
    # every stage of the request lands in the same place on both stores (D within its own bound)
    for k, x in bars.items():
        assert x == pytest.approx(bars0[k], abs=1.0), k


def test_request_page_on_agreeing_clocks_says_no_correction(app, views, skew_stores):
    tr = views(skew_stores["aligned"])
    rid = tr.query("SELECT request_id FROM requests ORDER BY arrival_ns LIMIT 1 OFFSET 3")[0]["request_id"]
    assert tr.query("SELECT count(*) AS n FROM spans WHERE request_id = ? AND clock_offset_ns <> 0", [rid])[0]["n"] == 0
    at = app(skew_stores["aligned"], "app_pages/request.py", {"request": rid})
    assert not at.exception
    assert not any("Clock correction applied" in i.value for i in at.info)
    assert any("No clock correction applied" in c.value for c in at.caption)
