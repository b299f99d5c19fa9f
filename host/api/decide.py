"""The one pick path: a :class:`PickRequest` from any front end -> a :class:`Verdict`.

gRPC ``Pick`` and ``PickStream`` (:mod:`epick.api.picker`), Envoy's ext_proc
(:mod:`epick.api.ext_proc`) and the HTTP front end translate their wire format into a
``PickRequest`` and call :meth:`Decider.decide`; the reference gateway reaches it through
gRPC ``Pick``. Here, and only here: validation (:func:`~epick.api.validate.to_request`,
:func:`~epick.api.validate.pin_of`), the pin / subset dispatch, scheduling, the outcome
label, telemetry (``epick_picks_total{outcome}``, ``epick_pick_latency_seconds{stage=
"total"}``) and the log line of a failure. A front end only turns the verdict back into
its wire format, through :data:`REFUSALS` — the one table of how each refusal is said.

Flow control (``[flow_control]``, docs/flow-control.md) sits in front of the scheduler:
:meth:`Decider.decide_async` is the pick path a front end awaits. While flow control is
off (``decider.flow is None``) it is :meth:`Decider.decide` (a front end checks
``decider.flow`` itself and calls ``decide`` directly, so the off path does not even
build a coroutine); while it is on, a request the saturated pool has no room for waits
in epick's queues until it is dispatched, its TTL or deadline passes, or its band is
full. :meth:`Decider.run` is the driver the service runs.

The input is the ``PickRequest`` rather than the validated :class:`abi.Request` because
validating it is part of the path: a malformed request is counted (``invalid``) and timed
like any other, whichever front end it came through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

import anyio
import grpc
import msgspec

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2
from epick.api.validate import SESSION_HEADER, InvalidArgument, pin_of, to_request
from epick.config import FlowControlConfig
from epick.flow import FlowController, QueueFull, Ticket
from epick.scheduler.scheduler import Decision, Scheduler, SchedulingError, Unavailable

__all__ = ["Decider", "Verdict", "Refusal", "REFUSALS", "outcome_of", "outcome_of_code",
           "QueueFullError", "QueueExpired", "priority_of", "fairness_of",
           "FAIRNESS_HEADER", "SLO_TTFT_HEADER"]

log = logging.getLogger("epick.api")


class Verdict(msgspec.Struct):
    """What :meth:`Decider.decide` answers; it never raises. (A struct, built once per
    pick: a dataclass's ``__init__`` is a Python call, several times the cost.)"""

    decision: Decision | None
    """The pick, or ``None`` when the request was refused."""
    outcome: str
    """The metric label: one of :data:`epick.telemetry.PICK_OUTCOMES`."""
    message: str = ""
    """Why it was refused (names the field, the setting or the state); ``""`` when ok."""
    trace: object = None
    """The decision's span context when it was traced (``epick.tracing``), for a front end
    that passes the trace on (ext_proc); ``None`` with tracing off or the pick unsampled."""
    queue_wait_ms: float = 0.0
    """Flow control: how long it waited in epick's queue (0: it went straight through)."""
    queue_reason: str = ""
    """Flow control: why it waited (``saturated``); ``""`` when it did not."""


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
    # Flow control: the request's priority band held [flow_control] max_requests or
    # max_bytes already / it waited past its TTL or the caller's deadline.
    "queue_full": Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded",
                          "rejected-queue-full"),
    "queue_expired": Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded",
                             "evicted-ttl"),
}
_BY_CODE: dict[grpc.StatusCode, str] = {}
for _outcome, _r in REFUSALS.items():
    _BY_CODE.setdefault(_r.grpc, _outcome)  # the first row of a code names it (shed)

#: Headers flow control reads when the PickRequest leaves the field unset.
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
#: Criticality -> priority band when neither ``priority`` nor a listed objective says.
_CRITICALITY_PRIORITY = {abi.Criticality.CRITICAL: 1, abi.Criticality.STANDARD: 0,
                         abi.Criticality.SHEDDABLE: -1}


class QueueFullError(SchedulingError):
    """Flow control: the request's priority band is full."""

    outcome = "queue_full"


class QueueExpired(SchedulingError):
    """Flow control: the request waited past its TTL or the caller's deadline."""

    outcome = "queue_expired"


def priority_of(msg: picker_pb2.PickRequest, request: abi.Request,
                objectives: dict[str, int]) -> int:
    """The request's band: ``PickRequest.priority``, else its objective header through
    ``[flow_control] objectives``, else its criticality (CRITICAL 1, STANDARD 0,
    SHEDDABLE -1)."""
    if msg.HasField("priority"):
        return msg.priority
    if objectives:
        headers = request.headers
        for name in OBJECTIVE_HEADERS:
            objective = headers.get(name)
            if objective is not None:
                band = objectives.get(objective.strip())
                if band is not None:
                    return band
                break
    return _CRITICALITY_PRIORITY.get(request.criticality, 0)


