"""A real epick service on free ports, run in its own thread (and event loop).

Imported by the tests that need one (``from epick_service import running``).

The service owns its thread for its whole life — every WASM Store is touched only there —
and tests talk to it like a gateway does: over gRPC, from the test's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import grpc
import msgspec

from epick import config as cfg
from epick.api.gen.epick.v1 import admin_pb2_grpc, picker_pb2_grpc
from epick.service import Service

TOKEN = "s3cret"


def make_config(addresses, *, policies=("load", "prefix-cache", "lora-affinity"), tmp: Path,
                params: dict[str, dict] | None = None, **pool_kw) -> cfg.Config:
    """``params``: per policy name, the params it is configured with."""
    pool = {"scrape_interval_ms": 20, "stale_after_ms": 400, "timeout_ms": 300, **pool_kw,
            "endpoints": [{"address": a} for a in addresses]}
    return msgspec.convert({
        "version": 1,
        "server": {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"},
        "pool": pool,
        "policies": [{"name": p, "module": p, "params": (params or {}).get(p, {})}
                     for p in policies],
        "runtime": {"cache_dir": str(tmp / "cache")},
        "admin": {"listen": "127.0.0.1:0", "token": TOKEN},
    }, cfg.Config)


def config_text(addresses, *, policies=("load",), tmp: Path) -> str:
    lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"', 'metrics_listen = ""',
             "[admin]", 'listen = ""', "[pool]", "scrape_interval_ms = 20",
             "stale_after_ms = 400", "[runtime]", f'cache_dir = "{tmp / "cache"}"']
    for a in addresses:
        lines += ["[[pool.endpoints]]", f'address = "{a}"']
    for p in policies:
        lines += ["[[policies]]", f'name = "{p}"', f'module = "{p}"']
    return "\n".join(lines) + "\n"


class Running:
    def __init__(self, service: Service, loop: asyncio.AbstractEventLoop):
        self.service = service
        self.loop = loop
        self.target = f"127.0.0.1:{service.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.picker = picker_pb2_grpc.EndpointPickerStub(self.channel)
        self.admin_channel = (grpc.insecure_channel(f"127.0.0.1:{service.admin_port}")
                              if service.admin_port else None)
        self.admin = (admin_pb2_grpc.AdminStub(self.admin_channel)
                      if self.admin_channel else None)

    @property
    def ext_proc_port(self) -> int:
        return self.service.ext_proc_port

    def call(self, fn, *args, **kw):
        """Run ``fn`` on the service's own thread (where its Stores live) and wait."""
        async def run():
            return fn(*args, **kw)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def reload(self, timeout: float = 60) -> bool:
        """Re-read the config file as the watcher would (``Service.reload_async``) and wait."""
        return asyncio.run_coroutine_threadsafe(self.service.reload_async(),
                                                self.loop).result(timeout=timeout)


@contextmanager
def running(config: cfg.Config, *, config_path: Path | None = None) -> Iterator[Running]:
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        try:
            service = Service(config, config_path=config_path)
            async with anyio.create_task_group() as tg:
                await tg.start(service.run)
                box["service"], box["loop"] = service, asyncio.get_running_loop()
                ready.set()
        except BaseException as exc:  # surfaced to the test below
            box["error"] = exc
            ready.set()
            raise

    thread = threading.Thread(target=lambda: anyio.run(main, backend="asyncio"),
                              name="epick-service")
    thread.start()
    ready.wait(timeout=30)
    if "error" in box:
        thread.join(timeout=10)
        raise box["error"]
    r = Running(box["service"], box["loop"])
    try:
        yield r
    finally:
        r.channel.close()
        if r.admin_channel:
            r.admin_channel.close()
        r.loop.call_soon_threadsafe(r.service.stop)
        thread.join(timeout=15)
        assert not thread.is_alive(), "the service did not stop"


def spy_complete(svc: Running) -> list[dict]:
    """Record the keyword arguments of every ``scheduler.complete`` call from now on."""
    seen: list[dict] = []
    complete = svc.service.scheduler.complete

    def spy(**kw):
        seen.append(kw)
        return complete(**kw)

    svc.call(setattr, svc.service.scheduler, "complete", spy)
    return seen
