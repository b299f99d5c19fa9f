"""A front-end worker's decider: the service's :class:`~epick.api.decide.Decider`, one
Unix socket away (:class:`~epick.frontend.hub.Hub` on the other end).

``decide_async`` sends the ``PickRequest`` and awaits its verdict; ``refuse`` and
``complete`` are one-way (counted and reported by the service). If the service's process
goes away, every pending pick is answered ``error`` (ext_proc's ``failure_mode`` then
says what the client gets) and :attr:`lost` is set: the worker stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from epick import abi
from epick.api.decide import SchedulingError, Verdict, outcome_of
from epick.api.gen.epick.v1 import picker_pb2
from epick.frontend import wire

__all__ = ["RemoteDecider", "RemoteDecision", "RemotePicker", "RelayedTrace",
           "RemoteWeights", "carry_trace"]

log = logging.getLogger("epick.frontend")


class RemoteDecision:
    """What a front end reads of a decision made in the service's process."""

    __slots__ = ("endpoint", "fallbacks", "decision_id")

    def __init__(self, endpoint: str, fallbacks: list[str], decision_id: str) -> None:
        self.endpoint = endpoint
        self.fallbacks = fallbacks
        self.decision_id = decision_id


class RelayedTrace:
    """The tracer a worker's front ends see (``decider.tracer``): the service's process
    traced the decision; its verdict's ``trace`` is the span's ``(traceparent,
    tracestate)`` as the hub sent them, and :meth:`outgoing` says them on."""

    __slots__ = ()

    @staticmethod
    def outgoing(trace: tuple[str, str]) -> dict[str, str]:
        traceparent, tracestate = trace
        out = {"traceparent": traceparent}
        if tracestate:
            out["tracestate"] = tracestate
        return out


#: The W3C trace headers a worker carries to the service's process in
#: ``PickRequest.headers`` (the names ``epick.tracing.TRACE_HEADERS`` reads; not imported:
#: a worker does not load OpenTelemetry).
_TRACE_HEADERS = ("traceparent", "tracestate")


def carry_trace(msg: picker_pb2.PickRequest, carrier) -> None:
    """Copy the caller's trace headers from ``carrier`` (HTTP request headers) into
    ``msg.headers`` where it has none: the service's process decides, and reads them
    there, as it reads a PickStream message's own (those win, as in one process)."""
    if carrier is None:
        return
    headers = msg.headers
    for name in _TRACE_HEADERS:
        value = carrier.get(name)
        if value and name not in headers:
            headers[name] = value


