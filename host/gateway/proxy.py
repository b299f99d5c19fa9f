"""A reference gateway: an OpenAI-compatible HTTP proxy that asks epick where to send
each request. Read it to integrate epick into your own data plane; it is short on purpose.

Per request::

    GET  /v1/models      forwarded to a replica epick picks for the base model
    POST /v1/completions | /v1/chat/completions  (JSON body)
      1. the PickRequest from headers and body: epick.api.openai_request.translate_with
         and the [openai] settings, the same translation the Envoy ext_proc adapter uses
         (model/adapter, prompt, model rewrite, criticality from x-criticality or the
         objective header, pinning)
      2. Pick(...)  -> endpoint + fallbacks + decision_id; a refusal is told as every
         front end tells it (epick.api.decide.REFUSALS via openai_request.refusal):
            RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503 (both with upstream's
            x-llm-d-request-dropped-reason), INVALID_ARGUMENT -> 400, INTERNAL -> 500
      3. forward to the endpoint (the rewritten body, if the model was rewritten); if it
         refuses the connection, the next fallback
      4. stream the answer back as it comes (SSE when the body asked for stream: true),
         reading usage and the first token's time from it (epick.api.usage.UsageReader)
      5. ReportCompletion(decision_id, endpoint, status, tokens, ttft) when the stream
         ends: OK, ERROR (status >= 400), CANCELLED (the client left, the replica broke)

The backend's address is not told to the client unless ``expose_endpoint`` is set
(then as ``x-gateway-destination-endpoint``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp import web

from epick.api.decide import outcome_of_code
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.api.openai_request import (
    DROPPED_REASON_HEADER,
    InvalidArgument,
    OpenAIConfig,
    OpenAIError,
    refusal,
    translate_with,
)
from epick.api.usage import UsageReader

__all__ = ["Gateway", "GatewayStats", "make_app"]

log = logging.getLogger("epick.gateway")

# Hop-by-hop headers a proxy must not forward (plus what aiohttp recomputes).
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host", "content-encoding"}


def _error(error: OpenAIError) -> web.Response:
    return web.Response(body=error.body(), status=error.status, headers=error.headers())


def _refused(exc: grpc.aio.AioRpcError) -> OpenAIError:
    """A failed Pick, told as every front end tells that outcome."""
    reason = ""
    for key, value in exc.trailing_metadata() or ():
        if key == DROPPED_REASON_HEADER:  # flow control's own reason (evicted-ttl, ...)
            reason = value
    return refusal(outcome_of_code(exc.code(), reason), exc.details() or str(exc.code()))


_ALL_REFUSED = OpenAIError(502, "bad_gateway",
                           "every endpoint epick offered refused the connection")


@dataclass
class GatewayStats:
    """What the demo's live table shows about the gateway."""

    picks: Counter = field(default_factory=Counter)   # endpoint -> requests sent there
    outcomes: Counter = field(default_factory=Counter)  # 200 / 429 / 503 / 400 / 502
    pick_latency_s: list[float] = field(default_factory=list)


class Gateway:
    """Create inside a running event loop; :meth:`close` when done."""

    def __init__(self, epick_target: str, base_model: str, *, timeout_s: float = 300.0,
                 objectives: dict[str, str] | None = None,
                 model_rewrites: dict[str, str] | None = None,
                 expose_endpoint: bool = False):
        # The [openai] settings (python -m epick.gateway --config reads them from a file).
        self.openai = OpenAIConfig(base_model=base_model, objectives=objectives or {},
                                   model_rewrites=model_rewrites or {})
        self.expose_endpoint = expose_endpoint
        self.channel = grpc.aio.insecure_channel(epick_target)
        self.picker = picker_pb2_grpc.EndpointPickerStub(self.channel)
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s, connect=2.0),
            connector=aiohttp.TCPConnector(limit=1000), auto_decompress=False)
        self.stats = GatewayStats()

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        t0 = time.perf_counter()  # TTFT counts from here
        try:
            if not raw:
                raise InvalidArgument("the body is empty; it must be a JSON object")
            headers = {k.lower(): v for k, v in request.headers.items()}
            parsed = translate_with(self.openai, headers, request.path, raw)
        except InvalidArgument as exc:
            error = refusal("invalid", str(exc))
            self.stats.outcomes[error.status] += 1
            return _error(error)

        t_pick = time.perf_counter()
        try:
            decision = await self.picker.Pick(parsed.pick, timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            error = _refused(exc)
            self.stats.outcomes[error.status] += 1
            return _error(error)
        self.stats.pick_latency_s.append(time.perf_counter() - t_pick)

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        for endpoint in [decision.endpoint, *decision.fallbacks]:
            try:
                upstream = await self.http.post(f"http://{endpoint}{request.path}",
                                                data=parsed.body, headers=headers)
            except aiohttp.ClientConnectionError:
                log.warning("endpoint %s refused; trying the next fallback", endpoint)
                continue
            self.stats.picks[endpoint] += 1
            self.stats.outcomes[upstream.status] += 1
            return await self._relay(request, upstream, decision.decision_id, endpoint, t0)
        await self._report(decision.decision_id, decision.endpoint, pb.ERROR, None)
        self.stats.outcomes[502] += 1
        return _error(_ALL_REFUSED)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: what a replica epick picks for the base model serves (its
        base model and loaded adapters), as OpenAI clients and benchmark tools expect."""
        try:
            decision = await self.picker.Pick(pb.PickRequest(model=self.openai.base_model),
                                              timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            return _error(_refused(exc))
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
        return _error(_ALL_REFUSED)

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     decision_id: str, endpoint: str, t0: float) -> web.StreamResponse:
        """Stream the replica's answer back as it comes; report completion at the end."""
        status = pb.OK
        usage = UsageReader(upstream.headers.get("content-type", ""), t0)
        headers = {k: v for k, v in upstream.headers.items()
                   if k.lower() not in _HOP and k.lower() != "x-gateway-destination-endpoint"}
        if self.expose_endpoint:
            headers["x-gateway-destination-endpoint"] = endpoint
        response = web.StreamResponse(status=upstream.status, headers=headers)
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                usage.feed(chunk, time.perf_counter())
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
            usage.finish()
            await self._report(decision_id, endpoint, status, usage)
        return response

    async def _report(self, decision_id: str, endpoint: str, status,
                      usage: UsageReader | None) -> None:
        report = pb.CompletionReport(decision_id=decision_id, endpoint=endpoint, status=status)
        if usage is not None:
            if usage.prompt_tokens is not None:
                report.prompt_tokens = usage.prompt_tokens
            if usage.completion_tokens is not None:
                report.completion_tokens = usage.completion_tokens
            if usage.ttft_s is not None:
                report.ttft_seconds = usage.ttft_s
        try:
            await self.picker.ReportCompletion(report, timeout=2.0)
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
