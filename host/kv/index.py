"""Which KV blocks each endpoint holds, from its own events; bounded in memory.

One insertion-ordered dict per endpoint (hash → None): a store (or a re-store, which
vLLM also publishes when a request reuses cached blocks) moves the hash to the newest
end; beyond ``max_blocks_per_endpoint`` the oldest go first — the engine's LRU order is
approximated by the order of its own events. Only the device tier is indexed (``medium``
"GPU" — vLLM says "GPU" on CPU too — or unset) and KV-cache group 0: offloaded copies and
other groups are not what a prefix hit on the engine means.

``matched`` is -1 for an endpoint with no event stream (never applied/cleared) or whose
index is uncertain (a gap that could not be replayed), so a policy falls back to its
estimate instead of trusting a hole. ``cleared_ms`` is when the endpoint's *engine* last
emptied its cache — an ``AllBlocksCleared`` (its batch's ``ts``), or a restart the
subscriber saw (``clear(..., at_ms=)``, the new engine's first batch) — in Unix ms of the
engine's clock (vLLM stamps batches with ``time.time()``; NTP keeps it within a few ms of
the host's): a policy drops what it believed of the endpoint before then. Clears of epick's
own making (joining, a rebuild after a gap) leave it: the engine lost nothing then. Not
thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections.abc import Sequence

from epick.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash64

__all__ = ["KvIndex", "batch_ms"]

_DEVICE = (None, "GPU")


class _Blocks:
    __slots__ = ("hashes", "uncertain", "block_size", "cleared_ms")

    def __init__(self) -> None:
        self.hashes: dict[int, None] = {}
        self.uncertain = False
        self.block_size = 0
        self.cleared_ms = 0


class KvIndex:
    def __init__(self, max_blocks_per_endpoint: int) -> None:
        if max_blocks_per_endpoint < 1:
            raise ValueError(
                f"max_blocks_per_endpoint must be >= 1, got {max_blocks_per_endpoint}"
            )
        self.max_blocks = max_blocks_per_endpoint
        self._eps: dict[str, _Blocks] = {}
        #: Blocks dropped because an endpoint reached the cap (all endpoints).
        self.evicted = 0

    def _get(self, address: str) -> _Blocks:
        blocks = self._eps.get(address)
        if blocks is None:
            blocks = self._eps[address] = _Blocks()
        return blocks

    def apply(self, address: str, batch: KVEventBatch) -> None:
        """Apply one batch in order; fresh events end an uncertain spell."""
        ep = self._get(address)
        hashes = ep.hashes
        cap = self.max_blocks
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.medium not in _DEVICE or (ev.group_idx or 0) != 0:
                    continue
                ep.block_size = ev.block_size
                for h in ev.block_hashes:
                    k = hash64(h)
                    hashes.pop(k, None)
                    hashes[k] = None
                over = len(hashes) - cap
                if over > 0:
                    self.evicted += over
                    for k in list(_first(hashes, over)):
                        del hashes[k]
            elif isinstance(ev, BlockRemoved):
                if ev.medium not in _DEVICE or (ev.group_idx or 0) != 0:
                    continue
                for h in ev.block_hashes:
                    hashes.pop(hash64(h), None)
            elif isinstance(ev, AllBlocksCleared):
                hashes.clear()
                ep.cleared_ms = max(ep.cleared_ms, batch_ms(batch.ts))
        ep.uncertain = False

    def matched(self, address: str, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the endpoint holds; -1 = unknown (see module doc)."""
        ep = self._eps.get(address)
        if ep is None or ep.uncertain:
            return -1
        held = ep.hashes
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def clear(self, address: str, *, at_ms: int = 0) -> None:
        """Forget the endpoint's blocks (it has a stream: matched answers 0, not -1);
        ``at_ms`` > 0: its engine emptied its cache then (a restart), see ``cleared_ms``."""
        ep = self._get(address)
        ep.hashes.clear()
        if at_ms > 0:
            ep.cleared_ms = max(ep.cleared_ms, at_ms)

    def cleared_ms(self, address: str) -> int:
        """When the endpoint's engine last emptied its cache (Unix ms); 0 = never seen."""
        ep = self._eps.get(address)
        return 0 if ep is None else ep.cleared_ms

    def mark_uncertain(self, address: str) -> None:
        """The index may miss blocks (a gap): matched answers -1 until the next apply."""
        self._get(address).uncertain = True

    def drop(self, address: str) -> None:
        """The endpoint left the pool: forget it entirely (matched answers -1)."""
        self._eps.pop(address, None)

    def block_size(self, address: str) -> int:
        """The block size the endpoint's last BlockStored carried; 0 = none seen."""
        ep = self._eps.get(address)
        return 0 if ep is None else ep.block_size

    def size(self, address: str) -> int:
        ep = self._eps.get(address)
        return 0 if ep is None else len(ep.hashes)

    def addresses(self) -> list[str]:
        return list(self._eps)


def batch_ms(ts: float) -> int:
    """A batch's ``ts`` (Unix seconds) in ms; at least 1 (0 = never), 0 for garbage."""
    try:
        return max(round(ts * 1000), 1)
    except (OverflowError, ValueError, TypeError):  # inf, nan: the decoder lets floats be
        return 0


def _first(d: dict[int, None], n: int):
    it = iter(d)
    for _ in range(n):
        yield next(it)
