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

from epick.api.decide import Verdict, outcome_of
from epick.api.gen.epick.v1 import picker_pb2
from epick.frontend import wire

__all__ = ["RemoteDecider", "RemoteDecision", "RemotePicker"]

log = logging.getLogger("epick.frontend")


class RemoteDecision:
    """What a front end reads of a decision made in the service's process."""

    __slots__ = ("endpoint", "fallbacks", "decision_id")

    def __init__(self, endpoint: str, fallbacks: list[str], decision_id: str) -> None:
        self.endpoint = endpoint
        self.fallbacks = fallbacks
        self.decision_id = decision_id


class RemoteDecider(asyncio.Protocol):
    """Connect with :meth:`connect`; then ``await decide_async(pick, subset=, started=)``.

    ``on_health(serving)`` hears the service's health.
    """

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
                    fut.set_result(Verdict(RemoteDecision(msg.endpoint, msg.fallbacks,
                                                          msg.decision_id), msg.outcome))
                else:
                    fut.set_result(Verdict(None, msg.outcome, msg.message))
            elif type(msg) is wire.Ack:
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


class RemotePicker:
    """:class:`~epick.api.picker.PickerService`'s answers, asked of the service's process:
    what the HTTP front end (:class:`epick.api.http.HttpApi`) calls in a worker."""

    def __init__(self, decider: RemoteDecider) -> None:
        self.decider = decider

    async def answer_pick(self, msg: picker_pb2.PickRequest, carrier=None):
        # carrier: trace headers; the service's process decides, and tracing is not
        # carried across the worker hop yet (docs/tracing.md).
        import grpc

        from epick.api.decide import REFUSALS

        answer = await self.decider.decide_async(msg, started=time.perf_counter(), full=True)
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
