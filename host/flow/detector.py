"""Is there room in the pool? Counted from the scrape and from what epick itself sent.

An endpoint has room when its metrics are fresh, it is awake, and both

    waiting (scraped) + picked_since_scrape (epick's own count) < queue_threshold
    kv_usage (scraped)                                          < kv_threshold

``picked_since_scrape`` (``epick.scheduler.assignments``) rises on every pick and is reset
by the endpoint's next good scrape, so a burst between two scrapes fills the threshold
with picks the engine has not reported yet instead of overshooting it (the stale-metrics
burst upstream's detector lets through). Stale metrics count as saturated.
"""

from __future__ import annotations

from typing import Protocol

from epick.interfaces import PoolView

__all__ = ["SaturationDetector", "Counts"]


class Counts(Protocol):
    def picked_since_scrape(self, address: str) -> int: ...


class SaturationDetector:
    __slots__ = ("queue_threshold", "kv_threshold")

    def __init__(self, queue_threshold: int = 5, kv_threshold: float = 0.8) -> None:
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold

    def room(self, view: PoolView, counts: Counts) -> int:
        """Endpoints with room now (0: the pool is saturated)."""
        return len(self.with_room(view, counts))

    def with_room(self, view: PoolView, counts: Counts) -> tuple[str, ...]:
        """The addresses of the endpoints with room now."""
        q, kv = self.queue_threshold, self.kv_threshold
        eps, info, since = view.snapshot.endpoints, view.info, counts.picked_since_scrape
        out = []
        for i in view.fresh:
            e = eps[i]
            if e.kv_usage < kv and e.waiting + since(e.address) < q and not info[i].sleeping:
                out.append(e.address)
        return tuple(out)

    def saturation(self, view: PoolView, counts: Counts) -> float:
        """Share of the pool's endpoints without room (1.0 for an empty pool)."""
        total = len(view.info)
        return 1.0 if not total else 1.0 - self.room(view, counts) / total
