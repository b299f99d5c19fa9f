"""The weights stream: per (model, adapter, criticality), every endpoint's share of new
traffic, kept current for data planes that cannot ask per request (docs/weights.md).

:class:`WeightsHub` owns one :class:`_Feed` per key that someone watches. A feed is
computed once per pool snapshot version (or policy-set / admission swap) by one ticker
task the hub owns (:meth:`WeightsHub.run`), with :meth:`Scheduler.weigh
<epick.scheduler.scheduler.Scheduler.weigh>` — the filters and weighted scores a Pick
with those features and no prompt would see, without picking — and turned into shares
by :func:`shares`. A new table is published when a share moved by more than
``threshold`` or the eligible set changed, at most every ``min_interval_ms``. Publishing
replaces the feed's one latest table and wakes its readers: each subscriber holds only
the latest table, so a slow reader skips to it instead of queueing a backlog, and
a publish costs one event whatever the number of subscribers.

Front ends use :meth:`WeightsHub.table` (one table now) and :meth:`WeightsHub.subscribe`
(a stream); :func:`watch_weights` is the gRPC one (``EndpointPicker/WatchWeights``).
Everything runs on the service's event-loop thread, like the scheduler.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import grpc
import numpy as np

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2
from epick.api.picker import InvalidArgument, status_for, to_request
from epick.scheduler.scheduler import Scheduler, SchedulingError, Shed

__all__ = ["WeightsHub", "WeightsTable", "EndpointShare", "Subscription", "shares",
           "watch_weights", "RULES", "SATURATED"]

RULES = ("proportional", "softmax")
#: ``filtered_by`` of an endpoint over the admission thresholds (weight 0).
SATURATED = "saturated"
#: How often the ticker looks at the pool's version (one attribute read per feed). The
#: pool publishes a new view per metrics change but notifies no one: polling is cheap.
POLL_S = 0.01
#: Stream writes in flight at once, over all subscribers (the pick path goes first).
WRITES_IN_FLIGHT = 8


@dataclass(frozen=True, slots=True)
class EndpointShare:
    endpoint: str
    weight: float
    """Share of new traffic in [0, 1]; 0 when ``filtered_by`` says why."""
    filtered_by: str = ""
    total: float = 0.0
    """The policies' weighted total (0 when filtered)."""


@dataclass(frozen=True, slots=True)
class WeightsTable:
    """One table: every endpoint of the pool's view, eligible ones first (by weight)."""

    model: str
    adapter: str
    criticality: abi.Criticality
    endpoints: tuple[EndpointShare, ...]
    snapshot_version: int
    snapshot_timestamp_ms: int
    timestamp_ms: int
    reason: str = ""
    """Why no endpoint is eligible (empty when some is)."""

    def weights(self) -> dict[str, float]:
        return {e.endpoint: e.weight for e in self.endpoints}

    def eligible(self) -> frozenset[str]:
        return frozenset(e.endpoint for e in self.endpoints if e.weight > 0)


def shares(totals: np.ndarray, rule: str = "softmax",
           temperature: float = 0.1) -> np.ndarray:
    """The share rule (docs/weights.md): totals -> shares summing to 1.

    ``proportional``: share = total / Σ totals (all totals 0: equal shares).
    ``softmax``: share ∝ exp(total / temperature).
    """
    n = len(totals)
    if n == 0:
        return np.zeros(0)
    if rule == "softmax":
        z = np.exp((totals - totals.max()) / temperature)
        return z / z.sum()
    t = np.clip(totals, 0.0, None)
    s = float(t.sum())
    return t / s if s > 0 else np.full(n, 1.0 / n)


def _changed(old: WeightsTable | None, new: WeightsTable, threshold: float) -> bool:
    """The eligible set changed, or some share moved by more than ``threshold``."""
    if old is None or old.eligible() != new.eligible() or old.reason != new.reason:
        return True
    before = old.weights()
    return any(abs(e.weight - before.get(e.endpoint, 0.0)) > threshold
               for e in new.endpoints)


