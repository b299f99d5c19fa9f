"""epick.pool.fetch: reading one endpoint over real HTTP (FakeVLLM), and HttpReader's
sessions (one per endpoint, owned by its run)."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from fakes import vllm_page

from epick.pool import ScrapeError
from epick.pool.fetch import HttpReader, Listing, new_session, parse_listing, read_models, read_page
from epick.pool.parse import parse_page

MODELS = msgspec.json.encode({"object": "list", "data": [
    {"id": "tiny-llama", "object": "model"},
    {"id": "sql-lora", "object": "model", "parent": "tiny-llama"},
]}).decode()


async def page_of(server, timeout_s: float = 5.0, previous=None):
    async with new_session(timeout_s, None) as client:
        return await read_page(client, url=server.url, engine="vllm", address=server.address,
                               previous=previous, timeout_s=timeout_s)


async def models_of(server, timeout_s: float = 5.0) -> Listing:
    async with new_session(timeout_s, None) as client:
        return await read_models(client, url=f"http://{server.address}/v1/models",
                                 timeout_s=timeout_s)


# --- read_page --------------------------------------------------------------------------


async def test_a_page_is_read_and_parsed_as_the_parser_alone_parses_it(fake_vllm):
    text = vllm_page(waiting=3, running=2, kv=0.5)
    server = fake_vllm(text)
    page = await page_of(server)
    assert page == parse_page(text, engine="vllm", url=server.url, previous=None,
                              address=server.address)
    assert (page.metrics.waiting, page.metrics.running, page.metrics.kv_usage) == (3, 2, 0.5)


async def test_an_http_error_status_is_an_http_status_error(fake_vllm):
    server = fake_vllm()
    server.status = 503
    with pytest.raises(ScrapeError) as err:
        await page_of(server)
    assert err.value.kind == "http-status"
    assert str(err.value) == f"{server.url}: HTTP 503 Service Unavailable"


async def test_no_answer_within_the_timeout_is_a_timeout_error(fake_vllm):
    server = fake_vllm()
    server.hang = True
    with anyio.fail_after(5), pytest.raises(ScrapeError) as err:
        await page_of(server, timeout_s=0.1)
    server.hang = False
    assert err.value.kind == "timeout"
    assert err.value.reason == "no answer within 100 ms"


async def test_a_refused_connection_is_a_network_error(fake_vllm):
    server = fake_vllm()
    server.stop()
    with pytest.raises(ScrapeError) as err:
        await page_of(server)
    assert err.value.kind == "network"
    assert str(err.value).startswith(f"{server.url}: ")


async def test_a_page_the_parser_refuses_fails_with_the_parsers_kind(fake_vllm):
    server = fake_vllm("<html>not metrics</html>")
    with pytest.raises(ScrapeError) as err:
        await page_of(server)
    assert err.value.kind == "missing-metric"


async def test_environment_proxies_are_ignored(fake_vllm, monkeypatch):
    """A scrape goes straight to the engine: an HTTP_PROXY meant for other traffic (here
    one that refuses every connection) must not capture it."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    server = fake_vllm(vllm_page(waiting=1))
    assert (await page_of(server)).metrics.waiting == 1


# --- read_models and parse_listing ------------------------------------------------------


def test_a_listing_splits_base_models_from_adapters_by_parent():
    assert parse_listing(MODELS.encode()) == Listing(
        models=frozenset({"tiny-llama"}), adapters=frozenset({"sql-lora"}))


def test_a_body_that_is_not_a_listing_is_a_decode_error():
    with pytest.raises(msgspec.DecodeError):
        parse_listing(b'{"data": "nope"}')


async def test_v1_models_is_read_into_a_listing(fake_vllm):
    server = fake_vllm()
    server.documents["/v1/models"] = MODELS
    assert await models_of(server) == Listing(models=frozenset({"tiny-llama"}),
                                              adapters=frozenset({"sql-lora"}))


@pytest.mark.parametrize(("breakage", "reason"), [
    ("not-json", "JSON"),
    ("http-500", "HTTP 500"),
    ("hang", "no answer within 100 ms"),
], ids=["not-json", "http-500", "hang"])
async def test_no_usable_listing_is_a_value_error_saying_why(fake_vllm, breakage, reason):
    server = fake_vllm("a metrics page, not JSON")  # /v1/models answers the page
    if breakage == "http-500":
        server.status = 500
    elif breakage == "hang":
        server.hang = True
    with anyio.fail_after(5), pytest.raises(ValueError, match=reason):
        await models_of(server, timeout_s=0.1)
    server.hang = False


# --- HttpReader ---------------------------------------------------------------------------


class CountingSessions:
    """HttpReader's session factory, counting what it opened."""

    def __init__(self) -> None:
        self.opened: list = []

    def __call__(self, timeout_s, tls):
        session = new_session(timeout_s, tls)
        self.opened.append(session)
        return session


async def read(reader: HttpReader, server):
    return await reader.read_page(url=server.url, engine="vllm", address=server.address,
                                  previous=None, timeout_s=5.0)


async def test_the_http_reader_keeps_one_session_per_endpoint_until_it_leaves(fake_vllm):
    a, b = fake_vllm(vllm_page(waiting=1)), fake_vllm(vllm_page(waiting=2))
    sessions = CountingSessions()
    reader = HttpReader(session=sessions)
    async with anyio.create_task_group() as tg:
        await tg.start(reader.run)
        assert (await read(reader, a)).metrics.waiting == 1
        assert (await read(reader, a)).metrics.waiting == 1
        assert (await read(reader, b)).metrics.waiting == 2
        assert len(sessions.opened) == 2  # a's second read reused a's session
        first_a = sessions.opened[0]
        reader.forget(a.address)
        await anyio.sleep(0.05)  # the close runs in the reader's task group
        assert first_a.closed and not sessions.opened[1].closed
        await read(reader, a)  # back in the pool: a new session
        assert len(sessions.opened) == 3
        tg.cancel_scope.cancel()
    assert all(s.closed for s in sessions.opened)  # the run's end closed the rest


async def test_the_http_reader_reads_only_while_it_runs(fake_vllm):
    server = fake_vllm()
    reader = HttpReader()
    with pytest.raises(RuntimeError, match="before run"):
        await read(reader, server)
    async with anyio.create_task_group() as tg:
        await tg.start(reader.run)
        with pytest.raises(RuntimeError, match="already running"):
            await reader.run()
        tg.cancel_scope.cancel()
    with pytest.raises(RuntimeError, match="after it ended"):
        await read(reader, server)
