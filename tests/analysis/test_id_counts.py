"""Distinct ids per request: requests.trace_count and request_base's linked_ids.

request_base reads the least and the greatest trace id (and linked id) of each side of a request in its
main pass and lists every distinct id only for the few requests where they differ (issue 17: cold cost of
the attribution rules). These cases put one, two, three and six distinct trace ids on the router's and
the engines' spans in different mixes, and one or two linked ids on the router's spans; the expected
counts are counted here from the rows written (events carry a trace id of their own, which the rule
does not count: "distinct W3C trace ids among the request's router, prefill and decode spans").
"""
import secrets

import pytest

from pdtrace_case_builder import Case, one


def _request(c, rid, b, linked=()):
    """A pull request: router root + dispatch + wait, P's queue and compute, D's transfer and first step
    (times in ms from ``b``). ``linked``: router.linked_request_id of the router's dispatch and wait spans."""
    root = c.router_request(rid, b, b + 100, "pull", first_token_ms=b + 90)
    for name, (s, e), link in zip(("router.dispatch", "router.wait"), ((b, b + 2), (b + 2, b + 90)),
                                  list(linked) + [None, None]):
        attrs = {"router.leg": "prefill"}
        if link:
            attrs["router.linked_request_id"] = link
        c.span("router", name, s, e, rid=rid, parent=root, attrs=attrs)
    c.span("prefill", "prefill.queue", b + 2, b + 5, rid=rid, engine="p0")
    c.span("prefill", "prefill.compute", b + 5, b + 50, rid=rid, engine="p0")
    c.span("decode", "kv.transfer", b + 50, b + 60, rid=rid, engine="d0", rank=0,
           attrs={"kv.bytes": 1 << 20, "kv.op": "READ", "peer.engine_id": "p0"})
    c.span("decode", "decode.first_step", b + 60, b + 88, rid=rid, engine="d0")


# per case: the trace id (a letter; None: a fresh id per span) of the router's 3 spans and the engines' 4
MIXES = {
    "one": ("aaa", "aaaa"),
    "router_split": ("abc", "aaaa"),
    "engines_split": ("aaa", "abcd"),
    "both_split": ("abb", "cccb"),
    "every_span": (None, None),
    "sides_differ": ("aaa", "bbbb"),  # one id per side, not the same: only least/greatest across sides tells
    "no_router": ("", "aaaa"),  # no router record at all (engine window): one id
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_trace_count(analyse, mix):
    c = Case()
    _request(c, "X", 0)
    letters = {k: secrets.token_hex(16) for k in "abcd"}
    router, engines = MIXES[mix]
    if router == "":  # drop the router's rows: the request is seen by the engines only
        c.rows = {k: v for k, v in c.rows.items() if k[0] != "router"}
    spans = {"router": [], "engines": []}
    for (role, _), rows in c.rows.items():
        for r in rows:
            if r["record"] == "event":
                r["trace_id"] = secrets.token_hex(16)  # not a span: never counted
            else:
                spans["router" if role == "router" else "engines"].append(r)
    for side, pattern in (("router", router), ("engines", engines)):
        assert len(spans[side]) == (len(pattern) if pattern is not None else 3 if side == "router" else 4)
        for i, r in enumerate(spans[side]):
            r["trace_id"] = secrets.token_hex(16) if pattern is None else letters[pattern[i]]
    expected = len({r["trace_id"] for side in spans.values() for r in side})
    tr = analyse(c)
    row = one(tr, "SELECT trace_count, flags FROM requests WHERE request_id = 'X'")
    assert row["trace_count"] == expected == {"one": 1, "router_split": 3, "engines_split": 4, "both_split": 3,
                                              "every_span": 7, "sides_differ": 2, "no_router": 1}[mix]
    assert ("split_trace" in row["flags"]) == (expected > 1)


@pytest.mark.parametrize("linked", [(), ("L1",), ("L1", "L1"), ("L2", "L1")])
def test_linked_ids(analyse, linked):
    c = Case()
    _request(c, "X", 0, linked=linked)
    tr = analyse(c)
    ids = one(tr, "SELECT linked_ids FROM _req_base WHERE request_id = 'X'")["linked_ids"]
    if not linked:
        assert ids is None
    else:
        assert sorted(ids) == sorted(set(linked))
