"""Lab-only injected delays: add a known delay inside one DESIGN.md §2 stage (proof by intervention).

``PDTRACE_LAB_INJECT="handoff.prep=40ms,kv.ready=25ms"`` (``pdtrace lab --inject ...`` sets it)
in the lab's engine and router processes. Test-only by construction: the hooks are installed
only by the lab's generated ``sitecustomize`` (engines; see :mod:`.progthread`) and by the lab's
own router (:mod:`.router`), and only when the variable is set; pdtrace's production code
(the plugin, the traced connectors, the middleware) has no call into this module. Unset or
empty: nothing is patched, nothing sleeps.

Which requests: each listed stage is injected into about half of the requests, chosen
independently per stage by ``sha256("<stage>:<X>")`` (X = the router's base request id, the
same in the router, P and D, so every process agrees without messages): a factorial design,
so injected and uninjected requests are interleaved under the same load, and each stage's
effect is ``mean(· | injected) - mean(· | not injected)`` over the same run. Every delay is
recorded as an event ``lab.inject`` on the request (attrs ``lab.stage``, ``lab.injected_ms``)
in the process that slept; :func:`selected` is the rule the analysis may recompute.

Where each delay goes (the hook lengthens that stage only; at most once per request and stage):

==================== ======================= ==================================================
stage                process / thread        hook (the delay is taken ...)
==================== ======================= ==================================================
``router.dispatch``  router, event loop      ... after the P leg's ``router.dispatch`` span
                                             opened, before the leg is sent (``asyncio.sleep``);
                                             push: before either leg is sent (concurrent
                                             legs: both dispatch spans hold it; serial:
                                             P's, D's starts when P answered)
``prefill.frontend`` P's API server, loop    ... inside pdtrace's ``FrontendMiddleware`` (after its
                                             span started), before vLLM parses the request and
                                             stamps ``arrival_time`` (``asyncio.sleep``)
``handoff.prep``     pull: D forward thread  ... before ``_read_blocks_for_req`` (D's blocks
                                             allocated -> READ posted; blocks D's forward thread)
                     push: P writer thread   ... before ``_xfer_blocks_for_req`` (KV ready and
                                             registration matched -> WRITE posted)
``kv.ready``         D, forward thread       the poll's ``finished_recving`` id is held back
                                             this long after the poll first reported it, so the
                                             scheduler promotes it later (transfer done ->
                                             promoted); non-blocking
``dest.register``    push: D writer thread   ... before ``_do_send_reg_notif`` (D's blocks
                                             allocated -> registration arrives on P)
==================== ======================= ==================================================

Not injectable here (no hook that lengthens that stage alone): ``prefill.queue`` /
``prefill.compute`` / ``decode.queue`` / ``decode.first_step`` (a sleep on the forward thread
lands in whichever step runs, and every request in the batch pays it), ``kv.transfer`` (NIXL's
own duration), ``router.wait`` / ``decode.frontend`` (they end when the engine answers).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.abc
import sys
import threading
import time

from pdtrace.instrument import config

ENV_SWITCH = "PDTRACE_LAB_INJECT"

#: stage -> the handoff modes it can be injected in (dest.register exists in push only)
STAGES: dict[str, tuple[str, ...]] = {
    "router.dispatch": ("pull", "push"),
    "prefill.frontend": ("pull", "push"),
    "handoff.prep": ("pull", "push"),
    "kv.ready": ("pull", "push"),
    "dest.register": ("push",),
}
EVENT = "lab.inject"


class InjectSpecError(ValueError):
    """A bad ``PDTRACE_LAB_INJECT`` value (unknown stage, bad duration)."""


def parse(spec: str | None) -> dict[str, float]:
    """``"handoff.prep=40ms,kv.ready=0.025s"`` -> ``{"handoff.prep": 40.0, "kv.ready": 25.0}`` (ms).

    A bare number is ms. Raises :class:`InjectSpecError` for an unknown stage, a bad or negative
    duration, or a stage given twice.
    """
    out: dict[str, float] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        stage, sep, val = part.partition("=")
        stage, val = stage.strip(), val.strip().lower()
        if not sep or stage not in STAGES:
            raise InjectSpecError(f"{ENV_SWITCH}: {part!r}: want <stage>=<ms>ms with stage one of {sorted(STAGES)}")
        scale = 1.0
        if val.endswith("ms"):
            val = val[:-2]
        elif val.endswith("s"):
            val, scale = val[:-1], 1000.0
        try:
            ms = float(val) * scale
        except ValueError:
            raise InjectSpecError(f"{ENV_SWITCH}: {part!r}: bad duration") from None
        if not (0 <= ms <= 60_000) or stage in out:
            raise InjectSpecError(f"{ENV_SWITCH}: {part!r}: duration must be 0..60000 ms, each stage once")
        out[stage] = ms
    return out


def selected(stage: str, request_id: str) -> bool:
    """True iff ``stage`` is injected into base request id ``request_id`` (about half, per stage)."""
    return hashlib.sha256(f"{stage}:{request_id}".encode()).digest()[0] & 1 == 1


_spec: dict[str, float] | None = None
_done: set = set()
_lock = threading.Lock()


def spec() -> dict[str, float]:
    """This process's parsed ``PDTRACE_LAB_INJECT`` (cached; a bad value warns once and injects nothing)."""
    global _spec
    if _spec is None:
        try:
            _spec = parse(config.raw(ENV_SWITCH))
        except InjectSpecError as exc:
            print(f"pdtrace: {exc}; nothing injected", file=sys.stderr)
            _spec = {}
    return _spec


