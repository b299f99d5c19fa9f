"""Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor``, answered by epick's scheduler.

An unmodified Envoy routes through epick with its ext_proc HTTP filter (the examples and
the whole story: ``examples/envoy/``, ``docs/envoy.md``). One gRPC stream per HTTP
request. The body mode is the one Envoy announces (``protocol_config`` on the first
message; none announced = BUFFERED):

``FULL_DUPLEX_STREAMED`` (upstream's mode; GIE proposal 004 says a picker MUST support it)::

    request_headers    held: no answer yet (a body-less request is scheduled right here)
    request_body ...   chunks kept until end_of_stream (over max_body_bytes -> 413), then
                       schedule -> the headers answer (destination header, envoy.lb
                       metadata, clear_route_cache, Content-Length when the model was
                       rewritten), then the body streamed back (the same chunks)
    response_headers   answered (decision id; the destination only if expose_endpoint)
    response_body ...  every chunk streamed back as it comes; usage and TTFT read from it;
                       at end_of_stream the completion is reported

``BUFFERED`` (the whole body in one message)::

    request_headers    CONTINUE            request_body   schedule -> the same mutations
    response_*         CONTINUE (usage read from bodies if Envoy sends them)

Observed (``examples/envoy/envoy-observer.yaml``): a second ext_proc filter in Envoy's
``observability_mode`` (each message sent without waiting; answers ignored) watches the
response, placed before the routing filter so it sees the answer after the routing
filter has set the decision id on it; the routing filter SKIPs the response body and
tells epick so in its gRPC initial metadata (``x-epick-observed: true``)::

    routing stream     as above (request headers, body), response_headers answered
                       (the decision id); it reports only when no response came (the
                       observer cannot know the decision then)
    observer stream    request_headers (the start TTFT is measured from), response_headers
                       (x-epick-decision-id, status), response_body ... (usage, TTFT):
                       never answered; at end_of_stream the completion is reported and
                       epick ends the stream

Any mode: the first immediate response (400 malformed, 413 too large, 429 shed, 503
nothing eligible — with ``x-llm-d-request-dropped-reason``) is the last message: the
stream then ends. ReportCompletion happens once: at the response's end_of_stream (or
trailers), else when the stream ends — OK (status < 400), ERROR (>= 400), CANCELLED (no
response, or a streamed response that never ended: the client left).

Upstream's protocol, kept: the header ``x-gateway-destination-endpoint`` and the
``envoy.lb`` metadata carry ``primary[,fallbacks]``; the served endpoint is read back from
``metadata_context[<namespace>]["x-gateway-destination-endpoint-served"]``; a subset hint
``metadata_context["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]``
restricts the pick to those endpoints (none eligible: 503).

Gateway conformance hooks (``conformance_hooks = true``; off by default, since any client
could steer its own request with the header): the upstream conformance suite's request
header ``test-epp-endpoint-selection: ip[:port][,...]`` restricts the pick to those
endpoints (a bare IP: every port on it; it replaces a subset hint; nothing eligible is a
429, as upstream's picker answers), and the response carries
``x-conformance-test-served-endpoint`` (the data plane's served-endpoint metadata, or
upstream's ``fail: ...`` text when it is missing) and ``x-conformance-test-selected-endpoint``
(epick's pick) — what the suite's reference picker does.

``failure_mode`` covers epick failing to decide (a bug: an unexpected exception): ``open``
lets the request through with no destination header — Envoy's route for requests without
one takes it — and ``closed`` answers 503. Epick's *decisions* (429, 503, 400) are the
same in both modes. Envoy's own ``failure_mode_allow`` covers epick being unreachable.

The request is read with the ``[openai]`` settings (:mod:`epick.api.openai_request`) and
decided by the one pick path every front end shares (:class:`epick.api.decide.Decider`:
validation, scheduling, outcome label, telemetry); this module only speaks Envoy's side.
Everything runs on the service's event-loop thread, like the Pick API: the decider is
called synchronously from the stream's coroutine. In a front-end worker process
(``[server] workers`` > 1, :mod:`epick.frontend`) the same streams run there and the
decider is a remote one (its ``decide_async`` hands the ``PickRequest`` to the service's
process and awaits the verdict); only the messages that route await anything.
"""

