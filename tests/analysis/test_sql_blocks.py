"""Golden tests of the SQL building blocks of the TTFT critical path, and of the modules' headers.

In the style of Perfetto's diff tests: each macro runs on inline input (a CTE over VALUES), the
input is drawn as a timeline in a comment, and the test asserts the whole output -- every row and
every column, with the column names. Times are plain integers (ns in the library).

- ``_latest_end_wins`` (module intervals): "latest end wins" flattening (ttft_segments step 4).
- ``_uncovered`` (module intervals): gap filling, the instants no interval covers (step 5).
- ``_handoff_join`` (module ttft_segments): the join rule, where the handoff starts (step 3).

Then every module loads into a fresh database with only what its ``-- requires:`` header names
(transitively), so a module that uses another's view or macro without declaring it fails here.
"""
import re

import duckdb
import pytest

from pdtrace.analysis import loader


def _db(*names: str) -> duckdb.DuckDBPyConnection:
    """A fresh in-memory database with the base tables and the modules ``names`` (and what they require)."""
    con = duckdb.connect()
    con.execute(loader.base_tables_sql())
    for mod in loader.with_requirements(names):
        con.execute(mod.text)
    return con


@pytest.fixture(scope="module")
def con():
    c = _db("ttft_segments")  # requires intervals
    yield c
    c.close()


