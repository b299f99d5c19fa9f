"""The ``epick.v1.EndpointPicker`` gRPC service: decode, schedule, encode — nothing else.

Validation of every field happens here (the edge), so the scheduler never re-checks;
scheduling errors become gRPC status codes in one place, :func:`status_for`.
"""

from __future__ import annotations

import time

import grpc

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc
from epick.scheduler.scheduler import Scheduler, SchedulingError, Shed, Unavailable, random_seed

__all__ = ["PickerService", "InvalidArgument", "to_request", "status_for"]

#: Limits on request fields; beyond them a request is INVALID_ARGUMENT.
MAX_PROMPT_BYTES = 4 << 20
MAX_NAME = 256
MAX_HEADERS = 128
MAX_HEADER_BYTES = 16 << 10

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


def to_request(msg: picker_pb2.PickRequest) -> abi.Request:
    """Validate a PickRequest and turn it into the policies' :class:`abi.Request`."""
    _check_name("PickRequest.model", msg.model, required=True)
    _check_name("PickRequest.adapter", msg.adapter)
    if len(msg.request_id) > MAX_NAME:
        raise InvalidArgument(
            f"PickRequest.request_id is {len(msg.request_id)} characters long; "
            f"the limit is {MAX_NAME}"
        )
    if len(msg.cache_salt) > MAX_NAME:
        raise InvalidArgument(
            f"PickRequest.cache_salt is {len(msg.cache_salt)} characters long; "
            f"the limit is {MAX_NAME}"
        )
    if "\0" in msg.cache_salt:
        # The prefix hash frames the salt with NUL bytes (policies/ABI.md).
        raise InvalidArgument("PickRequest.cache_salt contains a NUL character")
    prompt_bytes = len(msg.prompt.encode())
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
    if len(msg.headers) > MAX_HEADERS:
        raise InvalidArgument(
            f"PickRequest.headers has {len(msg.headers)} entries; the limit is {MAX_HEADERS}"
        )
    if sum(len(k) + len(v) for k, v in msg.headers.items()) > MAX_HEADER_BYTES:
        raise InvalidArgument(f"PickRequest.headers exceed {MAX_HEADER_BYTES} bytes in total")
    return abi.Request(
        request_id=msg.request_id,
        model=msg.model,
        adapter=msg.adapter,
        prompt=msg.prompt,
        criticality=criticality,
        seed=msg.seed if msg.HasField("seed") else random_seed(),
        cache_salt=msg.cache_salt,
        headers=dict(msg.headers),
    )


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
            )
    return resp


class PickerService(picker_pb2_grpc.EndpointPickerServicer):
    """Serves Pick and ReportCompletion from a :class:`Scheduler` on the event-loop thread."""

    def __init__(self, scheduler: Scheduler, telemetry=None) -> None:
        self.scheduler = scheduler
        self.telemetry = telemetry

    async def Pick(self, request, context):
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            decision = self.scheduler.schedule(to_request(request), explain=request.explain)
            return to_response(decision)
        except (InvalidArgument, SchedulingError) as exc:
            outcome = "invalid" if isinstance(exc, InvalidArgument) else exc.outcome
            await context.abort(status_for(exc), str(exc))
        except Exception as exc:  # a bug: never take the service down, say what happened
            outcome = "error"
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        finally:
            if self.telemetry is not None:
                self.telemetry.pick_done(outcome, time.perf_counter() - t0)

    async def ReportCompletion(self, request, context):
        if not request.decision_id and not request.request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "CompletionReport needs decision_id or request_id; both are empty",
            )
        status = _COMPLETION.get(request.status)
        if status is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"CompletionReport.status {request.status} is not one of OK (0), ERROR (1), "
                "CANCELLED (2)",
            )
        known = self.scheduler.complete(
            decision_id=request.decision_id,
            request_id=request.request_id,
            endpoint=request.endpoint,
            status=status,
            prompt_tokens=request.prompt_tokens if request.HasField("prompt_tokens") else None,
            completion_tokens=(request.completion_tokens
                               if request.HasField("completion_tokens") else None),
            ttft_s=request.ttft_seconds if request.HasField("ttft_seconds") else None,
        )
        return picker_pb2.CompletionAck(known=known)
