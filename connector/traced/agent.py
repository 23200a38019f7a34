"""A thin proxy around the worker's NIXL agent (``worker.nixl_wrapper``): the one place NIXL calls are timed.

Installed only when tracing is on, after the stock worker ``__init__`` created
the agent (the proxy wraps that same agent: no second agent, no threads).
Every attribute not defined here is forwarded unchanged.

Timed calls (thread: whoever calls them — D's forward thread in pull, P's
``nixl-push-writer`` in push):

- ``make_prepped_xfer`` → descriptor count and op of the new handle.
- ``transfer(handle)``  → the post time (``kv.transfer`` starts here).
- ``get_xfer_telemetry(handle)`` → NIXL's own bytes / descriptors / post and
  transfer durations (µs, converted to ns here, where they enter), recorded
  as the ``kv.transfer`` span [post, post + xferDuration] by the owner of the
  handle.
- ``check_xfer_state`` → a state other than DONE/PROC becomes a
  ``kv.transfer_failed`` event.
- ``send_notif`` / ``get_new_notifs`` → ``notification.sent`` /
  ``notification.received`` events (heartbeats are counted, not recorded),
  and the unmatched-notification check on a pull producer.

Every event that names a request follows the ``PDTRACE_SAMPLE`` rule
(``tracer.sampled``, cached per request id); one without a request id is kept.
"""
from __future__ import annotations

import threading

from pdtrace.instrument import tracer

from .common import notif_kind, split_id
from .safety import safe


class HandleInfo:
    __slots__ = ("rid", "op", "ndesc", "post_ns", "post_end_ns", "peer", "rank", "blocks")

    def __init__(self, rid, op, ndesc, peer, rank):
        self.rid = rid
        self.op = op
        self.ndesc = ndesc
        self.post_ns = 0
        self.post_end_ns = 0
        self.peer = peer
        self.rank = rank
        self.blocks = 0  # KV blocks the transfer fills, when the poster knows it (push: at the post)


