"""The ``epick.v1.EndpointPicker`` gRPC service: decode, decide, encode — nothing else.

Validation (:mod:`epick.api.validate`), scheduling, the outcome label and telemetry are
the one pick path every front end shares (:class:`epick.api.decide.Decider`); this module
only turns its :class:`~epick.api.decide.Verdict` into a ``PickResponse`` or a gRPC
status (:data:`~epick.api.decide.REFUSALS`). The unary ``Pick`` / ``ReportCompletion``
and the streaming ``PickStream`` share one answer per message
(:meth:`PickerService.answer_pick`, :meth:`PickerService.answer_completion`), so a message
gets the same answer either way.

This is the hot path (docs/performance.md): per pick it reads each protobuf field once,
records telemetry through pre-bound children, and builds no explanation unless asked.

With flow control on (``decider.flow`` set) picks go through the awaitable twins
(:meth:`PickerService.answer_pick_async`): a request may wait in epick's queue, and a
refusal carries upstream's ``x-llm-d-request-dropped-reason`` as trailing metadata.
Unary ``Pick`` passes its gRPC deadline; a PickStream answers in order, each pick
waiting on its own (a queued pick does not hold back the stream's reading).
"""

from __future__ import annotations

import logging

import anyio
import grpc

from epick.api.decide import REFUSALS, Decider, Verdict, outcome_of
from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc
from epick.api.status import grpc_code
from epick.api.validate import (
    SESSION_HEADER,
    InvalidArgument,
    pin_of,
    to_completion,
    to_request,
)
from epick.interfaces import PolicyFailure
from epick.scheduler.scheduler import Scheduler

__all__ = ["PickerService", "InvalidArgument", "to_request", "to_completion", "pin_of",
           "status_for", "to_response", "response_bytes", "add_to_server"]

log = logging.getLogger("epick.api")

#: Answers a PickStream may hold that the transport has not taken yet; beyond it, epick
#: stops reading that stream. Enough to overlap reading with writing.
STREAM_WINDOW = 16


def status_for(exc: Exception) -> grpc.StatusCode:
    """The gRPC status code of a pick that failed with ``exc``: a policy failure's by its
    kind (``interfaces.STATUS``), anything else's from :data:`REFUSALS`."""
    if isinstance(exc, PolicyFailure):
        return grpc_code(exc)
    return REFUSALS[outcome_of(exc)].grpc


def to_response(decision) -> picker_pb2.PickResponse:
    resp = picker_pb2.PickResponse(
        endpoint=decision.endpoint,
        fallbacks=decision.fallbacks,
        decision_id=decision.decision_id,
    )
    if decision.explanation is not None:
        ex = resp.explanation
        ex.snapshot_version = decision.snapshot_version
        ex.skipped_policies.extend(decision.skipped)
        for c in decision.explanation:
            ex.candidates.add(
                endpoint=c.endpoint, total=c.total, scores=c.scores,
                filtered_by=c.filtered_by, rank=c.rank, shadow_scores=c.shadow_scores,
                reason=c.reason,
                in_flight=c.in_flight, picked_since_scrape=c.picked_since_scrape,
                prefix_blocks=c.prefix_blocks, prefix_matched=c.prefix_matched,
            )
    return resp


