"""The per-request state every plugin of one scheduling cycle shares (kube's CycleState).

Moved here from ``epick.scheduler.framework``: the runtime's ``WasmPolicy`` encodes its
payload with :meth:`Cycle.score_input` and so needs this type, not the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from epick import abi
from epick.interfaces.view import PoolView

__all__ = ["Cycle", "AssignmentView", "KvCounts"]


class AssignmentView(Protocol):
    """What a cycle reads of the host's assignment counts (``epick.scheduler.assignments``
    implements it): ``(in_flight, picked_since_scrape)`` per address, both empty when
    nothing is assigned."""

    def of(self, addresses: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    def __bool__(self) -> bool: ...


class KvCounts(Protocol):
    """The KV-events seam (``epick.kv.KvRouting`` implements it): per candidate, the
    request's full KV blocks and how many leading ones the endpoint's events say it
    holds (``ScoreInput.prefix_blocks`` / ``prefix_matched``)."""

    def counts(self, request: abi.Request, endpoints: Sequence[abi.EndpointMetrics],
               candidates: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    def cleared(self, endpoints: Sequence[abi.EndpointMetrics],
                candidates: Sequence[int]) -> tuple[int, ...]:
        """Per candidate: Unix ms its engine last emptied its cache, 0 = never
        (``ScoreInput.prefix_cleared_ms``)."""
        ...


@dataclass(slots=True)
class Cycle:
    """Per-request state shared by every plugin of one scheduling cycle (read-only to them).

    Encoded payloads are cached here so that N policies cost one encoding.
    """

    view: PoolView
    request: abi.Request
    assignments: AssignmentView | None = None
    """What the host has sent where (``ScoreInput.in_flight`` / ``picked_since_scrape``)."""
    # The per-cycle caches below are made when first written (None until then): a pick
    # builds one Cycle and most of them are never used (KV events off, ABI v2 frames).
    _inputs: dict[tuple[bool, tuple[int, ...]], bytes] | None = None
    _assigned: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    now_ms: int = 0
    """Unix ms of this decision, stamped once by the scheduler so every policy's hooks see
    the same clock (and a replay of the decision log can give them the same again);
    0 = not stamped (plugins use their own clock)."""
    kv: KvCounts | None = None
    """Per-candidate KV block counts from the engines' events; ``None`` = KV events off:
    ``prefix_blocks``/``prefix_matched`` stay empty."""
    _kv: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    _pre: tuple[tuple[str, int], bytes] | None = None
    _cleared: dict[tuple[int, ...], tuple[int, ...]] | None = None
    _last: tuple[tuple[int, ...], bool, bytes] | None = None
    """The last :meth:`score_input` answer, found by the candidates' identity: every
    scorer of a pick gets the same tuple, and hashing 64 ints per lookup costs more than
    the lookup (a tuple does not keep its hash)."""

    def pre_request_input(self, endpoint: str, timestamp_ms: int) -> bytes:
        """The msgpack ``PreRequestEvent`` for the picked ``endpoint`` (one encoding for
        every policy's hook; ``timestamp_ms`` is ``now_ms`` when stamped)."""
        key = (endpoint, timestamp_ms)
        got = self._pre
        if got is None or got[0] != key:
            blob = abi.encoder.encode(abi.PreRequestEvent(
                request=self.request, endpoint=endpoint, timestamp_ms=timestamp_ms))
            got = self._pre = (key, blob)
        return got[1]

    def kv_counts(self, candidates: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(prefix_blocks, prefix_matched)`` per candidate (cached per cycle)."""
        if self.kv is None:
            return (), ()
        cache = self._kv
        if cache is None:
            cache = self._kv = {}
        got = cache.get(candidates)
        if got is None:
            got = cache[candidates] = self.kv.counts(
                self.request, self.view.snapshot.endpoints, candidates)
        return got

    def kv_cleared(self, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """``prefix_cleared_ms`` per candidate (cached per cycle); empty when KV events
        are off."""
        if self.kv is None:
            return ()
        cache = self._cleared
        if cache is None:
            cache = self._cleared = {}
        got = cache.get(candidates)
        if got is None:
            got = cache[candidates] = self.kv.cleared(self.view.snapshot.endpoints,
                                                      candidates)
        return got

    def uncached_tokens(self, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """``uncached_tokens`` per candidate: the prompt tokens its engine's KV events say it
        would prefill, -1 where unknown; empty when KV events are off (policies/ABI.md)."""
        if self.kv is None:
            return ()
        _, matched = self.kv_counts(candidates)
        if not matched:
            return ()
        endpoints = self.view.snapshot.endpoints
        tokens = self.request.prompt_tokens
        out = []
        for c, m in zip(candidates, matched):
            size = endpoints[c].block_size
            out.append(max(0, tokens - m * size) if m >= 0 and size > 0 else -1)
        return tuple(out)

    def assigned(self, candidates: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(in_flight, picked_since_scrape)`` per candidate as the policies see them
        (cached per cycle, so a decision log records what they saw, not the counts after
        the pick)."""
        cache = self._assigned
        if cache is None:
            cache = self._assigned = {}
        got = cache.get(candidates)
        if got is None:
            got = ((), ())
            if self.assignments:
                view = self.view
                addresses = view.addresses
                # Usually every endpoint, in order: then the precomputed tuple will do.
                if not (len(candidates) == len(addresses) and candidates == view.fresh):
                    addresses = [addresses[i] for i in candidates]
                got = self.assignments.of(addresses)
            cache[candidates] = got
        return got

    def score_input(self, candidates: tuple[int, ...], *, inline_snapshot: bool) -> bytes:
        """The msgpack ``ScoreInput`` for these candidates (cached per cycle).

        ``inline_snapshot=False`` leaves the snapshot out (nil) for policies that keep it
        resident via ``set_snapshot``.
        """
        last = self._last
        if last is not None and last[0] is candidates and last[1] == inline_snapshot:
            return last[2]
        key = (inline_snapshot, candidates)
        inputs = self._inputs
        if inputs is None:
            inputs = self._inputs = {}
        blob = inputs.get(key)
        if blob is None:
            in_flight, since = self.assigned(candidates)
            blocks, matched = self.kv_counts(candidates)
            blob = abi.encoder.encode(
                abi.ScoreInput(
                    snapshot=self.view.snapshot if inline_snapshot else None,
                    request=self.request,
                    candidates=candidates,
                    in_flight=in_flight,
                    picked_since_scrape=since,
                    prefix_blocks=blocks,
                    prefix_matched=matched,
                    prefix_cleared_ms=self.kv_cleared(candidates),
                    uncached_tokens=self.uncached_tokens(candidates),
                )
            )
            inputs[key] = blob
        self._last = (candidates, inline_snapshot, blob)
        return blob
