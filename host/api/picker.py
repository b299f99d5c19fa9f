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
"""

from __future__ import annotations

import logging

import anyio
import grpc

from epick.api.decide import REFUSALS, Decider, outcome_of
from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc
from epick.api.status import grpc_code
from epick.api.validate import InvalidArgument, pin_of, to_completion, to_request
from epick.interfaces import PolicyFailure
from epick.scheduler.scheduler import Scheduler

__all__ = ["PickerService", "InvalidArgument", "to_request", "to_completion", "pin_of",
           "status_for"]

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


#: One answer: a response, or the status code and details the call fails with.
Answer = tuple[object, None] | tuple[None, tuple[grpc.StatusCode, str]]


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
                 allow_pinning: bool = False, weights=None, tracer=None) -> None:
        self.decider = Decider(scheduler, telemetry, allow_pinning=allow_pinning,
                               tracer=tracer)
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
        response, error = self.answer_pick(request, context)
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
            tg.start_soon(self._answer_stream, request_iterator, send, context)
            async with receive:
                async for response in receive:
                    await context.write(response)

    async def WatchWeights(self, request, context) -> None:
        from epick.api.weights import watch_weights  # the module imports this one

        await watch_weights(self.weights, request, context)

    async def _answer_stream(self, request_iterator, send, context=None) -> None:
        async with send:
            async for msg in request_iterator:
                await send.send(self.answer_stream_message(msg, context))

    def answer_stream_message(
        self, msg: picker_pb2.PickStreamRequest, carrier=None
    ) -> picker_pb2.PickStreamResponse:
        """The one response to one PickStream message; never raises. ``carrier``: the
        stream's trace headers (its gRPC context); a message's own ``headers`` win."""
        kind = msg.WhichOneof("kind")
        if kind == "pick":
            response, error = self.answer_pick(msg.pick, carrier)
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