from __future__ import annotations

import inspect
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
from epick.api.decide import Decider
from epick.api.grpc_server import PENDING_CALLS_OPTIONS
from epick.api.openai_request import (
    DROPPED_REASON_HEADER,
    OpenAIError,
    OpenAIRequest,
    refusal,
    translate_with,
)
from epick.api.usage import UsageReader
from epick.config import ExtProcConfig, OpenAIConfig
from epick.scheduler.scheduler import Decision

__all__ = [
    "ExtProcService",
    "build_server",
    "DESTINATION_HEADER",
    "SERVED_KEY",
    "DECISION_HEADER",
    "DROPPED_REASON_HEADER",
    "SUBSET_NAMESPACE",
    "SUBSET_KEY",
    "SERVICE_NAME",
    "TEST_SELECTION_HEADER",
    "TEST_SERVED_HEADER",
    "TEST_SELECTED_HEADER",
    "OBSERVED_METADATA",
]

log = logging.getLogger("epick.ext_proc")

#: The header and metadata key that carry the picked endpoints (upstream's name).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: Metadata key (same namespace) by which a data plane says which endpoint served.
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: Response header carrying the decision id (to correlate logs, or report by hand).
DECISION_HEADER = "x-epick-decision-id"
#: gRPC metadata (the routing filter's ``grpc_service.initial_metadata``) saying that an
#: observer filter (``observability_mode``) reports this request's completion.
OBSERVED_METADATA = "x-epick-observed"
#: Where a data plane puts the endpoints a pick must come from (proposal 004).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

#: The conformance suite's hooks (``conformance_hooks``; upstream's names).
TEST_SELECTION_HEADER = "test-epp-endpoint-selection"
TEST_SERVED_HEADER = "x-conformance-test-served-endpoint"
TEST_SELECTED_HEADER = "x-conformance-test-selected-endpoint"

SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
#: Largest ProcessingRequest accepted (a buffered body and its headers).
MAX_MESSAGE_BYTES = 16 << 20
#: Largest body chunk sent back to Envoy (upstream's value: some data planes cap at 64 KiB).
CHUNK_BYTES = 62_000

_Mode = processing_mode_pb2.ProcessingMode
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_BUFFERED = (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)
_DUPLEX = _Mode.FULL_DUPLEX_STREAMED


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    # Envoy sends raw_value (bytes); older versions sent value. Header names are lower case.
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
            for h in msg.headers.headers}


def immediate(status: int, message: str, kind: str, *, reason: str = "") -> ep.ProcessingResponse:
    """An OpenAI-style JSON error Envoy sends to the client instead of forwarding.

    ``reason`` fills upstream's ``x-llm-d-request-dropped-reason`` (429 and 503)."""
    return _immediate(OpenAIError(status, kind, message, reason))


def _immediate(error: OpenAIError) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=ep.HeaderMutation(set_headers=[_header(k, v)
                                               for k, v in error.headers().items()]),
        body=error.body(),
        details=f"epick_{error.kind}",
    ))


def too_large(limit: int) -> ep.ProcessingResponse:
    """The request body is over ``[ext_proc] max_body_bytes``."""
    return immediate(413, f"request body too large: over epick's limit of {limit} bytes "
                     "([ext_proc] max_body_bytes)", "invalid_request_error")


def not_buffered() -> ep.ProcessingResponse:
    """BUFFERED mode, and the body did not fit in one message."""
    return immediate(413, "request body too large for Envoy's buffer (in BUFFERED mode "
                     "epick needs the whole body in one message; raise "
                     "per_connection_buffer_limit_bytes or use FULL_DUPLEX_STREAMED)",
                     "invalid_request_error")