class _Feed:
    """One key's latest table and its readers (no per-reader queue)."""

    __slots__ = ("key", "latest", "seq", "basis", "published_at", "readers", "wake", "memo")

    def __init__(self, key, table: WeightsTable, basis, now: float) -> None:
        self.key = key
        self.latest = table
        self.seq = 1
        self.basis = basis
        self.published_at = now
        self.readers = 0
        self.wake = anyio.Event()
        self.memo: tuple[int, Callable, object] | None = None
        """(seq, encode, encode(latest)): one encoding per table for all readers."""

    def publish(self, table: WeightsTable, now: float) -> None:
        self.latest = table
        self.seq += 1
        self.published_at = now
        wake, self.wake = self.wake, anyio.Event()
        wake.set()


class Subscription:
    """What :meth:`WeightsHub.subscribe` yields: ``async for table in sub`` gets the
    current table first, then each newer one; a reader that falls behind skips to the
    latest (``skipped`` counts the tables it never saw)."""

    def __init__(self, feed: _Feed) -> None:
        self._feed = feed
        self._seen = 0
        self.skipped = 0

    @property
    def latest(self) -> WeightsTable:
        return self._feed.latest

    async def wait(self) -> None:
        """Until there is a table this reader has not taken."""
        feed = self._feed
        while feed.seq == self._seen:
            await feed.wake.wait()

    def take(self) -> WeightsTable:
        """The latest table, now marked as seen."""
        feed = self._feed
        if self._seen:
            self.skipped += max(feed.seq - self._seen - 1, 0)
        self._seen = feed.seq
        return feed.latest

    def take_encoded(self, encode: Callable[[WeightsTable], object]) -> object:
        """:meth:`take`, as ``encode(table)`` — computed once per table and ``encode``
        for all the key's readers (a front end's message: building a protobuf costs
        ~30 µs, far more than writing it)."""
        feed = self._feed
        self.take()
        memo = feed.memo
        if memo is None or memo[0] != feed.seq or memo[1] is not encode:
            memo = feed.memo = (feed.seq, encode, encode(feed.latest))
        return memo[2]

    async def next(self) -> WeightsTable:
        await self.wait()
        return self.take()

    def __aiter__(self) -> AsyncIterator[WeightsTable]:
        return self

    async def __anext__(self) -> WeightsTable:
        return await self.next()


