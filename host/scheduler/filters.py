"""Host filters: the hard rules every request passes before any policy scores it.

Each is a :class:`~epick.interfaces.FilterPlugin` and runs in this order:
``fresh`` -> ``awake`` -> ``serves-model`` -> ``admission``. They read only the cycle's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from epick.abi import Criticality
from epick.interfaces import Cycle

__all__ = ["FreshFilter", "AwakeFilter", "ServesModelFilter", "AdmissionFilter"]


class FreshFilter:
    """Keep endpoints whose last good scrape is younger than ``stale_after_ms``."""

    name = "fresh"

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        view = cycle.view
        if len(candidates) == len(view.info):  # every endpoint: the precomputed answer
            return view.fresh
        info = view.info
        return tuple(i for i in candidates if info[i].fresh)


class AwakeFilter:
    """Drop endpoints whose engine reports it is asleep (queue 0 and KV 0 would attract)."""

    name = "awake"

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        view = cycle.view
        if not view.any_sleeping:
            return candidates
        info = view.info
        return tuple(i for i in candidates if not info[i].sleeping)


#: (model, adapter) answers a snapshot keeps: requests name what they like, memory must not.
_MAX_CACHED = 1024


class ServesModelFilter:
    """Keep endpoints that serve the model and adapter (pinned by config or engine-reported)."""

    name = "serves-model"

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        view = cycle.view
        if not view.restricted:
            return candidates
        model, adapter = cycle.request.model, cycle.request.adapter
        # The usual case: the fresh filter's precomputed tuple, untouched by the awake
        # filter, so the answer depends only on the snapshot and (model, adapter).
        every = candidates is view.fresh
        if every:
            kept = view.serving.get((model, adapter))
            if kept is not None:
                return kept
        kept = self._serving(view.info, candidates, model, adapter)
        if every and len(view.serving) < _MAX_CACHED:
            view.serving[(model, adapter)] = kept
        return kept

    @staticmethod
    def _serving(info, candidates: tuple[int, ...], model: str,
                 adapter: str) -> tuple[int, ...]:
        kept = []
        for i in candidates:
            e = info[i]
            if e.models is not None and model not in e.models:
                continue
            if adapter and e.adapters is not None and adapter not in e.adapters:
                continue
            kept.append(i)
        return tuple(kept)


@dataclass(frozen=True, slots=True)
class AdmissionFilter:
    """SHEDDABLE requests only go to endpoints with queue <= q and KV <= kv (the v1 rule).

    An empty result for a SHEDDABLE request means it is shed (RESOURCE_EXHAUSTED);
    other criticalities pass untouched.
    """

    queue_threshold: int = 5
    kv_threshold: float = 0.8
    name: str = "admission"

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        if cycle.request.criticality != Criticality.SHEDDABLE:
            return candidates
        eps = cycle.view.snapshot.endpoints
        q, kv = self.queue_threshold, self.kv_threshold
        return tuple(i for i in candidates if eps[i].waiting <= q and eps[i].kv_usage <= kv)
