"""Simulated vLLM replicas (``epick.sim``) on given loopback hosts, served from a thread
of their own (epick's service runs in another: tests/epick_service.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager

import anyio

from epick.sim.server import serve_fleet

__all__ = ["replicas"]


@contextmanager
def replicas(places: list[tuple[str, int]]) -> Iterator[list[str]]:
    """One simulated replica at each ``(host, port)`` (port 0: a free one); yields their
    ``host:port`` addresses and stops them all on exit."""
    box: dict = {}
    ready = threading.Event()

    async def main() -> None:
        try:
            async with AsyncExitStack() as stack:
                addresses = []
                for host, port in places:
                    fleet = await stack.enter_async_context(
                        serve_fleet(1, host=host, base_port=port))
                    addresses += fleet.addresses
                box["addresses"], box["loop"] = addresses, asyncio.get_running_loop()
                box["stop"] = stop = anyio.Event()
                ready.set()
                await stop.wait()
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            raise

    thread = threading.Thread(target=lambda: anyio.run(main, backend="asyncio"),
                              name="sim-replicas")
    thread.start()
    ready.wait(timeout=30)
    if "error" in box:
        thread.join(timeout=10)
        raise box["error"]
    try:
        yield box["addresses"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(timeout=15)