def bad_mode(mode: int) -> ep.ProcessingResponse:
    """Envoy sends the request body in a mode epick cannot route in."""
    name = _Mode.BodySendMode.Name(mode)
    return immediate(500, f"epick ext_proc reads the request body before it routes, and "
                     f"Envoy sends it in mode {name}: set processing_mode.request_body_mode "
                     "to FULL_DUPLEX_STREAMED (upstream's mode) or BUFFERED", "server_error")


def unexpected(kind: str | None) -> ep.ProcessingResponse:
    return immediate(500, f"epick ext_proc: unexpected message {kind!r}", "server_error")


def problem(what: str, svc: ExtProcService) -> list[ep.ProcessingResponse]:
    """The immediate response for a refusal a native worker saw first (wire.PickHttp's
    ``problem``), as this module writes it."""
    if what == "too_large":
        return [too_large(svc.config.max_body_bytes)]
    if what == "not_buffered":
        return [not_buffered()]
    if what.startswith("mode:"):
        return [bad_mode(int(what[5:]))]
    return [unexpected(None)]


def trailers_continue() -> ep.ProcessingResponse:
    """The request trailers' answer (no mutation)."""
    return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())


def _streamed_message(kind: str, chunk: bytes, eos: bool) -> ep.ProcessingResponse:
    """A body chunk streamed back, as a message (what :func:`_streamed` encodes)."""
    body = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=eos))))
    return (ep.ProcessingResponse(request_body=body) if kind == "request"
            else ep.ProcessingResponse(response_body=body))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(message, field: str, wire_type: int = 2) -> bytes:
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


#: The wrappers around a streamed chunk, outermost first (after the kind's own field):
#: BodyResponse.response > CommonResponse.body_mutation > BodyMutation.streamed_response.
_WRAPPERS = (_tag(ep.BodyResponse, "response"), _tag(ep.CommonResponse, "body_mutation"),
             _tag(ep.BodyMutation, "streamed_response"))
_KIND_TAG = {"request": _tag(ep.ProcessingResponse, "request_body"),
             "response": _tag(ep.ProcessingResponse, "response_body")}
_BODY_TAG = _tag(ep.StreamedBodyResponse, "body")
_EOS = _tag(ep.StreamedBodyResponse, "end_of_stream", 0) + b"\x01"


def _streamed(kind: str, chunk: bytes, eos: bool) -> bytes:
    """A body chunk streamed back, encoded by hand: the bytes protobuf would write for
    :func:`_streamed_message` (a test checks), without building five messages a chunk.
    The server's serializer passes bytes through (:func:`_serialize`)."""
    inner = [_BODY_TAG, _varint(len(chunk)), chunk] if chunk else []
    if eos:
        inner.append(_EOS)
    size = sum(len(p) for p in inner)
    heads = []
    for tag in (*reversed(_WRAPPERS), _KIND_TAG[kind]):
        head = tag + _varint(size)
        heads.append(head)
        size += len(head)
    heads.reverse()
    return b"".join(heads + inner)


def _serialize(response) -> bytes:
    """The Process responses' serializer: a message, or bytes already encoded."""
    return response if response.__class__ is bytes else response.SerializeToString()


def _subset(ctx: base_pb2.Metadata) -> list[str] | None:
    """The subset hint's endpoints, ``None`` without one; ValueError if it is malformed."""
    ns = ctx.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    if value.WhichOneof("kind") != "list_value":
        raise ValueError(f"metadata {SUBSET_NAMESPACE}/{SUBSET_KEY} must be a list of "
                         f"\"host:port\" strings, got a {value.WhichOneof('kind')}")
    out = []
    for i, v in enumerate(value.list_value.values):
        if v.WhichOneof("kind") != "string_value":
            raise ValueError(f"metadata {SUBSET_NAMESPACE}/{SUBSET_KEY}[{i}] must be a "
                             f"\"host:port\" string, got a {v.WhichOneof('kind')}")
        out.append(v.string_value.strip())
    return out