class TracedAgent:
    """Proxy over a ``nixl_agent``; ``owner`` is the traced worker (for request context and callbacks)."""

    def __init__(self, agent, owner) -> None:
        self._agent = agent
        self._owner = owner
        self._handles: dict[int, HandleInfo] = {}
        self._lock = threading.Lock()
        self.heartbeats_sent = 0
        self.heartbeats_received = 0
        # get_new_notifs drain times (monotonic ns): a notification returned by one drain
        # arrived after the previous drain started (``drain_lo``) and before this one (``drain_at``).
        self._drain_prev = 0
        self.drain_lo = 0
        self.drain_at = 0

    def __getattr__(self, name):
        return getattr(self._agent, name)

    # ------------------------------------------------------------ transfers
    def make_prepped_xfer(self, operation, local_xfer_side_handle, local_indices, remote_xfer_side_handle,
                          remote_indices, *args, **kwargs):
        h = self._agent.make_prepped_xfer(operation, local_xfer_side_handle, local_indices,
                                          remote_xfer_side_handle, remote_indices, *args, **kwargs)
        if tracer.on:
            safe(self._note_handle, h, operation, local_indices, kwargs.get("notif_msg"))
        return h

    def _note_handle(self, h, op, local_indices, notif_msg) -> None:
        ctx = self._owner._pdt_ctx()
        rid = ctx.rid if ctx is not None else None
        if rid is None and notif_msg:
            rid = notif_kind(bytes(notif_msg), "")[1]
        try:
            n = len(local_indices)
        except TypeError:
            n = 0
        info = HandleInfo(rid, str(op), n, ctx.peer if ctx is not None else None,
                          ctx.peer_rank if ctx is not None else None)
        with self._lock:
            if len(self._handles) > 65536:
                self._handles.clear()
            self._handles[_key(h)] = info

    def transfer(self, handle, *args, **kwargs):
        if not tracer.on:
            return self._agent.transfer(handle, *args, **kwargs)
        t0 = tracer.now()
        try:
            return self._agent.transfer(handle, *args, **kwargs)
        finally:
            t1 = tracer.now()
            safe(self._posted, handle, t0, t1)

    def _posted(self, handle, t0, t1) -> None:
        info = self._handles.get(_key(handle))
        if info is None:
            return
        info.post_ns, info.post_end_ns = t0, t1
        self._owner._pdt_on_post(info)

    def check_xfer_state(self, handle, *args, **kwargs):
        st = self._agent.check_xfer_state(handle, *args, **kwargs)
        if tracer.on and st != "DONE" and st != "PROC":
            safe(self._failed, handle, st)
        return st

    def _failed(self, handle, st) -> None:
        info = self._handles.pop(_key(handle), None)
        rid = info.rid if info else None
        x, pidx = split_id(rid) if rid else (None, 0)
        if x is not None and not tracer.sampled(x):
            return
        tracer.event("kv.transfer_failed", x, prompt_index=pidx, tp_rank=self._owner._pdt_rank,
                     attrs={"lifecycle.cause": f"xfer_state:{st}"[:64], "request.internal_id": rid or "",
                            "kv.op": info.op if info else ""})

    def get_xfer_telemetry(self, handle, *args, **kwargs):
        res = self._agent.get_xfer_telemetry(handle, *args, **kwargs)
        if tracer.on:
            safe(self._telemetry, handle, res)
        return res

    def _telemetry(self, handle, res) -> None:
        info = self._handles.pop(_key(handle), None)
        if info is None or res is None:
            return
        self._owner._pdt_on_transfer_done(info, res, tracer.now())

    # -------------------------------------------------------- notifications
    def send_notif(self, remote_agent_name, notif_msg=None, *args, **kwargs):
        r = self._agent.send_notif(remote_agent_name, notif_msg, *args, **kwargs) if notif_msg is not None \
            else self._agent.send_notif(remote_agent_name, *args, **kwargs)
        if tracer.on and notif_msg is not None:
            safe(self._sent, notif_msg)
        return r

    def _sent(self, msg) -> None:
        kind, rid = notif_kind(bytes(msg), self._owner._pdt_role)
        if kind == "heartbeat":
            self.heartbeats_sent += 1
            return
        if kind == "push_reg":  # recorded as registration.sent by the writer hook
            return
        if kind in ("read_done", "write_done"):
            # A notification *we* send completes the other side's wait.
            kind = "read_done" if self._owner._pdt_role == "decode" else "write_done"
        x, pidx = split_id(rid) if rid else (None, 0)
        if x is not None and not tracer.sampled(x):
            return
        tracer.event("notification.sent", x, prompt_index=pidx, tp_rank=self._owner._pdt_rank,
                     attrs={"kv.notif_kind": kind, "request.internal_id": rid or ""})

    def get_new_notifs(self, *args, **kwargs):
        t0 = tracer.now() if tracer.on else 0
        out = self._agent.get_new_notifs(*args, **kwargs)
        if tracer.on:
            self.drain_lo, self.drain_at, self._drain_prev = self._drain_prev, t0, t0
            if out:
                safe(self._received, out)
        return out

    def _received(self, out) -> None:
        t = tracer.now()
        own = self._owner
        for agent_name, notifs in out.items():
            for n in notifs:
                kind, rid = notif_kind(bytes(n), own._pdt_role)
                if kind == "heartbeat":
                    self.heartbeats_received += 1
                    continue
                if kind == "push_reg":  # recorded as registration.received by the writer hook
                    continue
                x, pidx = split_id(rid) if rid else (None, 0)
                if x is None or tracer.sampled(x):
                    tracer.event("notification.received", x, time_ns=t, prompt_index=pidx, tp_rank=own._pdt_rank,
                                 attrs={"kv.notif_kind": kind, "request.internal_id": rid or ""})
                own._pdt_on_notif(kind, rid, t)  # transfer-end bookkeeping, sampled or not


def _key(handle) -> int:
    # nixl's python handle objects wrap an int (``_handle``); vLLM passes them back unchanged.
    h = getattr(handle, "_handle", handle)
    try:
        return int(h)
    except (TypeError, ValueError):
        return id(handle)
