"""Output tokens and TPOT when the router records no token count (real lab stores).

The router writes chunks, not tokens: on a lab store it records no
gen_ai.usage.output_tokens, so output_tokens comes from D's scheduler's
``request.finished`` event (tokens D generated, recorded when it finishes a
sampled request normally). TPOT stays (router last token - router first
token) / (output_tokens - 1).
"""
from pdtrace_case_builder import Case


def _router_only_times(c, rid, first_ms, last_ms, prompt_index=0, output_tokens=None):
    """A router root with first/last token events and, unless given, no output-token count."""
    rows = c.rows[("router", None)]
    n = len(rows)
    c.router_request(rid, 0, last_ms + 5, "pull", first_token_ms=first_ms, last_token_ms=last_ms)
    for r in rows[n:]:
        r["prompt_index"] = prompt_index
        if r["name"] == "router.request":
            r["attrs"].pop("gen_ai.usage.output_tokens")
            if output_tokens is not None:
                r["attrs"]["gen_ai.usage.output_tokens"] = output_tokens


def _finished(c, rid, at_ms, tokens, attempt=0, role="decode", engine="d0", prompt_index=0):
    c.event(role, "request.finished", at_ms, rid=rid, engine=engine, attempt=attempt,
            attrs={"gen_ai.usage.output_tokens": tokens, "request.internal_id": f"cmpl-{rid}-0-0a1b2c3d"})
    c.rows[(role, engine)][-1]["prompt_index"] = prompt_index


def _case():
    c = Case()
    # o1: only D's event. First token 100, last 1100, 51 tokens -> TPOT 1000 / 50 = 20 ms.
    _router_only_times(c, "o1", 100, 1100)
    _finished(c, "o1", 1098, 51)
    # o2: D recomputed the request: attempt 0 finished with 7 tokens is superseded by
    #   attempt 1 (41 tokens; a second copy of the count with 40 -> the max, 41) -> 1000 / 40 = 25 ms.
    _router_only_times(c, "o2", 100, 1100)
    _finished(c, "o2", 500, 7, attempt=0)
    _finished(c, "o2", 1090, 40, attempt=1)
    _finished(c, "o2", 1098, 41, attempt=1)
    # o3: the router's own count wins over D's: 11 -> 1000 / 10 = 100 ms.
    _router_only_times(c, "o3", 100, 1100, output_tokens=11)
    _finished(c, "o3", 1098, 99)
    # o4: only P recorded a request.finished (not D's count): no output tokens, no TPOT.
    _router_only_times(c, "o4", 100, 1100)
    _finished(c, "o4", 90, 1, role="prefill", engine="p0")
    # o5: two prompts of one request (cmpl-o5-0, cmpl-o5-1): each index has its own count.
    _router_only_times(c, "o5", 100, 1100, prompt_index=0)
    _finished(c, "o5", 1098, 11, prompt_index=0)
    _router_only_times(c, "o5", 100, 600, prompt_index=1)
    _finished(c, "o5", 598, 6, prompt_index=1)
    # o6: a single generated token: output_tokens 1, TPOT undefined.
    _router_only_times(c, "o6", 100, 100)
    _finished(c, "o6", 99, 1)
    return c


def test_output_tokens_from_decode_request_finished(analyse):
    tr = analyse(_case())
    got = {(r["request_id"], r["prompt_index"]): (r["output_tokens"], r["tpot_ms"])
           for r in tr.query("SELECT request_id, prompt_index, output_tokens, tpot_ms FROM requests")}
    assert got == {
        ("o1", 0): (51, 20.0),
        ("o2", 0): (41, 25.0),
        ("o3", 0): (11, 100.0),
        ("o4", 0): (None, None),
        ("o5", 0): (11, 100.0),
        ("o5", 1): (6, 100.0),
        ("o6", 0): (1, None),
    }
    # the other views read the same count
    rs = {r["request_id"]: r for r in tr.query("SELECT * FROM request_stalls WHERE prompt_index = 0")}
    assert rs["o1"]["output_tokens"] == 51 and rs["o1"]["tpot_ms"] == 20.0
    assert rs["o2"]["output_tokens"] == 41 and rs["o2"]["tpot_ms"] == 25.0
    # the summary's TPOT: 5 requests with one (20, 25, 100, 100, 100 ms)
    m = tr.query("SELECT * FROM summary_by_mode")
    assert len(m) == 1 and m[0]["tpot_p50_ms"] == 100.0 and m[0]["tpot_mean_ms"] == 69.0
