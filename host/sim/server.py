"""The real-time driver: simulated replicas behind real HTTP servers (aiohttp).

Each replica gets its own listening socket and its own engine task, all in one process
and one event loop (anyio on the asyncio backend: aiohttp is asyncio-only). The engine
task sleeps until :meth:`Replica.next_event_time`, advances the replica to the loop's
clock and hands the tokens of each finished step to the requests' streams — so SSE
chunks are paced by the simulated steps and TTFT, queueing, adapter thrash and prefix
hits are felt by a real client.

Endpoints per replica (vLLM's):

* ``GET /metrics`` — the vLLM text page (:mod:`epick.sim.metrics`);
* ``POST /v1/completions``, ``POST /v1/chat/completions`` — OpenAI-compatible, with
  ``stream: true`` (SSE, one chunk per token, ``data: [DONE]`` last; a usage chunk when
  ``stream_options.include_usage``) or a whole JSON response. ``model`` is the base model
  or one of the adapter names (as vLLM serves ``--lora-modules``); another name is a 404
  ``The model `x` does not exist.``;
* ``GET /v1/models``, ``GET /health``;
* vLLM's dev-mode sleep endpoints: ``POST /sleep?level=N`` (0–2; default 1; every request
  in flight is aborted, as vLLM's default ``mode=abort`` does, and nothing is served until
  woken — the page shows ``engine_sleep_state``), ``POST /wake_up``, ``GET /is_sleeping``;
* ``GET /kv_event_sources`` — with ``serve_fleet(..., kv_events=True)`` each replica
  publishes vLLM's KV-cache events over ZMQ (:mod:`epick.sim.kv_publisher`: a PUB socket
  and a replay ROUTER on free ports, topic ``kv@host:port``) and this returns where, as
  vLLM does; ``{}`` with events off.

Every response carries ``x-epick-replica: host:port``. A client that disconnects
mid-stream has its request aborted in the engine (blocks and adapter slot released).

Usage::

    async with serve_fleet(3, adapters=adapter_names(4)) as fleet:
        fleet.addresses   # ("127.0.0.1:40123", ...)
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import msgspec
from aiohttp import web

from . import openai as oa
from .config import DEFAULT_CONFIG, ReplicaConfig
from .metrics import CONTENT_TYPE, MetricsPage
from .replica import EngineRequest, Replica, RequestRejected, Status

__all__ = ["ReplicaServer", "FleetServer", "serve_fleet", "REPLICA_HEADER"]

REPLICA_HEADER = "x-epick-replica"

_enc = msgspec.json.Encoder()

# Output text: one word per token, cycling (the sim generates no real language).
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "sed", "do", "tempor")


def _token_text(i: int) -> str:
    return " " + _WORDS[i % len(_WORDS)]


class _Flow:
    """A request's link between the engine task and its HTTP handler."""

    __slots__ = ("send", "recv")

    def __init__(self) -> None:
        self.send, self.recv = anyio.create_memory_object_stream[int](math.inf)


def _error(status: int, kind: str, message: str) -> web.Response:
    body = oa.ErrorBody(error=oa.ErrorInfo(message=message, type=kind, code=status))
    return web.Response(status=status, body=_enc.encode(body), content_type="application/json")