def _field(tag: int, text: str) -> bytes:
    """One length-delimited protobuf field: its tag byte, the varint length, the UTF-8."""
    raw = text.encode()
    n = len(raw)
    head = bytearray((tag,))
    while n >= 0x80:
        head.append((n & 0x7F) | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + raw


#: Each address's encoded ``endpoint`` (field 1) and ``fallbacks`` entry (field 2): a
#: pool names a bounded set, so every pick after the first finds them.
_ENDPOINT_FIELD: dict[str, bytes] = {}
_FALLBACK_FIELD: dict[str, bytes] = {}
_MAX_FIELDS = 4096
#: ``decision_id``'s tag and one-byte length, by length.
_ID_HEADS = tuple(bytes((0x1A, n)) for n in range(0x80))


def _cached(cache: dict[str, bytes], tag: int, text: str) -> bytes:
    got = cache.get(text)
    if got is None:
        if len(cache) >= _MAX_FIELDS:
            cache.clear()
        got = cache[text] = _field(tag, text)
    return got


def response_bytes(decision) -> bytes:
    """``to_response(decision).SerializeToString()`` for a decision without an
    explanation, built without a message: fields in number order, as protobuf writes
    them (an empty ``endpoint`` or ``decision_id`` is left out, every fallback is
    written). Unary ``Pick`` answers with it (:func:`add_to_server`); the same bytes,
    ~3 µs less a pick (tests/api/test_response_bytes.py)."""
    endpoint = decision.endpoint
    head = _ENDPOINT_FIELD.get(endpoint)
    if head is None:
        head = _cached(_ENDPOINT_FIELD, 0x0A, endpoint) if endpoint else b""
    fallbacks = _FALLBACK_FIELD
    for fallback in decision.fallbacks:
        got = fallbacks.get(fallback)
        head += got if got is not None else _cached(fallbacks, 0x12, fallback)
    raw = decision.decision_id.encode()
    if len(raw) < 0x80:  # a decision id (~12 bytes): a one-byte length
        return head + _ID_HEADS[len(raw)] + raw if raw else head
    return head + _field(0x1A, decision.decision_id)


def _serialize_pick(response) -> bytes:
    """Pick's response serializer: bytes :func:`response_bytes` made, or a message."""
    return response if response.__class__ is bytes else response.SerializeToString()


def add_to_server(servicer: PickerService, server) -> None:
    """``add_EndpointPickerServicer_to_server``, with unary Pick's responses allowed to be
    the bytes :func:`response_bytes` made (every other method as generated)."""

    class _Capture:
        def add_generic_rpc_handlers(self, handlers) -> None:
            pass

        def add_registered_method_handlers(self, name, handlers) -> None:
            self.name, self.handlers = name, dict(handlers)

    got = _Capture()
    picker_pb2_grpc.add_EndpointPickerServicer_to_server(servicer, got)
    handlers = got.handlers
    handlers["Pick"] = handlers["Pick"]._replace(response_serializer=_serialize_pick)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(got.name, handlers),))
    server.add_registered_method_handlers(got.name, handlers)


#: One answer: a response, or the status code and details the call fails with (the
#: async twins add trailing metadata: ``(code, details, metadata)``).
Answer = tuple[object, None] | tuple[None, tuple[grpc.StatusCode, str]]

#: Upstream's header on a refusal that says why the request was dropped.
DROPPED_REASON = "x-llm-d-request-dropped-reason"


