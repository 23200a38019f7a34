"""Record tuples (recorder.py layout) → Arrow tables of :data:`schema.SCHEMA`.

Runs in the sink process (:mod:`pdtrace.instrument.sink`), never in the traced
process, so it holds no GIL a traced thread could wait for and needs no yield
points. Attribute values pass the allowlist (:mod:`pdtrace.instrument.attributes`)
here: an unknown key or a value of the wrong type is dropped and counted
(``dropped_attributes``); a string longer than its spec's ``max_len`` is cut. An
int outside int64 (e.g. an unsigned 64-bit handle above 2**63 - 1) is of the wrong
type for an int key, and an int too large for a float of the wrong type for a
float key. :meth:`Converter.table` raises for a record it still cannot convert
(e.g. a string that is not valid Unicode); the sink then converts the batch
record by record and drops only that record.
"""
from __future__ import annotations

import itertools
from typing import Iterable

import numpy as np
import pyarrow as pa

from . import attributes, ids, schema

_RTYPES = pa.array(list(schema.RECORD_TYPES), pa.string())
_T = {name: typ for name, typ, _ in schema.COLUMNS}

#: Slots of a record tuple before its attributes (recorder.py's record layout).
N_FIXED = 15
#: The slot of a record tuple that holds its monotonic start (ns).
START = 6

#: Value types of the three attribute map columns (attr_int, attr_float, attr_str).
_VALUE_TYPES = (pa.int64(), pa.float64(), pa.string())
#: Python types accepted for an int, a float and a str attribute (bool counts as int; int as float).
_INT_OK = frozenset((int, bool))
#: int attribute values are stored as int64: outside [-2**63, 2**63) a value is of the wrong type.
_I64_LO, _I64_HI = -(1 << 63), (1 << 63) - 1
_FLOAT_OK = frozenset((float, int))
_STR_OK = frozenset((str,))
#: Records of one key tuple from which a batch converts them a column at a time: a column-wise
#: group costs ~80-110 µs of numpy/pyarrow calls and saves ~0.5-0.7 µs per record against
#: converting value by value (BENCHMARKS.md "Sink conversion"), so it pays from ~200 records;
#: smaller batches (the per-second part files of a lightly loaded engine) keep the per-value path.
GROUP_MIN = 256


