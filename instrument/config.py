"""Every environment variable pdtrace reads, with its meaning and default.

A bad value logs one warning naming the variable and falls back to the
default; it never raises into the traced process.

=============================  =========  ====================================================
variable                       default    meaning
=============================  =========  ====================================================
``PDTRACE_DIR``                (unset)    trace directory; tracing is off unless it is set (and
                                          then on in processes that trace: the connectors, the
                                          API server, the lab's router; never on import)
``PDTRACE_SAMPLE``             ``1.0``    fraction of requests traced, by sha256(request id)
``PDTRACE_STEP_SAMPLE``        ``1.0``    fraction of engine steps whose step spans are kept
                                          (every k-th step, k = round(1/fraction))
``PDTRACE_BUFFER_SPANS``       ``65536``  bound of the in-memory buffer, in records
``PDTRACE_FLUSH_INTERVAL_S``   ``1.0``    writer flush interval (s); a SIGKILL loses at most this
``PDTRACE_OPEN_AFTER_S``       ``1.0``    a span open (started, not ended) at least this long (s) is
                                          written at every flush as an ``open`` record with its
                                          latest attributes, until it ends (view ``in_flight``);
                                          0: every open span. Keep it <= 2 flush intervals: a stuck
                                          stage is then in the store within threshold + 1 interval
``PDTRACE_ROTATE_S``           ``60``     merge the sink's per-flush part files into one segment
                                          file at least this often (s); 0: only by size and when
                                          the last client has gone
``PDTRACE_ROTATE_BYTES``       ``67108864`` ... or when the sink holds this many bytes of them (Arrow
                                          buffers, kept in memory until the merge; 64 KiB..16 GiB)
``PDTRACE_SINK_IDLE_S``        ``5``      the host's sink exits this long (s, 0.1..86400) after its
                                          last client has gone (after writing everything); the
                                          next traced process starts a new one. The sink's own
                                          flush interval, rotation and idle time are those of the
                                          process that started it
``PDTRACE_ANCHOR_INTERVAL_S``  ``10``     write a (monotonic, wall) clock anchor this often (s)
``PDTRACE_LAYOUT``             ``flat``   where the host's sink puts its files: ``flat``, in the trace
                                          directory itself; ``hive``, in
                                          ``date=YYYY-MM-DD/hour=HH/host=<host>/`` under it (UTC
                                          hour the file is written; a segment goes where its parts
                                          are, the parts of an hour are merged when the next hour's
                                          first part is written; :mod:`pdtrace.instrument.layout`).
                                          The sink's setting (of the process that started it) is used
``PDTRACE_RETAIN``             ``all``    ``tail``: the host's sink holds each request's records and
                                          writes only the requests that miss a threshold below, fail,
                                          fall in a marked window (``pdtrace mark``) or are
                                          head-sampled (:mod:`pdtrace.instrument.retention`); the
                                          sink's setting (of the process that started it) is used
``PDTRACE_TAIL_TTFT_MS``       ``0``      tail: keep a request whose TTFT >= this (ms); 0: no TTFT rule
``PDTRACE_TAIL_TPOT_MS``       ``0``      tail: keep a request whose TPOT >= this (ms); 0: no TPOT rule
``PDTRACE_TAIL_HEAD``          ``0.1``    tail: fraction of the other requests kept anyway, by
                                          sha256 of the request id (not PDTRACE_SAMPLE's hash)
``PDTRACE_TAIL_HOLD_S``        ``30``     tail: a request that has received no record for this long
                                          (s) is decided then (kept if it never ended)
``PDTRACE_TAIL_MAX_HOLD_S``    ``600``    tail: a request held this long (s) after its first record
                                          is decided then, however busy (kept if not ended)
``PDTRACE_TAIL_MEMORY_MB``     ``256``    tail: bound of the records held undecided (MiB, estimated);
                                          over it the oldest requests are decided early
``PDTRACE_TAIL_STEP_MS``       ``0``      tail: a step span this long (ms) is a stall and kept; 0: a
                                          step > 2x the median of its process's last 255 steps
``PDTRACE_RUN_ID``             (unset)    run id written on every row (resource)
``PDTRACE_ROLE``               (unset)    role resource (router/prefill/decode/...) if the
                                          process does not set one itself
``PDTRACE_OTLP``               ``0``      ``1``: export over OTLP even without OTEL_* endpoint
                                          variables (to the SDK's default endpoint)
``OTEL_EXPORTER_OTLP_ENDPOINT``           standard OTLP variables; when an endpoint is set, spans
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``    also go out over OTLP/HTTP (protobuf)
``OTEL_EXPORTER_OTLP_TIMEOUT``  ``10``     OTLP export timeout (s; the variant
``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``     ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` wins)
``OTEL_SDK_DISABLED``                     ``true``: no OTLP export (standard)
``OTEL_TRACES_EXPORTER``                  ``none``: no OTLP export (standard)
``PDTRACE_SELF_CPU``           ``0``      ``1``: measure pdtrace's own CPU on every engine thread
                                          (thread CPU clock around each hook: EngineCore/forward
                                          thread, API-server event loop): per thread at every
                                          flush (``pdtrace.thread_cpu`` stats rows, view
                                          ``thread_cpu``) and per step (``step.pdtrace_cpu_ns``,
                                          ``step.thread_cpu_ns`` on the step spans); ``pdtrace
                                          lab`` sets it unless given
                                          (:mod:`pdtrace.instrument.selfcpu`)
``PDTRACE_HELPER_CPUS``        (unset)    CPUs for pdtrace's writer thread and sink process
                                          (cpulist, e.g. ``2-3``); unset: every CPU the process
                                          may use, never only the engine thread's pinned core
                                          (:mod:`pdtrace.instrument.cpus`)
``PDTRACE_TEST_WALL_OFFSET_NS`` ``0``     TEST ONLY: shift this process's wall anchor by this
                                          many ns, to reproduce clock skew between hosts on one
                                          machine. Recorded on every clock row.
=============================  =========  ====================================================

Read by the other parts (the analysis, the dashboard, the lab, the tests) through
:func:`raw`; :data:`VARIABLES` declares all of them, these and the recorder's
above, with meaning, default and bounds. A test
(``tests/instrument/test_config_declared.py``) fails when code names a
``PDTRACE_*`` variable that is not declared there, or reads one outside this
module.

=================================  ===========  ================================================
variable                           default      meaning
=================================  ===========  ================================================
``PDTRACE_CACHE_DIR``              (unset)      analysis: where a read-only store's cache and the
                                                SQL library template go (default ``<tmp>/pdtrace-cache``)
``PDTRACE_DASHBOARD_DIR``          (unset)      dashboard: the trace directory it opens
``PDTRACE_DASHBOARD_COMPARE_DIR``  (unset)      dashboard: the second directory of the compare page
``PDTRACE_LAB_CACHE``              (unset)      lab: model and build cache (default
                                                ``~/.cache/pdtrace/lab``)
``PDTRACE_LAB_INJECT``             (unset)      lab only: ``stage=MS,...`` delays injected into
                                                stages (:mod:`pdtrace.connector.lab.inject`)
``PDTRACE_LAB_KV_CORES``           (unset)      lab only: cores for vLLM's CPU KV cache threads
                                                (comma-separated ints)
``PDTRACE_NIXL_PROG_THREAD``       ``default``  lab only: NIXL progress thread: µs delay (int >= 0),
                                                ``busy`` or ``off``
``PDTRACE_LAB_REQUIRED``           (unset)      tests: ``1`` fails (not skips) lab tests when the
                                                lab environment is missing (CI)
``PDTRACE_VLLM033_WHEEL``          (unset)      tests: path of the vLLM 0.33.0 wheel the static hook
                                                check reads
``PDTRACE_CHROMIUM``               ``/usr/bin/chromium``  tests: the browser of the dashboard test
``PDTRACE_SKEW_REUSE``             (unset)      tests, development only: reuse the skew test's runs
``PDTRACE_TEST_REUSE_LAB_STORES``  (unset)      tests, development only: reuse the dashboard tests'
                                                lab stores
=================================  ===========  ================================================
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from .cpus import parse_cpulist

log = logging.getLogger("pdtrace")


@dataclass(frozen=True)
class Variable:
    """One environment variable pdtrace reads: its meaning, default (as text, None: unset) and bounds."""

    name: str
    default: str | None
    bounds: str
    scope: str  # 'recorder' | 'analysis' | 'dashboard' | 'lab' | 'test'
    meaning: str


#: Every environment variable pdtrace reads (the tables above), by name.
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("PDTRACE_DIR", None, "path", "recorder", "trace directory; tracing is off unless it is set"),
    Variable("PDTRACE_SAMPLE", "1.0", "[0, 1]", "recorder", "fraction of requests traced, by sha256(request id)"),
    Variable("PDTRACE_STEP_SAMPLE", "1.0", "[0, 1]", "recorder", "fraction of engine steps whose step spans are kept"),
    Variable("PDTRACE_BUFFER_SPANS", "65536", "[16, 2^26]", "recorder", "bound of the in-memory buffer (records)"),
    Variable("PDTRACE_FLUSH_INTERVAL_S", "1.0", "[0.01, 3600]", "recorder", "writer flush interval (s)"),
    Variable("PDTRACE_OPEN_AFTER_S", "1.0", "[0, 86400]", "recorder", "open spans at least this old (s) are written"),
    Variable("PDTRACE_ROTATE_S", "60", "[0, 86400]", "recorder", "merge part files into a segment this often (s)"),
    Variable("PDTRACE_ROTATE_BYTES", str(64 << 20), "[2^16, 2^34]", "recorder", "... or at this many bytes of parts"),
    Variable("PDTRACE_SINK_IDLE_S", "5", "[0.1, 86400]", "recorder", "the host's sink exits this long after its last client"),
    Variable("PDTRACE_ANCHOR_INTERVAL_S", "10", "[0.01, 86400]", "recorder", "clock anchor interval (s)"),
    Variable("PDTRACE_LAYOUT", "flat", "flat | hive", "recorder",
             "hive: the sink writes under date=YYYY-MM-DD/hour=HH/host=<host>/ (UTC hour of writing)"),
    Variable("PDTRACE_RUN_ID", None, "text", "recorder", "run id written on every row"),
    Variable("PDTRACE_RETAIN", "all", "all | tail", "recorder",
             "tail: keep only slow, failed, marked or head-sampled requests"),
    Variable("PDTRACE_TAIL_TTFT_MS", "0", "[0, 3.6e6]", "recorder",
             "tail: keep requests with TTFT >= this (ms)"),
    Variable("PDTRACE_TAIL_TPOT_MS", "0", "[0, 3.6e6]", "recorder",
             "tail: keep requests with TPOT >= this (ms)"),
    Variable("PDTRACE_TAIL_HEAD", "0.1", "[0, 1]", "recorder", "tail: fraction of other requests kept anyway"),
    Variable("PDTRACE_TAIL_HOLD_S", "30", "[0.1, 86400]", "recorder",
             "tail: a request idle (no record) this long is decided"),
    Variable("PDTRACE_TAIL_MAX_HOLD_S", "600", "[0.1, 86400]", "recorder",
             "tail: a request held this long after its first record is decided"),
    Variable("PDTRACE_TAIL_MEMORY_MB", "256", "[1, 65536]", "recorder", "tail: bound of the held records (MiB)"),
    Variable("PDTRACE_TAIL_STEP_MS", "0", "[0, 3.6e6]", "recorder",
             "tail: a step this long (ms) is kept; 0: automatic"),
    Variable("PDTRACE_ROLE", None, "text", "recorder", "role resource if the process sets none"),
    Variable("PDTRACE_OTLP", "0", "0 | 1", "recorder", "export over OTLP without OTEL_* endpoint variables"),
    Variable("PDTRACE_SELF_CPU", "0", "0 | 1", "recorder", "measure pdtrace's own CPU per engine step"),
    Variable("PDTRACE_HELPER_CPUS", None, "cpulist", "recorder", "CPUs of the writer thread and sink process"),
    Variable("PDTRACE_TEST_WALL_OFFSET_NS", "0", "[-2^62, 2^62]", "test", "shift the wall anchor (ns), tests only"),
    Variable("PDTRACE_CACHE_DIR", None, "path", "analysis",
             "cache directory of read-only stores and of the library template"),
    Variable("PDTRACE_DASHBOARD_DIR", None, "path", "dashboard", "trace directory the dashboard opens"),
    Variable("PDTRACE_DASHBOARD_COMPARE_DIR", None, "path", "dashboard", "second directory of the compare page"),
    Variable("PDTRACE_LAB_CACHE", None, "path", "lab", "the lab's model and build cache"),
    Variable("PDTRACE_LAB_INJECT", None, "stage=MS,...", "lab", "delays injected into stages (lab only)"),
    Variable("PDTRACE_LAB_KV_CORES", None, "comma-separated ints", "lab", "cores of vLLM's CPU KV cache threads"),
    Variable("PDTRACE_NIXL_PROG_THREAD", "default", "int >= 0 | busy | off", "lab", "NIXL progress thread mode"),
    Variable("PDTRACE_LAB_REQUIRED", None, "1", "test", "fail, not skip, lab tests without the lab environment"),
    Variable("PDTRACE_VLLM033_WHEEL", None, "path", "test", "vLLM 0.33.0 wheel of the static hook check"),
    Variable("PDTRACE_CHROMIUM", "/usr/bin/chromium", "path", "test", "browser of the dashboard test"),
    Variable("PDTRACE_SKEW_REUSE", None, "path", "test", "reuse the skew test's runs (development)"),
    Variable("PDTRACE_TEST_REUSE_LAB_STORES", None, "path", "test", "reuse the dashboard tests' stores (development)"),
    Variable("OTEL_EXPORTER_OTLP_ENDPOINT", None, "URL", "recorder", "OTLP base endpoint"),
    Variable("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None, "URL", "recorder", "OTLP traces endpoint"),
    Variable("OTEL_EXPORTER_OTLP_TIMEOUT", "10", "[0, 600]", "recorder", "OTLP export timeout (s)"),
    Variable("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", None, "[0, 600]", "recorder", "OTLP traces export timeout (s)"),
    Variable("OTEL_SDK_DISABLED", None, "true", "recorder", "true: no OTLP export"),
    Variable("OTEL_TRACES_EXPORTER", None, "none", "recorder", "none: no OTLP export"),
)}


def raw(name: str, env=None) -> str | None:
    """The text of declared variable ``name`` in ``env`` (default ``os.environ``); None when unset or empty.

    The one way code outside this module reads an environment variable of pdtrace's.
    Raises KeyError when ``name`` is not in :data:`VARIABLES` (declare it there first).
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in pdtrace.instrument.config.VARIABLES")
    return (os.environ if env is None else env).get(name) or None


