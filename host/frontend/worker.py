"""One front-end worker process: ``python -m epick.frontend.worker`` (the service starts
it; its :class:`WorkerSpec` arrives as JSON on stdin).

It connects to the service's :class:`~epick.frontend.hub.Hub`, serves ext_proc (and the
HTTP front end, when on) on the shared ports (SO_REUSEPORT: the kernel spreads the
connections over the workers) with a :class:`~epick.frontend.remote.RemoteDecider`, says
hello, and runs until SIGTERM or until the service's process goes away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import msgspec

from epick.config import ExtProcConfig, OpenAIConfig

__all__ = ["WorkerSpec", "main"]

log = logging.getLogger("epick.frontend")


class WorkerSpec(msgspec.Struct):
    index: int
    hub: str
    """The hub's Unix socket."""
    ext_proc: ExtProcConfig | None
    """``listen`` is the resolved address (a concrete port: every worker binds it); None:
    ext_proc is off."""
    openai: OpenAIConfig
    log_level: int = logging.WARNING
    http_listen: str = ""
    """The HTTP front end's resolved address, or empty (off)."""
    http_max_body_bytes: int = 8 << 20


#: The health names the service sets (Service._set_health), said the same here.
def _health_names() -> tuple[str, ...]:
    from epick.api.ext_proc import SERVICE_NAME
    from epick.api.gen.epick.v1 import picker_pb2

    picker = picker_pb2.DESCRIPTOR.services_by_name["EndpointPicker"].full_name
    return ("", picker, SERVICE_NAME, "readiness")


async def serve(spec: WorkerSpec) -> None:
    from grpc_health.v1 import health_pb2
    from grpc_health.v1._async import HealthServicer

    from epick.frontend.remote import RemoteDecider, RemotePicker

    loop = asyncio.get_running_loop()
    health = HealthServicer()
    names = _health_names()
    pending: set[asyncio.Task] = set()

    async def set_health(serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in names:
            await health.set(name, status)
        await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)

    state = {"serving": False}

    def on_health(serving: bool) -> None:
        state["serving"] = serving
        task = loop.create_task(set_health(serving))
        pending.add(task)
        task.add_done_callback(pending.discard)

    await set_health(False)
    remote = RemoteDecider(on_health=on_health)
    await remote.connect(spec.hub)
    server = http = None
    if spec.ext_proc is not None:
        from epick.api.ext_proc import build_server  # xds protos load only when used

        server, _port = build_server(remote, spec.ext_proc, spec.openai, health=health,
                                     reuse_port=True)
        await server.start()
    if spec.http_listen:
        from epick.api.http import HttpApi, HttpServer

        http = HttpServer(HttpApi(RemotePicker(remote), healthy=lambda: state["serving"],
                                  openai=spec.openai,
                                  max_body_bytes=spec.http_max_body_bytes), reuse_port=True)
        http.bind(spec.http_listen)
        await http.start()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    remote.hello(spec.index, os.getpid())
    waits = [loop.create_task(stop.wait()), loop.create_task(remote.lost.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in (*waits, *pending):  # every task this worker started ends with it
            w.cancel()
        if remote.lost.is_set() and not stop.is_set():
            log.warning("front-end worker %d: the service's process is gone; stopping",
                        spec.index)
        if server is not None:
            await server.stop(grace=1.0)
        if http is not None:
            await http.stop()
        remote.close()


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s worker {spec.index} %(levelname)s %(name)s: "
                               "%(message)s")
    asyncio.run(serve(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
