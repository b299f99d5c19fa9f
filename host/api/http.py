"""The HTTP/JSON front end: Pick for data planes that cannot speak gRPC (docs/dataplanes.md).

Routes (``[http] listen``)::

    POST /v1/pick        PickRequest (protobuf's JSON mapping) -> PickResponse
    POST /v1/completion  CompletionReport -> CompletionAck
    POST /v1/route       an OpenAI body as the client sent it, its headers -> where it goes
    GET  /v1/weights     ?model=&adapter=&criticality= -> WeightsTable (docs/weights.md);
                         with ``Accept: text/event-stream`` the stream, one SSE event per table
    POST /v3/discovery:endpoints   xDS REST-JSON EDS: a DiscoveryRequest naming weights
                         tables -> ClusterLoadAssignments (epick.api.eds)
    GET  /health         200 while Pick is served (the gRPC health status), else 503

This module only translates: a JSON body becomes the protobuf message the gRPC API gets,
and the one answer path (:meth:`PickerService.answer_pick`, ``answer_completion``) decides,
validates, records telemetry and logs, exactly as for gRPC. ``/v1/route`` runs the same
OpenAI translation as ext_proc (:func:`epick.api.openai_request.translate`) first.

Errors carry the HTTP status of the gRPC code and ``{"code": "<gRPC code name>",
"message": "…"}``; 429 and 503 (and 500) carry ``x-llm-d-request-dropped-reason`` as
ext_proc's do. A body over ``[http] max_body_bytes`` is a 413, malformed JSON a 400 that
says what is wrong.

The server is aiohttp on the service's event loop (chosen by measurement: docs/dataplanes.md),
so a pick runs on the loop thread like every gRPC pick. With ``[server] workers`` > 1 it
runs in each front-end worker instead (SO_REUSEPORT), over a remote picker that asks the
service's process (epick.frontend).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import json.encoder
import logging
import socket
import time
from collections.abc import Callable

import grpc
from aiohttp import web
from google.protobuf import json_format

from epick.api.decide import REFUSALS
from epick.api.gen.epick.v1 import picker_pb2
from epick.api.http_json import parse
from epick.api.openai_request import InvalidArgument, translate_with
from epick.api.picker import InvalidArgument as PickInvalidArgument
from epick.api.picker import PickerService, status_for
from epick.api.weights import _features, to_proto
from epick.config import OpenAIConfig
from epick.scheduler.scheduler import SchedulingError

__all__ = ["HttpApi", "HttpServer", "STATUS", "PATH_HEADER"]

log = logging.getLogger("epick.http")

# Upstream's names, as epick.api.ext_proc sends them (not imported from there: that module
# loads Envoy's protos, which the HTTP front end does not need).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DECISION_HEADER = "x-epick-decision-id"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"

#: gRPC code -> HTTP status: the refusals' own (the one table, ``decide.REFUSALS``) and
#: gRPC's usual mapping for the codes a pick never refuses with; anything else is a 500.
STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    **{r.grpc: r.http for r in REFUSALS.values()},
}
#: ext_proc's reasons for the same outcomes (upstream's header), from the same table.
_REASONS: dict[grpc.StatusCode, str] = {}
for _r in REFUSALS.values():
    if _r.reason:
        _REASONS.setdefault(_r.grpc, _r.reason)  # the first row of a code (shed's)
#: Optional header on ``/v1/route``: the client's own path (``/v1/chat/completions``…).
#: Without it a body with ``messages`` is a chat completion, any other a completion.
PATH_HEADER = "x-epick-path"
_JSON = "application/json"
_SSE = "text/event-stream"
#: An SSE comment this often on a quiet weights stream: tables come only on change, and a
#: write is how the server learns that a client went away (its subscription is freed).
SSE_KEEPALIVE_S = 15.0
_WEIGHTS_PARAMS = ("model", "adapter", "criticality")
#: A JSON string literal as ``json.dumps`` writes one by default (ASCII, escaped; C).
_quote = json.encoder.encode_basestring_ascii


def _error(code: grpc.StatusCode, message: str, metadata: tuple = (), *,
           status: int | None = None) -> web.Response:
    """``metadata``: the async answer's trailing metadata, whose dropped reason (flow
    control's own) wins over the code's."""
    headers = {}
    reason = dict(metadata).get(DROPPED_REASON_HEADER) or _REASONS.get(code)
    if reason is not None:
        headers[DROPPED_REASON_HEADER] = reason
    return _json(json.dumps({"code": code.name, "message": message}),
                 status=status or STATUS.get(code, 500), headers=headers)


def _json(text: str, *, status: int = 200, headers: dict[str, str] | None = None
          ) -> web.Response:
    # A bytes body: aiohttp adds no "; charset=utf-8" (JSON is UTF-8 by definition).
    headers = {"Content-Type": _JSON} | (headers or {})
    return web.Response(status=status, body=text.encode(), headers=headers)


def _message_json(msg) -> str:
    # grpcurl's output: lowerCamelCase, fields at their default left out.
    return json_format.MessageToJson(msg, indent=None)


def _pick_json(response: picker_pb2.PickResponse) -> str:
    """:func:`_message_json` of a ``PickResponse``, the same text, without walking the
    message's descriptors in Python: with no explanation its three fields are written as
    ``MessageToJson`` writes them (in field order, a field at its default left out,
    ``json.dumps``' separators and its ASCII escaping, through the same C function).
    ``tests/api/test_http.py`` compares the two."""
    if response.HasField("explanation"):
        return _message_json(response)
    parts = []
    endpoint, fallbacks, decision_id = (response.endpoint, response.fallbacks,
                                        response.decision_id)
    if endpoint:
        parts.append('"endpoint": ' + _quote(endpoint))
    if fallbacks:
        parts.append('"fallbacks": [' + ", ".join(map(_quote, fallbacks)) + "]")
    if decision_id:
        parts.append('"decisionId": ' + _quote(decision_id))
    return "{" + ", ".join(parts) + "}"


async def _result(answer):
    """An answer from :class:`PickerService` (a value) or from a front-end worker's remote
    picker (awaited: the decision is made in the service's process)."""
    return await answer if inspect.isawaitable(answer) else answer


def _flow_of(picker):
    return getattr(picker.decider, "flow", None)


class HttpApi:
    """The handlers, over a :class:`PickerService` (the same one gRPC serves), or in a
    front-end worker (``[server] workers``) a remote picker with the same answers."""

    def __init__(self, picker: PickerService, *, healthy: Callable[[], bool],
                 openai: OpenAIConfig, max_body_bytes: int) -> None:
        self.picker = picker
        self.healthy = healthy
        self.openai = openai
        self.max_body_bytes = max_body_bytes
        #: Open weights streams, cancelled by :meth:`close` (they never end by themselves).
        self._streams: set[asyncio.Task] = set()

    def close(self) -> None:
        """End the open weights streams (the server is stopping)."""
        for task in self._streams:
            task.cancel()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/pick", self.pick)
        app.router.add_post("/v1/completion", self.completion)
        app.router.add_post("/v1/route", self.route)
        app.router.add_get("/v1/weights", self.weights)
        app.router.add_post("/v3/discovery:endpoints", self.eds)
        app.router.add_get("/health", self.health)
        # Last: whatever matched nothing above gets a JSON error too.
        app.router.add_route("*", "/{tail:.*}", _no_route)
        return app


    def _answer_pick(self, msg, headers):
        """The picker's answer: straight, through flow control when it is on (both in the
        service's process), or (a front-end worker) from the service's process."""
        picker = self.picker
        if _flow_of(picker) is not None:
            return picker.answer_pick_async(msg, carrier=headers)
        return picker.answer_pick(msg, headers)

    async def _body(self, request: web.Request) -> bytes | web.Response:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request body too large: over epick's limit of "
                          f"{self.max_body_bytes} bytes ([http] max_body_bytes)", status=413)

    async def _parse(self, request: web.Request, msg):
        """``msg`` filled from the JSON body, or the error response to send."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            parse(body, msg)
        except json_format.ParseError as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed {msg.DESCRIPTOR.name} JSON: {exc}")
        except UnicodeDecodeError as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed {msg.DESCRIPTOR.name} JSON: the body is not UTF-8 ({exc})")
        return msg

    async def pick(self, request: web.Request) -> web.Response:
        msg = await self._parse(request, picker_pb2.PickRequest())
        if isinstance(msg, web.Response):
            return msg
        response, error = await _result(self._answer_pick(msg, request.headers))
        if error is not None:
            return _error(*error)
        return _json(_pick_json(response))

    async def completion(self, request: web.Request) -> web.Response:
        msg = await self._parse(request, picker_pb2.CompletionReport())
        if isinstance(msg, web.Response):
            return msg
        response, error = await _result(self.picker.answer_completion(msg))
        if error is not None:
            return _error(*error)
        if request.headers.get("prefer", "").strip().lower() == "return=minimal":
            # RFC 7240: no body wanted. NGINX's post_action keeps its connection to epick
            # only for an answer without a body (it never reads one).
            return web.Response(status=204)
        return _json(_message_json(response))

    async def route(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        settings = self.openai
        if not settings.base_model:
            return _error(grpc.StatusCode.NOT_FOUND,
                          "/v1/route is off: it needs the base model ([openai] base_model)")
        headers = {k.lower(): v for k, v in request.headers.items()}
        path = headers.pop(PATH_HEADER, "") or _path_of(body)
        t0 = time.perf_counter()
        try:
            parsed = translate_with(settings, headers, path, body or None)
        except InvalidArgument as exc:
            # Counted like ext_proc's malformed requests: an invalid pick.
            verdict = self.picker.decider.refuse(InvalidArgument(f"malformed request: {exc}"),
                                                 started=t0)
            return _error(REFUSALS[verdict.outcome].grpc, verdict.message)
        response, error = await _result(self._answer_pick(parsed.pick, request.headers))
        if error is not None:
            return _error(*error)
        fallbacks = list(response.fallbacks)
        return _json(
            json.dumps({"endpoint": response.endpoint, "fallbacks": fallbacks,
                        "decisionId": response.decision_id,
                        "model": parsed.pick.adapter or parsed.pick.model}),
            headers={DESTINATION_HEADER: ",".join([response.endpoint, *fallbacks]),
                     DECISION_HEADER: response.decision_id})

    def _weights_request(self, request: web.Request):
        """The query as a validated ``(model, adapter, criticality)``, or the error."""
        unknown = sorted(set(request.query) - set(_WEIGHTS_PARAMS))
        if unknown:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"GET /v1/weights: unknown query parameter {unknown[0]!r}; "
                          f"it takes {', '.join(_WEIGHTS_PARAMS)}")
        doc: dict[str, object] = {k: request.query[k] for k in _WEIGHTS_PARAMS
                                  if k in request.query}
        crit = doc.get("criticality")
        if isinstance(crit, str) and crit.isdigit():
            doc["criticality"] = int(crit)
        try:
            msg = json_format.ParseDict(doc, picker_pb2.WeightsRequest())
            return _features(msg)
        except json_format.ParseError as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed WeightsRequest query: {exc}")
        except PickInvalidArgument as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def weights(self, request: web.Request) -> web.StreamResponse:
        """One table (JSON), or with ``Accept: text/event-stream`` the stream: one SSE
        event per table, through the same hub as WatchWeights (latest, not a backlog)."""
        hub = self.picker.weights
        if hub is None:
            return _error(grpc.StatusCode.UNIMPLEMENTED, "the weights stream is off",
                          status=501)
        key = self._weights_request(request)
        if isinstance(key, web.Response):
            return key
        if _SSE not in request.headers.get("Accept", ""):
            try:
                table = await _result(hub.table(*key))  # a worker's: asked of the service
            except (PickInvalidArgument, SchedulingError) as exc:
                return _error(status_for(exc), str(exc))
            return _json(_message_json(to_proto(table)))
        if not getattr(hub, "streams", True):
            return _error(grpc.StatusCode.UNIMPLEMENTED,
                          "GET /v1/weights as a stream (text/event-stream) is not served by "
                          "front-end workers ([server] workers > 1): ask without the stream "
                          "(one table), watch over gRPC (EndpointPicker/WatchWeights on "
                          "[server] listen), or set [server] workers = 1", status=501)
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            async with hub.subscribe(*key) as sub:
                response = web.StreamResponse(headers={
                    "Content-Type": _SSE, "Cache-Control": "no-cache"})
                await response.prepare(request)
                while True:
                    try:
                        await asyncio.wait_for(sub.wait(), SSE_KEEPALIVE_S)
                    except TimeoutError:
                        await response.write(b": keepalive\n\n")
                        continue
                    async with hub.write_slots():
                        await response.write(sub.take_encoded(_sse_event))
        except (PickInvalidArgument, SchedulingError) as exc:
            return _error(status_for(exc), str(exc))
        except ConnectionResetError:
            # The client went away: the subscription is freed above.
            return web.Response(status=499)
        finally:
            self._streams.discard(task)

    async def eds(self, request: web.Request) -> web.Response:
        """Envoy's REST-JSON EDS (``api_type: REST``): every resource name is a weights
        table (``model=M[,adapter=A][,criticality=C]``), answered as a
        ``ClusterLoadAssignment`` with ``load_balancing_weight`` = share (docs/weights.md).
        Envoy polls at its ``refresh_delay``; each poll reads the tables now."""
        from envoy.service.discovery.v3 import discovery_pb2  # Envoy's protos: only here

        from epick.api import eds

        hub = self.picker.weights
        if hub is None:
            return _error(grpc.StatusCode.UNIMPLEMENTED, "the weights stream is off",
                          status=501)
        msg = await self._parse_json(request, discovery_pb2.DiscoveryRequest())
        if isinstance(msg, web.Response):
            return msg
        if msg.type_url and msg.type_url != eds.TYPE_URL:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"DiscoveryRequest.type_url {msg.type_url!r}: epick serves only "
                          f"{eds.TYPE_URL}")
        if not msg.resource_names:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          "DiscoveryRequest.resource_names is empty: name the weights "
                          "tables (model=M[,adapter=A]) as the EDS service names")
        try:
            # A worker's hub asks the service's process (awaited); the service's answers.
            tables = {name: await _result(hub.table(*eds.resource_key(name)))
                      for name in msg.resource_names}
        except (PickInvalidArgument, SchedulingError) as exc:
            return _error(status_for(exc), str(exc))
        return _json(_message_json(eds.discovery_response(tables)))

    async def _parse_json(self, request: web.Request, msg):
        """``msg`` from a JSON body that may carry fields epick does not read (Envoy's
        ``node``, its metadata...): parsed with unknown fields ignored."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            return json_format.Parse(body, msg, ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed {msg.DESCRIPTOR.name} JSON: {exc}")

    async def health(self, request: web.Request) -> web.Response:
        serving = self.healthy()
        return _json('{"status":"SERVING"}' if serving else '{"status":"NOT_SERVING"}',
                     status=200 if serving else 503)