def _split(rid: str) -> tuple[str, int]:
    from pdtrace.connector.traced.common import split_id
    return split_id(str(rid))


def delay_ms(stage: str, rid: str, once_key=None) -> float:
    """The delay (ms) to take now in ``stage`` for request ``rid`` (internal or base id), 0 if none.

    With ``once_key`` the delay is given once per (stage, once_key) in this process.
    """
    ms = spec().get(stage, 0.0)
    if not ms:
        return 0.0
    x, _ = _split(rid)
    if not selected(stage, x):
        return 0.0
    if once_key is not None:
        with _lock:
            key = (stage, once_key)
            if key in _done:
                return 0.0
            if len(_done) > 100_000:
                _done.clear()
            _done.add(key)
    return ms


def record(stage: str, rid: str, ms: float, t_ns: int | None = None) -> None:
    """Event ``lab.inject`` on the request (attrs ``lab.stage``, ``lab.injected_ms``); never raises."""
    try:
        from pdtrace.instrument import tracer
        if not tracer.on:
            return
        x, pidx = _split(rid)
        tracer.event(EVENT, x, time_ns=t_ns, prompt_index=pidx,
                     attrs={"lab.stage": stage, "lab.injected_ms": float(ms)})
    except Exception:  # noqa: BLE001 - a lab record must never break the engine
        pass


def sleep(stage: str, rid: str, once_key=None) -> float:
    """Blocking hook body: sleep this stage's delay for ``rid`` if selected; returns the ms slept."""
    ms = delay_ms(stage, rid, once_key)
    if ms:
        from pdtrace.instrument import tracer
        record(stage, rid, ms, tracer.now())
        time.sleep(ms / 1000.0)
    return ms


async def asleep(stage: str, rid: str, once_key=None) -> float:
    """Asyncio hook body (router, API server): as :func:`sleep` without blocking the event loop."""
    ms = delay_ms(stage, rid, once_key)
    if ms:
        from pdtrace.instrument import tracer
        record(stage, rid, ms, tracer.now())
        await asyncio.sleep(ms / 1000.0)
    return ms


# ------------------------------------------------------------------ engine patches
def _patch_middleware(mod) -> None:
    """prefill.frontend: wrap the app *inside* ``FrontendMiddleware`` (P's API server only), so the
    sleep comes after the span's start (HTTP received) and before vLLM parses the request and stamps
    its ``arrival_time`` (which starts ``prefill.queue``)."""
    cls = mod.FrontendMiddleware
    if "prefill.frontend" not in spec() or getattr(cls.__init__, "_pdtrace_inject", False):
        return
    real_init = cls.__init__

    @functools.wraps(real_init)
    def __init__(self, app, *args, **kwargs):
        real_init(self, app, *args, **kwargs)
        if self.role == "prefill":
            self.app = _SleepyApp(self.app, mod._PATHS)

    __init__._pdtrace_inject = True
    cls.__init__ = __init__


