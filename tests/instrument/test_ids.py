import hashlib

import pytest

from pdtrace.instrument import ids


@pytest.mark.parametrize("rid, base, index, suffix", [
    ("cmpl-X1-0-1a2b3c4d", "X1", 0, "1a2b3c4d"),
    ("cmpl-X2-0-5e6f7a8b", "X2", 0, "5e6f7a8b"),
    ("cmpl-abc-def-3-0badbeef", "abc-def", 3, "0badbeef"),
    ("cmpl-abc-def-3", "abc-def", 3, None),
    ("chatcmpl-X9-deadbeef", "X9", 0, "deadbeef"),
    ("chatcmpl-X9", "X9", 0, None),
    ("plainid", "plainid", 0, None),
    ("req-deadbeef", "req-deadbeef", 0, None),  # a bare router id is not cut
])
def test_parse_request_id(rid, base, index, suffix):
    p = ids.parse_request_id(rid)
    assert (p.base, p.prompt_index, p.suffix) == (base, index, suffix)


def test_same_base_different_suffix_join():
    # P's and D's internal ids differ only in the 8-hex suffix: same base.
    assert ids.base_id("cmpl-Q-0-1a2b3c4d") == ids.base_id("cmpl-Q-0-99999999") == "Q"


def test_internal_flag_forces_strip():
    assert ids.parse_request_id("req-deadbeef", internal=True).base == "req"
    # taken as external, it is not of the cmpl-X-i form (ends in hex): kept whole
    assert ids.parse_request_id("cmpl-a-0-deadbeef", internal=False).base == "cmpl-a-0-deadbeef"


def test_parse_rejects_non_str():
    with pytest.raises(TypeError):
        ids.parse_request_id(12)


def test_sampling_rule_is_sha256_below_threshold():
    for i in range(200):
        x = f"req{i}"
        v = int.from_bytes(hashlib.sha256(x.encode()).digest(), "big")
        assert ids.is_sampled(x, 0.5) == (v < (1 << 255))
    assert all(ids.is_sampled(f"r{i}", 1.0) for i in range(50))
    assert not any(ids.is_sampled(f"r{i}", 0.0) for i in range(50))
    kept = sum(ids.is_sampled(f"r{i}", 0.25) for i in range(4000))
    assert 850 < kept < 1150


def test_threshold_bounds():
    assert ids.sample_threshold(1.0) == 1 << 256
    with pytest.raises(ValueError):
        ids.sample_threshold(1.5)


def test_trace_id_and_traceparent():
    x = "abc"
    assert ids.trace_id(x) == hashlib.sha256(b"abc").hexdigest()[:32]
    assert ids.traceparent(x, 0xAB, True) == f"00-{ids.trace_id(x)}-00000000000000ab-01"
    assert ids.traceparent(x, 1, False).endswith("-00")