def _test_selection(value: str) -> list[str]:
    """The conformance header's entries as the subset filter reads them (``ip:port`` or a
    bare ``ip``; a bare IPv6 address bracketed, as epick writes addresses)."""
    out = []
    for item in value.split(","):
        item = item.strip()
        if item.count(":") > 1 and not item.startswith("["):
            item = f"[{item}]"
        if item:
            out.append(item)
    return out


def _complete(svc: ExtProcService, decision_id: str, endpoint: str,
              status: abi.CompletionStatus, usage: UsageReader | None) -> None:
    """Report one request's completion, with what its answer's body said (if read)."""
    if usage is not None:
        usage.finish()
    # Looked up per report (a test may wrap the scheduler's): remote deciders report
    # to the service's process themselves.
    complete = svc.decider.complete if svc.scheduler is None else svc.scheduler.complete
    complete(
        decision_id=decision_id, endpoint=endpoint, status=status,
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        ttft_s=usage.ttft_s if usage else None)


class _Stream:
    """One HTTP request's ext_proc conversation (one gRPC stream).

    ``handle`` answers one message with zero or more messages; after it sets ``ended``
    (an immediate response was sent) the stream must end.
    """

    __slots__ = ("svc", "duplex", "response_mode", "headers", "chunks", "size", "subset",
                 "subset_error", "started", "decision", "status", "response_started",
                 "response_done", "served", "lb_metadata", "reported", "usage", "ended",
                 "observed", "echo", "rewritten")

    def __init__(self, svc: ExtProcService, observed: bool = False) -> None:
        self.svc = svc
        #: An observer stream reports this request's completion (OBSERVED_METADATA).
        self.observed = observed
        self.duplex = False
        self.response_mode = _Mode.NONE
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.subset: list[str] | None = None
        self.subset_error: ValueError | None = None
        self.started = time.perf_counter()
        self.decision: Decision | None = None
        self.status: int | None = None
        self.response_started = False
        self.response_done = False
        self.served = ""
        self.lb_metadata: bool | None = None  # None: no namespace; False: no served key
        self.reported = False
        self.usage: UsageReader | None = None
        self.ended = False
        #: Stream the body's own chunks back after routing (False: the native worker's
        #: hub, whose worker echoes them itself).
        self.echo = True
        #: The routed body was rewritten (the chunks sent back are epick's, not Envoy's).
        self.rewritten = False

    # -- dispatch -------------------------------------------------------------------

    def handle(self, msg: ep.ProcessingRequest):
        """The answers to ``msg``: a list, or (a message that routes) an awaitable of one.
        Per-chunk messages never make a coroutine."""
        if msg.HasField("metadata_context"):
            self._read_metadata(msg.metadata_context)
        kind = msg.WhichOneof("request")
        if kind == "response_body":  # the most frequent by far (every answer chunk)
            return [self._response_body(msg.response_body)]
        if kind == "request_headers":
            return self._request_headers(msg)
        if kind == "request_body":
            return self._request_body(msg.request_body)
        if kind == "request_trailers":
            if self.duplex and self.decision is None:  # the body ended with trailers
                return self._route_trailers()
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            return [self._response_headers(msg.response_headers)]
        if kind == "response_trailers":
            self._response_end()
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return self._end(unexpected(kind))

    def _end(self, response: ep.ProcessingResponse) -> list[ep.ProcessingResponse]:
        self.ended = True
        return [response]

    async def _route_trailers(self) -> list[ep.ProcessingResponse]:
        out = await self._route(end=False)
        if not self.ended:
            out.append(trailers_continue())
        return out

    # -- the request ------------------------------------------------------------------

    def _request_headers(self, msg: ep.ProcessingRequest):
        self.headers = _headers(msg.request_headers)
        self.started = time.perf_counter()
        mode = _Mode.BUFFERED
        if msg.HasField("protocol_config"):
            mode = msg.protocol_config.request_body_mode
            self.response_mode = msg.protocol_config.response_body_mode
        self.duplex = mode == _DUPLEX
        if msg.request_headers.end_of_stream:
            return self._route(end=None)
        if mode != _DUPLEX and mode not in _BUFFERED:
            return self._end(bad_mode(mode))
        if self.duplex:
            return []  # the answer waits for the body: the destination depends on it
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    def _request_body(self, body: ep.HttpBody):
        limit = self.svc.config.max_body_bytes
        self.size += len(body.body)
        if self.size > limit:
            return self._end(too_large(limit))
        if not self.duplex:
            if not body.end_of_stream:
                return self._end(not_buffered())
            self.chunks.append(body.body)
            return self._route(end=True)
        self.chunks.append(body.body)
        if not body.end_of_stream:
            return []
        return self._route(end=True)

    async def _route(self, *, end: bool | None) -> list[ep.ProcessingResponse]:
        """Decide; ``end``: None = body-less, True = the body ended, False = trailers
        follow the body."""
        begun = self.route_begin(time.perf_counter())
        if isinstance(begun, list):
            return begun
        t0, parsed, subset, selected, verdict = begun
        if verdict is None:
            verdict = await self.svc.decide(parsed.pick, subset=subset, started=t0)
        return self.route_finish(verdict, parsed, selected, end)

    def route_begin(self, t0: float):
        """The request read (not decided): the answers when it ends here (a list), else
        ``(t0, parsed, subset, selected, verdict)`` — ``verdict`` set when refused
        already, else the pick is to decide. The native worker's hub calls it too."""
        svc = self.svc
        if self.subset_error is not None:  # Envoy's configuration, not the client: a 500
            svc.decider.refuse(self.subset_error, started=t0)
            return self._end(immediate(500, f"epick ext_proc: {self.subset_error}",
                                       "server_error", reason="rejected-internal"))
        raw = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        subset, selected = self.subset, None
        if svc.config.conformance_hooks:
            selected = _test_selection(self.headers.get(TEST_SELECTION_HEADER, "")) or None
            subset = selected or subset
        try:
            parsed = translate_with(svc.openai, self.headers, self.headers.get(":path", "/"),
                                    raw or None)
        except Exception as exc:  # malformed (invalid), or a bug (error)
            return t0, None, subset, selected, svc.decider.refuse(exc, started=t0)
        return t0, parsed, subset, selected, None

    def route_finish(self, verdict, parsed: OpenAIRequest | None, selected,
                     end: bool | None) -> list[ep.ProcessingResponse]:
        """The answers to a decided request (``route_begin``'s sequel)."""
        svc = self.svc
        decision = verdict.decision
        if decision is None:
            if selected and verdict.outcome == "unavailable":
                # Upstream's picker: no listed endpoint is a 429 (its suite expects it).
                return self._end(_immediate(refusal("shed", verdict.message)))
            if verdict.outcome != "error":  # epick's decision: the same in both modes
                return self._end(_immediate(refusal(verdict.outcome, verdict.message)))
            if svc.config.failure_mode == "closed":
                return self._end(immediate(503, f"epick: {verdict.message}",
                                           "service_unavailable", reason="rejected-internal"))
            # Open: no destination at all (a client's own copy is dropped too), so Envoy's
            # route for requests without one serves it.
            common = ep.CommonResponse(header_mutation=ep.HeaderMutation(
                remove_headers=[DESTINATION_HEADER]), clear_route_cache=True)
            return self._continue(common, None, None, end)
        self.decision = decision
        self.rewritten = parsed.rewritten

        value = ",".join([decision.endpoint, *decision.fallbacks[:svc.config.fallbacks]])
        set_headers = [_header(DESTINATION_HEADER, value)]
        if verdict.trace is not None:  # a traced pick: the model server's parent is its span
            set_headers += [_header(k, v)
                            for k, v in svc.decider.tracer.outgoing(verdict.trace).items()]
        if parsed.rewritten:
            set_headers.append(_header("content-length", str(len(parsed.body))))
        common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=set_headers),
                                   clear_route_cache=True)
        metadata = struct_pb2.Struct()
        metadata.get_or_create_struct(svc.config.metadata_namespace)[DESTINATION_HEADER] = value
        return self._continue(common, metadata, parsed, end)

    def _continue(self, common: ep.CommonResponse, metadata: struct_pb2.Struct | None,
                  parsed: OpenAIRequest | None, end: bool | None) -> list[ep.ProcessingResponse]:
        """The routing answer, shaped for the mode and the phase it comes in."""
        rewritten = parsed is not None and parsed.rewritten
        if end is None or self.duplex:
            first = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
        else:  # BUFFERED: the body message carries the mutations (headers are not sent yet)
            if rewritten:
                common.body_mutation.body = parsed.body
            first = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        if metadata is not None:
            first.dynamic_metadata.CopyFrom(metadata)
        out = [first]
        if end is not None and self.duplex:
            # Stream the body back: Envoy forwards only what we return.
            chunks = ([parsed.body[i:i + CHUNK_BYTES]
                       for i in range(0, len(parsed.body), CHUNK_BYTES)] or [b""]
                      if rewritten else self.chunks if self.echo else [])
            last = len(chunks) - 1
            out += [_streamed("request", c, end and i == last) for i, c in enumerate(chunks)]
        self.chunks = []
        return out

    # -- the response -----------------------------------------------------------------

    def _response_headers(self, msg: ep.HttpHeaders) -> ep.ProcessingResponse:
        headers = _headers(msg)
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else None
        self.response_started = True
        d = self.decision
        if self.response_mode != _Mode.NONE and d is not None:
            self.usage = UsageReader(headers.get("content-type", ""), self.started,
                                     limit=self.svc.config.max_body_bytes)
        if msg.end_of_stream:
            self._response_end()
        if d is None:
            if self.observed:  # the observer reports the id it reads here: only epick's
                return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(header_mutation=ep.HeaderMutation(
                        remove_headers=[DECISION_HEADER]))))
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        mutation = ep.HeaderMutation(set_headers=[_header(DECISION_HEADER, d.decision_id)])
        if self.svc.config.expose_endpoint:
            mutation.set_headers.append(_header(DESTINATION_HEADER, self.served or d.endpoint))
        else:
            mutation.remove_headers.append(DESTINATION_HEADER)
        if self.svc.config.conformance_hooks:
            served = (self.served if self.served
                      else "fail: missing envoy lb metadata" if self.lb_metadata is None
                      else "fail: missing destination endpoint served metadata")
            mutation.set_headers.append(_header(TEST_SERVED_HEADER, served))
            mutation.set_headers.append(_header(TEST_SELECTED_HEADER, d.endpoint))
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)))

    def _response_body(self, body: ep.HttpBody):
        # Per chunk: the body read out of the message once, usage/TTFT from it, and the
        # chunk written back as bytes (no message built).
        chunk = body.body
        eos = body.end_of_stream
        if self.usage is not None:
            self.usage.feed(chunk, time.perf_counter())
        if eos:
            self._response_end()
        if self.response_mode == _DUPLEX:
            return _streamed("response", chunk, eos)
        return ep.ProcessingResponse(response_body=ep.BodyResponse())

    def _response_end(self) -> None:
        if self.response_done:
            return
        self.response_done = True
        if self.observed:
            return  # the observer saw the same end, with the body: it reports
        if self.status is not None and self.status >= 400:
            self._report(abi.CompletionStatus.ERROR)
        else:
            self._report(abi.CompletionStatus.OK)

    def _read_metadata(self, ctx: base_pb2.Metadata) -> None:
        ns = ctx.filter_metadata.get(self.svc.config.metadata_namespace)
        if ns is not None:
            self.lb_metadata = bool(self.lb_metadata) or SERVED_KEY in ns.fields
            if SERVED_KEY in ns.fields:
                self.served = ns.fields[SERVED_KEY].string_value
        if self.decision is None:
            try:
                subset = _subset(ctx)
            except ValueError as exc:
                self.subset_error = exc
            else:
                if subset is not None:
                    self.subset = subset

    # -- completion -------------------------------------------------------------------

    def _report(self, status: abi.CompletionStatus) -> None:
        d = self.decision
        if d is None or self.reported:
            return
        self.reported = True
        _complete(self.svc, d.decision_id, self.served or d.endpoint, status, self.usage)

    def finish(self) -> None:
        """The stream ended (Envoy closes it when the HTTP stream is done): report once."""
        if self.reported or self.decision is None:
            return
        if self.observed and self.status is not None:
            return  # the answer carried the decision id to the observer: it reports
        if self.status is None:
            self._report(abi.CompletionStatus.CANCELLED)  # no response came
        elif self.response_mode != _Mode.NONE and not self.response_done:
            self._report(abi.CompletionStatus.CANCELLED)  # the client left mid-answer
        elif self.status >= 400:
            self._report(abi.CompletionStatus.ERROR)
        else:
            self._report(abi.CompletionStatus.OK)


