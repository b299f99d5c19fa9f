"""The precise-prefix router's KV side in `epick bench quality`: an index fed by the
simulated fleet's own KV-cache events, and the per-candidate counts the scheduler hands
the ``precise-prefix`` policy.

The fleet's replicas publish vLLM's events (``epick.sim``: vLLM's sha256 block hashes over
the sim's byte token ids); :class:`SimKvCounts` applies every batch to an
``epick.kv.index.KvIndex`` ``delay`` after it was made, and for each Pick tokenizes the
prompt with the host's ``bytes`` tokenizer (``epick.kv.tokenize.BytesTokenizer``, the
sim's contract), hashes it with ``epick.kv.hashing.BlockHasher`` at each endpoint's
reported block size (adapter as ``lora_name``, the cache salt) and counts the leading
blocks each candidate's index holds — what ``epick.kv.routing.KvRouting`` does in the
service from ZMQ subscriptions.

The bench hands it to the scheduler through its KV seam (``Scheduler.kv``).
"""

from __future__ import annotations

import msgspec

from epick.sim.fleet import CLOCK_ORIGIN

__all__ = ["SimKvCounts", "windowed_hit_rates"]


class SimKvCounts:
    """The service's :class:`~epick.kv.routing.KvRouting` over an index the fleet's events
    feed directly (no ZMQ in virtual time): ``on_batch`` is the fleet's listener,
    ``counts`` the scheduler's seam."""

    def __init__(self, max_blocks_per_endpoint: int, *, cache_entries: int = 512) -> None:
        from epick.kv.hashing import BlockHasher
        from epick.kv.index import KvIndex
        from epick.kv.routing import KvRouting
        from epick.kv.tokenize import BytesTokenizer

        self.index = KvIndex(max_blocks_per_endpoint)
        # The sim's engines: vLLM's default sha256 with no seed, byte tokens, and an
        # adapter's name as its path.
        self.routing = KvRouting(self.index, BytesTokenizer(), BlockHasher(),
                                 cache_entries=cache_entries)
        self.counts = self.routing.counts
        self.cleared = self.routing.cleared
        self.batches = 0
        self.events = 0

    def on_batch(self, address: str, seq: int, batch) -> None:
        """The fleet's listener (``Fleet.run(kv_events=...)``)."""
        # The sim's engines stamp batches CLOCK_ORIGIN + virtual t; the bench's host clock
        # (snapshots, picks) is virtual t: the index's clear stamps must be on the latter.
        batch = msgspec.structs.replace(batch, ts=batch.ts - CLOCK_ORIGIN)
        self.index.apply(address, batch)
        self.batches += 1
        self.events += len(batch.events)


def windowed_hit_rates(records, start_s: float, window_s: float, n: int) -> list[float]:
    """Prefix-cache hit rate (cached / prompt tokens) of the requests arriving in each of
    ``n`` windows of ``window_s`` from ``start_s`` (NaN for an empty window)."""
    cached = [0] * n
    prompt = [0] * n
    for r in records:
        k = int((r.arrival_s - start_s) // window_s)
        if 0 <= k < n:
            cached[k] += max(r.cached_tokens, 0)
            prompt[k] += r.prompt_tokens
    return [c / p if p else float("nan") for c, p in zip(cached, prompt)]