def fairness_of(msg: picker_pb2.PickRequest, request: abi.Request) -> str:
    """The request's flow: ``PickRequest.fairness_id``, else the fairness header, else
    ``""`` (the default flow)."""
    return msg.fairness_id or request.headers.get(FAIRNESS_HEADER, "").strip()


def slo_ttft_of(msg: picker_pb2.PickRequest, request: abi.Request) -> int | None:
    if msg.HasField("slo_ttft_ms"):
        return msg.slo_ttft_ms
    value = request.headers.get(SLO_TTFT_HEADER)
    if value is None:
        return None
    try:
        ms = int(value.strip())
    except ValueError:
        raise InvalidArgument(f"{SLO_TTFT_HEADER} {value!r} is not a whole number of "
                              "milliseconds") from None
    if ms < 0:
        raise InvalidArgument(f"{SLO_TTFT_HEADER} {value!r} is negative")
    return ms


def _within(room: tuple[str, ...] | None, subset: Collection[str] | None
            ) -> Collection[str] | None:
    """The endpoints a pick flow control lets through may go to: those with room
    (``None``: every one), inside the data plane's own subset hint (``host:port`` or bare
    ``host`` entries) when it sent one."""
    if room is None:
        return subset
    if subset is None:
        return room
    hint = set(subset)
    return tuple(a for a in room if a in hint or a.rsplit(":", 1)[0] in hint)


@dataclass(slots=True)
class _Waiting:
    """What a queued pick needs to be finished (a :class:`Ticket`'s payload)."""

    request: abi.Request
    explain: bool
    subset: Collection[str] | None
    started: float
    future: asyncio.Future | None = None
    """Made only once it waits (the caller awaits it)."""
    verdict: Verdict | None = None
    """Its verdict when it left inside ``submit`` itself (no future yet)."""

    def finish(self, verdict: Verdict) -> None:
        if self.future is None:
            self.verdict = verdict
        elif not self.future.done():
            self.future.set_result(verdict)

    @property
    def abandoned(self) -> bool:
        return self.future is not None and self.future.done()


def outcome_of(exc: Exception) -> str:
    """The outcome of a pick that failed with ``exc``: :class:`InvalidArgument` is
    ``invalid``, a :class:`SchedulingError` its own (``shed``, ``unavailable``), anything
    else ``error`` (a bug)."""
    if isinstance(exc, InvalidArgument):
        return "invalid"
    if isinstance(exc, SchedulingError):
        return exc.outcome
    return "error"