class _Observer:
    """One request's observer stream (a filter in ``observability_mode``): Envoy sends
    each message without waiting for an answer and ignores any, so none is sent.

    The decision id comes from the answer's ``x-epick-decision-id`` (set by the routing
    filter, which comes after this one in Envoy's chain: the answer passes it first);
    TTFT is measured from this stream's request headers. The completion is reported once:
    at the answer's end_of_stream (or trailers) — then epick ends the stream, so it does
    not linger for Envoy's ``deferred_close_timeout`` — else when the stream ends.
    """

    __slots__ = ("svc", "started", "decision_id", "served", "status", "usage", "done",
                 "reported", "ended")

    def __init__(self, svc: ExtProcService) -> None:
        self.svc = svc
        self.started = time.perf_counter()
        self.decision_id = ""
        self.served = ""
        self.status: int | None = None
        self.usage: UsageReader | None = None
        self.done = False
        self.reported = False
        self.ended = False

    def handle(self, msg: ep.ProcessingRequest) -> None:
        kind = msg.WhichOneof("request")
        if kind == "response_body":  # the most frequent by far (every answer chunk)
            body = msg.response_body
            if self.usage is not None:
                self.usage.feed(body.body, time.perf_counter())
            if body.end_of_stream:
                self._end()
        elif kind == "request_headers":
            self.started = time.perf_counter()
        elif kind == "response_headers":
            self._response_headers(msg)
        elif kind == "response_trailers":
            self._end()

    def _response_headers(self, msg: ep.ProcessingRequest) -> None:
        headers = _headers(msg.response_headers)
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else None
        self.decision_id = headers.get(DECISION_HEADER, "")
        if msg.HasField("metadata_context"):
            ns = msg.metadata_context.filter_metadata.get(self.svc.config.metadata_namespace)
            if ns is not None and SERVED_KEY in ns.fields:
                self.served = ns.fields[SERVED_KEY].string_value
        if self.decision_id:
            self.usage = UsageReader(headers.get("content-type", ""), self.started,
                                     limit=self.svc.config.max_body_bytes)
        if msg.response_headers.end_of_stream:
            self._end()

    def _end(self) -> None:
        self.done = True
        self.ended = True
        self._report(abi.CompletionStatus.ERROR if self.status is not None
                     and self.status >= 400 else abi.CompletionStatus.OK)

    def _report(self, status: abi.CompletionStatus) -> None:
        if not self.decision_id or self.reported:
            return
        self.reported = True
        # The endpoint that served, if the data plane said (metadata); else empty: the
        # scheduler releases the endpoint it picked, by the decision id.
        _complete(self.svc, self.decision_id, self.served, status, self.usage)

    def finish(self) -> None:
        """The stream ended before the answer did (the client left): CANCELLED."""
        if not self.reported:
            self._report(abi.CompletionStatus.CANCELLED)