_ROUTES = {"/v1/pick": "POST", "/v1/completion": "POST", "/v1/route": "POST",
           "/v1/weights": "GET", "/v3/discovery:endpoints": "POST", "/health": "GET"}


async def _no_route(request: web.Request) -> web.Response:
    allowed = _ROUTES.get(request.path)
    if allowed is not None:
        return _error(grpc.StatusCode.UNIMPLEMENTED,
                      f"{request.method} {request.path}: use {allowed}", status=405)
    return _error(grpc.StatusCode.NOT_FOUND,
                  f"no route {request.method} {request.path}; epick serves "
                  + ", ".join(f"{m} {p}" for p, m in _ROUTES.items()))


def _sse_event(table) -> bytes:
    # One event per table: its protobuf JSON (as GET /v1/weights answers) on one line.
    return b"data: " + _message_json(to_proto(table)).encode() + b"\n\n"


def _path_of(body: bytes) -> str:
    # Only the key's presence matters; translate parses (and judges) the body itself.
    return "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"


#: Connections waiting to be accepted (the kernel caps it at net.core.somaxconn): a proxy
#: opens one per request in flight, and a burst of thousands must queue, not be dropped
#: into SYN retries.
BACKLOG = 4096


class HttpServer:
    """The aiohttp server of one :class:`HttpApi`: ``bind`` (sync, so the service reports a
    busy port like its gRPC ones), then ``await start()``; ``await stop()`` at shutdown."""

    def __init__(self, api: HttpApi, *, reuse_port: bool = False) -> None:
        self.api = api
        self.reuse_port = reuse_port
        """Share the port with the other front-end workers (SO_REUSEPORT)."""
        self._sock: socket.socket | None = None
        self._runner: web.AppRunner | None = None

    def bind(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, int(port)))
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        return sock.getsockname()[1]

    async def start(self) -> None:
        self._runner = web.AppRunner(self.api.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        # (aiohttp listens again with its own backlog, 128 unless told)
        await web.SockSite(self._runner, self._sock, backlog=BACKLOG).start()

    async def stop(self) -> None:
        self.api.close()
        if self._runner is not None:
            await self._runner.cleanup()
        elif self._sock is not None:
            self._sock.close()