def _run(con, sql: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of ``sql``."""
    cur = con.execute(sql)
    return [d[0] for d in cur.description], cur.fetchall()


# ---------------------------------------------------------------- _latest_end_wins

def _lew(con, values: str, *, key: str = "k1") -> tuple[list[str], list[tuple]]:
    """_latest_end_wins over rows (k1, k2, id, s, e, label) given as a VALUES list (or a typed empty SELECT),
    partitioned by ``key``."""
    return _run(con, f"""
        WITH t AS (SELECT * FROM ({values}) v(k1, k2, id, s, e, label))
        SELECT * FROM _latest_end_wins('t', {key}, s, e, id) ORDER BY k1, id""")


LEW_COLS = ["k1", "k2", "id", "s", "e", "label", "owned_end"]


def test_latest_end_wins_staircase(con):
    # 0    3    5    6    8   10
    # |A--------|                  A [0, 5]
    #      |B--------------|       B [3, 8]
    #                |C---------|  C [6, 10]
    # => A [0, 3]  B [3, 6]  C [6, 10]: each owns up to the start of the next one to end
    cols, rows = _lew(con, "VALUES (1, 0, 1, 0, 5, 'A'), (1, 0, 2, 3, 8, 'B'), (1, 0, 3, 6, 10, 'C')")
    assert cols == LEW_COLS
    assert rows == [(1, 0, 1, 0, 5, "A", 3), (1, 0, 2, 3, 8, "B", 6), (1, 0, 3, 6, 10, "C", 10)]


def test_latest_end_wins_nested(con):
    # 0    2         5         10
    # |O-----------------------|   O [0, 10] (outer, ends last)
    #      |I--------|             I [2, 5]  (inside O)
    # => O owns all of [0, 10]; I owns nothing and is dropped (it ended before O did)
    cols, rows = _lew(con, "VALUES (1, 0, 1, 0, 10, 'O'), (1, 0, 2, 2, 5, 'I')")
    assert cols == LEW_COLS
    assert rows == [(1, 0, 1, 0, 10, "O", 10)]


def test_latest_end_wins_equal_ends(con):
    # 0    2                   10
    # |O-----------------------|   O [0, 10]
    #      |I------------------|   I [2, 10] (same end, later start)
    # => equal ends: the later start owns the shared part: I [2, 10], O keeps [0, 2]
    cols, rows = _lew(con, "VALUES (1, 0, 1, 0, 10, 'O'), (1, 0, 2, 2, 10, 'I')")
    assert rows == [(1, 0, 1, 0, 10, "O", 2), (1, 0, 2, 2, 10, "I", 10)]


def test_latest_end_wins_identical_intervals(con):
    # 0    4
    # |X---|   X [0, 4] id 7
    # |Y---|   Y [0, 4] id 3
    # => same start and end: the lower tie (id 3, Y) owns it; X owns nothing
    cols, rows = _lew(con, "VALUES (1, 0, 7, 0, 4, 'X'), (1, 0, 3, 0, 4, 'Y')")
    assert rows == [(1, 0, 3, 0, 4, "Y", 4)]


def test_latest_end_wins_touching_and_empty(con):
    # 0    5    8
    # |A---|          A [0, 5]
    #      |B---|     B [5, 8] (starts where A ends)
    #      |          Z [5, 5] (zero length)
    # => A [0, 5], B [5, 8]; Z owns nothing
    cols, rows = _lew(con, "VALUES (1, 0, 1, 0, 5, 'A'), (1, 0, 2, 5, 8, 'B'), (1, 0, 3, 5, 5, 'Z')")
    assert rows == [(1, 0, 1, 0, 5, "A", 5), (1, 0, 2, 5, 8, "B", 8)]


def test_latest_end_wins_keys_are_independent(con):
    # key (1, 0):  |A [0, 6]|            key (1, 1):  |C [0, 6]|
    #                 |B [4, 9]|
    # key (2, 0):  |D [2, 3]|
    # => with key row(k1, k2), only rows of the same (k1, k2) compete: A [0, 4], B [4, 9], C [0, 6], D [2, 3]
    cols, rows = _lew(con, "VALUES (1, 0, 1, 0, 6, 'A'), (1, 0, 2, 4, 9, 'B'), (1, 1, 3, 0, 6, 'C'),"
                           " (2, 0, 4, 2, 3, 'D')", key="row(k1, k2)")
    assert rows == [(1, 0, 1, 0, 6, "A", 4), (1, 0, 2, 4, 9, "B", 9), (1, 1, 3, 0, 6, "C", 6),
                    (2, 0, 4, 2, 3, "D", 3)]
    # the same rows with key k1: C competes with A and B
    # key 1: |A [0, 6]| |C [0, 6]| |B [4, 9]|  => B [4, 9]; A and C end together and start together:
    #        the lower id (A) owns [0, 4], C nothing
    cols, rows = _lew(con, "VALUES (1, 0, 1, 0, 6, 'A'), (1, 0, 2, 4, 9, 'B'), (1, 1, 3, 0, 6, 'C'),"
                           " (2, 0, 4, 2, 3, 'D')")
    assert rows == [(1, 0, 1, 0, 6, "A", 4), (1, 0, 2, 4, 9, "B", 9), (2, 0, 4, 2, 3, "D", 3)]


def test_latest_end_wins_null_end(con):
    # 0    1    3    6
    #      |N-------------->?    N [1, NULL] (end unknown)
    #           |A---|           A [3, 6]
    # => A (a known end) owns [3, 6]; N sorts after every end: it owns [1, 3], up to A's start
    cols, rows = _lew(con, "VALUES (1, 0, 1, 1, NULL, 'N'), (1, 0, 2, 3, 6, 'A')")
    assert rows == [(1, 0, 1, 1, None, "N", 3), (1, 0, 2, 3, 6, "A", 6)]
    # alone, a NULL end owns nothing
    cols, rows = _lew(con, "VALUES (1, 0, 1, 1, NULL::INTEGER, 'N')")
    assert rows == []


def test_latest_end_wins_empty_input(con):
    cols, rows = _lew(con, "SELECT 1, 0, 1, 0, 5, 'A' WHERE false")
    assert cols == LEW_COLS
    assert rows == []


# ---------------------------------------------------------------- _uncovered

UNC_COLS = ["k", "gap_start", "gap_end", "prev_label", "next_label"]


def _unc(con, intervals: str, windows: str) -> tuple[list[str], list[tuple]]:
    """_uncovered over intervals (k, s, e, label) and windows (k, lo, hi), VALUES lists or typed empty
    SELECTs; each interval row carries its window's lo as the macro asks."""
    return _run(con, f"""
        WITH w AS (SELECT * FROM ({windows}) v(k, lo, hi)),
             i AS (SELECT i.*, w.lo FROM ({intervals}) i(k, s, e, label) JOIN w USING (k))
        SELECT * FROM _uncovered('i', 'w') ORDER BY k, gap_start""")


def test_uncovered_gaps_named_by_neighbours(con):
    # window [0, 20]
    # 0    2    5    9    12   15   20
    # .....|a---|b---|....|c---|.....
    # => gaps [0, 2] (window start .. a), [9, 12] (b .. c), [15, 20] (c .. window end)
    cols, rows = _unc(con, "VALUES (1, 2, 5, 'a'), (1, 5, 9, 'b'), (1, 12, 15, 'c')",
                      "VALUES (1, 0, 20)")
    assert cols == UNC_COLS
    assert rows == [(1, 0, 2, None, "a"), (1, 9, 12, "b", "c"), (1, 15, 20, "c", None)]


def test_uncovered_empty_and_covered_windows(con):
    # key 1: window [0, 10], no intervals                  => one gap [0, 10]
    # key 2: window [0, 10] |a [0, 4]|b [4, 10]|           => covered: no gap
    # key 3: window [5, 5] (zero length)                   => no gap
    # key 4: window [0, 8] |a [0, 3]| .. |b [6, 8]|        => [3, 6]; no gap at either edge
    cols, rows = _unc(con, "VALUES (2, 0, 4, 'a'), (2, 4, 10, 'b'), (4, 0, 3, 'a'), (4, 6, 8, 'b')",
                      "VALUES (1, 0, 10), (2, 0, 10), (3, 5, 5), (4, 0, 8)")
    assert cols == UNC_COLS
    assert rows == [(1, 0, 10, None, None), (4, 3, 6, "a", "b")]


def test_uncovered_struct_keys_are_independent(con):
    # a parent's own time (ttft_segments: key {rkey, span_id}, window = the parent's interval)
    # key {1, 7}: window [0, 10] |a [2, 4]|
    # key {1, 8}: window [0, 10]           |b [6, 10]|
    # => {1, 7}: [0, 2], [4, 10]   {1, 8}: [0, 6] -- b does not cover {1, 7}'s instants
    k7, k8 = "{'rkey': 1, 'span_id': 7}", "{'rkey': 1, 'span_id': 8}"
    cols, rows = _unc(con, f"VALUES ({k7}, 2, 4, 'a'), ({k8}, 6, 10, 'b')", f"VALUES ({k7}, 0, 10), ({k8}, 0, 10)")
    assert cols == UNC_COLS
    r7, r8 = {"rkey": 1, "span_id": 7}, {"rkey": 1, "span_id": 8}
    assert rows == [(r7, 0, 2, None, "a"), (r7, 4, 10, "a", None), (r8, 0, 6, None, "b")]


def test_uncovered_null_end(con):
    # window [0, 10]
    # 0    2    6    8    10
    # .....|a-------?     a [2, NULL] (end unknown)
    #           |b---|    b [6, 8]
    # => [0, 2] before a; after a its end is unknown, so the gap before b starts at the window's
    #    start: [0, 6] (callers pass closed intervals); [8, 10] after b
    cols, rows = _unc(con, "VALUES (1, 2, NULL, 'a'), (1, 6, 8, 'b')", "VALUES (1, 0, 10)")
    assert rows == [(1, 0, 2, None, "a"), (1, 0, 6, "a", "b"), (1, 8, 10, "b", None)]


def test_uncovered_empty_input(con):
    cols, rows = _unc(con, "SELECT 1, 0, 1, 'a' WHERE false", "SELECT 1, 0, 1 WHERE false")
    assert cols == UNC_COLS
    assert rows == []


# ---------------------------------------------------------------- _handoff_join

JOIN_COLS = ["rkey", "join_ns", "chain_end_ns", "xfer_end_ns", "input_ns", "att_ns"]


def _join(con, values: str) -> tuple[list[str], list[tuple]]:
    """_handoff_join over candidates (rkey, stage, stage_group, branch, s0, e0, attempt_start_ns)."""
    return _run(con, f"""
        WITH c AS (SELECT * FROM ({values}) v(rkey, stage, stage_group, branch, s0, e0, attempt_start_ns))
        SELECT * FROM _handoff_join('c') ORDER BY rkey""")


def test_handoff_join_pull(con):
    # request 1 (pull)
    # 10                50   60   70   75        90   95        120
    # |prefill.compute--|                                            P
    #                        |dq--|                                  D decode.queue
    #                             |prep|xfer-----|rdy-|first_step|   D
    # => J = 70 (handoff.prep's start; I = 50, P's KV ready, is earlier); chain ends 120;
    #    transfer ends 90; no retry
    cols, rows = _join(con, """VALUES
        (1, 'prefill.compute', 'prefill.compute', 'prefill', 10, 50, NULL),
        (1, 'decode.queue', 'decode.queue', 'decode', 60, 70, NULL),
        (1, 'handoff.prep', 'handoff.prep', 'decode', 70, 75, NULL),
        (1, 'kv.transfer', 'kv.transfer', 'decode', 75, 90, NULL),
        (1, 'kv.ready', 'kv.ready', 'decode', 90, 95, NULL),
        (1, 'decode.first_step', 'decode.first_step', 'decode', 95, 120, NULL)""")
    assert cols == JOIN_COLS
    assert rows == [(1, 70, 120, 90, 50, None)]


def test_handoff_join_push_late_registration(con):
    # request 2 (push): D registers late, P's writer starts its prep before the match
    # 5    10             50   60        80   90   100
    #      |prefill.compute|                             P
    # |dest.register-----------------------|             D (ends at the match, 80)
    #                          |prep (step_wait)-----|   P handoff.step_wait under handoff.prep
    #                                            |xfer|
    # => I = max(50, 80) = 80; J = max(60, I) = 80 (rule 10: no earlier than the last input)
    cols, rows = _join(con, """VALUES
        (2, 'prefill.compute', 'prefill.compute', 'prefill', 10, 50, NULL),
        (2, 'dest.register', 'dest.register', 'decode', 5, 80, NULL),
        (2, 'handoff.step_wait', 'handoff.prep', 'prefill', 60, 90, NULL),
        (2, 'kv.transfer', 'kv.transfer', 'prefill', 90, 100, NULL)""")
    assert rows == [(2, 80, 100, 100, 80, None)]


def test_handoff_join_retry_counts_the_last_attempt(con):
    # request 3: the router retried at 200; only stages starting at or after 200 count
    # 0    40   50   60        150  200  230  240  250  270  300
    # |pc--|                                                      attempt 0: P compute (ignored)
    #           |prep|xfer-----|                                  attempt 0 handoff (ignored)
    #                               |pc--|                        attempt 1: P compute, KV ready 230
    #                                    |prep|xfer|first_step--| attempt 1 handoff from 240
    # => J = 240, I = 230, chain end 300, transfer end 270, att_ns 200
    cols, rows = _join(con, """VALUES
        (3, 'prefill.compute', 'prefill.compute', 'prefill', 0, 40, 200),
        (3, 'handoff.prep', 'handoff.prep', 'decode', 50, 60, 200),
        (3, 'kv.transfer', 'kv.transfer', 'decode', 60, 150, 200),
        (3, 'prefill.compute', 'prefill.compute', 'prefill', 200, 230, 200),
        (3, 'handoff.prep', 'handoff.prep', 'decode', 240, 250, 200),
        (3, 'kv.transfer', 'kv.transfer', 'decode', 250, 270, 200),
        (3, 'decode.first_step', 'decode.first_step', 'decode', 270, 300, 200)""")
    assert rows == [(3, 240, 300, 270, 230, 200)]


def test_handoff_join_edge_cases(con):
    # request 4: no post-join stage (a local prefill: |prefill.compute 0-10|)  => no row
    # request 5: a kv.transfer [10, NULL] (end unknown) and decode.first_step [20, 30]
    #            => J = 10 (the transfer's start), chain end 30 (max ignores the NULL end),
    #               xfer_end NULL (the only transfer's end), no input (I NULL)
    # request 6: a dest.register only on the D side and prefill.compute on the decode branch
    #            (not P's KV ready): I = the registration's end 15; J = max(12, 15) = 15
    #            |dest.register 0-15| |prefill.compute (branch decode) 0-40|  |kv.ready 12-18|
    cols, rows = _join(con, """VALUES
        (4, 'prefill.compute', 'prefill.compute', 'prefill', 0, 10, NULL),
        (5, 'kv.transfer', 'kv.transfer', 'decode', 10, NULL, NULL),
        (5, 'decode.first_step', 'decode.first_step', 'decode', 20, 30, NULL),
        (6, 'dest.register', 'dest.register', 'decode', 0, 15, NULL),
        (6, 'prefill.compute', 'prefill.compute', 'decode', 0, 40, NULL),
        (6, 'kv.ready', 'kv.ready', 'decode', 12, 18, NULL)""")
    assert cols == JOIN_COLS
    assert rows == [(5, 10, 30, None, None, None), (6, 15, 18, None, 15, None)]


def test_handoff_join_empty_input(con):
    cols, rows = _join(con, "SELECT 1, 'kv.transfer', 'kv.transfer', 'decode', 0, 1, NULL::INTEGER WHERE false")
    assert cols == JOIN_COLS
    assert rows == []


# ---------------------------------------------------------------- module headers

@pytest.mark.parametrize("name", sorted(loader.modules()))
def test_module_loads_with_only_its_requirements(name):
    """A fresh database with the base tables and only the modules ``name``'s header requires loads it."""
    con = _db(name)
    try:
        made = {r[0] for r in con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal UNION ALL "
            "SELECT function_name FROM duckdb_functions() WHERE NOT internal UNION ALL "
            "SELECT table_name FROM duckdb_tables() UNION ALL "
            "SELECT type_name FROM duckdb_types() WHERE NOT internal").fetchall()}
        # DuckDB resolves the functions a table macro calls only when it is called: bind each public
        # table macro the module makes (NULL arguments, no rows), so an undeclared requirement used
        # only inside one fails here too
        for fn, params in con.execute("SELECT function_name, parameters FROM duckdb_functions() "
                                      "WHERE function_type = 'table_macro' AND NOT internal "
                                      "AND NOT starts_with(function_name, '_')").fetchall():
            if re.search(rf"^CREATE (?:OR REPLACE )?MACRO {fn}\b", loader.modules()[name].text, re.MULTILINE):
                con.execute(f"SELECT * FROM {fn}({', '.join(['NULL'] * len(params))}) LIMIT 0").fetchall()
    finally:
        con.close()
    # everything the module creates exists (and it creates something)
    created = re.findall(r"^CREATE (?:OR REPLACE )?(?:VIEW|MACRO|TYPE|TABLE(?: IF NOT EXISTS)?) (\w+)",
                         loader.modules()[name].text, re.MULTILINE)
    assert created and set(created) <= made


