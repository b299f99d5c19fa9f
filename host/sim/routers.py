"""Baseline routers for the virtual-time fleet (the benchmarks compare real ones to these)."""

from __future__ import annotations

import random

from .fleet import FleetView
from .workload import SimRequest

__all__ = ["RandomRouter", "RoundRobinRouter", "LeastQueueRouter"]


class RandomRouter:
    """Uniformly random replica, seeded."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, req: SimRequest, view: FleetView) -> int:
        return self._rng.randrange(len(view))


class RoundRobinRouter:
    """Replicas in turn."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: SimRequest, view: FleetView) -> int:
        i = self._next % len(view)
        self._next = i + 1
        return i


class LeastQueueRouter:
    """Fewest waiting + running requests as last scraped; ties go to the lowest index."""

    def route(self, req: SimRequest, view: FleetView) -> int:
        loads = [m.waiting + m.running for m in view.all_metrics()]
        return loads.index(min(loads))