class Converter:
    """Stateful converter for one traced process: trace-id and resource-column caches, a drop counter.

    ``allowed``: the attribute allowlist (key -> ``attributes.Attr``) of that process; None: this
    process's own (:data:`pdtrace.instrument.attributes.ALLOWED`). The sink gives each client its own.
    """

    def __init__(self, allowed: dict | None = None) -> None:
        self.allowed = allowed
        self.dropped_attributes = 0
        self._trace_ids: dict[str, str] = {}
        self._res_cache: tuple | None = None

    def table(self, recs: list[tuple], resource: dict, offset_ns: int) -> pa.Table:
        """A table of ``len(recs)`` rows; monotonic ns times become Unix-epoch ns by adding ``offset_ns``.

        ``resource``: the resource columns (schema.RESOURCE_COLUMNS) plus an
        optional default ``tp_rank``. Attributes dropped are added to ``dropped_attributes``.
        Raises ValueError on an empty ``recs``, and for a record it cannot convert (see the module
        docstring). One segment of :meth:`table_joint`.
        """
        if not recs:
            raise ValueError("Converter.table: no records")
        out, dropped = self.table_joint([(recs, resource, offset_ns, None)])
        self.dropped_attributes += dropped[0]
        return out

    def table_joint(self, segments: list[tuple[list[tuple], dict, int, dict | None]]) -> tuple[pa.Table, list[int]]:
        """One table of the records of several processes; and the attributes dropped per segment.

        ``segments``: ``[(records, resource, offset_ns, allowed)]``, each as :meth:`table` takes
        them (``allowed``: that process's allowlist, None: this converter's). The rows keep the
        segments' order, each with its own resource columns, clock offset and default ``tp_rank``.
        The host's sink converts all its clients' records of one part file in one call: the fixed
        cost of a table (~0.23 ms: one Arrow array per column) is then paid once per file, not
        once per client (BENCHMARKS.md "Host sink"). ``dropped_attributes`` is not changed: the
        caller credits each segment's count to its process. Raises ValueError when there is no
        record, and what :meth:`table` raises for a record it cannot convert.
        """
        segs = [s for s in segments if s[0]]
        if not segs:
            raise ValueError("Converter.table_joint: no records")
        one = len(segs) == 1  # table()'s case: no copy of the records, a scalar clock offset
        recs = segs[0][0] if one else [r for s in segs for r in s[0]]
        n = len(recs)
        (rtype, record_id, span_id, parent, name, kind, start, end, status, msg,
         rid, pidx, attempt, rank, thread) = itertools.islice(zip(*recs), N_FIXED)  # columns, zip is lazy
        if one:
            cols: dict[str, pa.Array] = dict(self._resource_columns(segs[0][1], n))
        else:
            counts = np.asarray([len(s[0]) for s in segs], dtype=np.int64)
            cols = self._joint_resource_columns([s[1] for s in segs], counts, n)
        cols["record"] = pa.DictionaryArray.from_arrays(pa.array(rtype, pa.int32()), _RTYPES)
        cols["record_id"] = pa.array(record_id, pa.uint64())
        cols["span_id"] = pa.array(span_id, pa.uint64())
        cols["parent_span_id"] = pa.array(parent, pa.uint64())
        cols["name"] = pa.array(name, pa.string()).dictionary_encode()
        cols["kind"] = pa.array(kind, pa.int8())
        offs = segs[0][2] if one else np.repeat(np.asarray([s[2] for s in segs], dtype=np.int64), counts)
        cols["start_ns"] = pa.array(np.asarray(start, dtype=np.int64) + offs)
        cols["end_ns"] = pa.array(np.asarray(end, dtype=np.int64) + offs)
        cols["status_code"] = pa.array(status, pa.int8())
        cols["status_message"] = pa.array(msg, pa.string())
        rid_arr = pa.array(rid, pa.string())
        cols["request_id"] = rid_arr
        d = rid_arr.dictionary_encode()
        tids = pa.array([self._trace_id(x) for x in d.dictionary.to_pylist()], pa.string())
        cols["trace_id"] = tids.take(d.indices) if len(tids) else pa.nulls(n, pa.string())
        cols["prompt_index"] = pa.array(pidx, pa.int32())
        cols["attempt"] = pa.array(attempt, pa.int32())
        if one:
            dr = segs[0][1].get("tp_rank")
            if dr is not None:
                rank = [dr if r is None else r for r in rank]
        elif any(s[1].get("tp_rank") is not None for s in segs):
            rank = list(rank)
            pos = 0
            for s in segs:
                dr = s[1].get("tp_rank")
                if dr is not None:
                    rank[pos:pos + len(s[0])] = [dr if r is None else r for r in rank[pos:pos + len(s[0])]]
                pos += len(s[0])
        cols["tp_rank"] = pa.array(rank, pa.int16())
        cols["thread"] = pa.array(thread, pa.string()).dictionary_encode()
        if one:
            before = self.dropped_attributes
            cols["attr_int"], cols["attr_float"], cols["attr_str"] = self._attr_maps(recs, segs[0][3])
            dropped = [self.dropped_attributes - before]
            self.dropped_attributes = before
        else:
            # attribute maps: one call per run of segments sharing an allowlist object (the sink interns
            # equal allowlists); a run that dropped attributes is counted again segment by segment
            maps: tuple[list, list, list] = ([], [], [])
            dropped = []
            i = 0
            while i < len(segs):
                j = i + 1
                while j < len(segs) and segs[j][3] is segs[i][3]:
                    j += 1
                run = segs[i:j]
                before = self.dropped_attributes
                for t, m in enumerate(self._attr_maps(run[0][0] if j - i == 1 else [r for s in run for r in s[0]],
                                                       run[0][3])):
                    maps[t].append(m)
                if self.dropped_attributes == before or j - i == 1:
                    dropped += [self.dropped_attributes - before] + [0] * (j - i - 1)
                else:
                    for s in run:
                        b = self.dropped_attributes
                        self._attr_maps(s[0], s[3])
                        dropped.append(self.dropped_attributes - b)
                self.dropped_attributes = before
                i = j
            for t, c in enumerate(("attr_int", "attr_float", "attr_str")):
                cols[c] = maps[t][0] if len(maps[t]) == 1 else pa.concat_arrays(maps[t])
        arrays = [cols[c].cast(_T[c]) if cols[c].type != _T[c] else cols[c] for c, _, _ in schema.COLUMNS]
        out = pa.Table.from_arrays(arrays, schema=schema.SCHEMA)
        it = iter(dropped)
        return out, [next(it) if s[0] else 0 for s in segments]

    def _joint_resource_columns(self, resources: list[dict], counts: np.ndarray, n: int) -> dict[str, pa.Array]:
        """The resource columns (and schema_version) of segments of ``counts`` rows, each its ``resources`` entry."""
        if all(r is resources[0] for r in resources):
            return dict(self._resource_columns(resources[0], n))
        cols = {"schema_version": _const(schema.SCHEMA_VERSION, n)}
        for name in schema.RESOURCE_COLUMNS:
            vals = [r.get(name) for r in resources]
            if name == "pid":
                cols[name] = pa.array([v for v, k in zip(vals, counts) for _ in range(int(k))], _T[name])
                continue
            if all(v == vals[0] for v in vals):
                cols[name] = _const(vals[0], n)
                continue
            words = sorted({str(v) for v in vals if v is not None})
            code = {w: i for i, w in enumerate(words)}
            idx = np.repeat(np.asarray([code.get(str(v), 0) if v is not None else 0 for v in vals], dtype=np.int32),
                            counts)
            mask = np.repeat(np.asarray([v is None for v in vals]), counts)
            cols[name] = pa.DictionaryArray.from_arrays(pa.array(idx, mask=mask), pa.array(words, pa.string()))
        return cols

    def _attr_maps(self, recs: list[tuple], allowed: dict | None = None) -> tuple[pa.Array, pa.Array, pa.Array]:
        """The three typed attribute map columns (int64, float64, string values) of one batch.

        ``recs``: record tuples; a record's slots after the :data:`N_FIXED` fixed ones hold its
        attribute keys, then their values in the same order (recorder.py's record layout).

        Records are grouped by their key tuple (a call site passes the same keys every time). A group of
        at least :data:`GROUP_MIN` records is type-checked and converted a column at a time
        (:meth:`_group`); the other records, and a group holding any value of the wrong type, go one
        value at a time (:meth:`_rowwise`), with the same result. Either way every map keeps its
        record's key order.
        """
        n = len(recs)
        if allowed is None:
            allowed = attributes.ALLOWED if self.allowed is None else self.allowed
        groups: dict[tuple, list[int]] = {}
        for j, r in enumerate(recs if n >= GROUP_MIN else ()):
            w = len(r)
            if w > N_FIXED:
                k = r[N_FIXED: (w + N_FIXED) // 2]
                g = groups.get(k)
                if g is None:
                    groups[k] = [j]
                else:
                    g.append(j)
        pieces: tuple[list, list, list] = ([], [], [])  # per value type: its pieces (rows, counts, keys, values)
        slow: list[int] = []
        by_column = False
        for keys, rows in groups.items():
            piece = self._group(keys, rows, recs, allowed) if len(rows) >= GROUP_MIN else None
            if piece is None:
                slow.extend(rows)
                continue
            by_column = True
            for t in range(3):
                if piece[t] is not None:
                    pieces[t].append(piece[t])
        if not by_column:  # every record a value at a time, in record order: the maps directly
            return tuple(pa.MapArray.from_arrays(pa.array(offs, pa.int32()), pa.array(ks, pa.string()),
                                                 pa.array(vs, _VALUE_TYPES[t]))
                         for t, (offs, ks, vs) in enumerate(self._rowwise(range(n), recs, allowed)))
        if slow:
            rows_a = np.asarray(slow, dtype=np.int64)
            for t, (offs, ks, vs) in enumerate(self._rowwise(slow, recs, allowed)):
                if ks:
                    pieces[t].append((rows_a, np.diff(np.asarray(offs, dtype=np.int64)), pa.array(ks, pa.string()),
                                      pa.array(vs, _VALUE_TYPES[t])))
        return tuple(_map_column(n, pieces[t], _VALUE_TYPES[t]) for t in range(3))

    def _group(self, keys: tuple, rows: list[int], recs: list[tuple], allowed: dict) -> tuple | None:
        """One key tuple's records converted a column at a time: per value type (int, float, str) a
        piece ``(rows, counts, keys, values)`` or None; None for the whole group when some value is
        not of its key's type (the caller then converts the group record by record)."""
        m, h = len(rows), N_FIXED + len(keys)
        cols: tuple[list, list, list] = ([], [], [])  # per type: [(key, values)]
        dropped = 0
        for p, k in enumerate(keys):
            spec = allowed.get(k)
            if spec is None:
                dropped += m
                continue
            vals = [recs[j][h + p] for j in rows]
            types = set(map(type, vals))
            t = spec.type
            if t is int:
                if types <= _INT_OK and _I64_LO <= min(vals) and max(vals) <= _I64_HI:
                    cols[0].append((k, vals if bool not in types else [int(v) for v in vals]))
                    continue
            elif t is str:
                if types == _STR_OK:
                    lim = spec.max_len
                    if max(map(len, vals)) > lim:
                        vals = [v[:lim] for v in vals]
                    cols[2].append((k, vals))
                    continue
            elif types <= _FLOAT_OK:
                try:
                    cols[1].append((k, [float(v) for v in vals] if int in types else vals))
                    continue
                except OverflowError:  # an int too large for a float: value by value drops it alone
                    pass
            return None
        self.dropped_attributes += dropped
        rows_a = np.asarray(rows, dtype=np.int64)
        out = []
        for t in range(3):
            kv = cols[t]
            if not kv:
                out.append(None)
                continue
            k = len(kv)
            # values row-major (record by record, keys in order): column c, row r -> c * m + r
            flat = pa.array([v for _, vs in kv for v in vs], _VALUE_TYPES[t])
            order = (np.arange(k, dtype=np.int64)[None, :] * m + np.arange(m, dtype=np.int64)[:, None]).ravel()
            key_arr = pa.array([key for key, _ in kv], pa.string()).take(np.tile(np.arange(k, dtype=np.int32), m))
            out.append((rows_a, np.full(m, k, dtype=np.int64), key_arr, flat.take(order)))
        return tuple(out)

    def _rowwise(self, rows: Iterable[int], recs: list[tuple], allowed: dict) -> tuple:
        """The records ``rows`` converted one value at a time: an unknown key or a value of the wrong
        type is dropped and counted, a long string cut. Per value type (int, float, str): the map
        offsets (list of len(rows) + 1 ints, from 0), then the keys and the values of the entries,
        record after record in ``rows`` order (lists)."""
        oi, ki, vi = [0], [], []
        of, kf, vf = [0], [], []
        os_, ks, vs = [0], [], []
        dropped = 0
        for j in rows:
            a = recs[j]
            n = (len(a) - N_FIXED) // 2
            for k, v in zip(a[N_FIXED: N_FIXED + n], a[N_FIXED + n:]):
                spec = allowed.get(k)
                if spec is None:
                    dropped += 1
                    continue
                t = spec.type
                tv = type(v)
                if t is int:
                    if (tv is int or tv is bool) and _I64_LO <= v <= _I64_HI:
                        ki.append(k)
                        vi.append(int(v))
                    else:
                        dropped += 1
                elif t is str:
                    if tv is str:
                        ks.append(k)
                        vs.append(v if len(v) <= spec.max_len else v[: spec.max_len])
                    else:
                        dropped += 1
                elif tv is float or tv is int:
                    try:
                        fv = float(v)
                    except OverflowError:  # an int too large for a float
                        dropped += 1
                        continue
                    kf.append(k)
                    vf.append(fv)
                else:
                    dropped += 1
            oi.append(len(ki))
            of.append(len(kf))
            os_.append(len(ks))
        self.dropped_attributes += dropped
        return (oi, ki, vi), (of, kf, vf), (os_, ks, vs)

    def _trace_id(self, rid: str) -> str:
        t = self._trace_ids.get(rid)
        if t is None:
            if len(self._trace_ids) > 65536:
                self._trace_ids.clear()
            t = self._trace_ids[rid] = ids.trace_id(rid)
        return t

    def _resource_columns(self, res: dict, n: int) -> dict[str, pa.Array]:
        """The constant columns (resource attributes, schema_version) for ``n`` rows, built once per (resource, n)."""
        c = self._res_cache
        if c is None or c[0] is not res or c[1] != n:
            cols = {"schema_version": _const(schema.SCHEMA_VERSION, n)}
            for name in schema.RESOURCE_COLUMNS:
                v = res.get(name)
                cols[name] = pa.array([v] * n, _T[name]) if name == "pid" else _const(v, n)
            self._res_cache = c = (res, n, cols)
        return c[2]


def _const(value, n: int) -> pa.Array:
    """A dictionary-encoded column holding ``value`` (str or None) n times."""
    if value is None:
        return pa.nulls(n, pa.dictionary(pa.int32(), pa.string()))
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([str(value)]))


def _map_column(n: int, pieces: list[tuple], value_type: pa.DataType) -> pa.Array:
    """A map column of ``n`` records from pieces ``(rows, counts, keys, values)``: record ``rows[i]``
    holds ``counts[i]`` entries, and ``keys``/``values`` list the pieces' entries record by record.
    Records no piece names have an empty map."""
    counts = np.zeros(n, dtype=np.int64)
    for rows, cnt, _, _ in pieces:
        counts[rows] = cnt
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if not pieces:
        return pa.MapArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array([], pa.string()),
                                       pa.array([], value_type))
    # where each piece's entries go in the column's flat key/value arrays
    pos = []
    for rows, cnt, _, _ in pieces:
        within = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        pos.append(np.repeat(offsets[rows], cnt) + within)
    pos_a = np.concatenate(pos)
    inv = np.empty_like(pos_a)
    inv[pos_a] = np.arange(len(pos_a), dtype=np.int64)
    keys = pa.concat_arrays([p[2] for p in pieces]).take(inv)
    values = pa.concat_arrays([p[3] for p in pieces]).take(inv)
    return pa.MapArray.from_arrays(pa.array(offsets.astype(np.int32)), keys, values)