def outcome_of_code(code: grpc.StatusCode, reason: str = "") -> str:
    """The outcome a ``Pick`` that failed with ``code`` had, for a client of the gRPC API
    (the reference gateway). ``reason``: the call's ``x-llm-d-request-dropped-reason``
    trailing metadata (flow control sends it), which tells rows sharing a code apart. A
    code epick does not answer with (the call never reached it: unreachable, deadline) is
    ``unavailable``."""
    if reason:
        for outcome, r in REFUSALS.items():
            if r.grpc == code and r.reason == reason:
                return outcome
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

    __slots__ = ("scheduler", "telemetry", "allow_pinning", "session_header", "tracer",
                 "_pick_done", "flow", "objectives", "_wake")

    def __init__(self, scheduler: Scheduler, telemetry=None, *,
                 allow_pinning: bool = False, tracer=None,
                 session_header: str = SESSION_HEADER) -> None:
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.allow_pinning = allow_pinning
        #: ``[server] session_header``: the header naming a request's session.
        self.session_header = session_header
        #: :class:`epick.tracing.PickTracer` when ``[tracing]`` is on; None: a pick pays
        #: this one attribute check and nothing else for tracing.
        self.tracer = tracer
        # Bound once: the telemetry object does not change while serving.
        self._pick_done = telemetry.pick_done if telemetry is not None else None
        #: Flow control (:meth:`configure_flow`); ``None``: off, picks go straight through.
        self.flow: FlowController | None = None
        self.objectives: dict[str, int] = {}
        self._wake: anyio.Event | None = None

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
        # _schedule inline: a refused request and a failed pick are answered alike.
        try:
            pin = msg.pin_endpoint
            if pin:
                pin = pin_of(msg, allow_pinning=self.allow_pinning)
            request = to_request(msg, self.session_header)
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

    # -- flow control ------------------------------------------------------------------

    def configure_flow(self, config: FlowControlConfig, *, clock=None,
                       metrics: bool = True) -> None:
        """Apply ``[flow_control]`` (at start and on every reload). Turning it off
        dispatches everything still waiting (room or not): nothing is dropped."""
        self.objectives = dict(config.objectives)
        if not config.enabled:
            flow, self.flow = self.flow, None
            if flow is not None:
                flow.drain()
            return
        if self.flow is not None:
            self.flow.configure(config)
            return
        kwargs = {} if clock is None else {"clock": clock}
        self.flow = FlowController(config, view=self.scheduler.current_view,
                                   counts=self.scheduler.assignments,
                                   on_dispatch=self._dispatched, on_refuse=self._expired,
                                   metrics=metrics, **kwargs)

    async def decide_async(self, msg: picker_pb2.PickRequest, *,
                           subset: Collection[str] | None = None,
                           started: float | None = None,
                           deadline_s: float | None = None, carrier=None) -> Verdict:
        """:meth:`decide` through flow control; never raises. ``deadline_s``: the caller's
        time left (a gRPC deadline), which ends the wait when sooner than the TTL;
        ``carrier``: as for :meth:`decide` (a traced pick's span holds its wait).

        A pinned request skips the queue (tests, coordinators). A cancelled caller's
        request leaves the queue (counted ``cancelled``)."""
        flow = self.flow
        if flow is None:
            return self.decide(msg, subset=subset, started=started, carrier=carrier)
        t0 = time.perf_counter() if started is None else started
        tracer = self.tracer
        if tracer is not None and tracer.wants(msg, carrier):
            verdict = await self._queued(flow, msg, subset, t0, deadline_s, explain=True)
            return tracer.record(msg, verdict, started=t0, carrier=carrier)
        return await self._queued(flow, msg, subset, t0, deadline_s, explain=msg.explain)

    async def _queued(self, flow: FlowController, msg: picker_pb2.PickRequest,
                      subset: Collection[str] | None, t0: float, deadline_s: float | None,
                      *, explain: bool) -> Verdict:
        try:
            pin = pin_of(msg, allow_pinning=self.allow_pinning)
            request = to_request(msg, self.session_header)
            if pin:
                return self._schedule(request, explain, subset, pin, t0)
            priority = priority_of(msg, request, self.objectives)
            slo = slo_ttft_of(msg, request)
        except Exception as exc:
            return self.refuse(exc, started=t0)
        waiting = _Waiting(request, explain, subset, t0)
        try:
            ticket = flow.submit(
                flow=fairness_of(msg, request), priority=priority,
                size=len(request.prompt.encode()), slo_ttft_ms=slo,
                deadline=None if deadline_s is None else flow.clock() + deadline_s,
                payload=waiting)
        except QueueFull as exc:
            return self.refuse(QueueFullError(str(exc)), started=t0)
        if ticket is None:  # room, nothing waiting: straight through
            return self._schedule(request, explain, _within(flow.room, subset), "", t0)
        if ticket.done:  # it left inside submit (room came with this arrival)
            return waiting.verdict
        waiting.future = asyncio.get_running_loop().create_future()
        if self._wake is not None:
            self._wake.set()
        try:
            return await waiting.future
        except asyncio.CancelledError:
            flow.cancel(ticket)
            raise

    def _schedule(self, request: abi.Request, explain: bool,
                  subset: Collection[str] | None, pin: str, t0: float) -> Verdict:
        try:
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

    def _dispatched(self, ticket: Ticket) -> None:
        """Room came for a queued pick: schedule it now, before the next one is let
        through, so the detector counts it."""
        w: _Waiting = ticket.payload
        if w.abandoned:  # its caller went away while it was being chosen
            return
        room = self.flow.room if self.flow is not None else None
        verdict = self._schedule(w.request, w.explain, _within(room, w.subset), "",
                                 w.started)
        verdict.queue_wait_ms = ticket.wait_s * 1000
        verdict.queue_reason = "saturated"
        w.finish(verdict)

    def _expired(self, ticket: Ticket, outcome: str) -> None:
        w: _Waiting = ticket.payload
        if w.abandoned:
            return
        waited = ticket.wait_s * 1000
        if outcome == "unavailable":
            exc: Exception = Unavailable(
                f"no endpoint had fresh metrics while the request waited {waited:.0f} ms "
                "in flow control")
        else:
            exc = QueueExpired(
                f"flow control: the pool stayed saturated for the request's {waited:.0f} ms "
                f"wait ([flow_control] ttl_ms = {self.flow.config.ttl_ms if self.flow else 0}"
                ", or the caller's deadline)")
        verdict = self.refuse(exc, started=w.started)
        verdict.queue_wait_ms = waited
        verdict.queue_reason = "saturated"
        w.finish(verdict)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Flow control's driver: while requests wait, look for room (and expire them)
        every ``poll_ms``; asleep otherwise. The service runs it for as long as it
        serves; without it a queued request waits for the next arrival's check."""
        self._wake = anyio.Event()
        task_status.started()
        try:
            while True:
                flow = self.flow
                if flow is None or not flow.waiting:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                flow.pump()
                if flow.waiting:
                    await anyio.sleep(flow.config.poll_ms / 1000)
        finally:
            self._wake = None

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
