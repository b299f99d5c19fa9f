"""Reading endpoints over HTTP (aiohttp): GET a metrics page and parse it, or read
``/v1/models``.

:class:`HttpReader` is the pool's default :class:`~epick.pool.reader.Reader`: one
kept-alive session per endpoint on the pool's own event loop (``scrape_in = "loop"``).
The scrape worker (:mod:`epick.pool.worker`, ``scrape_in = "process"``) runs the same
reader in a child process so that parsing never holds up a pick; either way the same
code reads the same page the same way.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

import aiohttp
import anyio
import anyio.abc
import anyio.to_thread
import msgspec
from anyio.abc import TaskStatus

from epick import abi
from epick.pool.errors import ScrapeError
from epick.pool.parse import ScrapedPage, parse_page

__all__ = ["Listing", "HttpReader", "new_session", "read_page", "read_models", "parse_listing"]


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


def parse_listing(body: bytes) -> Listing:
    """An OpenAI ``/v1/models`` answer: base models (no ``parent``) and adapters (with one).

    Raises ``msgspec.DecodeError`` when it is not such an answer.
    """
    data = msgspec.json.decode(body, type=_ModelList).data
    return Listing(
        models=frozenset(m.id for m in data if not m.parent),
        adapters=frozenset(m.id for m in data if m.parent),
    )


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
    """Read ``/v1/models`` (:func:`parse_listing`).

    Raises ``ValueError`` saying why when there is no usable listing.
    """
    try:
        with anyio.fail_after(timeout_s):
            async with client.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                return parse_listing(await response.read())
    except TimeoutError as exc:
        raise ValueError(f"no answer within {timeout_s * 1000:g} ms") from exc
    except (aiohttp.ClientError, msgspec.DecodeError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc


class HttpReader:
    """Reads over HTTP on the caller's event loop: one session (one kept-alive
    connection) per endpoint address, opened on its first read.

    :meth:`run` owns the sessions: they exist only while it runs (a read before it
    starts or after it ends is refused), and all close when it ends; :meth:`forget`
    closes one endpoint's at once. The TLS context (~16 ms to load the CA bundle) is
    made once per run and shared.
    """

    def __init__(self, *, session: Callable[[float, ssl.SSLContext | None],
                                           aiohttp.ClientSession] = new_session) -> None:
        self._new_session = session
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._tls: ssl.SSLContext | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the sessions until cancelled, then close them all."""
        if self._tg is not None:
            raise RuntimeError("HttpReader.run is already running")
        # Loading the CA bundle took up to 180 ms of the event loop at start on a busy
        # machine (issue 32): a thread's work, not the loop's.
        self._tls = await anyio.to_thread.run_sync(ssl.create_default_context)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            sessions, self._sessions = self._sessions, {}
            with anyio.CancelScope(shield=True):
                for client in sessions.values():
                    await client.close()

    def _session(self, address: str, timeout_s: float) -> aiohttp.ClientSession:
        if self._tg is None:
            raise RuntimeError("HttpReader: read before run() started (or after it ended)")
        client = self._sessions.get(address)
        if client is None or client.closed:
            client = self._sessions[address] = self._new_session(timeout_s, self._tls)
        return client

    async def read_page(
        self, *, url: str, engine: str, address: str,
        previous: abi.EndpointMetrics | None, timeout_s: float,
    ) -> ScrapedPage:
        return await read_page(self._session(address, timeout_s), url=url, engine=engine,
                               address=address, previous=previous, timeout_s=timeout_s)

    async def read_models(self, *, url: str, address: str, timeout_s: float) -> Listing:
        return await read_models(self._session(address, timeout_s), url=url,
                                 timeout_s=timeout_s)

    def forget(self, address: str) -> None:
        """Close the session of an endpoint that left the pool."""
        client = self._sessions.pop(address, None)
        if client is not None and self._tg is not None:
            self._tg.start_soon(client.close)