class _SleepyApp:
    """ASGI app wrapper: sleeps the prefill.frontend delay of a selected completion request first."""

    def __init__(self, app, paths):
        self.app, self.paths = app, paths

    def __getattr__(self, name):  # the middleware reads e.g. ``self.app.state``
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("method") == "POST" and scope.get("path") in self.paths:
            x = next((v.decode("latin-1") for k, v in scope.get("headers") or () if k.lower() == b"x-request-id"),
                     None)
            if x:
                await asleep("prefill.frontend", x, once_key=x)
        return await self.app(scope, receive, send)


def _wrap_method(cls, name: str, make) -> None:
    real = getattr(cls, name)
    if getattr(real, "_pdtrace_inject", False):
        return
    new = make(real)
    new._pdtrace_inject = True
    setattr(cls, name, new)


def _patch_pull(mod) -> None:
    st = spec()
    if "handoff.prep" in st:
        def make(real):
            def _read_blocks_for_req(self, req_id, meta):
                sleep("handoff.prep", req_id, once_key=req_id)
                return real(self, req_id, meta)
            return _read_blocks_for_req
        _wrap_method(mod.TracedNixlPullConnectorWorker, "_read_blocks_for_req", make)
    if "kv.ready" in st:
        _patch_poll(mod.TracedNixlPullConnector)


def _patch_push(mod) -> None:
    st = spec()
    if "handoff.prep" in st:
        def make(real):
            def _xfer_blocks_for_req(self, req_id, meta):
                sleep("handoff.prep", req_id, once_key=req_id)
                return real(self, req_id, meta)
            return _xfer_blocks_for_req
        _wrap_method(mod.TracedNixlPushConnectorWorker, "_xfer_blocks_for_req", make)
    if "dest.register" in st:
        def make(real):
            def _do_send_reg_notif(self, req_id, reg_data):
                sleep("dest.register", req_id, once_key=req_id)
                return real(self, req_id, reg_data)
            return _do_send_reg_notif
        _wrap_method(mod.TracedNixlPushConnectorWorker, "_do_send_reg_notif", make)
    if "kv.ready" in st:
        _patch_poll(mod.TracedNixlPushConnector)


class _Held:
    """kv.ready: finished receives held back until their delay has passed (one per connector)."""

    def __init__(self):
        self.until: dict[str, int] = {}   # internal id -> monotonic ns it may be reported


def _hold(conn, finished: set) -> set:
    """Remove from ``finished`` the selected ids whose delay has not passed; add back those now due."""
    held = conn.__dict__.setdefault("_pdt_inject_held", _Held())
    now = time.monotonic_ns()
    for rid in list(finished or ()):
        if rid in held.until:
            continue
        ms = delay_ms("kv.ready", rid, once_key=rid)
        if ms:
            held.until[rid] = now + int(ms * 1e6)
            from pdtrace.instrument import tracer
            record("kv.ready", rid, ms, tracer.now())
    out = set(finished or ())
    for rid, t in list(held.until.items()):
        if t > now:
            out.discard(rid)
        else:
            out.add(rid)
            del held.until[rid]
    return out


def _patch_poll(cls) -> None:
    def make(real):
        def get_transfer_results(self, finished_req_ids):
            res = real(self, finished_req_ids)
            if getattr(self, "connector_worker", None) is None or \
                    getattr(self.connector_worker, "_pdt_role", "decode") != "decode":
                return res
            failed = set(getattr(res, "failed_recving", ()) or ())
            kept = _hold(self, set(res.finished_recving or ()) - failed)
            res.finished_recving = kept | (set(res.finished_recving or ()) & failed)
            return res
        return get_transfer_results
    _wrap_method(cls, "get_transfer_results", make)


_TARGETS = {
    "pdtrace.connector.traced.middleware": _patch_middleware,
    "pdtrace.connector.traced.pull": _patch_pull,
    "pdtrace.connector.traced.push": _patch_push,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self._inner, self._patch = inner, patch

    def create_module(self, spec_):
        return self._inner.create_module(spec_)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            self._patch(module)
        except Exception as exc:  # noqa: BLE001 - never break the engine over a lab patch
            print(f"pdtrace: lab inject patch of {module.__name__} failed: {type(exc).__name__}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _TARGETS.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            s = finder.find_spec(fullname, path, target)
            if s is not None and s.loader is not None:
                s.loader = _Loader(s.loader, patch)
                return s
        return None


def install() -> bool:
    """Install the engine hooks (idempotent) when ``PDTRACE_LAB_INJECT`` names a stage; False otherwise."""
    if not spec():
        return False
    for name, patch in _TARGETS.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
