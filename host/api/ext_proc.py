"""Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor``, answered by epick's scheduler.

An unmodified Envoy routes through epick with its ext_proc HTTP filter (the example and
the whole story: ``examples/envoy/envoy.yaml``, ``docs/envoy.md``). One gRPC stream per
HTTP request; what epick answers to each message Envoy sends::

    request_headers     remember them; CONTINUE (the body follows; buffered)
                        a body-less request (GET /v1/models) is scheduled right here
    request_body        (BUFFERED: the whole body, end_of_stream) -> schedule ->
                          header x-gateway-destination-endpoint = primary[,fallbacks]
                          dynamic metadata {<namespace>: {x-gateway-destination-endpoint: same}}
                          clear_route_cache
                        Shed -> immediate 429, Unavailable -> 503, malformed -> 400
                        (JSON errors, OpenAI-style), a partial body -> 413
    response_headers    remember :status; add x-gateway-destination-endpoint and
                        x-epick-decision-id to the response
    response_body/trailers  (if Envoy sends them) CONTINUE; end_of_stream = complete
    stream end          ReportCompletion: OK (status < 400), ERROR (>= 400), CANCELLED
                        (no response, or a streamed response body that never ended)

That is upstream's endpoint-picker protocol (gateway-api-inference-extension, proposal
004): the same header, the same ``envoy.lb`` metadata namespace and key, the same
comma-separated ``primary,fallback,...`` value, and the served endpoint read back from
``metadata_context[<namespace>]["x-gateway-destination-endpoint-served"]`` when the data
plane forwards it.

``failure_mode`` covers epick failing to decide (a bug: an unexpected exception): ``open``
lets the request through with no destination header — Envoy's route for requests without
one takes it — and ``closed`` answers 503. Epick's *decisions* (429, 503, 400) are the
same in both modes. Envoy's own ``failure_mode_allow`` covers epick being unreachable.

Everything runs on the service's event-loop thread, like the Pick API: the scheduler is
called synchronously from the stream's coroutine.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2_grpc

from epick import abi
from epick.api.ext_proc_request import InvalidArgument, to_request
from epick.config import ExtProcConfig
from epick.scheduler.scheduler import Decision, Scheduler, Shed, Unavailable

__all__ = [
    "ExtProcService",
    "build_server",
    "DESTINATION_HEADER",
    "SERVED_KEY",
    "DECISION_HEADER",
    "SERVICE_NAME",
]

log = logging.getLogger("epick.ext_proc")

#: The header and metadata key that carry the picked endpoints (upstream's name).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: Metadata key (same namespace) by which a data plane says which endpoint served.
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: Response header carrying the decision id (to correlate logs, or report by hand).
DECISION_HEADER = "x-epick-decision-id"

SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
#: Largest ProcessingRequest accepted (a buffered body and its headers).
MAX_MESSAGE_BYTES = 16 << 20

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_BUFFERED = (processing_mode_pb2.ProcessingMode.BUFFERED,
             processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL)


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    # Envoy sends raw_value (bytes); older versions sent value. Header names are lower case.
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
            for h in msg.headers.headers}


def immediate(status: int, message: str, kind: str) -> ep.ProcessingResponse:
    """An OpenAI-style JSON error Envoy sends to the client instead of forwarding."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=ep.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
        body=body.encode(),
        details=f"epick_{kind}",
    ))


