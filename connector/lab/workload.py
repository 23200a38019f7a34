"""Workload: real request traces (Azure 2023 conversation CSV, Mooncake FAST'25 JSONL), scaled.

Both formats are detected from the file's contents (not its name):

- **Azure CSV**: header ``TIMESTAMP,ContextTokens,GeneratedTokens``; absolute
  wall-clock timestamps with 7 fractional digits, rebased to t = 0.
- **Mooncake JSONL**: one object per line with ``timestamp`` (ms from the
  start), ``input_length``, ``output_length``, ``hash_ids`` (512-token
  prefix blocks). The conversation trace's timestamps are quantised to ≈3 s
  buckets; :func:`load` spreads the requests of a bucket uniformly over the
  bucket's width with a seeded RNG (deterministic), then re-sorts.

Scaling is explicit and reported, never silent: ``length_scale`` multiplies
prompt and output lengths (and Mooncake's 512-token block size), ``rate_scale``
multiplies the arrival rate (arrival times are divided by it). Requests whose
scaled prompt + output exceed the engine's ``max_model_len`` raise
:class:`WorkloadError` instead of being trimmed.

Prompts are token-id lists (``/v1/completions`` accepts them): exact lengths
and no text at all. Mooncake hash ids become shared prefixes: the same hash id
always yields the same block of token ids (seeded), so prefix reuse in the
trace is prefix reuse on the engine.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import random
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
FIRST_ID = 16  # token ids below this are left alone (the lab tokenizer's special tokens are 0..6)


class WorkloadError(ValueError):
    """The trace cannot be read, or cannot be replayed at the requested scale."""


@dataclasses.dataclass(frozen=True)
class TraceRow:
    """One request as the trace has it (unscaled). ``arrival_s`` is rebased to the first request."""

    trace_index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ReplayRequest:
    """One request to send: scaled arrival time (s from the replay start) and token-id prompt."""

    index: int
    trace_index: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    shared_prefix_tokens: int = 0  # tokens from hash blocks seen earlier in this replay


@dataclasses.dataclass
class Workload:
    name: str
    path: str
    fmt: str                # "azure-csv" | "mooncake-jsonl"
    length_scale: float
    rate_scale: float
    seed: int
    requests: list[ReplayRequest]
    rows_in_file: int
    jittered: bool

    def summary(self) -> dict:
        """Reportable facts: format, factors, counts, span (s), token totals."""
        r = self.requests
        return {
            "workload": self.name, "file": self.path, "format": self.fmt,
            "length_scale": self.length_scale, "rate_scale": self.rate_scale, "seed": self.seed,
            "rows_in_file": self.rows_in_file, "requests": len(r), "mooncake_bucket_jitter": self.jittered,
            "span_s": round(r[-1].arrival_s - r[0].arrival_s, 3) if r else 0.0,
            "prompt_tokens_total": sum(len(x.prompt) for x in r),
            "output_tokens_total": sum(x.max_tokens for x in r),
            "prompt_tokens_max": max((len(x.prompt) for x in r), default=0),
            "shared_prefix_tokens_total": sum(x.shared_prefix_tokens for x in r),
        }


def detect_format(path: Path) -> str:
    """``'mooncake-jsonl'`` or ``'azure-csv'`` from the first non-empty line; raises WorkloadError."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for line in f:
            s = line.strip()
            if not s:
                continue
            if s.startswith("{"):
                try:
                    obj = json.loads(s)
                except ValueError:
                    break
                if {"timestamp", "input_length", "output_length"} <= set(obj):
                    return "mooncake-jsonl"
                break
            cols = [c.strip() for c in s.split(",")]
            if cols[:3] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
                return "azure-csv"
            break
    raise WorkloadError(f"{path}: neither the Azure CSV format (header TIMESTAMP,ContextTokens,GeneratedTokens) "
                        "nor Mooncake JSONL (timestamp, input_length, output_length[, hash_ids])")


def _parse_azure_ts(s: str) -> float:
    s = s.strip()
    if "." in s:  # 7 fractional digits (100 ns): cut to 6 for datetime
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(s).timestamp()


