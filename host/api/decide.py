"""The one pick path: a :class:`PickRequest` from any front end -> a :class:`Verdict`.

gRPC ``Pick`` and ``PickStream`` (:mod:`epick.api.picker`), Envoy's ext_proc
(:mod:`epick.api.ext_proc`) and the HTTP front end translate their wire format into a
``PickRequest`` and call :meth:`Decider.decide`; the reference gateway reaches it through
gRPC ``Pick``. Here, and only here: validation (:func:`~epick.api.validate.to_request`,
:func:`~epick.api.validate.pin_of`), the pin / subset dispatch, scheduling, the outcome
label, telemetry (``epick_picks_total{outcome}``, ``epick_pick_latency_seconds{stage=
"total"}``) and the log line of a failure. A front end only turns the verdict back into
its wire format, through :data:`REFUSALS` — the one table of how each refusal is said.

The input is the ``PickRequest`` rather than the validated :class:`abi.Request` because
validating it is part of the path: a malformed request is counted (``invalid``) and timed
like any other, whichever front end it came through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from epick.api.gen.epick.v1 import picker_pb2
from epick.api.validate import InvalidArgument, pin_of, to_request
from epick.scheduler.scheduler import Decision, Scheduler, SchedulingError

__all__ = ["Decider", "Verdict", "Refusal", "REFUSALS", "outcome_of", "outcome_of_code"]

log = logging.getLogger("epick.api")


@dataclass(slots=True)
class Verdict:
    """What :meth:`Decider.decide` answers; it never raises. (A slotted class, not a
    NamedTuple: half the cost to build, once per pick.)"""

    decision: Decision | None
    """The pick, or ``None`` when the request was refused."""
    outcome: str
    """The metric label: one of :data:`epick.telemetry.PICK_OUTCOMES`."""
    message: str = ""
    """Why it was refused (names the field, the setting or the state); ``""`` when ok."""
    trace: object = None
    """The decision's span context when it was traced (``epick.tracing``), for a front end
    that passes the trace on (ext_proc); ``None`` with tracing off or the pick unsampled."""


class Refusal(NamedTuple):
    """How every front end says one refusal outcome."""

    grpc: grpc.StatusCode
    http: int
    kind: str
    """The OpenAI error ``type``."""
    reason: str
    """Upstream's ``x-llm-d-request-dropped-reason`` (``""``: the header is not sent)."""


#: outcome -> how it is said. ``ok`` is not a refusal. ext_proc's ``failure_mode`` may
#: override the ``error`` row (open: let the request through; closed: 503).
REFUSALS: dict[str, Refusal] = {
    "invalid": Refusal(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", ""),
    "shed": Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded",
                    "rejected-saturated"),
    "unavailable": Refusal(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable",
                           "rejected-no-endpoints"),
    "error": Refusal(grpc.StatusCode.INTERNAL, 500, "server_error", "rejected-internal"),
}
_BY_CODE = {r.grpc: outcome for outcome, r in REFUSALS.items()}


def outcome_of(exc: Exception) -> str:
    """The outcome of a pick that failed with ``exc``: :class:`InvalidArgument` is
    ``invalid``, a :class:`SchedulingError` its own (``shed``, ``unavailable``), anything
    else ``error`` (a bug)."""
    if isinstance(exc, InvalidArgument):
        return "invalid"
    if isinstance(exc, SchedulingError):
        return exc.outcome
    return "error"


def outcome_of_code(code: grpc.StatusCode) -> str:
    """The outcome a ``Pick`` that failed with ``code`` had, for a client of the gRPC API
    (the reference gateway). A code epick does not answer with (the call never reached
    it: unreachable, deadline) is ``unavailable``."""
    return _BY_CODE.get(code, "unavailable")


class Decider:
    """Validate, schedule, label and record one pick, for every front end.

    ``telemetry`` (optional) gets ``pick_done(outcome, seconds)`` per pick. Everything
    runs on the event-loop thread, synchronously: a pick never interleaves with another.
    A new front end needs five lines::

        decider = Decider(scheduler, recorder, allow_pinning=config.server.allow_pinning)
        verdict = decider.decide(pick_request)   # subset=["10.0.0.1:8000"] to restrict
        if verdict.decision is None:
            refusal = REFUSALS[verdict.outcome]  # .grpc / .http / .kind / .reason
            return error(refusal.http, verdict.message)
        return route_to(verdict.decision.endpoint, verdict.decision.fallbacks)

    A problem the front end finds before it has a ``PickRequest`` (its own parsing: an
    OpenAI body that is not JSON) goes through :meth:`refuse`, so it is counted the same.
    """

    __slots__ = ("scheduler", "telemetry", "allow_pinning", "tracer", "_pick_done")

    def __init__(self, scheduler: Scheduler, telemetry=None, *,
                 allow_pinning: bool = False, tracer=None) -> None:
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.allow_pinning = allow_pinning
        #: :class:`epick.tracing.PickTracer` when ``[tracing]`` is on; None: a pick pays
        #: this one attribute check and nothing else for tracing.
        self.tracer = tracer
        # Bound once: the telemetry object does not change while serving.
        self._pick_done = telemetry.pick_done if telemetry is not None else None

    def decide(self, msg: picker_pb2.PickRequest, *,
               subset: Collection[str] | None = None, started: float | None = None,
               carrier=None, explain: bool | None = None) -> Verdict:
        """The verdict on one pick; never raises.

        ``subset`` (a data plane's hint) keeps the pick inside those endpoints; a pinned
        request ignores it. ``started`` (``time.perf_counter()``) is when the front end
        began on this request, so the recorded latency includes its own parsing.
        ``carrier`` is where the front end's trace headers are (a gRPC servicer context,
        a mapping of HTTP headers); it is read only when tracing is on. ``explain`` is the
        tracer's (None: the request's own ``explain``).
        """
        t0 = time.perf_counter() if started is None else started
        if self.tracer is not None and explain is None:
            return self.tracer.decide(self, msg, subset=subset, started=t0, carrier=carrier)
        if explain is None:
            explain = msg.explain
        try:
            pin = pin_of(msg, allow_pinning=self.allow_pinning)
            request = to_request(msg)
            # Only the arguments a pick uses: the common case passes no keywords it ignores.
            if pin:
                decision = self.scheduler.schedule(request, explain=explain, pin=pin)
            elif subset is not None:
                decision = self.scheduler.schedule(request, explain=explain, subset=subset)
            else:
                decision = self.scheduler.schedule(request, explain=explain)
        except Exception as exc:
            return self.refuse(exc, started=t0)
        if self._pick_done is not None:
            self._pick_done("ok", time.perf_counter() - t0)
        return Verdict(decision, "ok")

    def refuse(self, exc: Exception, *, started: float) -> Verdict:
        """Record and answer a pick that failed with ``exc`` (its outcome:
        :func:`outcome_of`); an ``error`` is a bug and is logged with its traceback."""
        outcome = outcome_of(exc)
        if outcome == "error" and not isinstance(exc, SchedulingError):
            # Never take a front end down: say what happened.
            log.error("pick failed: %r", exc, exc_info=exc)
            message = f"internal error: {exc!r}"
        else:
            message = str(exc)
        if self._pick_done is not None:
            self._pick_done(outcome, time.perf_counter() - started)
        return Verdict(None, outcome, message)
