"""The pool's reader seam: what a scrape loop reads an endpoint through.

Like httpx's transports, the reader is given to :class:`~epick.pool.Pool`, which never
picks one itself: :class:`~epick.pool.fetch.HttpReader` (aiohttp on the pool's event
loop, the default), :class:`~epick.pool.worker.ScrapeWorker` (the same reads in a child
process) or any object with these four methods — tests read from memory, with no
socket (``MemoryReader`` in tests/fakes.py). :func:`reader_for` builds the one ``[pool] scrape_in``
names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from anyio.abc import TaskStatus

from epick import abi
from epick.pool.fetch import HttpReader, Listing
from epick.pool.parse import ScrapedPage
from epick.pool.worker import ScrapeWorker

__all__ = ["Reader", "SCRAPE_IN", "reader_for"]

#: Where pages are fetched and parsed: on the pool's event loop, or in a child process
#: (:mod:`epick.pool.worker`) so that parsing never holds up a pick.
SCRAPE_IN = ("loop", "process")


class Reader(Protocol):
    """Reads endpoints for a pool. Used from the pool's event loop only."""

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        """Hold what reading needs (sessions, a child process) until cancelled.

        :meth:`Pool.run <epick.pool.Pool.run>` starts it in its own task group before
        the first read and cancels it after the last."""
        ...

    async def read_page(self, *, url: str, engine: str, address: str,
                        previous: abi.EndpointMetrics | None, timeout_s: float) -> ScrapedPage:
        """GET and parse ``url``; :class:`~epick.pool.ScrapeError` otherwise."""
        ...

    async def read_models(self, *, url: str, address: str, timeout_s: float) -> Listing:
        """Read ``/v1/models``; ``ValueError`` saying why when there is no listing."""
        ...

    def forget(self, address: str) -> None:
        """The endpoint left the pool: drop what is kept for it (best effort)."""
        ...


def reader_for(scrape_in: str = "loop", *, nice: int = 0, cpus: Sequence[int] = ()) -> Reader:
    """The reader ``[pool] scrape_in`` names: ``"loop"`` (:class:`HttpReader`) or
    ``"process"`` (:class:`ScrapeWorker` at niceness ``nice`` on ``cpus``)."""
    if scrape_in == "loop":
        return HttpReader()
    if scrape_in == "process":
        return ScrapeWorker(nice=nice, cpus=cpus)
    raise ValueError(f"scrape_in must be one of {SCRAPE_IN}, got {scrape_in!r}")
