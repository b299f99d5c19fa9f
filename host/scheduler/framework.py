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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from epick import abi
from epick.scheduler.assignments import Assignments

__all__ = [
    "PoolSnapshot",
    "EndpointInfo",
    "Cycle",
    "PluginError",
    "FilterPlugin",
    "ScorePlugin",
    "PreRequestPlugin",
    "PostResponsePlugin",
    "KvCounts",
]


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """Host-side facts about an endpoint that policies never see."""

    fresh: bool = True
    """Its last good scrape is younger than ``stale_after_ms``."""
    models: frozenset[str] | None = None
    """Models it serves (pinned by config, else reported by the engine); ``None`` = any."""
    adapters: frozenset[str] | None = None
    """Adapters it serves (pinned, else reported by the engine); ``None`` = any."""
    labels: tuple[tuple[str, str], ...] = ()
    sleeping: bool = False
    """The engine reports it is asleep (vLLM sleep mode): never a candidate."""


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """One consistent view of the pool, built once per metrics change.

    ``snapshot.endpoints[i]`` and ``info[i]`` describe the same endpoint. ``encoded`` is
    the msgpack of ``snapshot`` — what ``set_snapshot`` receives — made once here so no
    request pays for it.
    """

    snapshot: abi.Snapshot
    encoded: bytes
    info: tuple[EndpointInfo, ...]
    fresh: tuple[int, ...] = ()
    """Indices of the fresh endpoints (precomputed: the host filters' fast path)."""
    restricted: bool = False
    """Some endpoint serves only listed models or adapters."""
    any_sleeping: bool = False
    """Some endpoint is asleep (the awake filter's fast path)."""

    @property
    def version(self) -> int:
        return self.snapshot.version

    @classmethod
    def build(
        cls, snapshot: abi.Snapshot, info: Sequence[EndpointInfo] | None = None
    ) -> PoolSnapshot:
        info = tuple(info) if info is not None else (EndpointInfo(),) * len(snapshot.endpoints)
        if len(info) != len(snapshot.endpoints):
            raise ValueError(
                f"PoolSnapshot.build: {len(info)} EndpointInfo for "
                f"{len(snapshot.endpoints)} endpoints"
            )
        return cls(
            snapshot=snapshot,
            encoded=abi.encoder.encode(snapshot),
            info=info,
            fresh=tuple(i for i, e in enumerate(info) if e.fresh),
            restricted=any(e.models is not None or e.adapters is not None for e in info),
            any_sleeping=any(e.sleeping for e in info),
        )


@dataclass(slots=True)
class Cycle:
    """Per-request state shared by every plugin of one scheduling cycle (read-only to them).

    Encoded payloads are cached here so that N policies cost one encoding.
    """

    pool: PoolSnapshot
    request: abi.Request
    assignments: Assignments | None = None
    """What the host has sent where (``ScoreInput.in_flight`` / ``picked_since_scrape``)."""
    _inputs: dict[tuple[bool, tuple[int, ...]], bytes] = field(default_factory=dict)
    _assigned: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict)
    data: dict[str, object] = field(default_factory=dict)
    """Free-form per-cycle data, keyed by plugin name (kube's CycleState)."""
    now_ms: int = 0
    """Unix ms of this decision, stamped once by the scheduler so every policy's hooks see
    the same clock (and a replay of the decision log can give them the same again);
    0 = not stamped (plugins use their own clock)."""
    kv: KvCounts | None = None
    """Per-candidate KV block counts from the engines' events (``epick.kv.KvRouting``);
    ``None`` = KV events off: ``prefix_blocks``/``prefix_matched`` stay empty."""
    _kv: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict)

    def kv_counts(self, candidates: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(prefix_blocks, prefix_matched)`` per candidate (cached per cycle)."""
        if self.kv is None:
            return (), ()
        got = self._kv.get(candidates)
        if got is None:
            got = self._kv[candidates] = self.kv.counts(
                self.request, self.pool.snapshot.endpoints, candidates)
        return got

    def assigned(self, candidates: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(in_flight, picked_since_scrape)`` per candidate as the policies see them
        (cached per cycle, so a decision log records what they saw, not the counts after
        the pick)."""
        got = self._assigned.get(candidates)
        if got is None:
            got = ((), ())
            if self.assignments:
                eps = self.pool.snapshot.endpoints
                got = self.assignments.of([eps[i].address for i in candidates])
            self._assigned[candidates] = got
        return got

    def score_input(self, candidates: tuple[int, ...], *, inline_snapshot: bool) -> bytes:
        """The msgpack ``ScoreInput`` for these candidates (cached per cycle).

        ``inline_snapshot=False`` leaves the snapshot out (nil) for policies that keep it
        resident via ``set_snapshot``.
        """
        key = (inline_snapshot, candidates)
        blob = self._inputs.get(key)
        if blob is None:
            in_flight, since = self.assigned(candidates)
            blocks, matched = self.kv_counts(candidates)
            blob = abi.encoder.encode(
                abi.ScoreInput(
                    snapshot=self.pool.snapshot if inline_snapshot else None,
                    request=self.request,
                    candidates=candidates,
                    in_flight=in_flight,
                    picked_since_scrape=since,
                    prefix_blocks=blocks,
                    prefix_matched=matched,
                )
            )
            self._inputs[key] = blob
        return blob


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


class KvCounts(Protocol):
    """The KV-events seam (``epick.kv.KvRouting``): the scheduler knows only this."""

    def counts(self, request: abi.Request, endpoints: Sequence[abi.EndpointMetrics],
               candidates: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ...


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
