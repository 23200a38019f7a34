"""Incremental maintenance of the analysis's materialized views (the refresh engine's steps).

The SQL modules declare what is materialized in their headers (``-- materialize: NAME KIND``, see
:mod:`pdtrace.analysis.loader`); :func:`materializations` turns each into a :class:`Materialization`
naming its table (``_mat_*``, what the view reads) and its definition (``_calc_*``, the view that
computes it). :class:`Materializer` holds the steps one refresh runs over a connection ``self.con``
(:class:`pdtrace.analysis.db.Trace` is one): absorb new and vanished files, hide duplicate records,
then refresh the ``file``, ``changed``, ``window``, ``full`` and ``request``/``scratch``
materializations in that order, for the request keys the change touched only.
"""
from __future__ import annotations

from dataclasses import dataclass

import duckdb

from . import loader

#: The kinds a module header may declare, in the order a refresh brings them up to date.
KINDS = ("file", "changed", "window", "full", "request", "scratch")


@dataclass(frozen=True)
class Materialization:
    """One materialized view: ``name`` (the view, e.g. ``ttft_segments``), ``kind`` (one of
    :data:`KINDS`, see :mod:`pdtrace.analysis.loader` for what each recomputes)."""

    name: str
    kind: str

    @property
    def table(self) -> str:
        """The table the view reads (``_mat_`` + the name without its leading underscores)."""
        return f"_mat_{self.name.lstrip('_')}"

    @property
    def calc(self) -> str:
        """The view whose rows fill :attr:`table` (``_calc_`` + the name without leading underscores)."""
        return f"_calc_{self.name.lstrip('_')}"

    def recompute(self, con: duckdb.DuckDBPyConnection) -> None:
        """Replace every row of :attr:`table` with :attr:`calc`'s."""
        con.execute(f"DELETE FROM {self.table}")
        con.execute(f"INSERT INTO {self.table} SELECT * FROM {self.calc}")


def materializations(*kinds: str) -> list[Materialization]:
    """The library's materializations of the given ``kinds`` (all when none), in module load order.
    Raises ValueError for a kind not in :data:`KINDS`."""
    bad = set(kinds) - set(KINDS)
    if bad:
        raise ValueError(f"unknown materialization kind(s): {sorted(bad)}")
    return [Materialization(name, kind) for name, kind in loader.materializations() if not kinds or kind in kinds]


def sql_list(paths: list[str]) -> str:
    """A SQL list literal of file paths (quotes doubled), for views over a fixed file list."""
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


