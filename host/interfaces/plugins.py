"""The scheduler's extension points — every plugin implements one or more of these.

One scheduling cycle, for one request (seed 001; the kube-scheduler framework):

    filter  (hard: drop candidates)   host filters first, then filter policies, in order
    score   (soft: one score per candidate in [0, 1])   every live scorer, weighted sum
    pick    (max total, seeded random tie-break; or weighted random)   primary + fallbacks
    pre_request   (after the pick: policies record it — LoRA history, prefix LRU)
    ...later, when the gateway reports completion...
    post_response

Plugins know nothing of each other; they share only the read-only :class:`Cycle`.
A plugin that fails raises :class:`PluginError`; the runner decides the consequence
(a failed scorer is skipped for that request, a failed filter is skipped too — failing
open — and both are counted).

Threading: a cycle runs start to finish on the thread that owns the scheduler (the
service's event-loop thread). WASM Stores are single-threaded, so plugins may assume it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from epick import abi
from epick.interfaces.cycle import Cycle

__all__ = [
    "PluginError",
    "FilterPlugin",
    "ScorePlugin",
    "PreRequestPlugin",
    "PostResponsePlugin",
    "Picker",
]


class PluginError(Exception):
    """A plugin failed for this call: it trapped, timed out, errored or misbehaved.

    ``plugin`` names who failed, ``stage`` where (``score``, ``filter``, ``pre_request``…),
    ``kind`` what happened (``error``, ``trap``, ``timeout``, ``invalid-output``,
    ``circuit-open``) — the label used by metrics.
    """

    def __init__(self, plugin: str, stage: str, kind: str, reason: str) -> None:
        super().__init__(f"policy {plugin!r} {stage}: {kind}: {reason}")
        self.plugin = plugin
        self.stage = stage
        self.kind = kind
        self.reason = reason


@runtime_checkable
class FilterPlugin(Protocol):
    """Hard requirement: keep only candidates that may serve the request."""

    name: str

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """Return the kept subset of ``candidates`` (indices into the snapshot), in order.

        Raise :class:`PluginError` on failure; the runner then keeps the input (fail open).
        An empty result means nothing can serve the request.
        """
        ...


@runtime_checkable
class ScorePlugin(Protocol):
    """Soft preference: one score per candidate."""

    name: str

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        """Return a float64 array, one score per candidate in order, each finite in [0, 1].

        Raise :class:`PluginError` on failure; the runner then skips this plugin for this
        request. Must not mutate state that changes later scores: recording a decision is
        ``pre_request``'s job.
        """
        ...


@runtime_checkable
class PreRequestPlugin(Protocol):
    """Runs once per successful pick, after it."""

    name: str

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        """Record that ``endpoint`` (an address) was picked for ``cycle.request``."""
        ...


@runtime_checkable
class PostResponsePlugin(Protocol):
    """Runs when the gateway reports completion."""

    name: str

    def post_response(self, event: abi.PostResponseEvent) -> None:
        """Idempotent; tolerates an event with no matching ``pre_request``."""
        ...


class Picker(Protocol):
    """Turns the weighted totals into the answer: primary first, then fallbacks
    (``epick.scheduler.pickers`` has the two the config names)."""

    name: str

    def pick(self, totals: np.ndarray, count: int, seed: int | None) -> list[int]:
        """Return up to ``count`` positions into ``totals``, best first."""
        ...
