"""Read vLLM's Prometheus ``/metrics`` (counters the lab checks) and the router's own stats."""
from __future__ import annotations

import json
import re
import urllib.request

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


def scrape(url: str, timeout: float = 10.0) -> dict[tuple[str, frozenset], float]:
    """Parse ``<url>/metrics`` into {(metric name, frozenset of label pairs): value}."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = frozenset(tuple(kv.split("=", 1)) for kv in re.findall(r'[a-zA-Z_]+="[^"]*"', m["labels"] or ""))
        labels = frozenset((k, v.strip('"')) for k, v in labels)
        try:
            out[(m["name"], labels)] = float(m["value"])
        except ValueError:
            pass
    return out


def total(metrics: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """vLLM's ``prompt_tokens_by_source_total`` per source (local_compute, local_cache_hit, external_kv_transfer)."""
    m = scrape(url)
    return {src: total(m, "vllm:prompt_tokens_by_source_total", source=src)
            for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def router_stats(router_url: str, timeout: float = 10.0) -> list[dict]:
    """The router's per-request rows (id, status, ttft_ns, overhead_ns) from ``/_lab/stats``."""
    with urllib.request.urlopen(router_url.rstrip("/") + "/_lab/stats", timeout=timeout) as r:
        return json.loads(r.read())["requests"]