class ReplicaServer:
    """One replica's engine, clock and aiohttp application."""

    def __init__(
        self, config: ReplicaConfig, adapters: Sequence[str], *, t0: float, wall0: float,
        kv_events: bool = False,
    ) -> None:
        self.config = config
        self.publisher = None
        """The replica's :class:`~epick.sim.kv_publisher.ZmqKvPublisher` (KV events on,
        set by :func:`serve_fleet` once the address is known)."""
        self.replica = Replica(config, kv_events=self._publish if kv_events else None)
        self.adapters = frozenset(adapters)
        self.page = MetricsPage(self.replica, clock_origin=wall0)
        self.address = ""
        self._t0 = t0
        self._wake = anyio.Event()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/sleep", self._sleep)
        app.router.add_post("/wake_up", self._wake_up)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.router.add_get("/kv_event_sources", self._kv_event_sources)
        app.on_response_prepare.append(self._stamp)
        self.app = app

    def _publish(self, events: list) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    def now(self) -> float:
        """Engine time: seconds since the fleet started, on the event loop's clock."""
        return anyio.current_time() - self._t0

    async def run_engine(self) -> None:
        """Advance the replica in real time; never returns unless cancelled."""
        replica = self.replica
        while True:
            self._wake = anyio.Event()
            t = replica.next_event_time()
            if t is None:
                await self._wake.wait()
            else:
                delay = t - self.now()
                if delay > 0:
                    with anyio.move_on_after(delay):
                        await self._wake.wait()
            # One engine event at a time, the LoRA series recorded after each, as vLLM
            # records its stats after every step (a late wake-up must not skip a state).
            now = self.now()
            while (t := replica.next_event_time()) is not None and t <= now:
                out = replica.advance(t)
                self.page.record(t)
                for req, n, _at in out.emitted:
                    flow: _Flow = req.handle  # type: ignore[assignment]
                    flow.send.send_nowait(n)
                for req in out.finished:
                    req.handle.send.close()  # type: ignore[union-attr]

    # --- handlers --------------------------------------------------------------------

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REPLICA_HEADER] = self.address

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _sleep(self, request: web.Request) -> web.Response:
        raw = request.query.get("level", "1")
        if raw not in ("0", "1", "2"):
            return _error(400, "BadRequestError", f"level must be 0, 1 or 2, got {raw!r}")
        for req in self.replica.sleep(int(raw)):
            req.handle.send.close()  # type: ignore[union-attr]
        self._wake.set()
        return web.json_response({"status": "sleeping", "level": int(raw)})

    async def _wake_up(self, request: web.Request) -> web.Response:
        self.replica.wake_up()
        self._wake.set()
        return web.json_response({"status": "awake", "tags": None})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response(self.publisher.sources() if self.publisher else {})

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.replica.sleep_level is not None})

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": self.config.model, "object": "model", "created": created,
                 "owned_by": "vllm", "root": self.config.model, "parent": None}]
        data += [{"id": a, "object": "model", "created": created, "owned_by": "vllm",
                  "root": a, "parent": self.config.model} for a in sorted(self.adapters)]
        return web.Response(body=_enc.encode({"object": "list", "data": data}),
                            content_type="application/json")

    def _adapter_for(self, model: str) -> str | None:
        if model == self.config.model:
            return ""
        if model in self.adapters:
            return model
        return None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req, prompt, max_tokens = oa.decode_completion(await request.read())
        except oa.BadRequest as exc:
            return _error(400, "BadRequestError", str(exc))
        return await self._serve(
            request, "cmpl", req.model, prompt, max_tokens, req.stream,
            req.stream_options is not None and req.stream_options.include_usage,
            req.cache_salt, chat=False,
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            req, prompt, max_tokens = oa.decode_chat(await request.read())
        except oa.BadRequest as exc:
            return _error(400, "BadRequestError", str(exc))
        return await self._serve(
            request, "chatcmpl", req.model, prompt, max_tokens, req.stream,
            req.stream_options is not None and req.stream_options.include_usage,
            req.cache_salt, chat=True,
        )

    async def _serve(
        self, request: web.Request, prefix: str, model: str, prompt: str, max_tokens: int,
        stream: bool, include_usage: bool, cache_salt: str, *, chat: bool,
    ) -> web.StreamResponse:
        adapter = self._adapter_for(model)
        if adapter is None:
            return _error(404, "NotFoundError", f"The model `{model}` does not exist.")
        rid = f"{prefix}-{uuid.uuid4().hex}"
        flow = _Flow()
        try:
            ereq = self.replica.submit(
                rid, prompt, max_tokens, self.now(), adapter=adapter, cache_salt=cache_salt,
                handle=flow,
            )
        except RequestRejected as exc:
            return _error(400, "BadRequestError", str(exc))
        self._wake.set()
        reply = _Reply(rid, model, int(time.time()), chat, ereq)
        try:
            if stream:
                return await self._stream(request, flow, reply, include_usage)
            async with flow.recv:
                async for _ in flow.recv:
                    pass
            if ereq.status is Status.ABORTED:
                return _error(503, "ServiceUnavailableError",
                              f"request {rid} was aborted: the engine was put to sleep")
            return web.Response(body=reply.whole(), content_type="application/json")
        finally:
            if ereq.finished_at is None:
                self.replica.abort(rid)
                self._wake.set()

    async def _stream(
        self, request: web.Request, flow: _Flow, reply: _Reply, include_usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        })
        await resp.prepare(request)
        try:
            if reply.chat:
                await resp.write(reply.sse(reply.chat_role()))
            async with flow.recv:
                async for n in flow.recv:
                    await resp.write(reply.sse(reply.token_chunk(n)))
            if reply.req.status is Status.ABORTED:
                await resp.write_eof()  # cut short: the engine was put to sleep
                return resp
            if include_usage:
                await resp.write(reply.sse(reply.usage_chunk()))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away mid-stream: not an error of ours. The caller's
            # ``finally`` aborts the request, freeing its KV blocks and adapter slot.
            pass
        return resp


