"""What a virtual-time run returns: one record per request and a summary."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

__all__ = ["RequestRecord", "ReplicaStats", "Summary", "Results", "summarize"]


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    group: str
    adapter: str
    replica: int
    arrival_s: float
    ttft_s: float
    """First token time minus arrival (frontend overhead and queueing included)."""
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache at first admission."""
    adapter_loads: int
    """Adapter loads its admission caused (0 or 1; more if it was preempted and
    re-admitted after its adapter was evicted). Summed over records: the fleet's loads."""
    preemptions: int


class ReplicaStats(msgspec.Struct, frozen=True, kw_only=True):
    address: str
    requests: int
    adapter_loads: int
    adapter_disk_loads: int
    preemptions: int
    steps: int
    kv_evictions: int
    """Cached KV blocks evicted (their prefix forgotten)."""


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    duration_s: float
    """First arrival to last completion."""
    output_tokens: int
    output_tok_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p90_s: float
    adapter_loads: int
    """Adapter loads these requests caused (for a whole run: every load of the fleet)."""
    prefix_cache_hit_rate: float
    """Cached prompt tokens / prompt tokens (vLLM's prefix_cache_hits / queries)."""
    preemptions: int
    """Preemptions these requests suffered."""


class Results(msgspec.Struct, frozen=True, kw_only=True):
    records: tuple[RequestRecord, ...]
    """In arrival order."""
    summary: Summary
    replicas: tuple[ReplicaStats, ...]
    cpu_s: float
    """Process CPU time the run took (not part of the summary: it varies run to run)."""

    def by_group(self) -> dict[str, Summary]:
        """One summary per workload group (adapter group, tenant), sorted by name."""
        groups: dict[str, list[RequestRecord]] = {}
        for r in self.records:
            groups.setdefault(r.group, []).append(r)
        return {g: summarize(rs) for g, rs in sorted(groups.items())}


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def summarize(records: Sequence[RequestRecord]) -> Summary:
    """Aggregate ``records`` (a whole run or any subset, e.g. one group); percentiles
    are numpy's linear interpolation."""
    if not records:
        return Summary(
            requests=0, duration_s=0.0, output_tokens=0, output_tok_s=0.0, ttft_p50_s=0.0,
            ttft_p90_s=0.0, ttft_p99_s=0.0, e2e_p50_s=0.0, e2e_p90_s=0.0,
            adapter_loads=0, prefix_cache_hit_rate=0.0, preemptions=0,
        )
    ttft = np.fromiter((r.ttft_s for r in records), float, len(records))
    e2e = np.fromiter((r.e2e_s for r in records), float, len(records))
    start = min(r.arrival_s for r in records)
    end = max(r.arrival_s + r.e2e_s for r in records)
    out_tokens = sum(r.output_tokens for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    duration = end - start
    return Summary(
        requests=len(records),
        duration_s=duration,
        output_tokens=out_tokens,
        output_tok_s=out_tokens / duration if duration > 0 else 0.0,
        ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90), ttft_p99_s=_pct(ttft, 99),
        e2e_p50_s=_pct(e2e, 50), e2e_p90_s=_pct(e2e, 90),
        adapter_loads=sum(r.adapter_loads for r in records),
        prefix_cache_hit_rate=sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        preemptions=sum(r.preemptions for r in records),
    )
