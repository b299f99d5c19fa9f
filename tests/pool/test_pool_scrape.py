"""Pool: readiness, staleness, membership, rebuild coalescing.

The pool's logic is tested through its reader seam on engines in memory (``engine``,
``source="memory"``); the tests marked ``over_http`` run again against real HTTP servers,
read on the loop and by the worker process. Freshness runs on an injected FakeClock, so
nothing here sleeps through a stale_after; the short real waits are the scrape interval
(10 ms) doing its work.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest
from fakes import FakeClock, FakeVLLM, MemoryEngine, MemoryReader, vllm_page

from epick import telemetry
from epick.pool import SCRAPE_IN, EndpointSpec, Pool, reader_for

INTERVAL_MS = 10

#: How the pool under test reads: ``DEFAULTS["reader"]()`` is a new reader (set by
#: ``engine`` below for the test's source).
DEFAULTS: dict[str, object] = {}

#: A test about reading itself also runs over real HTTP, on the loop and in the worker.
over_http = pytest.mark.parametrize("source", ["memory", *SCRAPE_IN], indirect=True)


@pytest.fixture(params=["memory"])
def source(request) -> str:
    return request.param


@pytest.fixture
def engine(source, fake_vllm, monkeypatch):
    """Factory of engines to scrape: ``engine(page=None)``, in memory or a real server."""
    if source == "memory":
        reader = MemoryReader()
        monkeypatch.setitem(DEFAULTS, "reader", lambda: reader)
        return reader.engine
    monkeypatch.setitem(DEFAULTS, "reader", lambda: reader_for(source))
    return fake_vllm


Engine = FakeVLLM | MemoryEngine


def make_pool(servers: list[Engine], clock: FakeClock, **kw) -> Pool:
    if "reader" not in kw:
        kw["reader"] = DEFAULTS["reader"]()
    kw.setdefault("scrape_interval_ms", INTERVAL_MS)
    kw.setdefault("stale_after_ms", 1000)
    kw.setdefault("timeout_ms", 2000)
    return Pool([EndpointSpec(address=s.address) for s in servers], clock=clock, **kw)


@asynccontextmanager
async def running(pool: Pool) -> AsyncIterator[Pool]:
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):  # a broken started() must fail the test, not hang it
            await tg.start(pool.run)
        try:
            yield pool
        finally:
            tg.cancel_scope.cancel()


async def eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


async def hits_grow_by(server: Engine, n: int) -> None:
    target = server.hits + n
    await eventually(lambda: server.hits >= target)


def status_of(pool: Pool, server: Engine):
    return next(s for s in pool.status() if s.address == server.address)


def metrics_of(pool: Pool, server: Engine):
    view = pool.view
    for metrics, info in zip(view.snapshot.endpoints, view.info):
        if metrics.address == server.address:
            return metrics, info
    return None


def sample(name: str, **labels: str) -> float:
    return telemetry.REGISTRY.get_sample_value(name, labels) or 0.0


# --- readiness ----------------------------------------------------------------------


async def test_snapshot_is_empty_and_pool_not_ready_before_run(engine, fake_clock):
    pool = make_pool([engine()], fake_clock)
    assert pool.view.version == 0
    assert pool.view.snapshot.endpoints == ()
    assert not pool.ready()


@over_http
async def test_started_comes_after_the_first_round_with_its_metrics_published(
    engine, fake_clock
):
    server = engine(vllm_page(waiting=3, running=2, kv=0.5))
    pool = make_pool([server], fake_clock)
    async with running(pool):
        assert server.hits >= 1
        view = pool.view
        assert view.version == 1
        assert [(m.address, m.waiting, m.running, m.kv_usage) for m in view.snapshot.endpoints] == [
            (server.address, 3, 2, 0.5)
        ]
        assert view.info[0].fresh
        assert pool.ready()


@over_http
async def test_first_round_waits_for_a_hung_endpoint_only_as_long_as_the_timeout(
    engine, fake_clock
):
    good, hung = engine(), engine()
    hung.hang = True
    before = sample("epick_scrape_errors_total", endpoint=hung.address, reason="timeout")
    pool = make_pool([good, hung], fake_clock, timeout_ms=200)
    # The hung endpoint never answers: a start that waited for it would never end. The
    # bound is generous because starting a scrape worker process took over 2 s at load ~30.
    with anyio.fail_after(20):
        async with running(pool):
            # started() came after the hung fetch gave up, not before.
            hung_status = status_of(pool, hung)
            assert hung_status.failures == 1
            assert hung_status.last_error == f"{hung.url}: no answer within 200 ms"
            assert hung_status.last_success_age_ms is None
            assert [m.address for m in pool.view.snapshot.endpoints] == [good.address]
    after = sample("epick_scrape_errors_total", endpoint=hung.address, reason="timeout")
    assert after == before + 1


async def test_a_hung_endpoint_does_not_hold_up_the_others(engine, fake_clock):
    good, slow = engine(vllm_page(waiting=1)), engine()
    pool = make_pool([good, slow], fake_clock, timeout_ms=30_000)
    async with running(pool):
        slow.hang = True
        await hits_grow_by(slow, 1)  # a fetch of `slow` is now stuck for up to 30 s
        good.page = vllm_page(waiting=7)
        await eventually(lambda: metrics_of(pool, good)[0].waiting == 7, timeout=20.0)
        # good's new page arrived while slow's fetch was still stuck, not after it
        assert status_of(pool, slow).failures == 0 and slow.hang
        slow.hang = False


async def test_a_round_spreads_its_wake_ups_over_half_the_interval(engine, fake_clock):
    """After the first round, a round's scrapes do not all start at once: they go out a
    group at a time over half the interval, so their answers reach the loop spread out
    (a pick never waits behind the whole round). Only lower bounds on time: a busy
    machine can only spread them more."""
    from epick.pool.pool import SPREAD, SPREAD_SLOTS

    servers = [engine() for _ in range(16)]
    done: list[tuple[str, float]] = []
    interval_ms = 400
    pool = make_pool(servers, fake_clock, scrape_interval_ms=interval_ms,
                     on_scrape=lambda address: done.append((address, anyio.current_time())))
    async with running(pool):
        await eventually(lambda: len(done) >= 16 * 3, timeout=20.0)
    rounds = [done[k * 16:(k + 1) * 16] for k in range(3)]
    assert all(len({a for a, _ in r}) == 16 for r in rounds)  # everyone, once a round
    first = max(t for _, t in rounds[0]) - min(t for _, t in rounds[0])
    step = interval_ms / 1000 * SPREAD / SPREAD_SLOTS
    for later in rounds[1:]:
        span = max(t for _, t in later) - min(t for _, t in later)
        # The first and the last of 8 groups start 7 steps apart.
        assert span >= 0.8 * (SPREAD_SLOTS - 1) * step, (span, first)


# --- rebuilds -----------------------------------------------------------------------


async def test_snapshot_is_not_rebuilt_while_nothing_changes(engine, fake_clock):
    server = engine(vllm_page(waiting=3))
    pool = make_pool([server], fake_clock)
    async with running(pool):
        first = pool.view
        rebuilds = sample("epick_snapshot_rebuilds_total")
        await hits_grow_by(server, 10)
        assert pool.view is first
        assert sample("epick_snapshot_rebuilds_total") == rebuilds


async def test_a_changed_value_rebuilds_the_snapshot_once(engine, fake_clock):
    server = engine(vllm_page(waiting=3))
    pool = make_pool([server], fake_clock)
    async with running(pool):
        version = pool.view.version
        server.page = vllm_page(waiting=9)
        await eventually(lambda: pool.view.snapshot.endpoints[0].waiting == 9)
        await hits_grow_by(server, 5)
        assert pool.view.version == version + 1


async def test_snapshot_keeps_spec_order_and_stamps_wall_clock_ms(engine, fake_clock):
    servers = [engine(vllm_page(waiting=i)) for i in range(3)]
    pool = make_pool(servers, fake_clock, wall_clock=lambda: 1_700_000_000.1234)
    async with running(pool):
        view = pool.view
        assert [m.address for m in view.snapshot.endpoints] == [s.address for s in servers]
        assert [m.waiting for m in view.snapshot.endpoints] == [0, 1, 2]
        assert view.snapshot.timestamp_ms == 1_700_000_000_123
        assert sample("epick_snapshot_endpoints") == 3


# --- failures and staleness -----------------------------------------------------------


@pytest.mark.parametrize(
    ("breakage", "reason", "message"),
    [
        ("garbage", "missing-metric",
         "missing vllm:num_requests_waiting (no known metric on the page: wrong engine or URL?)"),
        ("http-500", "http-status", "HTTP 500 Internal Server Error"),
    ],
    ids=["garbage-page", "http-500"],
)
@over_http
async def test_a_failing_endpoint_keeps_its_last_values_until_stale_after(
    engine, fake_clock, breakage, reason, message
):
    server = engine(vllm_page(waiting=4, kv=0.25))
    errors = sample("epick_scrape_errors_total", endpoint=server.address, reason=reason)
    pool = make_pool([server], fake_clock, stale_after_ms=1000)
    async with running(pool):
        good = pool.view.snapshot.endpoints[0]
        if breakage == "garbage":
            server.page = "<html><body>oops</body></html>"
        else:
            server.status = 500
        await eventually(lambda: status_of(pool, server).failures >= 1)
        assert status_of(pool, server).last_error == f"{server.url}: {message}"
        assert sample("epick_scrape_errors_total", endpoint=server.address, reason=reason) > errors

        fake_clock.advance(0.999)  # not yet older than stale_after
        await hits_grow_by(server, 1)
        assert pool.view.snapshot.endpoints == (good,)
        assert pool.view.info[0].fresh

        fake_clock.advance(0.002)  # now it is: the next tick flips it, no scrape needed
        await eventually(lambda: not pool.view.info[0].fresh)
        assert pool.view.snapshot.endpoints == (good,)  # last good values kept
        assert not pool.ready()
        assert sample("epick_endpoint_fresh", endpoint=server.address) == 0


async def test_recovery_after_stale_makes_the_endpoint_fresh_again(engine, fake_clock):
    server = engine(vllm_page(waiting=4))
    pool = make_pool([server], fake_clock, stale_after_ms=1000)
    async with running(pool):
        server.status = 500
        await eventually(lambda: status_of(pool, server).failures >= 1)
        fake_clock.advance(2)
        await eventually(lambda: not pool.view.info[0].fresh)
        server.status, server.page = 200, vllm_page(waiting=5)
        await eventually(lambda: pool.view.info[0].fresh, timeout=5)  # within the back-off
        assert pool.view.snapshot.endpoints[0].waiting == 5
        assert status_of(pool, server).failures == 0


@over_http
async def test_a_killed_server_goes_stale_while_the_others_stay_fresh(engine, fake_clock):
    alive, killed = engine(), engine()
    pool = make_pool([alive, killed], fake_clock, stale_after_ms=1000)
    async with running(pool):
        killed.stop()
        await eventually(lambda: status_of(pool, killed).failures >= 1)
        assert status_of(pool, killed).last_error.startswith(f"{killed.url}: ")
        fake_clock.advance(1.5)
        await eventually(lambda: not metrics_of(pool, killed)[1].fresh)
        await eventually(lambda: metrics_of(pool, alive)[1].fresh)
        assert pool.ready()
        assert sample("epick_scrape_errors_total", endpoint=killed.address, reason="network") >= 1
        assert [s.fresh for s in pool.status()] == [True, False]


async def test_an_endpoint_that_never_answered_is_not_in_the_snapshot(engine, fake_clock):
    alive, dead = engine(), engine()
    dead.stop()
    pool = make_pool([alive, dead], fake_clock)
    async with running(pool):
        assert [m.address for m in pool.view.snapshot.endpoints] == [alive.address]
        status = status_of(pool, dead)
        assert (status.fresh, status.last_success_age_ms, status.failures) == (False, None, 1)


async def test_failures_back_off_and_are_logged_with_endpoint_and_delay(
    engine, fake_clock, caplog
):
    caplog.set_level(logging.INFO, logger="epick.pool")
    server = engine()
    pool = make_pool([server], fake_clock)
    async with running(pool):
        server.status = 500
        hits = server.hits
        await anyio.sleep(0.4)  # 40 intervals: without back-off ~40 requests
        # Back-off doubles from 10 ms: retries at +10, +20, +40, +80, +160 ms (~5-6 in 0.4 s).
        assert server.hits - hits <= 8
    records = [r for r in caplog.records if r.name == "epick.pool"]
    messages = [r.getMessage() for r in records]
    url = server.url
    assert messages[0] == (
        f"scrape of {server.address} failed (1 in a row): "
        f"{url}: HTTP 500 Internal Server Error; retrying in 10 ms"
    )
    assert messages[1] == (
        f"scrape of {server.address} failed (2 in a row): "
        f"{url}: HTTP 500 Internal Server Error; retrying in 20 ms"
    )
    assert [r.levelno for r in records[:2]] == [logging.WARNING, logging.INFO]


# --- membership ---------------------------------------------------------------------


async def test_set_endpoints_adds_without_disturbing_existing_ones(engine, fake_clock):
    a, b = engine(vllm_page(waiting=1)), engine(vllm_page(waiting=2))
    pool = make_pool([a], fake_clock)
    async with running(pool):
        a_metrics = pool.view.snapshot.endpoints[0]
        pool.set_endpoints([EndpointSpec(address=a.address), EndpointSpec(address=b.address)])
        await eventually(lambda: len(pool.view.snapshot.endpoints) == 2)
        endpoints = pool.view.snapshot.endpoints
        assert endpoints[0] is a_metrics  # unchanged endpoint kept its state
        assert (endpoints[1].address, endpoints[1].waiting) == (b.address, 2)


@over_http
async def test_set_endpoints_removes_at_once_and_stops_scraping(engine, fake_clock):
    a, b = engine(), engine()
    pool = make_pool([a, b], fake_clock)
    async with running(pool):
        version = pool.view.version
        pool.set_endpoints([EndpointSpec(address=b.address)])
        # Visible right away, not after the next round.
        assert [m.address for m in pool.view.snapshot.endpoints] == [b.address]
        assert pool.view.version == version + 1
        assert [s.address for s in pool.status()] == [b.address]
        assert telemetry.REGISTRY.get_sample_value(
            "epick_endpoint_fresh", {"endpoint": a.address}
        ) is None
        await anyio.sleep(0.02)  # let an in-flight fetch of `a` land (it must be ignored)
        hits = a.hits
        await hits_grow_by(b, 5)
        assert a.hits == hits
        assert [m.address for m in pool.view.snapshot.endpoints] == [b.address]


async def test_the_pool_owns_its_readers_run_and_tells_it_who_left(fake_clock):
    reader = MemoryReader()
    a, b = reader.engine(), reader.engine()
    pool = make_pool([a, b], fake_clock, reader=reader)
    assert pool.reader is reader and not reader.running
    async with running(pool):
        assert reader.running
        pool.set_endpoints([EndpointSpec(address=b.address)])
        assert reader.forgotten == [a.address]
    assert not reader.running  # Pool.run ended: so did the reader's


async def test_set_endpoints_with_new_labels_keeps_metrics_and_republishes(
    engine, fake_clock
):
    server = engine(vllm_page(waiting=6))
    pool = make_pool([server], fake_clock)
    async with running(pool):
        before = pool.view
        pool.set_endpoints(
            [EndpointSpec(address=server.address, labels={"zone": "b"}, models=["llama"])]
        )
        after = pool.view
        assert after.version == before.version + 1
        assert after.snapshot.endpoints == before.snapshot.endpoints
        assert after.info[0].labels == (("zone", "b"),)
        assert after.info[0].models == frozenset({"llama"})


async def test_set_endpoints_before_run_is_used_by_run(engine, fake_clock):
    a, b = engine(), engine()
    pool = make_pool([a], fake_clock)
    pool.set_endpoints([EndpointSpec(address=b.address)])
    async with running(pool):
        assert [m.address for m in pool.view.snapshot.endpoints] == [b.address]
    assert a.hits == 0


def test_duplicate_addresses_are_refused_and_leave_the_pool_unchanged(fake_clock):
    pool = Pool([EndpointSpec(address="a:1")], clock=fake_clock)
    with pytest.raises(ValueError) as info:
        pool.set_endpoints(
            [EndpointSpec(address="b:1"), EndpointSpec(address="c:1"), EndpointSpec(address="b:1")]
        )
    assert str(info.value) == "duplicate endpoint address 'b:1' (endpoints[0] and endpoints[2])"
    assert [s.address for s in pool.status()] == ["a:1"]


@pytest.mark.parametrize("name", ["scrape_interval_ms", "stale_after_ms", "timeout_ms"])
def test_pool_timings_must_be_positive(name):
    with pytest.raises(ValueError) as info:
        Pool([], **{name: 0})
    assert str(info.value) == f"Pool {name} must be a number > 0, got 0"


async def test_run_twice_at_once_is_refused(engine, fake_clock):
    pool = make_pool([engine()], fake_clock)
    async with running(pool):
        with pytest.raises(RuntimeError, match="Pool.run is already running"):
            await pool.run()


# --- engines and URLs -------------------------------------------------------------------


@over_http
async def test_the_spec_engine_and_metrics_url_are_used_and_the_address_is_the_identity(
    engine, fake_clock
):
    sglang = engine(
        "sglang:num_queue_reqs 4\nsglang:num_running_reqs 1\nsglang:token_usage 0.5\n"
    )
    spec = EndpointSpec(address="pod-a:30000", metrics_url=sglang.url, engine="sglang")
    pool = make_pool([], fake_clock)
    pool.set_endpoints([spec])
    async with running(pool):
        (metrics,) = pool.view.snapshot.endpoints
        assert (metrics.address, metrics.waiting, metrics.running, metrics.kv_usage) == (
            "pod-a:30000", 4, 1, 0.5
        )
        assert sample("epick_endpoint_fresh", endpoint="pod-a:30000") == 1


async def test_an_endpoint_hung_for_good_still_goes_stale_on_the_next_tick(
    engine, fake_clock
):
    server = engine()
    pool = make_pool([server], fake_clock, stale_after_ms=1000, timeout_ms=5000,
                     stale_grace_ms=0)
    async with running(pool):
        server.hang = True
        await hits_grow_by(server, 1)  # no scrape will finish for 5 s
        fake_clock.advance(1.5)
        await eventually(lambda: not pool.view.info[0].fresh, timeout=1.0)
        assert status_of(pool, server).failures == 0  # nothing failed yet: it just hangs


async def test_when_none_is_fresh_a_late_endpoint_is_the_last_resort_for_the_grace_only(
    engine, fake_clock
):
    """Issue 32: two real replicas busy generating answered /metrics late, both went
    stale and every pick was refused while both were serving. A page that is late (still
    coming, or timed out) is a busy engine: while no endpoint is fresh it stays usable on
    its last metrics for stale_grace_ms, and then goes stale all the same."""
    server = engine()
    pool = make_pool([server], fake_clock, stale_after_ms=1000, timeout_ms=5000,
                     stale_grace_ms=2000)
    async with running(pool):
        server.hang = True
        await hits_grow_by(server, 1)  # its page is late from now on
        fake_clock.advance(1.5)  # past stale_after, within the grace
        await anyio.sleep(5 * INTERVAL_MS / 1000)
        await eventually(lambda: sample("epick_pool_last_resort_endpoints") == 1, timeout=2.0)
        assert pool.view.info[0].fresh and pool.ready()
        assert status_of(pool, server).fresh is False  # the status tells the truth
        assert sample("epick_endpoint_fresh", endpoint=server.address) == 0
        fake_clock.advance(1.6)  # past stale_after + grace
        await eventually(lambda: not pool.view.info[0].fresh, timeout=2.0)
        assert not pool.ready()
        assert sample("epick_pool_last_resort_endpoints") == 0
        server.hang = False


async def test_a_refused_endpoint_gets_no_grace(engine, fake_clock):
    """A connection refused (or an error page) is not a busy engine: it goes stale on
    time even when it was the last endpoint."""
    server = engine()
    pool = make_pool([server], fake_clock, stale_after_ms=1000, stale_grace_ms=5000)
    async with running(pool):
        await eventually(lambda: bool(pool.view.info) and pool.view.info[0].fresh)
        server.stop()
        await eventually(lambda: status_of(pool, server).failures >= 1)
        fake_clock.advance(1.5)
        await eventually(lambda: not pool.view.info[0].fresh, timeout=2.0)


async def test_a_late_endpoint_is_not_used_while_another_is_fresh(engine, fake_clock):
    good, late = engine(), engine()
    pool = make_pool([good, late], fake_clock, stale_after_ms=1000, timeout_ms=5000,
                     stale_grace_ms=5000)
    async with running(pool):
        late.hang = True
        await hits_grow_by(late, 1)
        fake_clock.advance(1.5)
        # good keeps answering, so it is fresh on the next round; late is stale.
        await eventually(lambda: [i.fresh for i in pool.view.info] == [True, False], timeout=2.0)
        assert sample("epick_pool_last_resort_endpoints") == 0
        late.hang = False


async def test_an_endpoint_that_never_answered_is_exported_as_not_fresh(engine, fake_clock):
    dead = engine()
    dead.stop()
    # An earlier test's server may have had this port: its series are not ours.
    telemetry.forget_endpoint(dead.address)
    pool = make_pool([dead], fake_clock)
    async with running(pool):
        assert sample("epick_endpoint_fresh", endpoint=dead.address) == 0
        assert telemetry.REGISTRY.get_sample_value(
            "epick_endpoint_scrape_age_seconds", {"endpoint": dead.address}
        ) is None
