"""Payload builders for the policy tests, and the runtime's error types.

So each test states its pool and request in one line: ``score_input(snap([ep("a", waiting=3)]))``.
"""

from __future__ import annotations

from collections.abc import Iterable

from epick import abi
from epick.runtime import PolicyCallError, PolicyLoadError

__all__ = ["PolicyCallError", "PolicyLoadError", "ep", "snap", "score_input", "pre", "post", "memory_bytes"]


def ep(address: str, **fields) -> abi.EndpointMetrics:
    return abi.EndpointMetrics(address=address, **fields)


def snap(endpoints: Iterable[abi.EndpointMetrics], *, version: int = 1, timestamp_ms: int = 0) -> abi.Snapshot:
    return abi.Snapshot(version=version, timestamp_ms=timestamp_ms, endpoints=tuple(endpoints))


def score_input(snapshot: abi.Snapshot | None, candidates: Iterable[int] | None = None,
                in_flight=(), picked_since_scrape=(), **request) -> bytes:
    """A ScoreInput; candidates default to every endpoint of ``snapshot``."""
    if candidates is None:
        candidates = range(len(snapshot.endpoints)) if snapshot is not None else ()
    return abi.encoder.encode(
        abi.ScoreInput(snapshot=snapshot, request=abi.Request(**request), candidates=tuple(candidates),
                       in_flight=tuple(in_flight), picked_since_scrape=tuple(picked_since_scrape))
    )


def pre(endpoint: str, timestamp_ms: int = 0, **request) -> bytes:
    return abi.encoder.encode(
        abi.PreRequestEvent(request=abi.Request(**request), endpoint=endpoint, timestamp_ms=timestamp_ms)
    )


def post(endpoint: str, timestamp_ms: int = 0, **fields) -> bytes:
    return abi.encoder.encode(abi.PostResponseEvent(endpoint=endpoint, timestamp_ms=timestamp_ms, **fields))


def memory_bytes(inst) -> int:
    """The instance's linear-memory size (the runtime has no public accessor yet)."""
    return inst._memory.size