def _warn(name: str, raw: str, default: object, why: str) -> None:
    log.warning("pdtrace: ignoring %s=%r (%s); using %r", name, raw, why, default)


def _float(env, name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        _warn(name, raw, default, "not a number")
        return default
    if not (lo <= v <= hi) or math.isnan(v):
        _warn(name, raw, default, f"outside [{lo}, {hi}]")
        return default
    return v


def _int(env, name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        _warn(name, raw, default, "not an integer")
        return default
    if not lo <= v <= hi:
        _warn(name, raw, default, f"outside [{lo}, {hi}]")
        return default
    return v


@dataclass(frozen=True)
class Config:
    """The recorder's settings, read once from the environment (see the module doc for each)."""

    trace_dir: str | None = None
    sample: float = 1.0
    step_sample: float = 1.0
    buffer_spans: int = 65536
    flush_interval_s: float = 1.0
    open_after_s: float = 1.0
    rotate_s: float = 60.0
    rotate_bytes: int = 64 << 20
    sink_idle_s: float = 5.0
    anchor_interval_s: float = 10.0
    run_id: str | None = None
    role: str | None = None
    otlp: bool = False
    test_wall_offset_ns: int = 0
    otlp_endpoint: str | None = None
    otlp_timeout_s: float | None = None
    self_cpu: bool = False
    helper_cpus: tuple[int, ...] | None = None
    retain: str = "all"
    tail_ttft_ms: float = 0.0
    tail_tpot_ms: float = 0.0
    tail_head: float = 0.1
    tail_hold_s: float = 30.0
    tail_max_hold_s: float = 600.0
    tail_memory_mb: float = 256.0
    tail_step_ms: float = 0.0
    layout: str = "flat"

    @property
    def enabled(self) -> bool:
        """True when a trace directory is set."""
        return bool(self.trace_dir)


def requested(env=None) -> bool:
    """True iff ``PDTRACE_DIR`` is set (non-empty) in ``env`` (default ``os.environ``).

    The whole check of pdtrace's vLLM plugin when tracing is off: one
    dictionary lookup, nothing else read, started or imported.
    """
    return bool((os.environ if env is None else env).get("PDTRACE_DIR"))


def self_cpu_given(env=None) -> bool:
    """True iff ``PDTRACE_SELF_CPU`` is set (to anything) in ``env`` (default ``os.environ``): ``pdtrace
    lab`` switches the self-measurement on for its engines unless the caller chose."""
    return "PDTRACE_SELF_CPU" in (os.environ if env is None else env)


def from_env(env: dict | None = None) -> Config:
    """Read :class:`Config` from ``env`` (default ``os.environ``); never raises."""
    env = os.environ if env is None else env
    otlp_flag = env.get("PDTRACE_OTLP", "0")
    if otlp_flag not in ("0", "1", ""):
        _warn("PDTRACE_OTLP", otlp_flag, "0", "not 0 or 1")
        otlp_flag = "0"
    otlp = otlp_flag == "1" or bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "") == "none":
        otlp = False
    self_cpu = env.get("PDTRACE_SELF_CPU", "0")
    if self_cpu not in ("0", "1", ""):
        _warn("PDTRACE_SELF_CPU", self_cpu, "0", "not 0 or 1")
        self_cpu = "0"
    retain = (env.get("PDTRACE_RETAIN") or "all").strip().lower()
    if retain not in ("all", "tail"):
        _warn("PDTRACE_RETAIN", retain, "all", "not all or tail")
        retain = "all"
    layout = (env.get("PDTRACE_LAYOUT") or "flat").strip().lower()
    if layout not in ("flat", "hive"):
        _warn("PDTRACE_LAYOUT", layout, "flat", "not flat or hive")
        layout = "flat"
    return Config(
        layout=layout,
        retain=retain,
        tail_ttft_ms=_float(env, "PDTRACE_TAIL_TTFT_MS", 0.0, 0.0, 3.6e6),
        tail_tpot_ms=_float(env, "PDTRACE_TAIL_TPOT_MS", 0.0, 0.0, 3.6e6),
        tail_head=_float(env, "PDTRACE_TAIL_HEAD", 0.1, 0.0, 1.0),
        tail_hold_s=_float(env, "PDTRACE_TAIL_HOLD_S", 30.0, 0.1, 86400.0),
        tail_max_hold_s=_float(env, "PDTRACE_TAIL_MAX_HOLD_S", 600.0, 0.1, 86400.0),
        tail_memory_mb=_float(env, "PDTRACE_TAIL_MEMORY_MB", 256.0, 1.0, 65536.0),
        tail_step_ms=_float(env, "PDTRACE_TAIL_STEP_MS", 0.0, 0.0, 3.6e6),
        self_cpu=self_cpu == "1",
        helper_cpus=_cpulist(env, "PDTRACE_HELPER_CPUS"),
        trace_dir=env.get("PDTRACE_DIR") or None,
        sample=_float(env, "PDTRACE_SAMPLE", 1.0, 0.0, 1.0),
        step_sample=_float(env, "PDTRACE_STEP_SAMPLE", 1.0, 0.0, 1.0),
        buffer_spans=_int(env, "PDTRACE_BUFFER_SPANS", 65536, 16, 1 << 26),
        flush_interval_s=_float(env, "PDTRACE_FLUSH_INTERVAL_S", 1.0, 0.01, 3600.0),
        open_after_s=_float(env, "PDTRACE_OPEN_AFTER_S", 1.0, 0.0, 86400.0),
        rotate_s=_float(env, "PDTRACE_ROTATE_S", 60.0, 0.0, 86400.0),
        rotate_bytes=_int(env, "PDTRACE_ROTATE_BYTES", 64 << 20, 1 << 16, 1 << 34),
        sink_idle_s=_float(env, "PDTRACE_SINK_IDLE_S", 5.0, 0.1, 86400.0),
        anchor_interval_s=_float(env, "PDTRACE_ANCHOR_INTERVAL_S", 10.0, 0.01, 86400.0),
        run_id=env.get("PDTRACE_RUN_ID") or None,
        role=env.get("PDTRACE_ROLE") or None,
        otlp=otlp,
        test_wall_offset_ns=_int(env, "PDTRACE_TEST_WALL_OFFSET_NS", 0, -(1 << 62), 1 << 62),
        otlp_endpoint=_otlp_endpoint(env),
        otlp_timeout_s=_float(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", 0.0, 0.0, 600.0)
        or _float(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 0.0, 0.0, 600.0) or None,
    )


def _cpulist(env, name: str) -> tuple[int, ...] | None:
    """CPU ids of a cpulist variable (:func:`pdtrace.instrument.cpus.parse_cpulist`); None if unset or bad."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return parse_cpulist(raw)
    except ValueError as exc:
        _warn(name, raw, None, str(exc))
        return None


def _otlp_endpoint(env) -> str | None:
    """The OTLP/HTTP traces URL: the traces variable as given, or the base endpoint + '/v1/traces'."""
    url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if url:
        return url
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base:
        return base.rstrip("/") + "/v1/traces"
    return None
