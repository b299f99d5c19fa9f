"""The ``epick.v1.EndpointPicker`` gRPC service: decode, schedule, encode — nothing else.

Validation of every field happens here (the edge), so the scheduler never re-checks;
scheduling errors become gRPC status codes in one place, :func:`status_for`. The unary
``Pick`` / ``ReportCompletion`` and the streaming ``PickStream`` share one validation and
one answer per message (:meth:`PickerService.answer_pick`,
:meth:`PickerService.answer_completion`), so a message gets the same answer either way.

This is the hot path (docs/performance.md): per pick it reads each protobuf field once,
records telemetry through pre-bound children, and builds no explanation unless asked.
"""

from __future__ import annotations

import logging
import random
import time

import anyio
import grpc

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc
from epick.scheduler.scheduler import Scheduler, SchedulingError, Shed, Unavailable

__all__ = ["PickerService", "InvalidArgument", "to_request", "to_completion", "pin_of",
           "status_for"]

log = logging.getLogger("epick.api")

#: Limits on request fields; beyond them a request is INVALID_ARGUMENT.
MAX_PROMPT_BYTES = 4 << 20
MAX_NAME = 256
MAX_HEADERS = 128
MAX_HEADER_BYTES = 16 << 10
#: Answers a PickStream may hold that the transport has not taken yet; beyond it, epick
#: stops reading that stream. Enough to overlap reading with writing.
STREAM_WINDOW = 16

# PickRequest.Criticality -> abi.Criticality (UNSPECIFIED means STANDARD).
_CRITICALITY = {
    picker_pb2.CRITICALITY_UNSPECIFIED: abi.Criticality.STANDARD,
    picker_pb2.CRITICAL: abi.Criticality.CRITICAL,
    picker_pb2.STANDARD: abi.Criticality.STANDARD,
    picker_pb2.SHEDDABLE: abi.Criticality.SHEDDABLE,
}
_COMPLETION = {
    picker_pb2.OK: abi.CompletionStatus.OK,
    picker_pb2.ERROR: abi.CompletionStatus.ERROR,
    picker_pb2.CANCELLED: abi.CompletionStatus.CANCELLED,
}


class InvalidArgument(ValueError):
    """A request field is malformed; the message names the field and what was wrong."""


def _check_name(field: str, value: str, *, required: bool = False) -> None:
    if required and not value:
        raise InvalidArgument(f"{field} is required")
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"{field} is {len(value)} characters long; the limit is {MAX_NAME}")
    if "," in value:
        raise InvalidArgument(f"{field} {value!r} contains a comma, which no model server allows")
    if value != value.strip():
        raise InvalidArgument(f"{field} {value!r} has leading or trailing whitespace")
    if not value.isprintable():
        raise InvalidArgument(f"{field} {value!r} contains control characters")


def random_seed() -> int:
    """A fresh u64 seed for a request that brought none (the API's default, so the
    scheduler only ever sees seeded requests)."""
    return random.getrandbits(64)


def to_request(msg: picker_pb2.PickRequest) -> abi.Request:
    """Validate a PickRequest and turn it into the policies' :class:`abi.Request`."""
    # Each protobuf field access builds a new Python object (a str decoded from UTF-8
    # for the prompt): read every field once.
    model, adapter, prompt = msg.model, msg.adapter, msg.prompt
    request_id, cache_salt, headers = msg.request_id, msg.cache_salt, msg.headers
    _check_name("PickRequest.model", model, required=True)
    if adapter:
        _check_name("PickRequest.adapter", adapter)
    if len(request_id) > MAX_NAME:
        raise InvalidArgument(
            f"PickRequest.request_id is {len(request_id)} characters long; "
            f"the limit is {MAX_NAME}"
        )
    if cache_salt:
        if len(cache_salt) > MAX_NAME:
            raise InvalidArgument(
                f"PickRequest.cache_salt is {len(cache_salt)} characters long; "
                f"the limit is {MAX_NAME}"
            )
        if "\0" in cache_salt:
            # The prefix hash frames the salt with NUL bytes (policies/ABI.md).
            raise InvalidArgument("PickRequest.cache_salt contains a NUL character")
    # A character is at most 4 UTF-8 bytes: only a long prompt needs encoding to count.
    if len(prompt) * 4 > MAX_PROMPT_BYTES:
        prompt_bytes = len(prompt.encode())
        if prompt_bytes > MAX_PROMPT_BYTES:
            raise InvalidArgument(
                f"PickRequest.prompt is {prompt_bytes} bytes; the limit is {MAX_PROMPT_BYTES}"
            )
    criticality = _CRITICALITY.get(msg.criticality)
    if criticality is None:
        raise InvalidArgument(
            f"PickRequest.criticality {msg.criticality} is not one of CRITICAL (1), "
            "STANDARD (2), SHEDDABLE (3)"
        )
    if headers:
        if len(headers) > MAX_HEADERS:
            raise InvalidArgument(
                f"PickRequest.headers has {len(headers)} entries; the limit is {MAX_HEADERS}"
            )
        headers = dict(headers)
        if sum(len(k) + len(v) for k, v in headers.items()) > MAX_HEADER_BYTES:
            raise InvalidArgument(f"PickRequest.headers exceed {MAX_HEADER_BYTES} bytes in total")
    else:
        headers = {}
    return abi.Request(
        request_id=request_id,
        model=model,
        adapter=adapter,
        prompt=prompt,
        criticality=criticality,
        seed=msg.seed if msg.HasField("seed") else random_seed(),
        cache_salt=cache_salt,
        headers=headers,
    )