def read_rows(path: Path, fmt: str | None = None, limit: int | None = None) -> tuple[str, list[TraceRow], int]:
    """Read a trace; returns (format, rows with rebased arrival, rows in file). Raises WorkloadError."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    rows: list[TraceRow] = []
    n = 0
    try:
        if fmt == "azure-csv":
            with open(path, newline="") as f:
                for i, rec in enumerate(csv.DictReader(f)):
                    n += 1
                    rows.append(TraceRow(i, _parse_azure_ts(rec["TIMESTAMP"]),
                                         int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
        else:
            with open(path) as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    n += 1
                    rows.append(TraceRow(i, float(obj["timestamp"]) / 1000.0, int(obj["input_length"]),
                                         int(obj["output_length"]), tuple(obj.get("hash_ids") or ()) or None))
    except (KeyError, ValueError) as exc:
        raise WorkloadError(f"{path}: bad {fmt} record ({type(exc).__name__}: {exc})") from None
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    t0 = min(r.arrival_s for r in rows)
    rows = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in rows]
    rows.sort(key=lambda r: (r.arrival_s, r.trace_index))
    return fmt, rows, n


def jitter_buckets(rows: list[TraceRow], seed: int) -> tuple[list[TraceRow], bool]:
    """Spread requests sharing a timestamp over the bucket width (median gap between distinct stamps).

    Deterministic for a seed. Returns (rows re-sorted, whether anything was jittered).
    """
    stamps = sorted({r.arrival_s for r in rows})
    if len(stamps) < 2 or len(stamps) > 0.5 * len(rows):  # not bucketed
        return rows, False
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    width = gaps[len(gaps) // 2]
    rng = random.Random(seed)
    out = [dataclasses.replace(r, arrival_s=r.arrival_s + rng.uniform(0.0, width)) for r in rows]
    out.sort(key=lambda r: (r.arrival_s, r.trace_index))
    return out, True


def _block(seed: int, key: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(f"{seed}:{key}")
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def build(name: str, path: Path, *, vocab_size: int, length_scale: float, rate_scale: float,
          max_requests: int | None = None, max_duration_s: float | None = None, seed: int = 0,
          max_model_len: int | None = None) -> Workload:
    """Read, jitter (Mooncake buckets), cap and scale a trace into replayable requests.

    ``max_requests`` keeps the first N arrivals; ``max_duration_s`` keeps
    arrivals before that many seconds (after rate scaling). Raises
    :class:`WorkloadError` for bad factors, an empty selection, or requests
    longer than ``max_model_len`` tokens (prompt + output) at this scale.
    """
    if length_scale <= 0 or rate_scale <= 0:
        raise WorkloadError(f"length_scale and rate_scale must be > 0 (got {length_scale}, {rate_scale})")
    fmt, rows, n = read_rows(path)
    jittered = False
    if fmt == "mooncake-jsonl":
        rows, jittered = jitter_buckets(rows, seed)
    sel: list[TraceRow] = []
    for r in rows:
        t = r.arrival_s / rate_scale
        if max_duration_s is not None and t > max_duration_s:
            break
        sel.append(r)
        if max_requests is not None and len(sel) >= max_requests:
            break
    if not sel:
        raise WorkloadError("no request left after the request/duration caps")
    t0 = sel[0].arrival_s
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    seen: set[int] = set()
    out, too_long = [], []
    for i, r in enumerate(sel):
        plen = max(1, round(r.input_len * length_scale))
        olen = max(1, round(r.output_len * length_scale))
        shared = 0
        if r.hash_ids:
            toks: list[int] = []
            for h in r.hash_ids:
                blk = _block(seed, h, block_tokens, vocab_size)
                if h in seen and len(toks) + block_tokens <= plen:
                    shared += block_tokens
                toks.extend(blk)
                if len(toks) >= plen:
                    break
            seen.update(r.hash_ids)
            if len(toks) < plen:
                toks.extend(_block(seed, -1 - r.trace_index, plen - len(toks), vocab_size))
            prompt = toks[:plen]
        else:
            prompt = _block(seed, -1 - r.trace_index, plen, vocab_size)
        if max_model_len is not None and plen + olen > max_model_len:
            too_long.append((r.trace_index, plen + olen))
        out.append(ReplayRequest(i, r.trace_index, (r.arrival_s - t0) / rate_scale, prompt, olen, shared))
    if too_long:
        worst = max(t for _, t in too_long)
        raise WorkloadError(
            f"{len(too_long)} of {len(out)} selected requests need more than max_model_len={max_model_len} "
            f"tokens at length_scale={length_scale} (longest {worst}); lower --length-scale "
            f"(e.g. {length_scale * max_model_len / worst:.3g}) or raise --max-model-len. Nothing is trimmed.")
    return Workload(name, str(path), fmt, length_scale, rate_scale, seed, out, n, jittered)