class WeightsHub:
    """The weights tables, shared by every subscriber of the same key.

    Parameters
    ----------
    scheduler:
        Its :meth:`~epick.scheduler.scheduler.Scheduler.weigh` gives filters and totals.
    threshold:
        Publish when some share moved by more than this (max absolute change).
    min_interval_ms:
        At most one table per key per this interval.
    rule, temperature:
        The share rule (:func:`shares`).
    """

    def __init__(self, scheduler: Scheduler, *, threshold: float = 0.02,
                 min_interval_ms: float = 500.0, rule: str = "softmax",
                 temperature: float = 0.1,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if rule not in RULES:
            raise ValueError(f"WeightsHub rule must be one of {RULES}, got {rule!r}")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"WeightsHub temperature must be > 0, got {temperature!r}")
        self.scheduler = scheduler
        self.threshold = threshold
        self.min_interval_s = min_interval_ms / 1000
        self.rule = rule
        self.temperature = temperature
        self._clock = clock
        self._wall_clock = wall_clock
        self._feeds: dict[tuple[str, str, abi.Criticality], _Feed] = {}
        self._has_feeds: anyio.Event | None = None  # made by run(): needs the loop
        self._write_slots: anyio.CapacityLimiter | None = None
        self.computations = 0
        """Tables computed by the ticker (tests and the bench read it)."""

    def configure(self, config) -> None:
        """Take a reloaded ``[weights]`` table (``epick.config.WeightsConfig``)."""
        self.threshold = config.threshold
        self.min_interval_s = config.min_interval_ms / 1000
        self.rule = config.rule
        self.temperature = config.temperature

    def write_slots(self) -> anyio.CapacityLimiter:
        """The limiter every stream's write goes through (:data:`WRITES_IN_FLIGHT`)."""
        if self._write_slots is None:  # made on the loop, on first use
            self._write_slots = anyio.CapacityLimiter(WRITES_IN_FLIGHT)
        return self._write_slots

    @property
    def subscribers(self) -> int:
        return sum(f.readers for f in self._feeds.values())

    @property
    def feeds(self) -> int:
        return len(self._feeds)

    # -- what front ends call -------------------------------------------------------

    def table(self, model: str, adapter: str = "",
              criticality: abi.Criticality = abi.Criticality.STANDARD) -> WeightsTable:
        """The table now (a watched key's latest, else computed). Raises
        :class:`InvalidArgument` for a bad name and
        :class:`~epick.scheduler.scheduler.Unavailable` as a Pick would."""
        key = self._key(model, adapter, criticality)
        feed = self._feeds.get(key)
        if feed is not None:
            return feed.latest
        return self._compute(key, first=True)

    @asynccontextmanager
    async def subscribe(self, model: str, adapter: str = "",
                        criticality: abi.Criticality = abi.Criticality.STANDARD
                        ) -> AsyncIterator[Subscription]:
        """``async with hub.subscribe(...) as sub: async for table in sub: ...``.

        Raises on entry as :meth:`table` does; leaving the block frees the subscription
        (and the key's feed with its last reader).
        """
        key = self._key(model, adapter, criticality)
        feed = self._feeds.get(key)
        if feed is None:
            table = self._compute(key, first=True)
            feed = self._feeds[key] = _Feed(key, table, self._basis(), self._clock())
            if self._has_feeds is not None:
                self._has_feeds.set()
        feed.readers += 1
        try:
            yield Subscription(feed)
        finally:
            feed.readers -= 1
            if feed.readers == 0 and self._feeds.get(key) is feed:
                del self._feeds[key]

    # -- the ticker -----------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Recompute watched keys on a new snapshot version (or policy/admission swap);
        sleeps while nobody watches. Owned by the service's task group."""
        task_status.started()
        while True:
            if not self._feeds:
                self._has_feeds = anyio.Event()
                await self._has_feeds.wait()
            await anyio.sleep(POLL_S)
            self.tick()

    def tick(self) -> None:
        """One look at the pool: recompute the feeds whose basis changed and whose last
        table is older than ``min_interval_ms``; publish what changed enough."""
        if not self._feeds:
            return
        basis = self._basis()
        now = self._clock()
        for feed in list(self._feeds.values()):
            if _same(feed.basis, basis) or now - feed.published_at < self.min_interval_s:
                continue
            feed.basis = basis
            table = self._compute(feed.key, first=False)
            self.computations += 1
            if _changed(feed.latest, table, self.threshold):
                feed.publish(table, now)

    # -- helpers ------------------------------------------------------------------------

    def _basis(self):
        s = self.scheduler
        return (s.current_view().version, s.policies, s.admission)

    @staticmethod
    def _key(model: str, adapter: str, criticality) -> tuple[str, str, abi.Criticality]:
        """Validated as Pick validates them, the error naming ``WeightsRequest``."""
        try:
            request = to_request(picker_pb2.PickRequest(model=model, adapter=adapter))
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc).replace("PickRequest.", "WeightsRequest.")) from None
        return request.model, request.adapter, abi.Criticality(criticality)

    def _compute(self, key, *, first: bool) -> WeightsTable:
        """The table for ``key`` now. ``first``: Unavailable raises (the stream does not
        start); later it becomes a table with no eligible endpoint and a reason."""
        model, adapter, criticality = key
        request = abi.Request(model=model, adapter=adapter, criticality=criticality, seed=0)
        now_ms = int(self._wall_clock() * 1000)
        try:
            view, candidates, totals, why = self.scheduler.weigh(request)
        except SchedulingError as exc:
            if first and not isinstance(exc, Shed):
                raise
            view = self.scheduler.current_view()
            return WeightsTable(
                model, adapter, criticality,
                tuple(EndpointShare(a, 0.0, "") for a in view.addresses),
                view.version, view.snapshot.timestamp_ms, now_ms, reason=str(exc))
        eps = view.snapshot.endpoints
        adm = self.scheduler.admission
        # Saturated endpoints get nothing: an L4 data plane cannot shed or queue, so
        # traffic sent there waits. Unless all are: then the scores decide (SHEDDABLE
        # never gets here then: its admission filter already shed it).
        fit = [k for k, i in enumerate(candidates)
               if eps[i].waiting <= adm.queue_threshold and eps[i].kv_usage <= adm.kv_threshold]
        saturated: set[int] = set()
        if fit and len(fit) < len(candidates):
            saturated = set(candidates) - {candidates[k] for k in fit}
            kept = np.array(fit)
            part = shares(totals[kept], self.rule, self.temperature)
            share = np.zeros(len(candidates))
            share[kept] = part
        else:
            share = shares(totals, self.rule, self.temperature)
        rows = [EndpointShare(eps[i].address, float(share[k]),
                              SATURATED if i in saturated else "", float(totals[k]))
                for k, i in enumerate(candidates)]
        rows.sort(key=lambda r: -r.weight)
        in_table = set(candidates)
        rows += [EndpointShare(e.address, 0.0, why.get(i, "filtered"))
                 for i, e in enumerate(eps) if i not in in_table]
        return WeightsTable(model, adapter, criticality, tuple(rows), view.version,
                            view.snapshot.timestamp_ms, now_ms)


