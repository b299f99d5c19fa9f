"""Is there room in the pool? Counted from the scrape and from what epick itself sent.

An endpoint has room when its metrics are fresh, it is awake, and all of

    waiting (scraped) + picked_since_scrape (epick's own count) < queue_threshold
    kv_usage (scraped)                                          < kv_threshold
    in_flight (epick's own count)                               < max_in_flight  (0: off)

``picked_since_scrape`` (``epick.scheduler.assignments``) rises on every pick and is reset
by the endpoint's next good scrape, so a burst between two scrapes fills the threshold
with picks the engine has not reported yet instead of overshooting it (the stale-metrics
burst upstream's detector lets through). Stale metrics count as saturated.

``in_flight`` is what epick picked for the endpoint and has not yet seen complete
(ReportCompletion, the ext_proc stream's end, else the decision's expiry): its running
batch plus its queue, as epick sent them, current to the request rather than to the last
scrape. Capped at the engine's batch size (vLLM ``max_num_seqs``), a dispatched request
starts at once instead of waiting in the engine for a batch slot, and what waits for the
next completion waits in epick's queue, where it can be ordered (upstream's
concurrency detector keeps the same count). ``max_in_flight_endpoints`` sets the cap per
address (replicas of different sizes); an address not listed takes ``max_in_flight``.

``reserved_in_flight`` keeps the pool's last free slots for urgent requests: when the
free slots under the caps, summed over the endpoints with room, are this many or fewer,
there is room only for an urgent request (:meth:`rooms` gives both answers; the
controller applies the reserve only while requests wait in its queue). A pool that
is full has a free slot only when a request completes, so without a reserve even the
first request in epick's queue waits for the next completion somewhere in the pool;
counted over the pool, the reserve binds only when the pool is nearly full (an endpoint
without a cap counts as unlimited free slots).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from epick.interfaces import PoolView

__all__ = ["SaturationDetector", "Counts"]


class Counts(Protocol):
    def picked_since_scrape(self, address: str) -> int: ...

    def in_flight(self, address: str) -> int: ...


class SaturationDetector:
    __slots__ = ("queue_threshold", "kv_threshold", "max_in_flight", "per_endpoint",
                 "reserved")

    def __init__(self, queue_threshold: int = 5, kv_threshold: float = 0.8,
                 max_in_flight: int = 0,
                 per_endpoint: Mapping[str, int] | None = None,
                 reserved: int = 0) -> None:
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.max_in_flight = max_in_flight
        self.per_endpoint = dict(per_endpoint or {})
        self.reserved = reserved

    def room(self, view: PoolView, counts: Counts) -> int:
        """Endpoints with room now (0: the pool is saturated)."""
        return len(self.with_room(view, counts))

    def with_room(self, view: PoolView, counts: Counts) -> tuple[str, ...]:
        """The addresses of the endpoints with room now (for an urgent request)."""
        return self.rooms(view, counts)[0]

    def rooms(self, view: PoolView, counts: Counts
              ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(room, open)``: the endpoints with room for an urgent request, and those of
        them with room for any request (outside the reserve; the same tuple when there
        is no reserve)."""
        q, kv = self.queue_threshold, self.kv_threshold
        eps, info, since = view.snapshot.endpoints, view.info, counts.picked_since_scrape
        cap, caps, reserved = self.max_in_flight, self.per_endpoint, self.reserved
        out: list[str] = []
        free = 0  # slots under the caps of the endpoints with room (-1: unlimited)
        for i in view.fresh:
            e = eps[i]
            if e.kv_usage < kv and e.waiting + since(e.address) < q and not info[i].sleeping:
                limit = caps.get(e.address, cap) if caps else cap
                if limit:
                    n = counts.in_flight(e.address)
                    if n >= limit:
                        continue
                    if free >= 0:
                        free += limit - n
                else:
                    free = -1
                out.append(e.address)
        room = tuple(out)
        return room, (room if not reserved or free < 0 or free > reserved else ())

    def saturation(self, view: PoolView, counts: Counts) -> float:
        """Share of the pool's endpoints without room (1.0 for an empty pool)."""
        total = len(view.info)
        return 1.0 if not total else 1.0 - self.room(view, counts) / total