def _observed(context) -> bool:
    """Whether the routing filter says an observer reports (OBSERVED_METADATA)."""
    for key, value in context.invocation_metadata() or ():
        if key == OBSERVED_METADATA:
            return value.strip().lower() in ("true", "1")
    return False


def _awaitable(decide):
    """The service's ``decide`` as the streams call it (awaited): a verdict, or an
    awaitable of one from a decider that may wait (flow control)."""
    async def decide_async(pick, *, subset, started):
        verdict = decide(pick, subset=subset, started=started)
        return await verdict if inspect.isawaitable(verdict) else verdict
    return decide_async


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    """Serves ``Process`` streams through ``decider`` (the pick path every front end
    shares) on the event-loop thread, reading requests with the ``openai`` settings.

    ``decider`` is the service's :class:`Decider` (called synchronously), or a remote one
    (a front-end worker's: ``decide_async``, ``refuse`` and ``complete``).
    """

    def __init__(self, decider: Decider, config: ExtProcConfig, openai: OpenAIConfig) -> None:
        if not openai.base_model:
            raise ValueError("ExtProcService needs a base model (openai.base_model)")
        self.decider = decider
        self.scheduler = getattr(decider, "scheduler", None)
        self.decide = getattr(decider, "decide_async", None) or _awaitable(decider.decide)
        self.config = config
        self.openai = openai

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context) -> AsyncIterator[ep.ProcessingResponse]:
        messages = request_iterator.__aiter__()
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            return
        if first.observability_mode:
            await self._observe(first, messages)
            return
        stream = _Stream(self, _observed(context))
        try:
            msg = first
            while True:
                out = stream.handle(msg)
                if not isinstance(out, list):  # waiting for a decision (flow control, a worker)
                    out = await out
                for response in out:
                    yield response
                if stream.ended:
                    return  # one immediate response, then the stream ends
                try:
                    msg = await messages.__anext__()
                except StopAsyncIteration:
                    return
        finally:
            stream.finish()

    async def _observe(self, first: ep.ProcessingRequest, messages) -> None:
        """An observer stream: read, never answer; end it once the answer ended."""
        stream = _Observer(self)
        try:
            stream.handle(first)
            if stream.ended:
                return
            async for msg in messages:
                stream.handle(msg)
                if stream.ended:
                    return
        finally:
            stream.finish()


