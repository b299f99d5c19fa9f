"""Paged KV cache with automatic prefix caching — vLLM v1's block pool, minus the tensors.

Contract:

* ``num_blocks`` blocks, each either *referenced* (held by ≥ 1 running request) or
  *free*. Free blocks sit in one LRU queue; allocation takes from its front.
* A full prompt block may carry a hash (see :mod:`epick.sim.tokens`). A hashed block that
  is freed stays in the cache: a later request whose leading hashes match takes a
  reference on it and skips computing those tokens. It is forgotten only when the LRU
  hands it out again (eviction of an unreferenced block).
* Usage, as vLLM reports it, is ``1 - free / num_blocks``: cached-but-unreferenced blocks
  count as free, because they can be reclaimed at once.
* When a request releases its blocks they join the queue's tail in reverse order, so its
  last blocks (the least shareable) are evicted before its first ones — as vLLM does.
* With ``publish=True`` (KV-cache events on) a registered block also carries the hash the
  replica *publishes* for it (vLLM's, over the sim's token ids: :mod:`epick.sim.replica`
  computes it), and the pool queues vLLM's events in :attr:`KVCache.events`: a
  ``BlockRemoved`` when a cached block is evicted (one event per block, as vLLM sends
  them) and ``AllBlocksCleared`` on :meth:`KVCache.reset_prefix_cache`. ``BlockStored``
  comes from the replica, which knows the blocks' tokens. Off (the default), nothing of
  this runs and the pool behaves exactly as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KVCache"]


class KVCache:
    """The block pool of one replica."""

    __slots__ = ("num_blocks", "_ref", "_hash", "_cached", "_free", "evictions", "_pub", "events")

    def __init__(self, num_blocks: int, *, publish: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.evictions = 0
        """Cached blocks handed out again (their prefix forgotten)."""
        self._pub: list[int | None] | None = [None] * num_blocks if publish else None
        self.events: list | None = [] if publish else None
        """KV-cache events not yet taken by the replica (``publish=True`` only)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: the referenced fraction of blocks, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks currently reachable by hash."""
        return len(self._cached)

    def match_prefix(self, hashes: Sequence[int], limit: int) -> list[int]:
        """Blocks holding the longest cached run of ``hashes[:limit]`` (no refs taken)."""
        cached = self._cached
        out: list[int] = []
        for h in hashes[:limit]:
            block = cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def free_needed_for(self, hit_blocks: Sequence[int], new_blocks: int) -> int:
        """Free blocks that taking ``hit_blocks`` plus ``new_blocks`` fresh ones consumes."""
        return new_blocks + sum(1 for b in hit_blocks if self._ref[b] == 0)

    def take(self, hit_blocks: Sequence[int]) -> None:
        """Take one reference on each of ``hit_blocks`` (prefix-cache hits)."""
        ref, free = self._ref, self._free
        for b in hit_blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` fresh blocks, evicting cached ones LRU-first.

        The caller checks :attr:`num_free` first; asking for more raises ``RuntimeError``.
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        ref, hashes, cached, free = self._ref, self._hash, self._cached, self._free
        out: list[int] = []
        for _ in range(n):
            b, _none = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                    self.evictions += 1
                    if self._pub is not None:
                        self._removed(b)
                hashes[b] = None
            ref[b] = 1
            out.append(b)
        return out

    def _removed(self, block: int) -> None:
        from epick.kv.events import BlockRemoved

        pub = self._pub
        assert pub is not None and self.events is not None
        h = pub[block]
        if h is not None:
            self.events.append(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0))
            pub[block] = None

    def register(self, block: int, block_hash: int, published: int | None = None) -> bool:
        """Publish a computed full block under ``block_hash`` (first writer wins); True if
        it is now cached. ``published``: the hash its events name (``publish=True``)."""
        if self._hash[block] is None and block_hash not in self._cached:
            self._hash[block] = block_hash
            self._cached[block_hash] = block
            if self._pub is not None:
                self._pub[block] = published
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM's ``reset_prefix_cache``, done by sleep level >= 1).

        Only when no block is referenced (the engine aborted everything first);
        otherwise ``RuntimeError``."""
        if len(self._free) != self.num_blocks:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self.num_blocks - len(self._free)} blocks in use")
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        if self._pub is not None and self.events is not None:
            from epick.kv.events import AllBlocksCleared

            self._pub = [None] * self.num_blocks
            self.events.append(AllBlocksCleared())

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones join the LRU tail."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
