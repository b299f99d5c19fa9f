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

:func:`attach` hands the counts to the scheduler through its KV seam (``Scheduler.kv``,
from the kv-host branch). Where this checkout's scheduler has no seam yet, it wraps the
policy plugins instead so that their ``ScoreInput`` carries the counts (a bench-only
stand-in, dropped once the seam is merged).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from epick import abi

__all__ = ["SimKvCounts", "attach", "windowed_hit_rates"]


class SimKvCounts:
    """``counts(request, endpoints, candidates) -> (prefix_blocks, prefix_matched)``,
    from an index of what the fleet's events said (see the module docstring)."""

    def __init__(self, max_blocks_per_endpoint: int, *, cache_entries: int = 512) -> None:
        from epick.kv.hashing import BlockHasher
        from epick.kv.index import KvIndex
        from epick.kv.tokenize import BytesTokenizer

        self.index = KvIndex(max_blocks_per_endpoint)
        self.tokenizer = BytesTokenizer()
        self.hasher = BlockHasher()  # the sim's engines: vLLM's default sha256, no seed
        self._hashes: OrderedDict[tuple, list[int]] = OrderedDict()
        self._cap = cache_entries
        self.batches = 0
        self.events = 0

    def on_batch(self, address: str, seq: int, batch) -> None:
        """The fleet's listener (``Fleet.run(kv_events=...)``)."""
        self.index.apply(address, batch)
        self.batches += 1
        self.events += len(batch.events)

    def _block_hashes(self, request: abi.Request, block_size: int) -> list[int]:
        key = (request.prompt, block_size, request.adapter, request.cache_salt)
        got = self._hashes.get(key)
        if got is None:
            got = self.hasher.block_hashes(
                self.tokenizer.encode_prompt(request.prompt), block_size,
                lora_name=request.adapter or None, cache_salt=request.cache_salt or None)
            self._hashes[key] = got
            if len(self._hashes) > self._cap:
                self._hashes.popitem(last=False)
        return got

    def counts(self, request: abi.Request, endpoints: Sequence[abi.EndpointMetrics],
               candidates: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        blocks: list[int] = []
        matched: list[int] = []
        for i in candidates:
            ep = endpoints[i]
            if ep.block_size <= 0:  # geometry unknown: nothing can be matched
                blocks.append(0)
                matched.append(-1)
                continue
            hashes = self._block_hashes(request, ep.block_size)
            blocks.append(len(hashes))
            matched.append(self.index.matched(ep.address, hashes))
        return tuple(blocks), tuple(matched)


class _WithCounts:
    """A policy plugin whose ScoreInputs carry the KV counts (no scheduler seam yet)."""

    def __init__(self, plugin, kv: SimKvCounts) -> None:
        self._plugin = plugin
        self._kv = kv
        self.name = plugin.name

    def _fill(self, cycle, candidates: tuple[int, ...]) -> None:
        for inline in (True, False):
            key = (inline, candidates)
            if key in cycle._inputs:
                continue
            in_flight, since = cycle.assigned(candidates)
            blocks, matched = self._kv.counts(cycle.request, cycle.pool.snapshot.endpoints,
                                              candidates)
            cycle._inputs[key] = abi.encoder.encode(abi.ScoreInput(
                snapshot=cycle.pool.snapshot if inline else None, request=cycle.request,
                candidates=candidates, in_flight=in_flight, picked_since_scrape=since,
                prefix_blocks=blocks, prefix_matched=matched))

    def score(self, cycle, candidates):
        self._fill(cycle, candidates)
        return self._plugin.score(cycle, candidates)

    def filter(self, cycle, candidates):
        self._fill(cycle, candidates)
        return self._plugin.filter(cycle, candidates)

    def __getattr__(self, name):
        return getattr(self._plugin, name)


def attach(scheduler, policies, kv: SimKvCounts):
    """Give ``scheduler`` the counts: its KV seam when it has one, else wrapped plugins.
    Returns the policy set to use (``policies`` itself with the seam)."""
    if hasattr(scheduler, "kv"):
        scheduler.kv = kv
        return policies
    from epick.scheduler.policyset import PolicyEntry, PolicySet

    return PolicySet(tuple(
        PolicyEntry(e.name, _WithCounts(e.plugin, kv), weight=e.weight, shadow=e.shadow)
        for e in policies.entries))


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