@dataclass(slots=True)
class _Reply:
    """Formats one request's chunks and final response."""

    id: str
    model: str
    created: int
    chat: bool
    req: EngineRequest

    @staticmethod
    def sse(chunk: msgspec.Struct) -> bytes:
        return b"data: " + _enc.encode(chunk) + b"\n\n"

    def _finish(self, n: int) -> str | None:
        return "length" if n >= self.req.max_tokens else None

    def _usage(self) -> oa.Usage:
        out = self.req.output_tokens
        return oa.Usage(prompt_tokens=self.req.prompt_tokens, completion_tokens=out,
                        total_tokens=self.req.prompt_tokens + out)

    def chat_role(self) -> oa.ChatChunk:
        return oa.ChatChunk(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
            choices=[oa.ChatChunkChoice(delta=oa.ChatDelta(role="assistant", content=""))])

    def token_chunk(self, n: int) -> msgspec.Struct:
        """The chunk carrying output token number ``n`` (1-based)."""
        text = _token_text(n - 1)
        if self.chat:
            return oa.ChatChunk(
                id=self.id, object="chat.completion.chunk", created=self.created,
                model=self.model, choices=[oa.ChatChunkChoice(
                    delta=oa.ChatDelta(content=text), finish_reason=self._finish(n))])
        return oa.Completion(
            id=self.id, object="text_completion", created=self.created, model=self.model,
            choices=[oa.CompletionChoice(text=text, finish_reason=self._finish(n))])

    def usage_chunk(self) -> msgspec.Struct:
        kind = oa.ChatChunk if self.chat else oa.Completion
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return kind(id=self.id, object=obj, created=self.created, model=self.model,
                    choices=[], usage=self._usage())

    def whole(self) -> bytes:
        text = "".join(_token_text(i) for i in range(self.req.output_tokens))
        if self.chat:
            return _enc.encode(oa.ChatCompletion(
                id=self.id, object="chat.completion", created=self.created, model=self.model,
                choices=[oa.ChatChoice(message=oa.ChatMessage(content=text), finish_reason="length")],
                usage=self._usage()))
        return _enc.encode(oa.Completion(
            id=self.id, object="text_completion", created=self.created, model=self.model,
            choices=[oa.CompletionChoice(text=text, finish_reason="length")],
            usage=self._usage()))


@dataclass(frozen=True, slots=True)
class FleetServer:
    """What :func:`serve_fleet` yields."""

    addresses: tuple[str, ...]
    """``host:port`` of each replica, in replica order."""
    replicas: tuple[ReplicaServer, ...]


@asynccontextmanager
async def serve_fleet(
    n_replicas: int,
    *,
    adapters: Sequence[str] = (),
    config: ReplicaConfig = DEFAULT_CONFIG,
    host: str = "127.0.0.1",
    base_port: int = 0,
    kv_events: bool = False,
) -> AsyncIterator[FleetServer]:
    """Run ``n_replicas`` simulated vLLM servers until the block exits.

    Replica ``i`` listens on ``base_port + i`` (every one on a free port when
    ``base_port`` is 0). All are listening when the block is entered. Leaving the block
    stops the engines and closes the servers (open streams are cut). ``kv_events``: each
    replica publishes its KV-cache events over ZMQ (see the module docstring).

    Raises
    ------
    RuntimeError
        Not running on anyio's asyncio backend (aiohttp needs asyncio).
    OSError
        A port is taken (the message names the address).
    """
    if n_replicas < 1:
        raise ValueError(f"n_replicas must be >= 1, got {n_replicas}")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "epick.sim.server needs the asyncio backend (aiohttp is asyncio-only)") from None
    t0 = anyio.current_time()
    wall0 = time.time()
    servers = [ReplicaServer(config, adapters, t0=t0, wall0=wall0, kv_events=kv_events)
               for _ in range(n_replicas)]
    runners: list[web.AppRunner] = []
    zmq_ctx = None
    if kv_events:
        import zmq.asyncio

        zmq_ctx = zmq.asyncio.Context()
    try:
        for i, srv in enumerate(servers):
            port = base_port + i if base_port else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                sock.close()
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
            srv.address = f"{host}:{sock.getsockname()[1]}"
            if zmq_ctx is not None:
                from .kv_publisher import ZmqKvPublisher

                srv.publisher = ZmqKvPublisher(zmq_ctx, host=host, topic=f"kv@{srv.address}")
            runner = web.AppRunner(srv.app, handle_signals=False, access_log=None,
                                   shutdown_timeout=0.5)
            runners.append(runner)
            await runner.setup()
            await web.SockSite(runner, sock).start()
        async with anyio.create_task_group() as tg:
            for srv in servers:
                tg.start_soon(srv.run_engine)
                if srv.publisher is not None:
                    tg.start_soon(srv.publisher.serve_replay)
            try:
                yield FleetServer(tuple(s.address for s in servers), tuple(servers))
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for runner in runners:
                await runner.cleanup()
        for srv in servers:
            if srv.publisher is not None:
                srv.publisher.close()
        if zmq_ctx is not None:
            zmq_ctx.destroy(linger=0)