class _Stream:
    """One HTTP request's ext_proc conversation (one gRPC stream)."""

    __slots__ = ("svc", "headers", "decision", "status", "body_streamed", "response_done",
                 "served", "reported")

    def __init__(self, svc: ExtProcService) -> None:
        self.svc = svc
        self.headers: dict[str, str] = {}
        self.decision: Decision | None = None
        self.status: int | None = None
        self.body_streamed = False
        self.response_done = False
        self.served = ""
        self.reported = False

    def handle(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        if msg.HasField("metadata_context"):
            self._read_served(msg.metadata_context)
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(msg.request_headers)
            if msg.request_headers.end_of_stream:
                return self._route(None, body_phase=False)
            if (msg.HasField("protocol_config")
                    and msg.protocol_config.request_body_mode not in _BUFFERED):
                return immediate(500, "epick ext_proc needs the whole request body: set "
                                 "processing_mode.request_body_mode to BUFFERED in Envoy",
                                 "server_error")
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        if kind == "request_body":
            if not msg.request_body.end_of_stream:
                return immediate(413, "request body too large for Envoy's buffer (epick ext_proc "
                                 "needs the whole body; request_body_mode must be BUFFERED)",
                                 "invalid_request_error")
            return self._route(msg.request_body.body, body_phase=True)
        if kind == "request_trailers":
            return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        if kind == "response_headers":
            return self._response_headers(msg.response_headers)
        if kind == "response_body":
            self.body_streamed = True
            self.response_done = self.response_done or msg.response_body.end_of_stream
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        if kind == "response_trailers":
            self.response_done = True
            return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        return immediate(500, f"epick ext_proc: unexpected message {kind!r}", "server_error")

    def _route(self, body: bytes | None, *, body_phase: bool) -> ep.ProcessingResponse:
        svc = self.svc
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            request = to_request(self.headers, body, base_model=svc.config.base_model)
            self.decision = decision = svc.scheduler.schedule(request)
        except InvalidArgument as exc:
            outcome = "invalid"
            return immediate(400, f"malformed request: {exc}", "invalid_request_error")
        except Shed as exc:
            outcome = exc.outcome
            return immediate(429, f"epick: {exc}", "rate_limit_exceeded")
        except Unavailable as exc:
            outcome = exc.outcome
            return immediate(503, f"epick: {exc}", "service_unavailable")
        except Exception as exc:  # a bug: never take the stream down; obey failure_mode
            outcome = "error"
            log.exception("ext_proc: scheduling failed (failure_mode=%s)", svc.config.failure_mode)
            if svc.config.failure_mode == "closed":
                return immediate(503, f"epick: internal error: {exc!r}", "service_unavailable")
            # Open: no destination at all (a client's own copy is dropped too), so Envoy's
            # route for requests without one serves it.
            common = ep.CommonResponse(header_mutation=ep.HeaderMutation(
                remove_headers=[DESTINATION_HEADER]), clear_route_cache=True)
            return self._continue(common, None, body_phase)
        finally:
            if svc.telemetry is not None:
                svc.telemetry.pick_done(outcome, time.perf_counter() - t0)

        value = ",".join([decision.endpoint, *decision.fallbacks[:svc.config.fallbacks]])
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, value)]),
            clear_route_cache=True,
        )
        metadata = struct_pb2.Struct()
        metadata.get_or_create_struct(svc.config.metadata_namespace)[DESTINATION_HEADER] = value
        return self._continue(common, metadata, body_phase)

    @staticmethod
    def _continue(common: ep.CommonResponse, metadata: struct_pb2.Struct | None,
                  body_phase: bool) -> ep.ProcessingResponse:
        resp = (ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
                if body_phase else
                ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common)))
        if metadata is not None:
            resp.dynamic_metadata.CopyFrom(metadata)
        return resp

    def _response_headers(self, msg: ep.HttpHeaders) -> ep.ProcessingResponse:
        status = _headers(msg).get(":status", "")
        self.status = int(status) if status.isdigit() else None
        if msg.end_of_stream:
            self.response_done = True
        d = self.decision
        if d is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        mutation = ep.HeaderMutation(set_headers=[
            _header(DESTINATION_HEADER, self.served or d.endpoint),
            _header(DECISION_HEADER, d.decision_id),
        ])
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)))

    def _read_served(self, ctx: base_pb2.Metadata) -> None:
        ns = ctx.filter_metadata.get(self.svc.config.metadata_namespace)
        if ns is not None and SERVED_KEY in ns.fields:
            self.served = ns.fields[SERVED_KEY].string_value

    def finish(self) -> None:
        """The stream ended (Envoy closes it when the HTTP stream is done): report once."""
        d = self.decision
        if d is None or self.reported:
            return
        self.reported = True
        if self.status is None or (self.body_streamed and not self.response_done):
            status = abi.CompletionStatus.CANCELLED
        elif self.status >= 400:
            status = abi.CompletionStatus.ERROR
        else:
            status = abi.CompletionStatus.OK
        self.svc.scheduler.complete(decision_id=d.decision_id,
                                    endpoint=self.served or d.endpoint, status=status)


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    """Serves ``Process`` streams from a :class:`Scheduler` on the event-loop thread.

    ``telemetry`` (optional) gets ``pick_done(outcome, seconds)`` like the Pick API's.
    """

    def __init__(self, scheduler: Scheduler, config: ExtProcConfig, telemetry=None) -> None:
        if not config.base_model:
            raise ValueError("ExtProcService needs config.base_model (ext_proc.base_model)")
        self.scheduler = scheduler
        self.config = config
        self.telemetry = telemetry

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context) -> AsyncIterator[ep.ProcessingResponse]:
        stream = _Stream(self)
        try:
            async for msg in request_iterator:
                yield stream.handle(msg)
        finally:
            stream.finish()


def build_server(scheduler: Scheduler, config: ExtProcConfig, *, health=None,
                 telemetry=None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) serving ext_proc (and ``health``, if given) on
    ``config.listen``; returns it and the bound port. Raises OSError if it cannot bind."""
    # A ProcessingRequest carries the whole body: allow Envoy's buffer (4 MiB in the
    # example) plus headers, above gRPC's 4 MiB default.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    ep_grpc.add_ExternalProcessorServicer_to_server(
        ExtProcService(scheduler, config, telemetry), server)
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(config.listen)
    if not port:
        raise OSError(f"ext_proc: cannot listen on {config.listen}")
    return server, port