def build_server(decider: Decider, config: ExtProcConfig, openai: OpenAIConfig, *,
                 health=None, reuse_port: bool = False
                 ) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) serving ext_proc (and ``health``, if given) on
    ``config.listen``; returns it and the bound port. Raises OSError if it cannot bind.
    ``reuse_port``: share the port with the other front-end workers (SO_REUSEPORT)."""
    # A ProcessingRequest carries the whole body in BUFFERED mode: allow Envoy's buffer
    # (4 MiB in the example) plus headers, above gRPC's 4 MiB default.
    # Thousands of streams open at once while the loop is busy: Core must hold them all
    # until the loop takes them, not refuse those past 1,000 nor cancel those it held
    # 30 s (epick.api.grpc_server).
    server = grpc.aio.server(options=[("grpc.so_reuseport", int(reuse_port)),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      *PENDING_CALLS_OPTIONS])
    # The generated registration, with a serializer that also takes pre-encoded bytes.
    service = ExtProcService(decider, config, openai)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Process": grpc.stream_stream_rpc_method_handler(
            service.Process, request_deserializer=ep.ProcessingRequest.FromString,
            response_serializer=_serialize)}),))
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(config.listen)
    if not port:
        raise OSError(f"ext_proc: cannot listen on {config.listen}")
    return server, port
