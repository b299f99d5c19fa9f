"""The pool: scrape every endpoint's metrics and publish one consistent view.

Concurrency (structured; trio/anyio style): :meth:`Pool.run` owns one task group holding
one scrape loop per endpoint and, in its own body, the *round ticker*. Every
``scrape_interval_ms`` the ticker wakes each endpoint that is neither mid-fetch nor
backing off (spread over half the interval, a group at a time), waits until they have
all answered (or the interval is over — a hung endpoint never holds up the others),
then publishes: it rebuilds the view once if
anything changed. So a rebuild is coalesced per round and never happens per request,
and a staleness flip is noticed on the next tick even when no scrape succeeds.

Clocks: ``clock`` (monotonic seconds) dates good scrapes and decides freshness, so tests
fake it; ``wall_clock`` stamps ``Snapshot.timestamp_ms``. Scheduling (interval, timeout,
back-off) runs on the event loop's own clock.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import msgspec
from anyio.abc import TaskStatus
from prometheus_client import Gauge

from epick import abi, telemetry
from epick.interfaces import EndpointInfo, PoolView
from epick.pool.errors import ScrapeError
from epick.pool.fetch import HttpReader, Listing
from epick.pool.reader import Reader
from epick.pool.spec import EndpointSpec

__all__ = ["Pool", "EndpointStatus", "MAX_BACKOFF_MS"]

log = logging.getLogger("epick.pool")

#: How often an endpoint's ``/v1/models`` is read again (served models and adapters can
#: change at run time: vLLM's dynamic LoRA loading, a restart with other flags).
MODELS_REFRESH_S = 10.0

#: Upper bound of the retry back-off after consecutive failed scrapes. The back-off
#: doubles from ``scrape_interval_ms``; capped at 1 s so a recovered endpoint is back
#: within about a second, and a dead one costs one connection attempt (and one log
#: line) a second.
MAX_BACKOFF_MS = 1000.0

#: A round's wake-ups are spread over this share of the interval, in this many groups
#: (Pool._round), so the answers reach the event loop a group at a time.
SPREAD = 0.5
SPREAD_SLOTS = 8

class EndpointStatus(msgspec.Struct, frozen=True, kw_only=True):
    """How scraping one endpoint goes (admin/debug view, not the hot path)."""

    address: str
    url: str
    engine: str
    fresh: bool
    """Its last good scrape is at most ``stale_after_ms`` old."""
    last_success_age_ms: float | None
    """Age of the last good scrape; ``None`` = never scraped successfully."""
    last_error: str | None
    """The most recent failure (kept after a recovery), ``None`` if it never failed."""
    failures: int
    """Consecutive failed scrapes since the last good one."""


@dataclass(eq=False, slots=True)
class _Endpoint:
    """Mutable per-endpoint state; touched only from the event loop thread."""

    spec: EndpointSpec
    info_fresh: EndpointInfo
    info_stale: EndpointInfo
    metrics: abi.EndpointMetrics | None = None
    sleeping: bool = False
    page_models: tuple[str, ...] = ()  # model_name labels on the last page
    listed: Listing | None = None  # what /v1/models says
    models_due: float = -math.inf  # event-loop time of the next /v1/models read
    last_success: float | None = None  # Pool.clock() of the last good scrape
    last_error: str | None = None
    last_skipped: tuple[str, ...] = ()
    failures: int = 0
    busy: bool = False  # woken for a scrape that has not finished yet
    timed_out: bool = False  # the last failure since the last good scrape was a timeout
    not_before: float = -math.inf  # event-loop time before which it is not scraped
    wake: anyio.Event | None = None
    scope: anyio.CancelScope | None = None
    # This endpoint's telemetry series, looked up once: labels() per round per endpoint
    # was most of an unchanged round's ~200 us at 64 endpoints.
    fresh_gauge: Gauge = None  # type: ignore[assignment]  # set in of()
    age_gauge: Gauge | None = None

    @classmethod
    def of(cls, spec: EndpointSpec) -> _Endpoint:
        ep = cls(spec=spec, info_fresh=EndpointInfo(), info_stale=EndpointInfo())
        ep.set_spec(spec)
        ep.fresh_gauge = telemetry.ENDPOINT_FRESH.labels(spec.address)
        return ep

    def set_spec(self, spec: EndpointSpec) -> None:
        self.spec = spec
        self.refresh_info()

    def refresh_info(self) -> None:
        """Rebuild the two EndpointInfo values from the spec and what the engine reported.

        Pinned ``models``/``adapters`` win; else the engine's own word: ``/v1/models``
        (base models and adapters) united with the page's ``model_name`` labels. Nothing
        reported means any.
        """
        spec = self.spec
        models = frozenset(spec.models) if spec.models is not None else None
        adapters = frozenset(spec.adapters) if spec.adapters is not None else None
        if spec.discover:
            if models is None and (self.listed is not None or self.page_models):
                models = frozenset(self.page_models) | (
                    self.listed.models if self.listed else frozenset())
            if adapters is None and self.listed is not None:
                adapters = self.listed.adapters
        facts = dict(
            models=models,
            adapters=adapters,
            labels=tuple(sorted(spec.labels.items())),
            sleeping=self.sleeping,
        )
        self.info_fresh = EndpointInfo(fresh=True, **facts)
        self.info_stale = EndpointInfo(fresh=False, **facts)


class Pool:
    """Endpoint discovery, metric scraping and the published :class:`PoolView`.

    Parameters
    ----------
    specs:
        The endpoints; their order is the snapshot's order. Addresses must be unique.
    scrape_interval_ms:
        One scrape round per interval (upstream default 50 ms).
    stale_after_ms:
        An endpoint whose last good scrape is older than this is published with
        ``EndpointInfo.fresh=False`` (its last good metrics stay in the snapshot).
    stale_grace_ms:
        The last resort: while *no* endpoint is fresh, an endpoint that is only *late*
        — its page timed out or has not come yet, so the engine accepted the request and
        is busy (a refused connection or an error page is not late) — stays fresh for
        this much longer, on its last metrics. Two real vLLM-CPU replicas generating on
        the machine's two cores answered /metrics in over a second, so both went stale
        and every pick was refused UNAVAILABLE while both were serving (issue 32).
        0 = off.
    timeout_ms:
        Bound on one fetch, connect to last byte.
    clock, wall_clock:
        Monotonic seconds (scrape ages, freshness) and Unix seconds (snapshot timestamp).
    on_scrape:
        Called with the address after every good scrape (the scheduler's
        :class:`~epick.scheduler.assignments.Assignments` resets "picks since scrape").
    reader:
        What every endpoint is read through (:class:`~epick.pool.reader.Reader`);
        :meth:`run` owns it. Default: :class:`~epick.pool.fetch.HttpReader`, fetch and
        parse on this event loop. :func:`~epick.pool.reader.reader_for` builds the one
        ``[pool] scrape_in`` names (``"process"``: a child process, so the loop spends a
        few µs per scrape instead of the parse's few hundred).

    Threading: :attr:`view` may be read from any thread (one attribute read of an
    immutable object). Everything else must be called from the event loop thread that
    runs :meth:`run` (from other threads, go through ``anyio.from_thread.run_sync``).
    """

    def __init__(
        self,
        specs: Sequence[EndpointSpec],
        *,
        scrape_interval_ms: float = 50,
        stale_after_ms: float = 2000,
        timeout_ms: float = 5000,
        stale_grace_ms: float = 3000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_scrape: Callable[[str], None] | None = None,
        reader: Reader | None = None,
    ) -> None:
        for name, value in (
            ("scrape_interval_ms", scrape_interval_ms),
            ("stale_after_ms", stale_after_ms),
            ("timeout_ms", timeout_ms),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Pool {name} must be a number > 0, got {value!r}")
        if not (isinstance(stale_grace_ms, (int, float)) and math.isfinite(stale_grace_ms)
                and stale_grace_ms >= 0):
            raise ValueError(f"Pool stale_grace_ms must be a number >= 0, got {stale_grace_ms!r}")
        self._interval_s = scrape_interval_ms / 1000
        self._stale_after_s = stale_after_ms / 1000
        self._last_resort_s = (stale_after_ms + stale_grace_ms) / 1000
        self._last_resort: tuple[str, ...] = ()  # the endpoints used late, for the log
        self._timeout_s = timeout_ms / 1000
        self._clock = clock
        self._wall_clock = wall_clock
        self._on_scrape = on_scrape
        self.reader: Reader = reader if reader is not None else HttpReader()
        """What every endpoint is read through (given, never swapped)."""

        self._endpoints: dict[str, _Endpoint] = {}
        self._view = PoolView.build(abi.Snapshot(version=0, timestamp_ms=0))
        self._published: tuple[tuple[abi.EndpointMetrics, EndpointInfo], ...] = ()
        self._tg: anyio.abc.TaskGroup | None = None
        self._pending: set[_Endpoint] = set()
        self._round_done: anyio.Event | None = None
        self.set_endpoints(specs)

    # --- the view -------------------------------------------------------------------

    @property
    def view(self) -> PoolView:
        """The current view: one immutable object, replaced (never mutated) on change.

        Version 0 is the empty pool before any good scrape. Endpoints that never had a
        good scrape are absent; stale ones are present with ``fresh=False``.
        """
        return self._view

    def ready(self) -> bool:
        """At least one endpoint is fresh in the published view.

        Judged on the view, not on the clock now, so health never disagrees with
        what a pick sees (the view lags the clock by at most one interval).
        """
        return any(info.fresh for info in self._view.info)

    def status(self) -> list[EndpointStatus]:
        """Per endpoint, in spec order: freshness, last success age, last error, failures."""
        now = self._clock()
        return [
            EndpointStatus(
                address=ep.spec.address,
                url=ep.spec.url,
                engine=ep.spec.engine,
                fresh=self._is_fresh(ep, now),
                last_success_age_ms=(
                    None if ep.last_success is None else (now - ep.last_success) * 1000
                ),
                last_error=ep.last_error,
                failures=ep.failures,
            )
            for ep in self._endpoints.values()
        ]

    # --- membership -----------------------------------------------------------------

    def set_endpoints(self, specs: Sequence[EndpointSpec]) -> None:
        """Replace the endpoint set without a restart.

        An endpoint whose spec is unchanged keeps all its state (metrics, ages, back-off).
        One whose ``models``/``adapters``/``labels`` changed keeps its metrics too; one
        whose metrics URL or engine changed starts over. Removed endpoints stop being
        scraped at once, and the view is republished right away, so a removed
        endpoint is never picked after this returns.

        Raises ``ValueError`` naming a duplicate address; the pool is then unchanged.
        """
        specs = list(specs)
        seen: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if spec.address in seen:
                raise ValueError(
                    f"duplicate endpoint address {spec.address!r} "
                    f"(endpoints[{seen[spec.address]}] and endpoints[{i}])"
                )
            seen[spec.address] = i

        updated: dict[str, _Endpoint] = {}
        for spec in specs:
            old = self._endpoints.get(spec.address)
            if old is not None and (old.spec.url, old.spec.engine) == (spec.url, spec.engine):
                if old.spec != spec:
                    old.set_spec(spec)
                updated[spec.address] = old
                continue
            if old is not None:
                self._stop(old)
            ep = _Endpoint.of(spec)
            updated[spec.address] = ep
            if self._tg is not None:
                self._start(ep)
        for address, old in self._endpoints.items():
            if address not in updated:
                self._stop(old)
                telemetry.forget_endpoint(address)
                self.reader.forget(address)
        self._endpoints = updated
        self._publish()

    # --- running --------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Scrape until cancelled; never returns otherwise.

        Calls ``task_status.started()`` once the first round has finished — every
        endpoint answered, failed or timed out — and its view is published; start it
        with ``await tg.start(pool.run)`` to be ready only after that.

        Error handling: a failed scrape (:class:`ScrapeError`: network, timeout, HTTP
        status, bad page) is counted in ``epick_scrape_errors_total``, logged on logger
        ``epick.pool`` with the endpoint and the back-off, and retried after the back-off
        (doubling from the interval up to :data:`MAX_BACKOFF_MS`). Nothing a model
        server does ends ``run``.

        Resources: this task group owns the reader (its ``run``). The default
        :class:`~epick.pool.fetch.HttpReader` keeps one ``aiohttp.ClientSession`` per
        endpoint holding one kept-alive connection (environment proxies ignored), closed
        when the endpoint leaves or the run ends; the sessions share one TLS context. A
        :class:`~epick.pool.worker.ScrapeWorker` keeps them in its child process, which
        it starts and stops.
        aiohttp, not httpx: scraping is the service's biggest background cost (64
        endpoints × 20/s), and an aiohttp GET costs ~5× less CPU than an httpx one here (~60–120 µs vs ~600 µs, C-accelerated parser). The
        service runs on asyncio anyway (grpc.aio needs it).
        """
        if self._tg is not None:
            raise RuntimeError("Pool.run is already running")
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                try:
                    await tg.start(self.reader.run)
                    for ep in self._endpoints.values():
                        self._start(ep)
                    await self._round(deadline=None)
                    task_status.started()
                    while True:
                        deadline = anyio.current_time() + self._interval_s
                        await self._round(deadline=deadline)
                        await anyio.sleep_until(deadline)
                finally:
                    tg.cancel_scope.cancel()  # the loops end with the ticker, whatever ended it
        finally:
            # Only here, once every loop has exited, may their state be reset.
            self._tg = None
            self._pending, self._round_done = set(), None
            for ep in self._endpoints.values():
                ep.busy, ep.scope, ep.wake = False, None, None

    async def _round(self, *, deadline: float | None) -> None:
        """Wake every due endpoint, wait for them (at most until ``deadline``), publish.

        With a deadline the wake-ups are spread over the first :data:`SPREAD` of the
        interval in :data:`SPREAD_SLOTS` groups: 64 answers handled back to back are
        ~3 ms of the loop, and a pick arriving meanwhile waited behind all of them
        (docs/performance.md); a group is an eighth of that. The first round (no
        deadline) wakes everyone at once, to be ready soon.
        """
        now = anyio.current_time()
        due = [ep for ep in self._endpoints.values() if not ep.busy and ep.not_before <= now]
        self._pending = set(due)
        self._round_done = done = anyio.Event()
        if not due:
            done.set()
        if deadline is None:
            self._wake(due)
            await done.wait()
        else:
            with anyio.move_on_after(deadline - now):
                slots = min(SPREAD_SLOTS, len(due))
                step = (deadline - now) * SPREAD / max(slots, 1)
                try:
                    for k in range(slots):
                        if k:
                            await anyio.sleep_until(now + k * step)
                        self._wake(due[k::slots])
                finally:  # the deadline came first: the rest wait for the next round
                    for ep in due:
                        if not ep.busy:
                            self._pending.discard(ep)
                    if not self._pending:
                        done.set()
                await done.wait()
        self._publish()

    def _wake(self, eps: Sequence[_Endpoint]) -> None:
        for ep in eps:
            if ep not in self._pending:  # removed from the pool since the round began
                continue
            ep.busy = True
            assert ep.wake is not None  # started in _start
            ep.wake.set()

    def _start(self, ep: _Endpoint) -> None:
        assert self._tg is not None
        ep.scope = anyio.CancelScope()
        ep.wake = anyio.Event()
        self._tg.start_soon(self._loop, ep, name=f"epick.pool scrape {ep.spec.address}")

    def _stop(self, ep: _Endpoint) -> None:
        if ep.scope is not None:
            ep.scope.cancel()
        self._finished(ep)

    def _finished(self, ep: _Endpoint) -> None:
        ep.busy = False
        self._pending.discard(ep)
        if not self._pending and self._round_done is not None:
            self._round_done.set()

    async def _loop(self, ep: _Endpoint) -> None:
        assert ep.scope is not None
        with ep.scope:
            await self._serve(ep, self.reader)

    async def _serve(self, ep: _Endpoint, reader: Reader) -> None:
        while True:
            assert ep.wake is not None
            await ep.wake.wait()
            ep.wake = anyio.Event()
            try:
                await self._scrape(ep, reader)
            finally:
                self._finished(ep)

    async def _scrape(self, ep: _Endpoint, reader: Reader) -> None:
        """Fetch and parse once; record the result on ``ep``. Never raises ScrapeError."""
        url = ep.spec.url
        try:
            page = await reader.read_page(url=url, engine=ep.spec.engine,
                                          address=ep.spec.address, previous=ep.metrics,
                                          timeout_s=self._timeout_s)
        except ScrapeError as err:
            self._failed(ep, err)
            return
        if ep.failures:
            log.info("scrape of %s recovered after %d failures", ep.spec.address, ep.failures)
        if page.skipped and page.skipped != ep.last_skipped:
            log.warning("scrape of %s: left out %s", ep.spec.address, "; ".join(page.skipped))
        ep.last_skipped = page.skipped
        metrics = page.metrics
        # Keep the old object when nothing changed: publishing then compares by identity.
        if metrics != ep.metrics:
            ep.metrics = metrics
        changed = page.sleeping != ep.sleeping or page.models != ep.page_models
        if page.models != ep.page_models:
            ep.models_due = -math.inf  # a new served name (a restart?): list again now
        ep.sleeping, ep.page_models = page.sleeping, page.models
        if ep.spec.discover and anyio.current_time() >= ep.models_due:
            changed |= await self._list_models(ep, reader)
        if changed:
            ep.refresh_info()
        ep.last_success = self._clock()
        ep.failures = 0
        ep.timed_out = False
        ep.not_before = -math.inf
        if self._on_scrape is not None:
            self._on_scrape(ep.spec.address)

    async def _list_models(self, ep: _Endpoint, reader: Reader) -> bool:
        """Read ``/v1/models``: base models (no ``parent``) and adapters (with one).

        Best effort: a failure keeps what was listed before (or nothing) and retries
        after :data:`MODELS_REFRESH_S`. Returns whether the listing changed.
        """
        ep.models_due = anyio.current_time() + MODELS_REFRESH_S
        url = ep.spec.models_url
        try:
            listed = await reader.read_models(url=url, address=ep.spec.address,
                                              timeout_s=self._timeout_s)
        except ValueError as exc:
            if ep.listed is None:
                log.debug("no model listing at %s (%s): serves any model", url, exc)
            return False
        if listed == ep.listed:
            return False
        ep.listed = listed
        log.info("%s serves models %s, adapters %s", ep.spec.address,
                 ", ".join(sorted(listed.models)) or "-",
                 ", ".join(sorted(listed.adapters)) or "-")
        return True

    def _failed(self, ep: _Endpoint, err: ScrapeError) -> None:
        ep.failures += 1
        ep.timed_out = err.kind == "timeout"
        ep.last_error = str(err)
        backoff_ms = min(
            self._interval_s * 1000 * 2 ** min(ep.failures - 1, 30),
            max(MAX_BACKOFF_MS, self._interval_s * 1000),
        )
        ep.not_before = anyio.current_time() + backoff_ms / 1000
        telemetry.SCRAPE_ERRORS.labels(ep.spec.address, err.kind).inc()
        log.log(
            logging.WARNING if ep.failures == 1 else logging.INFO,
            "scrape of %s failed (%d in a row): %s; retrying in %.0f ms",
            ep.spec.address,
            ep.failures,
            err,
            backoff_ms,
        )

    # --- publishing -----------------------------------------------------------------

    def _is_fresh(self, ep: _Endpoint, now: float) -> bool:
        return ep.last_success is not None and now - ep.last_success <= self._stale_after_s

    @staticmethod
    def _is_late(ep: _Endpoint) -> bool:
        """Its page is late, not refused: the last try timed out, or the scrape after a
        good one is still out."""
        return ep.timed_out or (ep.failures == 0 and ep.busy)

    def _note_last_resort(self, addresses: tuple[str, ...], now: float) -> None:
        if addresses == self._last_resort:
            return
        if addresses:
            ages = ", ".join(
                f"{a} {(now - (self._endpoints[a].last_success or now)) * 1000:.0f} ms"
                for a in addresses)
            log.warning("no endpoint has fresh metrics: picks use %d whose pages are late "
                        "(timed out or still coming, not refused) on their last metrics "
                        "(age: %s; [pool] stale_grace_ms)", len(addresses), ages)
        else:
            log.info("last resort over: %s", "an endpoint is fresh again"
                     if any(self._is_fresh(ep, now) for ep in self._endpoints.values())
                     else "the late endpoints went stale")
        self._last_resort = addresses
        telemetry.POOL_LAST_RESORT.set(len(addresses))

    def _publish(self) -> bool:
        """Rebuild the view if metrics, freshness or the endpoint set changed.

        Returns whether it rebuilt. Called once per round and after ``set_endpoints``.
        """
        now = self._clock()
        rows = []
        late: list[tuple[int, _Endpoint]] = []  # row index, endpoint: the last resort
        any_fresh = False
        for ep in self._endpoints.values():
            if ep.metrics is None or ep.last_success is None:
                # Exported as not fresh, so an alert on fresh == 0 also sees endpoints
                # that never answered; they stay out of the snapshot.
                ep.fresh_gauge.set(0)
                continue
            age = now - ep.last_success
            fresh = age <= self._stale_after_s
            any_fresh |= fresh
            ep.fresh_gauge.set(1 if fresh else 0)
            if ep.age_gauge is None:  # only once there is an age: no made-up 0 before
                ep.age_gauge = telemetry.ENDPOINT_SCRAPE_AGE.labels(ep.spec.address)
            ep.age_gauge.set(max(age, 0.0))
            if not fresh and age <= self._last_resort_s and self._is_late(ep):
                late.append((len(rows), ep))
            rows.append((ep.metrics, ep.info_fresh if fresh else ep.info_stale))
        if any_fresh:
            late = []
        for i, ep in late:
            rows[i] = (ep.metrics, ep.info_fresh)
        self._note_last_resort(tuple(ep.spec.address for _, ep in late), now)
        published = tuple(rows)
        if published == self._published:
            return False
        snapshot = abi.Snapshot(
            version=self._view.version + 1,
            timestamp_ms=int(self._wall_clock() * 1000),
            endpoints=tuple(metrics for metrics, _ in published),
        )
        self._view = PoolView.build(snapshot, [info for _, info in published])
        self._published = published
        telemetry.SNAPSHOT_REBUILDS.inc()
        telemetry.SNAPSHOT_ENDPOINTS.set(len(published))
        return True