class Materializer:
    """The refresh steps over ``self.con``, a DuckDB connection holding the SQL library (mixed into
    :class:`pdtrace.analysis.db.Trace`; tests override single steps in a subclass)."""

    con: duckdb.DuckDBPyConnection

    #: How ``_records`` is (re)defined: ``VIEW`` in the database, or ``TEMP VIEW`` on a connection
    #: that may not write it (a Spark task's read-only snapshot, :mod:`pdtrace.analysis.spark`).
    _records_view = "VIEW"

    def _set_records(self, files: list[str]) -> None:
        """Point ``_records`` at ``files`` (read in place), hiding the copies listed in ``_dup_drop``."""
        con = self.con
        kind = self._records_view
        if not files:
            con.execute(f"CREATE OR REPLACE {kind} _records AS SELECT * FROM _records_empty")
            return
        lit = sql_list(files)
        has_dups = con.execute("SELECT count(*) FROM _dup_drop").fetchone()[0] > 0
        anti = " WHERE NOT _hidden_copy(r.record_id, r._file)" if has_dups else ""
        con.execute(f"CREATE OR REPLACE {kind} _records AS SELECT * FROM _read_store({lit}) r{anti}")

    def _absorb(self, new: list[str], gone: list[str], good: dict[str, tuple[int, int]], cold: bool) -> int:
        con = self.con
        files = sorted(good)
        con.execute("DELETE FROM _changed_keys")
        if gone:
            con.execute("CREATE OR REPLACE TEMP TABLE _gone AS SELECT unnest(?::VARCHAR[]) AS path", [gone])
            con.execute("INSERT INTO _changed_keys SELECT rkey FROM _file_keys WHERE _file IN (SELECT path FROM _gone)")
            con.execute("DELETE FROM _file_keys WHERE _file IN (SELECT path FROM _gone)")
            con.execute("DELETE FROM _files WHERE path IN (SELECT path FROM _gone)")
        if new:
            # what each new file touches: its request keys and the keys its router rows link to
            con.execute("""
                CREATE OR REPLACE TEMP TABLE _new_keys AS
                SELECT DISTINCT _file, k AS rkey FROM (
                    SELECT _file, rkey AS k FROM _read_store(?) WHERE rkey IS NOT NULL
                    UNION ALL
                    SELECT _file, _request_key(run_id, attr_str['router.linked_request_id'], prompt_index)
                    FROM _read_store(?) WHERE role = 'router' AND attr_str['router.linked_request_id'] IS NOT NULL)""",
                        [new, new])
            con.execute("INSERT INTO _file_keys SELECT * FROM _new_keys")
            if not cold:
                con.execute("INSERT INTO _changed_keys SELECT rkey FROM _new_keys")
            con.execute("""INSERT OR REPLACE INTO _files
                           SELECT f.path, f.size, f.mtime_ns, c.n, true, '', now()
                           FROM (SELECT unnest(?::VARCHAR[]) AS path, unnest(?::BIGINT[]) AS size,
                                        unnest(?::BIGINT[]) AS mtime_ns) f
                           LEFT JOIN (SELECT file_name, sum(num_rows) AS n FROM parquet_file_metadata(?)
                                      GROUP BY file_name) c ON c.file_name = f.path""",
                        [new, [good[p][0] for p in new], [good[p][1] for p in new], new])
        self._refresh_duplicates(files, new, gone, cold)
        self._set_records(files)
        self._refresh_file_parts(files if cold else new, gone, cold)
        self._refresh_changed(cold)
        # clock offsets: recompute; requests on clocks whose offset moved are dirty too
        con.execute("CREATE OR REPLACE TEMP TABLE _old_offsets AS SELECT * FROM _mat_domain_offsets")
        for m in materializations("full"):
            m.recompute(con)
        con.execute("DELETE FROM _scope_keys")
        if cold:
            con.execute("INSERT INTO _scope_keys SELECT DISTINCT rkey FROM _file_keys")
        else:
            con.execute("""
                CREATE OR REPLACE TEMP TABLE _moved AS
                SELECT coalesce(n.domain, o.domain) AS domain, coalesce(n.window_idx, o.window_idx) AS window_idx
                FROM _mat_domain_offsets n FULL OUTER JOIN _old_offsets o
                  ON n.domain = o.domain AND n.window_idx IS NOT DISTINCT FROM o.window_idx
                WHERE n.offset_ns IS DISTINCT FROM o.offset_ns""")
            moved = con.execute("SELECT count(*) FROM _moved").fetchone()[0] > 0
            con.execute("""
                INSERT INTO _scope_keys
                SELECT rkey FROM _changed_keys WHERE rkey IS NOT NULL
                UNION SELECT by_rkey FROM _req_links WHERE rkey IN (SELECT rkey FROM _changed_keys)""")
            if moved:
                con.execute("""
                    INSERT INTO _scope_keys
                    SELECT DISTINCT r.rkey FROM _records r JOIN _moved m ON r.domain = m.domain
                      AND (m.window_idx IS NULL OR r.start_ns // _clock_window_ns() = m.window_idx)
                    WHERE r.rkey IS NOT NULL AND r.rkey NOT IN (SELECT rkey FROM _scope_keys)""")
        n_scope = con.execute("SELECT count(*) FROM _scope_keys").fetchone()[0]
        try:
            self._materialize_requests(files, n_scope, cold)
        finally:
            self._tidy(lambda: self._set_records(files))
        self._apply_window()
        return n_scope

    #: The :class:`pdtrace.analysis.window.Window` of the analysis (None: every request).
    window = None

    def _apply_window(self) -> None:
        """Fill ``_window_out`` with the request keys outside :attr:`window` (none without one): the
        request-level views and the summaries leave those out, while their rows stay in the ``_mat_``
        tables (another request's root cause or culprit may lie in one).

        A key is in the window when

        * its request's arrival (``_req_base.arrival_ns``, corrected clock) is in ``[since, until)``;
        * it is an id the router linked to such a request (``router.linked_request_id``: no
          ``_req_base`` row of its own);
        * it has no arrival (no ``_req_base`` row: only open records so far, or engine-only
          processes such as ``pdtrace collect``'s role ``engine``; or a NULL arrival) and is not a
          linked id, and its earliest record starts in ``[since, until)`` (its writer's clock).

        The arrival of a request that began before ``since`` comes from the rows read: the router's
        root span, which lasts from the arrival to the end, or else P's API server or the earliest
        record. Without a router root, a request whose first records all ended more than the margin
        before ``since`` can show a later arrival and fall in the window (a request whose TTFT is
        longer than the margin, 5 min by default). Recomputed whole by every refresh that absorbs a
        change."""
        con = self.con
        con.execute("DELETE FROM _window_out")
        w = self.window
        if w is None:
            return
        bounds = {"lo": -(1 << 63) if w.since_ns is None else w.since_ns,
                  "hi": (1 << 63) - 1 if w.until_ns is None else w.until_ns}
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _window_keep AS
            SELECT rkey FROM _mat_req_base WHERE arrival_ns >= $lo AND arrival_ns < $hi
            UNION
            SELECT l.rkey FROM _req_links l JOIN _mat_req_base q ON q.rkey = l.by_rkey
            WHERE q.arrival_ns >= $lo AND q.arrival_ns < $hi""", bounds)
        # keys no arrival places: by their earliest record (a scan of the records, only when there are some)
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _window_unplaced AS
            SELECT DISTINCT rkey FROM _file_keys WHERE rkey IS NOT NULL
            EXCEPT SELECT rkey FROM _mat_req_base WHERE arrival_ns IS NOT NULL
            EXCEPT SELECT rkey FROM _req_links""")
        if con.execute("SELECT count(*) FROM _window_unplaced").fetchone()[0]:
            con.execute("""
                INSERT INTO _window_keep
                SELECT rkey FROM _records WHERE rkey IN (SELECT rkey FROM _window_unplaced)
                GROUP BY rkey HAVING min(start_ns) >= $lo AND min(start_ns) < $hi""", bounds)
        con.execute("""
            INSERT INTO _window_out SELECT DISTINCT rkey FROM _file_keys
            WHERE rkey IS NOT NULL AND rkey NOT IN (SELECT rkey FROM _window_keep)""")
        con.execute("DROP TABLE _window_keep")
        con.execute("DROP TABLE _window_unplaced")

    def _materialize_requests(self, files: list[str], n_scope: int, cold: bool) -> None:
        """Recompute the ``request``/``scratch`` materializations of the ``n_scope`` keys in
        ``_scope_keys``: in one pass, or in batches when more than :attr:`batch_requests` (the step
        another engine replaces: :class:`pdtrace.analysis.spark.SparkTrace` runs the batches as Spark
        tasks)."""
        if n_scope <= self.batch_requests:
            if not cold:
                self._restrict_records(files)
            self._materialize_scope()
        else:
            self._materialize_in_batches(files, n_scope)

    def _tidy(self, step) -> None:
        """Run the clean-up ``step()`` of a refresh step (from a ``finally``). After a failure inside
        a warm refresh's transaction DuckDB refuses every statement ('transaction is aborted') and
        the rollback undoes the step anyway: the clean-up is skipped there, so that the step's own
        error is the one raised."""
        try:
            step()
        except duckdb.TransactionException as exc:
            if "aborted" not in str(exc):
                raise

    def _refresh_duplicates(self, files: list[str], new: list[str], gone: list[str], cold: bool) -> None:
        """Bring ``_dup_copies`` and ``_dup_drop`` up to date: one visible copy per record_id, the copy in the
        first file by name (the recorder's compaction briefly leaves a record in a part and a segment).

        Cold: every file's record ids are grouped once. Warm: the copies in vanished (or rewritten) files
        are forgotten, and only the new files' record ids are looked up in the other files (their
        ``record_id`` column, restricted to the new ids' min..max so that Parquet row-group statistics can
        skip the rest) instead of grouping every record id of the store on each absorb.
        """
        con = self.con
        if cold:
            con.execute("DELETE FROM _dup_copies")
            if files:
                con.execute("""
                    INSERT INTO _dup_copies
                    SELECT DISTINCT record_id, filename
                    FROM read_parquet(?, filename = true, hive_partitioning = false)
                    WHERE record_id IN (SELECT record_id FROM read_parquet(?, hive_partitioning = false)
                                        GROUP BY record_id HAVING count(*) > 1)""",
                            [files, files])
        else:
            if gone:
                con.execute("DELETE FROM _dup_copies WHERE _file IN (SELECT unnest(?::VARCHAR[]))", [gone])
            if new:
                con.execute("CREATE OR REPLACE TEMP TABLE _new_ids AS "
                            "SELECT DISTINCT record_id, filename AS _file "
                            "FROM read_parquet(?, filename = true, hive_partitioning = false)", [new])
                lo, hi = con.execute("SELECT min(record_id), max(record_id) FROM _new_ids").fetchone()
                fresh = set(new)
                old = [f for f in files if f not in fresh]
                con.execute("CREATE OR REPLACE TEMP TABLE _id_copies AS SELECT record_id, _file FROM _new_ids")
                if old and lo is not None:
                    con.execute("""
                        INSERT INTO _id_copies
                        SELECT DISTINCT record_id, filename
                        FROM read_parquet(?, filename = true, hive_partitioning = false)
                        WHERE record_id BETWEEN ? AND ? AND record_id IN (SELECT record_id FROM _new_ids)""",
                                [old, lo, hi])
                con.execute("DELETE FROM _dup_copies WHERE record_id IN (SELECT record_id FROM _new_ids)")
                con.execute("""
                    INSERT INTO _dup_copies SELECT record_id, _file FROM _id_copies
                    WHERE record_id IN (SELECT record_id FROM _id_copies GROUP BY record_id HAVING count(*) > 1)""")
        # a record left in one file (its other copies vanished) is no longer a duplicate
        con.execute("""DELETE FROM _dup_copies WHERE record_id IN (
                           SELECT record_id FROM _dup_copies GROUP BY record_id HAVING count(DISTINCT _file) < 2)""")
        con.execute("DELETE FROM _dup_drop")
        con.execute("""
            INSERT INTO _dup_drop
            SELECT record_id, _file FROM (
                SELECT record_id, _file, row_number() OVER (PARTITION BY record_id ORDER BY _file) AS rn FROM _dup_copies)
            WHERE rn > 1""")

    def _refresh_changed(self, cold: bool) -> None:
        """Refresh the ``changed`` materializations, then the ``window`` ones (see
        :mod:`pdtrace.analysis.loader`): recompute the request keys in ``_changed_keys``, or every key on a
        cold build (``_changed_keys`` is then set to every key of ``_file_keys``); the windows a ``changed``
        table with a ``window_idx`` column held rows of those keys in, before or after, go to
        ``_changed_windows`` and their roll-ups are recomputed."""
        con = self.con
        if cold:
            con.execute("DELETE FROM _changed_keys")
            con.execute("INSERT INTO _changed_keys SELECT DISTINCT rkey FROM _file_keys WHERE rkey IS NOT NULL")
        con.execute("DELETE FROM _changed_windows")
        for m in materializations("changed", "window"):
            mat, calc = m.table, m.calc
            if m.kind == "changed":
                windowed = "window_idx" in [d[0] for d in con.execute(f"SELECT * FROM {mat} LIMIT 0").description]
                touched = (f"INSERT INTO _changed_windows SELECT DISTINCT window_idx FROM {mat} "
                           "WHERE rkey IN (SELECT rkey FROM _changed_keys)")
                if cold:
                    con.execute(f"DELETE FROM {mat}")
                else:
                    if windowed:
                        con.execute(touched)
                    con.execute(f"DELETE FROM {mat} WHERE rkey IN (SELECT rkey FROM _changed_keys)")
                con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
                if windowed:
                    con.execute(f"INSERT INTO _changed_windows SELECT DISTINCT window_idx FROM {mat}" if cold
                                else touched)
            else:  # window
                if cold:
                    con.execute(f"DELETE FROM {mat}")
                else:
                    con.execute(f"DELETE FROM {mat} WHERE window_idx IN (SELECT window_idx FROM _changed_windows)")
                con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")

    def _refresh_file_parts(self, read: list[str], gone: list[str], cold: bool) -> None:
        """Refresh the ``file`` materializations (see :mod:`pdtrace.analysis.loader`): delete the rows of
        vanished (or rewritten) files and add those of the files in ``read`` -- the new files, or every
        file on a cold build -- reading only those files through ``_file_rows`` (and listing them in
        ``_read_files``)."""
        con = self.con
        parts = materializations("file")
        if read:
            con.execute(f"CREATE OR REPLACE VIEW _file_rows AS SELECT * FROM _read_store({sql_list(read)})")
            con.execute("INSERT INTO _read_files SELECT unnest(?::VARCHAR[])", [read])
        try:
            for m in parts:
                mat, calc = m.table, m.calc
                if cold:
                    con.execute(f"DELETE FROM {mat}")
                elif gone:
                    con.execute(f"DELETE FROM {mat} WHERE _file IN (SELECT unnest(?::VARCHAR[]))", [gone])
                if read:
                    con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
        finally:
            self._tidy(lambda: (con.execute("CREATE OR REPLACE VIEW _file_rows AS SELECT * FROM _records_empty"),
                                con.execute("DELETE FROM _read_files")))

    #: Requests recomputed per batch: a refresh touching more is done in batches
    #: of consecutive requests (see :meth:`_materialize_in_batches`).
    batch_requests = 100_000

    def _restrict_records(self, files: list[str]) -> None:
        """Point ``_records`` at the files holding rows of the requests in ``_scope_keys``
        (``_file_keys`` maps each file to the request keys, and linked ids, it touches)."""
        keep = set(files)
        self._set_records(sorted(keep.intersection(r[0] for r in self.con.execute(
            "SELECT DISTINCT _file FROM _file_keys WHERE rkey IN (SELECT rkey FROM _scope_keys)").fetchall())))

    def _materialize_scope(self) -> None:
        """Recompute the per-request materializations for the keys in ``_scope_keys``."""
        con = self.con
        try:
            for m in materializations("request", "scratch"):
                mat, calc = m.table, m.calc
                if m.kind == "request":
                    con.execute(f"DELETE FROM {mat} WHERE rkey IN (SELECT rkey FROM _scope_keys)")
                    con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
                else:  # scratch
                    con.execute(f"DELETE FROM {mat}")
                    con.execute(f"INSERT INTO {mat} SELECT * FROM {calc}")
        finally:
            self._tidy(lambda: [con.execute(f"DELETE FROM {m.table}") for m in materializations("scratch")])

    def _materialize_in_batches(self, files: list[str], n_scope: int) -> None:
        """Recompute ``n_scope`` requests in time-ordered batches of :attr:`batch_requests`.

        One pass over a million requests at once outgrows memory (DuckDB spills; in
        batches of 100,000 the 1M benchmark store peaks at 2.2 GiB RSS instead of
        10.4 GiB in one pass; BENCHMARKS.md "Analysis cold build"). Requests are ordered by the
        earliest modification time of the files holding their rows (files rotate
        in time, so a batch's requests share files), and each batch reads only the
        files holding its requests, exactly like a warm refresh: per-request
        results are the same whatever the batching. A request and the ids the
        router linked to it (``router.linked_request_id``) go to the same batch.
        """
        con = self.con
        batches = self._plan_batches(-(-n_scope // self.batch_requests))
        holding = self._batch_files(files)
        for b in batches:
            con.execute("DELETE FROM _scope_keys")
            con.execute("INSERT INTO _scope_keys SELECT rkey FROM _scope_batch WHERE b = ?", [b])
            self._set_records(holding.get(b, []))
            self._materialize_scope()
        self._end_batches()

    def _batch_files(self, files: list[str]) -> dict[int, list[str]]:
        """{batch b: the files of ``files`` holding rows of its requests, sorted} for the batches of
        ``_scope_batch`` (:meth:`_plan_batches`; ``_file_keys`` maps each file to the request keys, and
        linked ids, it touches). A batch whose requests have no file is absent."""
        good = set(files)
        return {b: sorted(good.intersection(fs)) for b, fs in self.con.execute("""
            SELECT s.b, list(DISTINCT fk._file) FROM _scope_batch s JOIN _file_keys fk ON fk.rkey = s.rkey
            GROUP BY s.b""").fetchall()}

    def _end_batches(self) -> None:
        """After the batches: ``_scope_keys`` holds every key of the refresh again (``_scope_all``)."""
        self.con.execute("DELETE FROM _scope_keys")
        self.con.execute("INSERT INTO _scope_keys SELECT rkey FROM _scope_all")

    def _plan_batches(self, n_batches: int) -> list[int]:
        """Split the keys in ``_scope_keys`` into about ``n_batches`` time-ordered batches (rules in
        :meth:`_materialize_in_batches`): fills the temp tables ``_scope_all`` (every key) and
        ``_scope_batch`` (rkey, b); returns the batch numbers b in order."""
        con = self.con
        n_scope = con.execute("SELECT count(DISTINCT rkey) FROM _scope_keys").fetchone()[0]
        n_batches = max(1, min(n_batches, n_scope))
        con.execute("CREATE OR REPLACE TEMP TABLE _scope_all AS SELECT DISTINCT rkey FROM _scope_keys")
        # each key's batch: its linking request's (a linked id follows the request that names it)
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _scope_batch AS
            WITH t AS (
                SELECT k.rkey, min(f.mtime_ns) AS t0 FROM _scope_all k
                LEFT JOIN _file_keys fk ON fk.rkey = k.rkey LEFT JOIN _files f ON f.path = fk._file
                GROUP BY k.rkey
            ), lead AS (
                SELECT t.rkey, coalesce(min(tl.t0), t.t0) AS t0, coalesce(min(l.by_rkey), t.rkey) AS owner
                FROM t LEFT JOIN _req_links l ON l.rkey = t.rkey LEFT JOIN t tl ON tl.rkey = l.by_rkey
                GROUP BY t.rkey, t.t0
            )
            SELECT rkey, (dense_rank() OVER (ORDER BY t0, owner) - 1) * ? // ? AS b FROM lead""",
                    [n_batches, max(n_scope, 1)])
        return [r[0] for r in con.execute("SELECT DISTINCT b FROM _scope_batch ORDER BY b").fetchall()]