class RemoteDecider(asyncio.Protocol):
    """Connect with :meth:`connect`; then ``await decide_async(pick, subset=, started=)``.

    ``on_health(serving)`` hears the service's health.
    """

    #: A traced verdict's ``trace`` is what the hub sent (:class:`RelayedTrace`).
    tracer = RelayedTrace()

    def __init__(self, *, on_health: Callable[[bool], None] = lambda _s: None) -> None:
        self.on_health = on_health
        self.lost = asyncio.Event()
        self._frames = wire.Frames(wire.ToWorker)
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0

    async def connect(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: self, path)

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        self._transport = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(Verdict(None, "error", "epick's decision process is gone"))
        self._pending.clear()
        self.lost.set()

    def data_received(self, data: bytes) -> None:
        for msg in self._frames.feed(data):
            if type(msg) is wire.Answer:
                fut = self._pending.pop(msg.id, None)
                if fut is None or fut.done():  # the stream went away meanwhile
                    continue
                if msg.response:
                    fut.set_result(msg)  # a full answer: RemotePicker reads it
                elif msg.decision_id:
                    verdict = Verdict(RemoteDecision(msg.endpoint, msg.fallbacks,
                                                     msg.decision_id), msg.outcome)
                    if msg.traceparent:  # traced in the service's process
                        verdict.trace = (msg.traceparent, msg.tracestate)
                    fut.set_result(verdict)
                else:
                    fut.set_result(Verdict(None, msg.outcome, msg.message))
            elif type(msg) is wire.Ack or type(msg) is wire.TablesAnswer:
                fut = self._pending.pop(msg.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                self.on_health(msg.serving)

    # -- the decider -------------------------------------------------------------------

    def hello(self, worker: int, pid: int) -> None:
        self._send(wire.Hello(worker, pid))

    async def decide_async(self, pick: picker_pb2.PickRequest, *,
                           subset: Collection[str] | None = None,
                           started: float | None = None, full: bool = False):
        """The verdict (``full``: the hub's whole :class:`~epick.frontend.wire.Answer`
        when it decided, with the serialized ``PickResponse``)."""
        if self._transport is None:
            return Verdict(None, "error", "epick's decision process is gone")
        elapsed = 0.0 if started is None else time.perf_counter() - started
        return await self._ask(lambda id_: wire.Pick(
            id_, pick.SerializeToString(), None if subset is None else list(subset), elapsed,
            full))

    async def report(self, report: picker_pb2.CompletionReport):
        """A ReportCompletion's :class:`~epick.frontend.wire.Ack` (or a lost Verdict)."""
        if self._transport is None:
            return Verdict(None, "error", "epick's decision process is gone")
        return await self._ask(lambda id_: wire.Report(id_, report.SerializeToString()))

    async def tables(self, keys: list[tuple[str, str, int]]):
        """The service's weights tables for ``keys``: a :class:`~epick.frontend.wire.
        TablesAnswer` (or a lost Verdict)."""
        if self._transport is None:
            return Verdict(None, "error", "epick's decision process is gone")
        return await self._ask(lambda id_: wire.Tables(id_, keys))

    async def _ask(self, message):
        self._next += 1
        id_ = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[id_] = fut
        self._send(message(id_))
        try:
            return await fut
        finally:
            self._pending.pop(id_, None)

    def refuse(self, exc: Exception, *, started: float) -> Verdict:
        """As :meth:`Decider.refuse`: the service counts it; a bug is logged here."""
        outcome = outcome_of(exc)
        if outcome == "error":
            log.error("pick failed: %r", exc, exc_info=exc)
            message = f"internal error: {exc!r}"
        else:
            message = str(exc)
        self._send(wire.Refused(outcome, time.perf_counter() - started))
        return Verdict(None, outcome, message)

    def complete(self, *, decision_id: str, endpoint: str, status, prompt_tokens=None,
                 completion_tokens=None, ttft_s=None) -> None:
        self._send(wire.Complete(decision_id, endpoint, int(status), prompt_tokens,
                                 completion_tokens, ttft_s))

    def _send(self, msg) -> None:
        if self._transport is not None:
            self._transport.write(wire.frame(msg))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class RemoteRefusal(SchedulingError):  # the pick path's refusal base, as api says it
    """A weights table the service's process refused: its ``outcome`` (a ``REFUSALS``
    row) and message, said by the HTTP front end as in one process."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class RemoteWeights:
    """The :class:`~epick.api.weights.WeightsHub` a worker's HTTP front end sees: one
    table at a time (``GET /v1/weights``, EDS) asked of the service's process.

    The stream (``GET /v1/weights`` with ``Accept: text/event-stream``) is not carried
    across the worker hop (``streams`` is False: the HTTP front end answers 501): a
    stream's subscription lives in the service's process, where gRPC ``WatchWeights``
    serves it."""

    streams = False

    def __init__(self, decider: RemoteDecider) -> None:
        self.decider = decider

    async def table(self, model: str, adapter: str = "",
                    criticality: abi.Criticality = abi.Criticality.STANDARD):
        from epick.api.picker import InvalidArgument
        from epick.api.weights import EndpointShare, WeightsTable

        answer = await self.decider.tables([(model, adapter, int(criticality))])
        if isinstance(answer, Verdict):  # the service's process is gone
            raise RemoteRefusal("unavailable", answer.message)
        if answer.outcome:
            if answer.outcome == "invalid":
                raise InvalidArgument(answer.message)
            raise RemoteRefusal(answer.outcome, answer.message)
        msg = picker_pb2.WeightsTable.FromString(answer.tables[0])
        return WeightsTable(
            model, adapter, abi.Criticality(criticality),
            tuple(EndpointShare(e.endpoint, e.weight, e.filtered_by, e.total)
                  for e in msg.endpoints),
            msg.snapshot_version, msg.snapshot_timestamp_ms, msg.timestamp_ms, msg.reason)


class RemotePicker:
    """:class:`~epick.api.picker.PickerService`'s answers, asked of the service's process:
    what the HTTP front end (:class:`epick.api.http.HttpApi`) calls in a worker."""

    def __init__(self, decider: RemoteDecider) -> None:
        self.decider = decider
        self.weights = RemoteWeights(decider)

    async def answer_pick(self, msg: picker_pb2.PickRequest, carrier=None):
        # carrier: the HTTP request's headers; their trace context goes along in the
        # PickRequest (the service's process traces the decision).
        import grpc

        from epick.api.decide import REFUSALS

        started = time.perf_counter()
        carry_trace(msg, carrier)
        answer = await self.decider.decide_async(msg, started=started, full=True)
        if isinstance(answer, Verdict):  # refused, or the service's process is gone
            return None, (REFUSALS[answer.outcome].grpc if answer.outcome in REFUSALS
                          else grpc.StatusCode.INTERNAL, answer.message)
        return picker_pb2.PickResponse.FromString(answer.response), None

    async def answer_completion(self, msg: picker_pb2.CompletionReport):
        import grpc

        ack = await self.decider.report(msg)
        if isinstance(ack, Verdict):
            return None, (grpc.StatusCode.UNAVAILABLE, ack.message)
        if ack.code:
            return None, (grpc.StatusCode[ack.code], ack.message)
        return picker_pb2.CompletionAck(known=ack.known), None
