"""A reference gateway: an OpenAI-compatible HTTP proxy that asks epick where to send
each request. Read it to integrate epick into your own data plane; it is short on purpose.

Per request::

    GET  /v1/models      forwarded to a replica epick picks for the base model
    POST /v1/completions | /v1/chat/completions  (JSON body)
      1. model, adapter, prompt from the body   (chat: epick.chat.serialize_messages)
      2. Pick(model, adapter, prompt, criticality)  -> endpoint + fallbacks + decision_id
            RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503, INVALID_ARGUMENT -> 400
      3. forward to the endpoint; if it refuses the connection, the next fallback
      4. stream the answer back unchanged (SSE when the body asked for stream: true)
      5. ReportCompletion(decision_id, endpoint, status, ttft) when the stream ends

Model naming (as vLLM does): ``model`` equal to the gateway's base model is a base-model
request; any other value names a LoRA adapter of that base model. Criticality comes from
the ``x-criticality`` header (critical | standard | sheddable; default standard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp import web

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.chat import serialize_messages

__all__ = ["Gateway", "GatewayStats", "make_app"]

log = logging.getLogger("epick.gateway")

_CRITICALITY = {"critical": pb.CRITICAL, "standard": pb.STANDARD, "sheddable": pb.SHEDDABLE}
_HTTP_FOR = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
}
# Hop-by-hop headers a proxy must not forward (plus what aiohttp recomputes).
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host", "content-encoding"}


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


@dataclass
class GatewayStats:
    """What the demo's live table shows about the gateway."""

    picks: Counter = field(default_factory=Counter)   # endpoint -> requests sent there
    outcomes: Counter = field(default_factory=Counter)  # 200 / 429 / 503 / 400 / 502
    pick_latency_s: list[float] = field(default_factory=list)


class Gateway:
    """Create inside a running event loop; :meth:`close` when done."""

    def __init__(self, epick_target: str, base_model: str, *, timeout_s: float = 300.0):
        self.base_model = base_model
        self.channel = grpc.aio.insecure_channel(epick_target)
        self.picker = picker_pb2_grpc.EndpointPickerStub(self.channel)
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s, connect=2.0),
            connector=aiohttp.TCPConnector(limit=1000), auto_decompress=False)
        self.stats = GatewayStats()

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()

    def pick_request(self, path: str, body: dict, headers) -> pb.PickRequest:
        """Turn an OpenAI request into a PickRequest; ValueError names what is wrong."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("body.model must be a non-empty string")
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise ValueError("body.messages must be a list")
            prompt = serialize_messages(messages)
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list):
                prompt = "".join(p for p in prompt if isinstance(p, str))
            if not isinstance(prompt, str):
                raise ValueError("body.prompt must be a string or a list of strings")
        crit = headers.get("x-criticality", "standard").lower()
        if crit not in _CRITICALITY:
            raise ValueError(f"x-criticality {crit!r} is not critical, standard or sheddable")
        return pb.PickRequest(
            request_id=headers.get("x-request-id", ""),
            model=self.base_model,
            adapter="" if model == self.base_model else model,
            prompt=prompt,
            criticality=_CRITICALITY[crit],
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            pick_req = self.pick_request(request.path, body, request.headers)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self.stats.outcomes[400] += 1
            return _error(400, f"malformed request: {exc}", "invalid_request_error")

        t0 = time.perf_counter()
        try:
            decision = await self.picker.Pick(pick_req, timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            status = _HTTP_FOR.get(exc.code(), 503)
            self.stats.outcomes[status] += 1
            kind = "rate_limit_exceeded" if status == 429 else "service_unavailable"
            return _error(status, f"epick: {exc.details()}", kind)
        self.stats.pick_latency_s.append(time.perf_counter() - t0)

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        for endpoint in [decision.endpoint, *decision.fallbacks]:
            try:
                upstream = await self.http.post(f"http://{endpoint}{request.path}", data=raw,
                                                headers=headers)
            except aiohttp.ClientConnectionError:
                log.warning("endpoint %s refused; trying the next fallback", endpoint)
                continue
            self.stats.picks[endpoint] += 1
            self.stats.outcomes[upstream.status] += 1
            return await self._relay(request, upstream, decision.decision_id, endpoint, t0)
        await self._report(decision.decision_id, decision.endpoint, pb.ERROR, None)
        self.stats.outcomes[502] += 1
        return _error(502, "every endpoint epick offered refused the connection", "bad_gateway")

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: what a replica epick picks for the base model serves (its
        base model and loaded adapters), as OpenAI clients and benchmark tools expect."""
        try:
            decision = await self.picker.Pick(pb.PickRequest(model=self.base_model),
                                              timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            return _error(_HTTP_FOR.get(exc.code(), 503), f"epick: {exc.details()}",
                          "service_unavailable")
        for endpoint in [decision.endpoint, *decision.fallbacks]:
            try:
                async with self.http.get(f"http://{endpoint}/v1/models") as upstream:
                    body, status = await upstream.read(), upstream.status
            except aiohttp.ClientConnectionError:
                continue
            await self._report(decision.decision_id, endpoint,
                               pb.OK if status < 400 else pb.ERROR, None)
            return web.Response(body=body, status=status, content_type="application/json")
        await self._report(decision.decision_id, decision.endpoint, pb.ERROR, None)
        return _error(502, "every endpoint epick offered refused the connection",
                      "bad_gateway")

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     decision_id: str, endpoint: str, t0: float) -> web.StreamResponse:
        """Stream the replica's answer back as it comes; report completion at the end."""
        status, ttft = pb.OK, None
        response = web.StreamResponse(status=upstream.status, headers={
            **{k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
            "x-gateway-destination-endpoint": endpoint})
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                await response.write(chunk)
            await response.write_eof()
            if upstream.status >= 400:
                status = pb.ERROR
        except asyncio.CancelledError:
            status = pb.CANCELLED
            raise
        except (ConnectionResetError, aiohttp.ClientError):
            # The client went away, or the replica broke mid-stream: report it, do not
            # log it as a gateway error.
            status = pb.CANCELLED
        finally:
            upstream.release()
            await self._report(decision_id, endpoint, status, ttft)
        return response

    async def _report(self, decision_id: str, endpoint: str, status, ttft) -> None:
        try:
            await self.picker.ReportCompletion(
                pb.CompletionReport(decision_id=decision_id, endpoint=endpoint, status=status,
                                    ttft_seconds=ttft), timeout=2.0)
        except grpc.aio.AioRpcError as exc:  # losing a report only delays reconcile
            log.warning("ReportCompletion failed: %s", exc.details())


def make_app(gateway: Gateway) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def close(_: web.Application) -> None:
        await gateway.close()

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/v1/completions", gateway.handle)
    app.router.add_post("/v1/chat/completions", gateway.handle)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app
