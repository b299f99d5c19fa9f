"""Host-side locality analytics of a stream of picks: prefix hits, adapter residency."""

from __future__ import annotations

from collections import OrderedDict, defaultdict

__all__ = ["Locality", "LOCALITY_LRU_BLOCKS"]

#: Per-endpoint LRU size of the prefix-locality estimate (the prefix policy's default).
LOCALITY_LRU_BLOCKS = 31_250


class Locality:
    """Host-side estimate of prefix and adapter locality for one stream of picks."""

    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self.hit_sum = 0.0
        self.hit_n = 0
        self.resident = 0
        self.adapter_n = 0
        self.adapter_eps: dict[str, set[str]] = defaultdict(set)

    def see(self, endpoint: str, hashes: tuple[int, ...], adapter: str,
            running: tuple[str, ...] | None) -> None:
        if hashes:
            lru = self.lru[endpoint]
            k = 0
            for h in hashes:
                if h not in lru:
                    break
                k += 1
            self.hit_sum += k / len(hashes)
            self.hit_n += 1
            for h in hashes:
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
            while len(lru) > LOCALITY_LRU_BLOCKS:
                lru.popitem(last=False)
        if adapter:
            self.adapter_n += 1
            self.resident += running is not None and adapter in running
            self.adapter_eps[adapter].add(endpoint)

    def hit(self) -> float | None:
        return self.hit_sum / self.hit_n if self.hit_n else None

    def resident_share(self) -> float | None:
        return self.resident / self.adapter_n if self.adapter_n else None

    def per_adapter(self) -> float | None:
        eps = self.adapter_eps
        return sum(len(v) for v in eps.values()) / len(eps) if eps else None