def pin_of(msg: picker_pb2.PickRequest, *, allow_pinning: bool) -> str:
    """The endpoint ``msg`` pins (``""``: none); refused unless pinning is allowed."""
    pin = msg.pin_endpoint
    if not pin:
        return ""
    if not allow_pinning:
        raise InvalidArgument(
            f"PickRequest.pin_endpoint {pin!r} is refused: pinning is off on this server "
            "(set [server] allow_pinning = true to allow it)")
    _check_name("PickRequest.pin_endpoint", pin)
    host, sep, port = pin.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"PickRequest.pin_endpoint {pin!r} is not host:port")
    return pin


def to_completion(msg: picker_pb2.CompletionReport) -> abi.CompletionStatus:
    """Validate a CompletionReport; its status as :class:`abi.CompletionStatus`."""
    if not msg.decision_id and not msg.request_id:
        raise InvalidArgument("CompletionReport needs decision_id or request_id; both are empty")
    status = _COMPLETION.get(msg.status)
    if status is None:
        raise InvalidArgument(
            f"CompletionReport.status {msg.status} is not one of OK (0), ERROR (1), "
            "CANCELLED (2)"
        )
    return status


def status_for(exc: Exception) -> grpc.StatusCode:
    """The one mapping from errors to gRPC status codes."""
    if isinstance(exc, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, Shed):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


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


#: One answer: a response, or the status code and details the call fails with.
Answer = tuple[object, None] | tuple[None, tuple[grpc.StatusCode, str]]


class PickerService(picker_pb2_grpc.EndpointPickerServicer):
    """Serves Pick, ReportCompletion and PickStream from a :class:`Scheduler`.

    Everything runs on the event-loop thread: a message is validated, scheduled and
    encoded without an ``await`` in between, so picks never interleave with each other
    or with a policy swap.

    ``telemetry`` (optional) gets ``pick_done(outcome, seconds)`` per pick, with
    outcome one of :data:`epick.telemetry.PICK_OUTCOMES`.
    """

    def __init__(self, scheduler: Scheduler, telemetry=None, *,
                 allow_pinning: bool = False, weights=None) -> None:
        self.scheduler = scheduler
        #: The :class:`epick.api.weights.WeightsHub` behind WatchWeights (None: off).
        self.weights = weights
        self.telemetry = telemetry
        self.allow_pinning = allow_pinning
        # Bound once: the telemetry object does not change while serving.
        self._pick_done = telemetry.pick_done if telemetry is not None else None

    def answer_pick(self, msg: picker_pb2.PickRequest) -> Answer:
        """Validate, schedule and encode one pick, and record it; never raises."""
        t0 = time.perf_counter()
        try:
            pin = pin_of(msg, allow_pinning=self.allow_pinning)
            req = to_request(msg)
            decision = (self.scheduler.schedule(req, explain=msg.explain, pin=pin) if pin
                        else self.scheduler.schedule(req, explain=msg.explain))
            answer, outcome = (to_response(decision), None), "ok"
        except InvalidArgument as exc:
            answer, outcome = (None, (grpc.StatusCode.INVALID_ARGUMENT, str(exc))), "invalid"
        except SchedulingError as exc:
            answer, outcome = (None, (status_for(exc), str(exc))), exc.outcome
        except Exception as exc:  # a bug: never take the service down, say what happened
            log.exception("Pick failed")
            answer = (None, (grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"))
            outcome = "error"
        if self._pick_done is not None:
            self._pick_done(outcome, time.perf_counter() - t0)
        return answer

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
        response, error = self.answer_pick(request)
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
            tg.start_soon(self._answer_stream, request_iterator, send)
            async with receive:
                async for response in receive:
                    await context.write(response)

    async def WatchWeights(self, request, context) -> None:
        from epick.api.weights import watch_weights  # the module imports this one

        await watch_weights(self.weights, request, context)

    async def _answer_stream(self, request_iterator, send) -> None:
        async with send:
            async for msg in request_iterator:
                await send.send(self.answer_stream_message(msg))

    def answer_stream_message(
        self, msg: picker_pb2.PickStreamRequest
    ) -> picker_pb2.PickStreamResponse:
        """The one response to one PickStream message; never raises."""
        kind = msg.WhichOneof("kind")
        if kind == "pick":
            response, error = self.answer_pick(msg.pick)
            if error is None:
                return picker_pb2.PickStreamResponse(id=msg.id, pick=response)
        elif kind == "completion":
            response, error = self.answer_completion(msg.completion)
            if error is None:
                return picker_pb2.PickStreamResponse(id=msg.id, completion=response)
        else:
            error = (grpc.StatusCode.INVALID_ARGUMENT,
                     f"PickStreamRequest {msg.id} has neither pick nor completion")
        code, details = error
        return picker_pb2.PickStreamResponse(
            id=msg.id, error=picker_pb2.StreamError(code=code.value[0], message=details))
