"""Record tuples (recorder.py layout) → Arrow tables of :data:`schema.SCHEMA`.

Runs in the sink process (:mod:`pdtrace.instrument.sink`), never in the traced
process, so it holds no GIL a traced thread could wait for and needs no yield
points. Attribute values pass the allowlist (:mod:`pdtrace.instrument.attributes`)
here: an unknown key or a value of the wrong type is dropped and counted
(``dropped_attributes``); a string longer than its spec's ``max_len`` is cut.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from . import attributes, ids, schema

_RTYPES = pa.array(list(schema.RECORD_TYPES), pa.string())
_T = {name: typ for name, typ, _ in schema.COLUMNS}

#: Slots of a record tuple before its attributes (recorder.py's record layout).
N_FIXED = 15


class Converter:
    """Stateful converter for one traced process: trace-id and resource-column caches, a drop counter."""

    def __init__(self) -> None:
        self.dropped_attributes = 0
        self._trace_ids: dict[str, str] = {}
        self._res_cache: tuple | None = None

    def table(self, recs: list[tuple], resource: dict, offset_ns: int) -> pa.Table:
        """A table of ``len(recs)`` rows; monotonic ns times become Unix-epoch ns by adding ``offset_ns``.

        ``resource``: the resource columns (schema.RESOURCE_COLUMNS) plus an
        optional default ``tp_rank``. Raises ValueError on an empty ``recs``.
        """
        n = len(recs)
        if n == 0:
            raise ValueError("Converter.table: no records")
        (rtype, record_id, span_id, parent, name, kind, start, end, status, msg,
         rid, pidx, attempt, rank, thread) = zip(*(r[:N_FIXED] for r in recs))
        attrs = [r[N_FIXED:] for r in recs]
        cols: dict[str, pa.Array] = dict(self._resource_columns(resource, n))
        cols["record"] = pa.DictionaryArray.from_arrays(pa.array(rtype, pa.int32()), _RTYPES)
        cols["record_id"] = pa.array(record_id, pa.uint64())
        cols["span_id"] = pa.array(span_id, pa.uint64())
        cols["parent_span_id"] = pa.array(parent, pa.uint64())
        cols["name"] = pa.array(name, pa.string()).dictionary_encode()
        cols["kind"] = pa.array(kind, pa.int8())
        cols["start_ns"] = pa.array(np.asarray(start, dtype=np.int64) + offset_ns)
        cols["end_ns"] = pa.array(np.asarray(end, dtype=np.int64) + offset_ns)
        cols["status_code"] = pa.array(status, pa.int8())
        cols["status_message"] = pa.array(msg, pa.string())
        rid_arr = pa.array(rid, pa.string())
        cols["request_id"] = rid_arr
        d = rid_arr.dictionary_encode()
        tids = pa.array([self._trace_id(x) for x in d.dictionary.to_pylist()], pa.string())
        cols["trace_id"] = tids.take(d.indices) if len(tids) else pa.nulls(n, pa.string())
        cols["prompt_index"] = pa.array(pidx, pa.int32())
        cols["attempt"] = pa.array(attempt, pa.int32())
        default_rank = resource.get("tp_rank")
        if default_rank is not None:
            rank = [default_rank if r is None else r for r in rank]
        cols["tp_rank"] = pa.array(rank, pa.int16())
        cols["thread"] = pa.array(thread, pa.string()).dictionary_encode()
        cols["attr_int"], cols["attr_float"], cols["attr_str"] = self._attr_maps(attrs)
        arrays = [cols[c].cast(_T[c]) if cols[c].type != _T[c] else cols[c] for c, _, _ in schema.COLUMNS]
        return pa.Table.from_arrays(arrays, schema=schema.SCHEMA)

    def _attr_maps(self, attrs: tuple) -> tuple[pa.Array, pa.Array, pa.Array]:
        """The three typed attribute map columns (int64, float64, string values) of one batch.

        ``attrs``: per record, its slots after the fixed ones: the keys then the values, in the same
        order (recorder.py's record layout), empty without attributes.
        """
        oi, ki, vi = [0], [], []
        of, kf, vf = [0], [], []
        os_, ks, vs = [0], [], []
        allowed = attributes.ALLOWED
        dropped = 0
        for a in attrs:
            if a:
                n = len(a) // 2
                for k, v in zip(a[:n], a[n:]):
                    spec = allowed.get(k)
                    if spec is None:
                        dropped += 1
                        continue
                    t = spec.type
                    tv = type(v)
                    if t is int:
                        if tv is int or tv is bool:
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
                        kf.append(k)
                        vf.append(float(v))
                    else:
                        dropped += 1
            oi.append(len(ki))
            of.append(len(kf))
            os_.append(len(ks))
        self.dropped_attributes += dropped
        return (pa.MapArray.from_arrays(pa.array(oi, pa.int32()), pa.array(ki, pa.string()), pa.array(vi, pa.int64())),
                pa.MapArray.from_arrays(pa.array(of, pa.int32()), pa.array(kf, pa.string()), pa.array(vf, pa.float64())),
                pa.MapArray.from_arrays(pa.array(os_, pa.int32()), pa.array(ks, pa.string()), pa.array(vs, pa.string())))

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
