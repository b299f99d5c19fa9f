"""A Kubernetes API emulator (kmock's ``KubernetesEmulator``: LIST, WATCH, GET, POST,
PATCH, DELETE of any resource, held in memory) in a thread of its own, for the
InferencePool source's emulated tests. Objects are shaped like the real API's
(InferencePool ``inference.networking.k8s.io/v1``, Pod ``v1``): see :func:`pool` and
:func:`pod`.

epick talks to ``url``, a TCP relay in front of the emulator; the test writes through
``admin`` (the emulator itself). :meth:`KubeEmulator.break_watches` closes the relay
(every watch through it breaks, new connections are refused) and :meth:`resume` opens it
again on the same port: what the test changes in between reaches epick only by a resync.

What the emulator does not do (so the tests do not rely on it): filter by
``labelSelector`` / ``fieldSelector`` (epick filters again itself), keep
``resourceVersion`` (a watch replays every object as ADDED), end a watch after
``timeoutSeconds``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import kmock
from kmock._internal import apps

__all__ = ["KubeEmulator", "emulator", "pool", "pod", "POOLS", "PODS"]

POOLS = "inference.networking.k8s.io/v1/inferencepools"
PODS = "v1/pods"


def pool(name: str, *, labels: dict[str, str], ports: list[int], namespace: str = "default",
         picker: str = "epick", picker_port: int = 9002) -> dict:
    """An InferencePool v1 as the API server returns it."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker,
                                  "portNumber": picker_port, "failureMode": "FailClose"},
        },
    }


def pod(name: str, *, labels: dict[str, str], ip: str = "", ready: bool = False,
        namespace: str = "default") -> dict:
    """A Pod v1: Pending without an IP, Running (Ready or not) with one."""
    status: dict = {"phase": "Pending", "conditions": []}
    if ip:
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                  "conditions": [{"type": "Initialized", "status": "True"},
                                 {"type": "Ready", "status": "True" if ready else "False"},
                                 {"type": "ContainersReady",
                                  "status": "True" if ready else "False"}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": status,
    }


def _path(resource: str, namespace: str, name: str = "") -> str:
    group_version, plural = resource.rsplit("/", 1)
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


class KubeEmulator:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler = None
        self._relay: asyncio.Server | None = None
        self._links: list = []
        self._upstream = 0
        self._gone: list[str] = []
        self.port = 0
        self.admin = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- writes (through the admin server, so every watch sees the event) ---------------

    def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.admin + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def create(self, resource: str, obj: dict) -> dict:
        return self._send("POST", _path(resource, obj["metadata"]["namespace"]), obj)

    def patch(self, resource: str, name: str, patch: dict, namespace: str = "default") -> dict:
        return self._send("PATCH", _path(resource, namespace, name), patch)

    def delete(self, resource: str, name: str, namespace: str = "default") -> dict:
        return self._send("DELETE", _path(resource, namespace, name))

    def set_ready(self, name: str, ip: str, ready: bool = True,
                  namespace: str = "default") -> dict:
        state = "True" if ready else "False"
        return self.patch(PODS, name, {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Initialized", "status": "True"},
                           {"type": "Ready", "status": state},
                           {"type": "ContainersReady", "status": state}]}}, namespace)

    def expire_next_watch(self, plural: str) -> None:
        """The next WATCH of ``plural`` is answered by an ERROR event, ``410 Gone`` (the
        resourceVersion asked for is too old), as a real API server says it."""
        self._gone.append(plural)

    def authorizations(self) -> set[str]:
        """The ``Authorization`` headers of every request the emulator has seen."""
        return {r.headers.get("Authorization", "") for r in list(self._handler)}

    # -- breaking the watches -----------------------------------------------------------

    def _run(self, coro):
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _relay_open(self, upstream_port: int) -> None:
        async def pipe(reader, writer):
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def accept(reader, writer):
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
            except OSError:
                writer.close()
                return
            self._links += [writer, up_writer]
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        self._upstream = upstream_port
        self._relay = await asyncio.start_server(accept, "127.0.0.1", self.port)
        self.port = self._relay.sockets[0].getsockname()[1]

    async def _relay_close(self) -> None:
        self._relay.close()
        for writer in self._links:
            writer.close()
        self._links = []
        await self._relay.wait_closed()

    def break_watches(self) -> None:
        """Close the relay: epick's watches break, its connections are refused."""
        self._run(self._relay_close())

    def resume(self) -> None:
        """Open the relay again on the same port."""
        self._run(self._relay_open(self._upstream))


@contextmanager
def emulator() -> Iterator[KubeEmulator]:
    """A running emulator that knows InferencePools and Pods; stopped on exit."""
    emu = KubeEmulator()
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        try:
            async with kmock.KubernetesEmulator() as handler:
                handler.resources[POOLS] = kmock.ResourceInfo(kind="InferencePool",
                                                              namespaced=True)
                handler.resources[PODS] = kmock.ResourceInfo(kind="Pod", namespaced=True)

                def gone(req) -> bool:
                    plural = req.url.path.rsplit("/", 1)[-1]
                    return req.params.get("watch") == "true" and plural in emu._gone

                def expired(req) -> dict:
                    emu._gone.remove(req.url.path.rsplit("/", 1)[-1])
                    return {"type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "code": 410, "reason": "Expired",
                        "message": "too old resource version: 1 (2)"}}

                handler[gone] << expired
                emu._handler = handler
                async with apps.Server(handler) as admin:
                    emu.admin = str(admin.url).rstrip("/")
                    emu._loop = asyncio.get_running_loop()
                    await emu._relay_open(admin.port)
                    box["stop"] = stop = asyncio.Event()
                    ready.set()
                    await stop.wait()
                    await emu._relay_close()
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            raise

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="kube-emulator")
    thread.start()
    ready.wait(timeout=30)
    if "error" in box:
        thread.join(timeout=10)
        raise box["error"]
    try:
        yield emu
    finally:
        emu._loop.call_soon_threadsafe(box["stop"].set)
        thread.join(timeout=15)
