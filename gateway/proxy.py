"""A reference gateway: an OpenAI-compatible HTTP proxy that asks epick where to send
each request. Read it to integrate epick into your own data plane; it is short on purpose.

Per request::

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

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

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
# Hop-by-hop headers a proxy must not forward.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host"}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


@dataclass
class GatewayStats:
    """What the demo's live table shows about the gateway."""

    picks: Counter = field(default_factory=Counter)   # endpoint -> requests sent there
    outcomes: Counter = field(default_factory=Counter)  # 200 / 429 / 503 / 400 / 502
    pick_latency_s: list[float] = field(default_factory=list)


class Gateway:
    def __init__(self, epick_target: str, base_model: str, *, timeout_s: float = 300.0):
        self.base_model = base_model
        self.channel = grpc.aio.insecure_channel(epick_target)
        self.picker = picker_pb2_grpc.EndpointPickerStub(self.channel)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=2.0),
                                      limits=httpx.Limits(max_connections=1000))
        self.stats = GatewayStats()

    async def close(self) -> None:
        await self.http.aclose()
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

    async def handle(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            pick_req = self.pick_request(request.url.path, body, request.headers)
        except (ValueError, json.JSONDecodeError) as exc:
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
        raw = await request.body()
        for endpoint in [decision.endpoint, *decision.fallbacks]:
            upstream = self.http.build_request(
                "POST", f"http://{endpoint}{request.url.path}", content=raw, headers=headers)
            try:
                resp = await self.http.send(upstream, stream=True)
            except httpx.ConnectError:
                log.warning("endpoint %s refused; trying the next fallback", endpoint)
                continue
            self.stats.picks[endpoint] += 1
            self.stats.outcomes[resp.status_code] += 1
            return StreamingResponse(
                self._relay(resp, decision.decision_id, endpoint, t0),
                status_code=resp.status_code,
                headers={k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
                | {"x-gateway-destination-endpoint": endpoint},
            )
        await self._report(decision.decision_id, decision.endpoint, pb.ERROR, None)
        self.stats.outcomes[502] += 1
        return _error(502, "every endpoint epick offered refused the connection", "bad_gateway")

    async def _relay(self, resp: httpx.Response, decision_id: str, endpoint: str, t0: float):
        status, ttft = pb.OK, None
        try:
            async for chunk in resp.aiter_raw():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                yield chunk
            if resp.status_code >= 400:
                status = pb.ERROR
        except BaseException:
            status = pb.CANCELLED  # the client went away (or the replica broke mid-stream)
            raise
        finally:
            await resp.aclose()
            await self._report(decision_id, endpoint, status, ttft)

    async def _report(self, decision_id: str, endpoint: str, status, ttft) -> None:
        try:
            await self.picker.ReportCompletion(
                pb.CompletionReport(decision_id=decision_id, endpoint=endpoint, status=status,
                                    ttft_seconds=ttft), timeout=2.0)
        except grpc.aio.AioRpcError as exc:  # losing a report only delays reconcile
            log.warning("ReportCompletion failed: %s", exc.details())


def make_app(gateway: Gateway) -> Starlette:
    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[
        Route("/v1/completions", gateway.handle, methods=["POST"]),
        Route("/v1/chat/completions", gateway.handle, methods=["POST"]),
        Route("/health", health),
    ], on_shutdown=[gateway.close])