def _same(a, b) -> bool:
    return a[0] == b[0] and a[1] is b[1] and a[2] is b[2]


# -- gRPC ----------------------------------------------------------------------------

_CRITICALITY = {
    picker_pb2.CRITICALITY_UNSPECIFIED: abi.Criticality.STANDARD,
    picker_pb2.CRITICAL: abi.Criticality.CRITICAL,
    picker_pb2.STANDARD: abi.Criticality.STANDARD,
    picker_pb2.SHEDDABLE: abi.Criticality.SHEDDABLE,
}


def to_proto(table: WeightsTable) -> picker_pb2.WeightsTable:
    msg = picker_pb2.WeightsTable(snapshot_version=table.snapshot_version,
                                  timestamp_ms=table.timestamp_ms,
                                  snapshot_timestamp_ms=table.snapshot_timestamp_ms,
                                  reason=table.reason)
    for e in table.endpoints:
        msg.endpoints.add(endpoint=e.endpoint, weight=e.weight, filtered_by=e.filtered_by,
                          total=e.total)
    return msg


def _features(msg: picker_pb2.WeightsRequest) -> tuple[str, str, abi.Criticality]:
    """The request's fields (names are checked by :meth:`WeightsHub.subscribe`)."""
    criticality = _CRITICALITY.get(msg.criticality)
    if criticality is None:
        raise InvalidArgument(
            f"WeightsRequest.criticality {msg.criticality} is not one of CRITICAL (1), "
            "STANDARD (2), SHEDDABLE (3)")
    return msg.model, msg.adapter, criticality


async def watch_weights(hub: WeightsHub | None, msg: picker_pb2.WeightsRequest,
                        context) -> None:
    """``EndpointPicker/WatchWeights``: the first table at once, then each newer one the
    client is ready for (a slow client gets the latest, not a backlog)."""
    if hub is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the weights stream is off")
    try:
        model, adapter, criticality = _features(msg)
        async with hub.subscribe(model, adapter, criticality) as sub:
            while True:
                await sub.wait()
                # A few writes at a time: a publish to 1,000 streams must not put 1,000
                # writes ahead of the picks on the loop. A reader waiting for a slot
                # takes the table that is latest when it gets one.
                async with hub.write_slots():
                    await context.write(sub.take_encoded(to_proto))
    except (InvalidArgument, SchedulingError) as exc:
        await context.abort(status_for(exc), str(exc))