class PickerService(picker_pb2_grpc.EndpointPickerServicer):
    """Serves Pick, ReportCompletion and PickStream from a :class:`Scheduler`.

    Everything runs on the event-loop thread: a message is validated, scheduled and
    encoded without an ``await`` in between, so picks never interleave with each other
    or with a policy swap.

    ``telemetry`` (optional) gets ``pick_done(outcome, seconds)`` per pick, with
    outcome one of :data:`epick.telemetry.PICK_OUTCOMES`. ``decider`` is the pick path
    (:class:`Decider`), shared with the service's other front ends.
    """

    def __init__(self, scheduler: Scheduler, telemetry=None, *,
                 allow_pinning: bool = False, weights=None, tracer=None,
                 session_header: str = SESSION_HEADER) -> None:
        self.decider = Decider(scheduler, telemetry, allow_pinning=allow_pinning,
                               tracer=tracer, session_header=session_header)
        self.scheduler = scheduler  # for ReportCompletion
        self._decide = self.decider.decide
        #: The :class:`epick.api.weights.WeightsHub` behind WatchWeights (None: off).
        self.weights = weights

    @property
    def telemetry(self):
        return self.decider.telemetry

    def answer_pick(self, msg: picker_pb2.PickRequest, carrier=None) -> Answer:
        """Decide one pick and encode the verdict; never raises. ``carrier``: where the
        call's trace headers are (the gRPC context, HTTP headers), read only when tracing
        is on."""
        verdict = self._decide(msg, carrier=carrier)
        if verdict.decision is not None:
            return to_response(verdict.decision), None
        return None, (REFUSALS[verdict.outcome].grpc, verdict.message)

    async def answer_pick_async(self, msg: picker_pb2.PickRequest, *,
                                deadline_s: float | None = None, carrier=None) -> Answer:
        """:meth:`answer_pick` through flow control; an error is ``(code, details,
        trailing metadata)`` with the dropped reason."""
        return self.encode(await self.decider.decide_async(msg, deadline_s=deadline_s,
                                                           carrier=carrier), msg.explain)

    @staticmethod
    def encode(verdict: Verdict, explain: bool) -> Answer:
        if verdict.decision is not None:
            response = to_response(verdict.decision)
            if explain:
                response.explanation.queue_wait_ms = verdict.queue_wait_ms
                response.explanation.queue_reason = verdict.queue_reason
            return response, None
        refusal = REFUSALS[verdict.outcome]
        metadata = ((DROPPED_REASON, refusal.reason),) if refusal.reason else ()
        return None, (refusal.grpc, verdict.message, metadata)

    def answer_completion(self, msg: picker_pb2.CompletionReport) -> Answer:
        """Validate one completion report and run the post_response hooks; never raises."""
        try:
            status = to_completion(msg)
        except InvalidArgument as exc:
            return None, (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            known = self.scheduler.complete(
                decision_id=msg.decision_id,
                request_id=msg.request_id,
                endpoint=msg.endpoint,
                status=status,
                prompt_tokens=msg.prompt_tokens if msg.HasField("prompt_tokens") else None,
                completion_tokens=(msg.completion_tokens
                                   if msg.HasField("completion_tokens") else None),
                ttft_s=msg.ttft_seconds if msg.HasField("ttft_seconds") else None,
            )
        except Exception as exc:  # a bug, as in answer_pick
            log.exception("ReportCompletion failed")
            return None, (grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        return picker_pb2.CompletionAck(known=known), None

    async def Pick(self, request, context):
        """Registered by :func:`add_to_server`: a plain answer is the response's bytes."""
        if self.decider.flow is None:
            verdict = self._decide(request, carrier=context)  # answer_pick, inline
            decision = verdict.decision
            if decision is not None:
                if decision.explanation is None:
                    return response_bytes(decision)
                return to_response(decision)
            error = (REFUSALS[verdict.outcome].grpc, verdict.message)
        else:
            response, error = await self.answer_pick_async(
                request, deadline_s=context.time_remaining(), carrier=context)
        if error is not None:
            await context.abort(*error)
        return response

    async def ReportCompletion(self, request, context):
        response, error = self.answer_completion(request)
        if error is not None:
            await context.abort(*error)
        return response

    async def PickStream(self, request_iterator, context) -> None:
        """One response per request message, in order, each with the request's id.

        A bad message is answered with a :class:`StreamError` and the stream goes on.
        Two tasks: one reads and answers, one writes, so reading message k + 1 overlaps
        writing answer k. Between them at most :data:`STREAM_WINDOW` answers wait; when
        the client stops reading, writes stall (HTTP/2 flow control), that buffer fills,
        and epick stops reading the stream: backpressure all the way to the client.
        """
        send, receive = anyio.create_memory_object_stream[picker_pb2.PickStreamResponse](
            STREAM_WINDOW)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._answer_stream, request_iterator, send, tg, context)
            async with receive:
                async for response in receive:
                    if isinstance(response, _Slot):  # a pick waiting in flow control
                        await response.filled.wait()
                        response = response.value
                    await context.write(response)

    async def WatchWeights(self, request, context) -> None:
        from epick.api.weights import watch_weights  # the module imports this one

        await watch_weights(self.weights, request, context)

    async def _answer_stream(self, request_iterator, send, tg, context=None) -> None:
        async with send:
            async for msg in request_iterator:
                if self.decider.flow is not None and msg.WhichOneof("kind") == "pick":
                    # Its answer is written in order, when it comes; reading goes on.
                    slot = _Slot()
                    tg.start_soon(self._fill, slot, msg, context)
                    await send.send(slot)
                else:
                    await send.send(self.answer_stream_message(msg, context))

    async def _fill(self, slot: _Slot, msg: picker_pb2.PickStreamRequest,
                    context=None) -> None:
        response, error = await self.answer_pick_async(msg.pick, carrier=context)
        slot.value = self._stream_answer(msg, response, error)
        slot.filled.set()

    def answer_stream_message(
        self, msg: picker_pb2.PickStreamRequest, carrier=None
    ) -> picker_pb2.PickStreamResponse:
        """The one response to one PickStream message; never raises. ``carrier``: the
        stream's trace headers (its gRPC context); a message's own ``headers`` win."""
        kind = msg.WhichOneof("kind")
        if kind == "pick":
            response, error = self.answer_pick(msg.pick, carrier)
            return self._stream_answer(msg, response, error)
        if kind == "completion":
            response, error = self.answer_completion(msg.completion)
            if error is None:
                return picker_pb2.PickStreamResponse(id=msg.id, completion=response)
        else:
            error = (grpc.StatusCode.INVALID_ARGUMENT,
                     f"PickStreamRequest {msg.id} has neither pick nor completion")
        code, details = error[:2]
        return picker_pb2.PickStreamResponse(
            id=msg.id, error=picker_pb2.StreamError(code=code.value[0], message=details))

    @staticmethod
    def _stream_answer(msg: picker_pb2.PickStreamRequest, response, error
                       ) -> picker_pb2.PickStreamResponse:
        if error is None:
            return picker_pb2.PickStreamResponse(id=msg.id, pick=response)
        code, details = error[:2]
        return picker_pb2.PickStreamResponse(
            id=msg.id, error=picker_pb2.StreamError(code=code.value[0], message=details))


class _Slot:
    """A PickStream answer still waiting in flow control (written when filled)."""

    __slots__ = ("filled", "value")

    def __init__(self) -> None:
        self.filled = anyio.Event()
        self.value: picker_pb2.PickStreamResponse | None = None
