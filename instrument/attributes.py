"""The attribute allowlist: every key a span or event may carry, with its type and unit.

Privacy rule (DESIGN.md §5): only keys listed here reach the store or OTLP;
values are ints, floats or short strings; prompt and completion text never
appear. An unknown key, or a value of the wrong type, is dropped and counted
(``recorder.dropped_attributes``), never raised into the caller. Strings are
cut to the key's ``max_len``. Exceptions are reduced to class and code by
:func:`error_attrs`.

Add a key with :func:`register` (plug-ins) or, for pdtrace itself, a line in
``_ALLOWED`` below. Stage names and event names live in
:mod:`pdtrace.instrument.stages`.
"""
from __future__ import annotations

from typing import NamedTuple


class Attr(NamedTuple):
    """One allowlisted attribute: Python type (int, float or str), max length for str, doc with unit."""

    type: type
    doc: str
    max_len: int = 256


_A = Attr
_ALLOWED: dict[str, Attr] = {
    # --- request identity and shape (gen_ai.* where OpenTelemetry has one) ---
    "gen_ai.request.id": _A(str, "vLLM external request id (cmpl-X-i / chatcmpl-X)"),
    "gen_ai.request.model": _A(str, "served model name"),
    "gen_ai.request.max_tokens": _A(int, "max_tokens asked for (tokens)"),
    "gen_ai.usage.input_tokens": _A(int, "prompt tokens"),
    "gen_ai.usage.output_tokens": _A(int, "generated tokens"),
    "request.internal_id": _A(str, "vLLM internal request id (external + 8 hex), differs on P and D"),
    "request.client_id": _A(str, "the client's own request id, if it sent one"),
    "request.mode": _A(str, "handoff mode: 'pull' (decode READs) or 'push' (prefill WRITEs)"),
    "request.num_cached_tokens": _A(int, "prompt tokens served from the prefix cache (tokens)"),
    "request.uncached_tokens": _A(int, "prompt tokens computed (prompt - cached) (tokens)"),
    "request.stream": _A(int, "1 if the client asked for a stream"),
    "http.response.status_code": _A(int, "HTTP status of a leg or of the client response"),
    # --- router -------------------------------------------------------------
    "router.leg": _A(str, "which leg a router.dispatch/wait span is for: 'prefill' or 'decode'"),
    "router.upstream": _A(str, "engine URL a leg went to (host:port)"),
    "router.policy": _A(str, "routing policy name (e.g. 'round-robin')"),
    "router.concurrent_legs": _A(int, "1 if push legs were dispatched concurrently"),
    "router.linked_request_id": _A(str, "request id sent on the other leg, when it differs (bug/mismatch evidence)"),
    # --- engines and peers ----------------------------------------------------
    "peer.engine_id": _A(str, "engine id of the other side of a handoff"),
    "peer.host": _A(str, "host of the other side"),
    "peer.port": _A(int, "side-channel port of the other side"),
    "peer.tp_size": _A(int, "tensor-parallel size of the other side"),
    "peer.tp_rank": _A(int, "rank on the other side that a per-rank record concerns"),
    # --- engine steps -----------------------------------------------------------
    "step.id": _A(int, "engine step counter of the recording engine (0-based)"),
    "step.num_reqs": _A(int, "requests scheduled in the step"),
    "step.prefill_tokens": _A(int, "prompt tokens scheduled in the step (tokens)"),
    "step.decode_tokens": _A(int, "decode tokens scheduled in the step (tokens)"),
    "step.recompute_tokens": _A(int, "tokens recomputed in the step after preemption or load failure (tokens)"),
    "step.batch": _A(str, "batch composition: 'X:p128;Y:d1;Z:r64' = request X, 128 prefill tokens; Y 1 decode; Z 64 recompute", 16384),
    "step.chunk_index": _A(int, "prefill chunk number of a prefill.compute child (0-based)"),
    "step.tokens": _A(int, "tokens this request had scheduled in the step (tokens)"),
    "step.pdtrace_cpu_ns": _A(int, "pdtrace's own CPU time on the recording thread (thread CPU clock around every pdtrace hook, less one calibrated clock read per hook) since the previous record carrying it: on a step span the EngineCore thread's since the previous step span, on a connector.load span the worker's forward thread's since the previous connector.load; ns; only with PDTRACE_SELF_CPU=1, not on the first one"),
    "step.thread_cpu_ns": _A(int, "the recording thread's whole CPU time (thread CPU clock, less the self-measurement's two clock reads per hook) over the same interval as step.pdtrace_cpu_ns, ns; their ratio is that step's hot-path share on the thread; only with PDTRACE_SELF_CPU=1"),
    "step.idle_before": _A(int, "idle engine steps (nothing scheduled, no connector work for any request) since the previous recorded step; not recorded themselves"),
    "vllm.method": _A(str, "vLLM connector method a connector.* span timed (e.g. 'start_load_kv')"),
    "connector.request_ids": _A(str, "request ids (X) the connector work served, ';'-separated", 16384),
    # --- KV transfer --------------------------------------------------------------
    "kv.op": _A(str, "NIXL operation: 'READ' (pull) or 'WRITE' (push)"),
    "kv.backend": _A(str, "NIXL backend (e.g. 'UCX')"),
    "kv.transport": _A(str, "transport the NIXL backend used for the transfer, when known (e.g. 'rc_mlx5', 'cuda_ipc', 'tcp')"),
    "kv.transport_fallback": _A(int, "1 if the backend fell back to a slower transport than configured (e.g. UCX TCP instead of RDMA)"),
    "kv.bytes": _A(int, "bytes moved by the transfer (bytes)"),
    "kv.descriptors": _A(int, "descriptor count of the transfer"),
    "kv.descriptors_requested": _A(int, "descriptor ids vLLM passed to make_prepped_xfer (before NIXL merging)"),
    "kv.blocks": _A(int, "KV blocks moved / held / reserved"),
    "kv.block_bytes": _A(int, "bytes per KV block across all layers on one rank (bytes)"),
    "kv.post_ns": _A(int, "NIXL post duration (ns; NIXL reports us, converted where read)"),
    "kv.xfer_ns": _A(int, "NIXL transfer duration (ns; NIXL reports us, converted where read)"),
    "kv.handle": _A(int, "NIXL transfer handle (opaque int) to join telemetry"),
    "kv.ranks_expected": _A(int, "ranks (or producer ranks) whose completion is expected"),
    "kv.ranks_received": _A(int, "ranks whose completion or notification arrived"),
    "kv.ranks_missing": _A(str, "missing ranks, ','-separated (e.g. '2')"),
    "kv.first_contact": _A(int, "1 if this handoff paid the first-contact cost (handshake) for its engine pair and rank"),
    "kv.release_cause": _A(str, "why P's blocks were released: 'notification', 'expiry', 'abort', 'never'"),
    "kv.lease_ns": _A(int, "lease or TTL length in force (ns)"),
    "kv.prefix_hit_blocks": _A(int, "blocks already held by the destination (prefix cache hit)"),
    "kv.notif_kind": _A(str, "kind of NIXL notification: 'push_reg', 'write_done', 'read_done', other"),
    # --- clock samples ------------------------------------------------------------
    "clock.offset_ns": _A(int, "estimated peer clock minus own clock (ns)"),
    "clock.rtt_ns": _A(int, "round trip of the sample that gave the offset (ns)"),
    "clock.send_ns": _A(int, "sender's timestamp carried in a message (ns since epoch, sender's clock)"),
    "clock.peer_engine_id": _A(str, "engine whose clock the sample compares with"),
    "clock.rtt_bound_ns": _A(int, "upper bound on the round trip of a clock sample: the whole NIXL handshake (ns)"),
    "clock.domain": _A(str, "clock of clock.offset_ns: 'monotonic' (peer monotonic minus own monotonic; convert through both processes' anchors) or 'wall'"),
    "clock.source": _A(str, "where a clock sample came from (e.g. 'nixl_handshake')"),
    # --- errors and lifecycle -------------------------------------------------------
    "error.type": _A(str, "exception class name (no message: messages can echo prompts)"),
    "error.code": _A(str, "errno, HTTP status or NIXL status code, as text"),
    "lifecycle.cause": _A(str, "cause of a failure/lifecycle event (e.g. 'post_failure', 'ttl_expired')"),
    "lifecycle.phase": _A(str, "handoff phase a failure/lifecycle event happened in: 'handshake', 'registration', 'post', 'transfer', 'notification', 'release', 'load'"),
    "lifecycle.expected": _A(int, "expected count (ranks, notifications) for a lifecycle event"),
    "lifecycle.received": _A(int, "received count for a lifecycle event"),
    # --- foreign spans received by `pdtrace collect` (pdtrace.instrument.collect) ----
    # vLLM's own llm_request span (vllm/tracing/utils.py SpanAttributes; times in s as vLLM sends them)
    "gen_ai.usage.prompt_tokens": _A(int, "vLLM llm_request: prompt tokens"),
    "gen_ai.usage.completion_tokens": _A(int, "vLLM llm_request: generated tokens"),
    "gen_ai.usage.num_sequences": _A(int, "vLLM llm_request: sequences generated"),
    "gen_ai.request.n": _A(int, "vLLM llm_request: n asked for"),
    "gen_ai.request.temperature": _A(float, "vLLM llm_request: sampling temperature"),
    "gen_ai.request.top_p": _A(float, "vLLM llm_request: top_p"),
    "gen_ai.response.model": _A(str, "model that served the response"),
    "gen_ai.latency.time_in_queue": _A(float, "vLLM llm_request: queued -> first scheduled in EngineCore (s); on a P/D decode engine (async KV load) it includes the KV load"),
    "gen_ai.latency.time_to_first_token": _A(float, "vLLM llm_request: engine_ttft, API-server arrival -> first token (s)"),
    "gen_ai.latency.e2e": _A(float, "vLLM llm_request: API-server arrival -> finished (s)"),
    "gen_ai.latency.time_in_scheduler": _A(float, "vLLM: time in the scheduler (s)"),
    "gen_ai.latency.time_in_model_forward": _A(float, "vLLM: model forward time (s)"),
    "gen_ai.latency.time_in_model_execute": _A(float, "vLLM: model execute time (s)"),
    "gen_ai.latency.time_in_model_prefill": _A(float, "vLLM llm_request: first scheduled -> first token (s); on a P/D decode engine (async KV load) its first decode step"),
    "gen_ai.latency.time_in_model_decode": _A(float, "vLLM llm_request: first token -> last token (s)"),
    "gen_ai.latency.time_in_model_inference": _A(float, "vLLM llm_request: first scheduled -> last token (s)"),
    # a foreign router's root span
    "gen_ai.server.time_to_first_token": _A(float, "a foreign router's root span: span start -> first token written (s)"),
    "http.request.method": _A(str, "HTTP method of a foreign server/client span", 16),
    "http.route": _A(str, "matched HTTP route of a foreign server span (e.g. '/v1/completions')"),
    "url.path": _A(str, "URL path of a foreign HTTP span (no query string)"),
    # added by pdtrace collect itself
    "otlp.join": _A(str, "how a collected span got its request_id: 'pdtrace.request_id', 'gen_ai.request.id', 'trace_id', 'x-request-id' or 'none' (unjoined)"),
    "otlp.scope": _A(str, "OpenTelemetry instrumentation scope name of a collected span"),
    "otlp.derived_from": _A(str, "derived row (router.request, router.*_token): span id (16 hex) of the foreign root span it was made from"),
    "otlp.last_token_source": _A(str, "derived router.last_token: 'event' (the root's last-token event) or 'span_end' (none: the root's end)"),
    "collect.received_spans": _A(int, "pdtrace collect: spans received in decodable bodies (cumulative count)"),
    "collect.written_spans": _A(int, "pdtrace collect: collected spans written to the store (cumulative count)"),
    "collect.dropped_spans": _A(int, "pdtrace collect: spans dropped (queue full or a failed write) (cumulative count)"),
    "collect.bad_bodies": _A(int, "pdtrace collect: request bodies refused (not decodable: HTTP 400; too large: 413; bad content type: 415) (cumulative count)"),
    "collect.unjoined_spans": _A(int, "pdtrace collect: spans written with no request id that maps (cumulative count)"),
    "collect.dropped_attributes": _A(int, "pdtrace collect: foreign attributes dropped (not allowlisted or wrong type) (cumulative count)"),
    "collect.write_errors": _A(int, "pdtrace collect: failed file writes (cumulative count)"),
    "collect.skipped_pdtrace_spans": _A(int, "pdtrace collect: spans of pdtrace's own OTLP export, skipped (already in the store) (cumulative count)"),
    "collect.held_spans": _A(int, "pdtrace collect: spans waiting for their trace id to map, at the stats row's time (count)"),
    # --- lab only: injected delays (pdtrace.connector.lab.inject) --------------------
    "lab.stage": _A(str, "event lab.inject: DESIGN.md §2 stage the lab delayed for this request"),
    "lab.injected_ms": _A(float, "event lab.inject: delay the lab added inside lab.stage (ms)"),
    # --- open spans (record type 'open': a stage still waiting) ----------------------
    "open.state": _A(str, "state of an 'open' row: 'open' (still open at the flush) or 'abandoned' (dropped, no span row follows)"),
    "wait.for": _A(str, "what an open stage waits for: 'schedule' (a batch slot), 'blocks' (KV blocks), 'registration', "
                        "'read_post', 'read_done', 'write_done' (rank notifications), 'engine' (EngineCore output)"),
    "wait.expected": _A(int, "open stage: messages or ranks it waits for in all (count)"),
    "wait.received": _A(int, "open stage: of wait.expected, those received so far (count)"),
}