def _without(name: str, header: str, dropped: str) -> tuple[duckdb.DuckDBPyConnection, list]:
    """A fresh database with the base tables, and the modules to load for ``name`` when its
    ``-- requires:`` line ``header`` lacks ``dropped`` (so ``name`` no longer declares it)."""
    mods = loader.modules()
    text = mods[name].text.replace(header, header.replace(f", {dropped}", ""))
    assert text != mods[name].text
    mods[name] = loader.read_module(name, text)
    con = duckdb.connect()
    con.execute(loader.base_tables_sql())
    return con, loader.with_requirements([name], mods)


def test_an_undeclared_requirement_inside_a_table_macro_fails():
    """window_summary without `summary` (prompt_bucket) in its header loads, but binding its table macros fails."""
    con, order = _without("window_summary", "-- requires: requests, ttft_breakdown, summary", "summary")
    for mod in order:
        con.execute(mod.text)                               # loads
    if any(m.name == "summary" for m in order):
        pytest.skip("summary is still required through another module")
    with pytest.raises(duckdb.CatalogException, match="prompt_bucket"):
        con.execute("SELECT * FROM category_shares_by_prompt_bucket(NULL, NULL) LIMIT 0").fetchall()


def test_an_undeclared_requirement_fails_to_load():
    """The check above can fail: ttft_segments without `intervals` in its header does not load."""
    con, order = _without("ttft_segments", "-- requires: request_base, segment_culprits, intervals", "intervals")
    with pytest.raises(duckdb.CatalogException, match="_latest_end_wins"):
        for mod in order:
            con.execute(mod.text)
