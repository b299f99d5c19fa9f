"""Reading one endpoint: GET its metrics page and parse it, or read its ``/v1/models``.

These two coroutines are the whole of a scrape's I/O and CPU. The pool runs them on its
own event loop (``scrape_in = "loop"``) or hands them to a child process
(:mod:`epick.pool.worker`, ``scrape_in = "process"``) so that parsing never holds up a
pick; either way the same code reads the same page the same way.
"""

from __future__ import annotations

import ssl

import aiohttp
import anyio
import msgspec

from epick import abi
from epick.pool.errors import ScrapeError
from epick.pool.parse import ScrapedPage, parse_page

__all__ = ["Listing", "LocalReader", "new_session", "read_page", "read_models"]


class _Model(msgspec.Struct):
    id: str
    parent: str | None = None


class _ModelList(msgspec.Struct):
    """The part of an OpenAI ``/v1/models`` answer the pool reads."""

    data: list[_Model]


class Listing(msgspec.Struct, array_like=True, frozen=True):
    """What ``/v1/models`` says an endpoint serves: base models and adapters."""

    models: frozenset[str]
    adapters: frozenset[str]


def new_session(timeout_s: float, tls: ssl.SSLContext | None) -> aiohttp.ClientSession:
    """One endpoint's session: one kept-alive connection, environment proxies ignored."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=1, ssl=tls or True),
        trust_env=False,
        auto_decompress=True,
    )


async def read_page(
    client: aiohttp.ClientSession,
    *,
    url: str,
    engine: str,
    address: str,
    previous: abi.EndpointMetrics | None,
    timeout_s: float,
) -> ScrapedPage:
    """GET ``url`` and parse it; :class:`ScrapeError` (timeout, network, http-status, or
    any of :func:`~epick.pool.parse.parse_page`'s) otherwise."""
    try:
        with anyio.fail_after(timeout_s):
            async with client.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise ScrapeError(
                        url, f"HTTP {response.status} {response.reason or ''}".rstrip(),
                        kind="http-status",
                    )
                text = await response.text(errors="replace")
    except TimeoutError as exc:  # anyio's deadline and aiohttp's both raise it
        raise ScrapeError(
            url, f"no answer within {timeout_s * 1000:g} ms", kind="timeout"
        ) from exc
    except aiohttp.ClientError as exc:
        detail = str(exc) or type(exc).__name__
        raise ScrapeError(url, detail, kind="network") from exc
    return parse_page(text, engine=engine, url=url, previous=previous, address=address)


async def read_models(client: aiohttp.ClientSession, *, url: str, timeout_s: float) -> Listing:
    """Read ``/v1/models``: base models (no ``parent``) and adapters (with one).

    Raises ``ValueError`` saying why when there is no usable listing.
    """
    try:
        with anyio.fail_after(timeout_s):
            async with client.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                body = msgspec.json.decode(await response.read(), type=_ModelList)
    except TimeoutError as exc:
        raise ValueError(f"no answer within {timeout_s * 1000:g} ms") from exc
    except (aiohttp.ClientError, msgspec.DecodeError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc
    return Listing(
        models=frozenset(m.id for m in body.data if not m.parent),
        adapters=frozenset(m.id for m in body.data if m.parent),
    )


class LocalReader:
    """Reads on the caller's event loop through one endpoint's session.

    :class:`epick.pool.worker.ScrapeWorker` has the same two methods and reads in a
    child process; the pool takes either.
    """

    def __init__(self, client: aiohttp.ClientSession) -> None:
        self._client = client

    async def read_page(
        self, *, url: str, engine: str, address: str,
        previous: abi.EndpointMetrics | None, timeout_s: float,
    ) -> ScrapedPage:
        return await read_page(self._client, url=url, engine=engine, address=address,
                               previous=previous, timeout_s=timeout_s)

    async def read_models(self, *, url: str, address: str, timeout_s: float) -> Listing:
        return await read_models(self._client, url=url, timeout_s=timeout_s)