#: Public read-only view of the allowlist: {key: Attr}.
ALLOWED = _ALLOWED

#: Number of :func:`register` calls so far (the writer re-sends the allowlist to its sink when it changes).
registrations = 0


def register(key: str, typ: type, doc: str, max_len: int = 256) -> None:
    """Add ``key`` to the allowlist with Python type ``typ`` (int, float or str).

    Raises ValueError for another type or when ``key`` is already registered
    with a different type.
    """
    if typ not in (int, float, str):
        raise ValueError(f"attribute {key!r}: type must be int, float or str")
    old = _ALLOWED.get(key)
    if old is not None and old.type is not typ:
        raise ValueError(f"attribute {key!r} already registered as {old.type.__name__}")
    global registrations
    _ALLOWED[key] = Attr(typ, doc, max_len)
    registrations += 1


def error_attrs(exc: BaseException, code: object | None = None) -> dict[str, str]:
    """Reduce an exception to ``{'error.type': class name, 'error.code': code}``.

    ``code`` defaults to ``exc.errno`` or ``exc.status``/``exc.code`` when the
    exception has one; the message is never kept (it can echo prompt text).
    """
    out = {"error.type": type(exc).__name__}
    if code is None:
        for name in ("errno", "status", "status_code", "code"):
            v = getattr(exc, name, None)
            if isinstance(v, (int, str)) and not isinstance(v, bool):
                code = v
                break
    if code is not None:
        out["error.code"] = str(code)[:64]
    return out
