"""What a pool publishes: one consistent, read-only view of every endpoint per change.

Built by the pool (``epick.pool``), read by the host filters, the policies (through
``encoded``) and the explain view. Moved here from ``epick.scheduler.framework`` so the
pool no longer builds a scheduler type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epick import abi

__all__ = ["PoolView", "EndpointInfo"]


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
class PoolView:
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
    addresses: tuple[str, ...] = ()
    """``snapshot.endpoints[i].address`` for every i (read per pick: precomputed)."""
    serving: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict,
                                                             compare=False, repr=False)
    """The serves-model filter's answers for all endpoints, per (model, adapter), filled as
    requests ask (this snapshot never changes, so neither do they)."""

    @property
    def version(self) -> int:
        return self.snapshot.version

    @classmethod
    def build(
        cls, snapshot: abi.Snapshot, info: Sequence[EndpointInfo] | None = None
    ) -> PoolView:
        info = tuple(info) if info is not None else (EndpointInfo(),) * len(snapshot.endpoints)
        if len(info) != len(snapshot.endpoints):
            raise ValueError(
                f"PoolView.build: {len(info)} EndpointInfo for "
                f"{len(snapshot.endpoints)} endpoints"
            )
        return cls(
            snapshot=snapshot,
            encoded=abi.encoder.encode(snapshot),
            info=info,
            fresh=tuple(i for i, e in enumerate(info) if e.fresh),
            restricted=any(e.models is not None or e.adapters is not None for e in info),
            any_sleeping=any(e.sleeping for e in info),
            addresses=tuple(e.address for e in snapshot.endpoints),
        )
