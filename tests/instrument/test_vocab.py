"""The one definition of roles, stage categories and clock conversion (instrument/stages.py, instrument/clock.py)."""
from __future__ import annotations

import time

from pdtrace.instrument import clock, stages


def test_kv_role_maps_to_engine_role_and_back():
    """vLLM's kv_role names each engine role once; anything else is no engine role (the caller's default)."""
    assert stages.role_of_kv_role("kv_producer") == "prefill"
    assert stages.role_of_kv_role("kv_consumer") == "decode"
    for role in stages.ENGINE_ROLES:
        assert stages.role_of_kv_role(stages.KV_ROLES[role]) == role
    assert stages.role_of_kv_role("kv_both") is None and stages.role_of_kv_role(None) is None
    assert stages.role_of_kv_role("kv_both", stages.DECODE) == "decode"
    assert stages.ROLES == ("router", "prefill", "decode") and stages.ENGINE_ROLES == stages.ROLES[1:]


def test_every_stage_names_a_known_role_and_category():
    """The stage table the analysis loads: owners are roles (or none), categories are the breakdown's four."""
    bad = {name: st for name, st in stages.STAGES.items()
           if st.role not in stages.ROLES + ("",) or st.category not in stages.CATEGORIES + (None,)}
    assert bad == {}
    leaf_roles = {st.role for st in stages.STAGES.values() if st.category is not None}
    assert leaf_roles == set(stages.ROLES) | {""}  # every role owns charged time; "" is 'unattributed' only
    assert [n for n, st in stages.STAGES.items() if st.role == ""] == ["unattributed"]


def test_wall_and_monotonic_conversions_agree_with_the_clocks():
    """wall_to_mono / mono_to_wall land on the other clock's reading of the same instant (within the
    scheduling slack of a few reads), are each other's inverse, and agree with a store anchor."""
    w0, m0 = time.time_ns(), time.monotonic_ns()
    assert abs(clock.wall_to_mono(w0) - m0) < 5_000_000
    assert abs(clock.mono_to_wall(m0) - w0) < 5_000_000
    assert abs(clock.mono_to_wall(clock.wall_to_mono(w0)) - w0) < 1_000_000
    a = clock.take_anchor()
    assert abs(clock.wall_minus_mono_ns() - a.offset_ns) < 1_000_000
    assert abs(clock.mono_to_wall(a.mono_ns) - a.wall_ns) < 1_000_000
