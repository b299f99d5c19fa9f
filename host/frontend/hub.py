"""The service's side of the front-end workers: one Unix socket, every decision here.

Each worker holds one connection. A :class:`~epick.frontend.wire.Pick` frame goes
through the service's own :class:`~epick.api.decide.Decider` — the very pick path the
gRPC Pick API and the in-process ext_proc use — and its verdict goes back as an
:class:`~epick.frontend.wire.Answer`; completions reach the scheduler as ReportCompletion
does. Frames are read and answered in ``data_received``, on the event-loop thread: one
read can carry many picks under load, and each is decided without an ``await`` in
between, as a PickStream message is; their answers leave in one write at the read's end
(one system call a read, not one a pick: 13–24% of this process's busy time under native
load before, docs/performance.md). Answers decided later (flow control) are written as
they come.

With tracing on, the service's tracer decides here as for any front end: the worker's
``PickRequest.headers`` carry the caller's ``traceparent`` / ``tracestate`` (ext_proc's
request headers; the HTTP front end copies its own in), and a traced verdict's span goes
back in the Answer, for ext_proc in the worker to name as the model server's parent.

A pick that waits in flow control is answered by a task the hub owns: a worker's
connection going away cancels its waiting picks (they leave the queue, counted
``cancelled``), and the hub stopping cancels them all.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Callable
from pathlib import Path

import anyio

from epick import abi
from epick.api.decide import Decider, Verdict, outcome_of
from epick.api.gen.epick.v1 import picker_pb2
from epick.api.picker import PickerService, to_response
from epick.api.usage import tokens_from
from epick.api.weights import to_proto
from epick.frontend import wire

__all__ = ["Hub"]

log = logging.getLogger("epick.frontend")


class _Connection(asyncio.Protocol):
    """One worker's connection."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.frames = wire.Frames(wire.ToHub)
        self.transport: asyncio.Transport | None = None
        self.worker: int | None = None
        #: Picks waiting in flow control for this worker (cancelled when it goes away).
        self.waiting: set[asyncio.Task] = set()
        #: While ``data_received`` answers one read's frames: their answers, written in
        #: one piece at its end (one write a read, not one a pick; None: write at once).
        self._batch: list[bytes] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.hub._connections.add(self)

    def connection_lost(self, exc) -> None:
        self.hub._connections.discard(self)
        for task in list(self.waiting):  # no one to answer: out of the queue
            task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.frames.feed(data)
        except (ValueError, TypeError) as exc:  # msgspec.DecodeError is a ValueError
            log.error("front-end worker %s sent a bad frame (%s): closing its connection",
                      self.worker, exc)
            self.transport.close()
            return
        hub = self.hub
        self._batch = []
        try:
            self._answer_all(messages, hub)
        finally:
            batch, self._batch = self._batch, None
            if batch and self.transport is not None and not self.transport.is_closing():
                self.transport.write(batch[0] if len(batch) == 1 else b"".join(batch))

    def _answer_all(self, messages, hub: Hub) -> None:
        for msg in messages:
            if type(msg) is wire.Pick:
                self._pick(msg)
            elif type(msg) is wire.PickHttp:
                self._pick_http(msg)
            elif type(msg) is wire.Complete:
                hub.complete(msg)
            elif type(msg) is wire.Refused:
                hub.refused(msg)
            elif type(msg) is wire.Report:
                self.send(hub.report(msg))
            elif type(msg) is wire.Tables:
                self.send(hub.tables(msg))
            else:
                self.worker = msg.worker
                self.send(wire.Health(hub.serving))
                hub.on_hello(msg.worker, msg.pid)

    def _pick(self, msg: wire.Pick) -> None:
        started = self.hub.clock() - msg.elapsed_s
        try:
            pick = picker_pb2.PickRequest.FromString(msg.pick)
        except Exception as exc:  # noqa: BLE001 (a worker bug: counted, answered)
            self._answer(msg.id, self.hub.decider.refuse(exc, started=started))
            return
        subset = msg.subset
        decider = self.hub.decider
        if decider.flow is not None:  # flow control: the answer may have to wait
            verdict = decider.decide_async(pick, subset=subset, started=started)
        elif subset is None:
            verdict = decider.decide(pick, started=started)
        else:
            verdict = decider.decide(pick, subset=subset, started=started)
        if inspect.isawaitable(verdict):  # a decider that may wait (flow control)
            self.hub._own(self._answer_later(msg.id, verdict, msg.full), self.waiting)
        else:
            self._answer(msg.id, verdict, msg.full)

    def _pick_http(self, msg: wire.PickHttp) -> None:
        """A native worker's request: read, decided and answered by ext_proc.py's own
        stream code here, so the answer is the one the Python front end writes."""
        from epick.api import ext_proc

        hub = self.hub
        service = hub.ext_proc_service()
        stream = ext_proc._Stream(service)
        stream.echo = False  # the worker streams the body's own chunks back
        stream.duplex = msg.duplex
        if msg.problem:
            stream.ended = True
            self.send(_routed(msg.id, stream, ext_proc.problem(msg.problem, service), -1))
            return
        stream.headers = msg.headers
        stream.chunks = [msg.body] if msg.body else []
        for raw in msg.metadata:
            stream._read_metadata(ext_proc.base_pb2.Metadata.FromString(raw))
        end = (None, True, False)[msg.end]
        begun = stream.route_begin(hub.clock() - msg.elapsed_s)
        if isinstance(begun, list):
            self.send(_routed(msg.id, stream, begun, -1))
            return
        t0, parsed, subset, selected, verdict = begun
        if verdict is None:
            decider = hub.decider
            if decider.flow is not None:  # flow control: the answer may have to wait
                hub._own(self._routed_later(msg, stream, end, begun), self.waiting)
                return
            verdict = decider.decide(parsed.pick, subset=subset, started=t0)
        self.send(_finish_route(msg, stream, end, verdict, parsed, selected))

    async def _routed_later(self, msg: wire.PickHttp, stream, end, begun) -> None:
        t0, parsed, subset, selected, _ = begun
        verdict = await self.hub.decider.decide_async(parsed.pick, subset=subset, started=t0)
        self.send(_finish_route(msg, stream, end, verdict, parsed, selected))

    async def _answer_later(self, id_: int, verdict, full: bool) -> None:
        self._answer(id_, await verdict, full)

    def _answer(self, id_: int, verdict: Verdict, full: bool = False) -> None:
        d = verdict.decision
        if d is None:
            self.send(wire.Answer(id_, verdict.outcome, verdict.message))
        else:
            response = to_response(d).SerializeToString() if full else b""
            tp = ts = ""
            if verdict.trace is not None:  # traced: the worker passes the span on
                out = self.hub.decider.tracer.outgoing(verdict.trace)
                tp, ts = out.get("traceparent", ""), out.get("tracestate", "")
            self.send(wire.Answer(id_, verdict.outcome, "", d.endpoint, list(d.fallbacks),
                                  d.decision_id, response, tp, ts))

    def send(self, msg) -> None:
        if self._batch is not None:
            self._batch.append(wire.frame(msg))
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(wire.frame(msg))


def _finish_route(msg: wire.PickHttp, stream, end, verdict, parsed, selected) -> wire.Routed:
    from epick.api.ext_proc import trailers_continue

    out = stream.route_finish(verdict, parsed, selected, end)
    if end is False and not stream.ended:  # ext_proc.py's _route_trailers
        out.append(trailers_continue())
    echo = 1 if msg.duplex and end is not None and not stream.ended and not stream.rewritten \
        else -1
    return _routed(msg.id, stream, out, echo)


def _routed(id_: int, stream, out: list, echo_at: int) -> wire.Routed:
    from epick.api.ext_proc import _serialize

    d = stream.decision
    return wire.Routed(id_, [_serialize(r) for r in out], echo_at, stream.ended,
                       d.decision_id if d is not None else "", d.endpoint if d is not None else "")


class Hub:
    """Serves the workers' connections on a Unix socket at ``path`` (``run``).

    ``on_hello(worker, pid)`` is told when a worker's servers listen; :meth:`set_health`
    tells every worker the service's health (a worker connecting later is told at once).
    """

    def __init__(self, picker: PickerService, path: Path, *,
                 on_hello: Callable[[int, int], None] = lambda _w, _p: None,
                 clock: Callable[[], float] | None = None, ext_proc=None,
                 openai=None) -> None:
        import time

        self.picker = picker
        self.decider: Decider = picker.decider
        self.scheduler = picker.scheduler
        self.path = path
        self.on_hello = on_hello
        self.clock = clock or time.perf_counter
        self.serving = False
        #: ``[ext_proc]`` and ``[openai]``: what native workers' requests are read with.
        self.ext_proc = ext_proc
        self.openai = openai
        self._ext_proc_service = None
        self._connections: set[_Connection] = set()
        #: Every pick waiting in flow control (owned here; cancelled when the hub stops).
        self._tasks: set[asyncio.Task] = set()

    def _own(self, coro, also: set[asyncio.Task]) -> asyncio.Task:
        """Run ``coro`` as a task this hub (and ``also``, its connection's set) owns."""
        task = asyncio.get_running_loop().create_task(coro)
        for owner in (self._tasks, also):
            owner.add(task)
            task.add_done_callback(owner.discard)
        return task

    def ext_proc_service(self):
        """The ext_proc service native workers' streams are answered through (made once:
        it loads the xds protos)."""
        if self._ext_proc_service is None:
            from epick.api.ext_proc import ExtProcService

            self._ext_proc_service = ExtProcService(self.decider, self.ext_proc, self.openai)
        return self._ext_proc_service

    @property
    def waiting(self) -> int:
        """Picks the hub is answering later (waiting in flow control)."""
        return len(self._tasks)

    @property
    def connected(self) -> int:
        return sum(1 for c in self._connections if c.worker is not None)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        loop = asyncio.get_running_loop()
        if self.path.exists():
            self.path.unlink()
        server = await loop.create_unix_server(lambda: _Connection(self), str(self.path))
        os.chmod(self.path, 0o600)  # this user's workers only
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            server.close()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            for conn in list(self._connections):
                if conn.transport is not None:
                    conn.transport.close()
            self._connections.clear()
            self.path.unlink(missing_ok=True)
            if tasks:  # let the cancelled picks leave the queue before the hub is gone
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(tasks)

    def set_health(self, serving: bool) -> None:
        self.serving = serving
        for conn in list(self._connections):
            conn.send(wire.Health(serving))

    def complete(self, msg: wire.Complete) -> None:
        try:
            prompt, completion = msg.prompt_tokens, msg.completion_tokens
            if msg.usage_kind:  # a native worker's raw usage: read with the same rules
                prompt, completion = tokens_from(msg.usage_kind, msg.usage)
            self.scheduler.complete(
                decision_id=msg.decision_id, endpoint=msg.endpoint,
                status=abi.CompletionStatus(msg.status), prompt_tokens=prompt,
                completion_tokens=completion, ttft_s=msg.ttft_s)
        except Exception:  # a bug, as in PickerService.answer_completion
            log.exception("a front-end worker's completion report failed")

    def report(self, msg: wire.Report) -> wire.Ack:
        """A completion report answered as gRPC ReportCompletion answers it."""
        try:
            report = picker_pb2.CompletionReport.FromString(msg.report)
        except Exception as exc:  # noqa: BLE001 (a worker bug: said, not raised)
            return wire.Ack(msg.id, False, "INTERNAL", f"undecodable report: {exc!r}")
        response, error = self.picker.answer_completion(report)
        if error is not None:
            return wire.Ack(msg.id, False, error[0].name, error[1])
        return wire.Ack(msg.id, response.known)

    def tables(self, msg: wire.Tables) -> wire.TablesAnswer:
        """The weights tables now, as the HTTP front end in the service's process reads
        them (``WeightsHub.table``); a refusal (a bad name, no endpoint) is said."""
        weights = self.picker.weights
        if weights is None:
            return wire.TablesAnswer(msg.id, [], "error", "the weights stream is off")
        try:
            return wire.TablesAnswer(msg.id, [
                to_proto(weights.table(model, adapter, abi.Criticality(crit)))
                .SerializeToString() for model, adapter, crit in msg.keys])
        except Exception as exc:  # noqa: BLE001 (said to the worker, as a Pick's would be)
            outcome = outcome_of(exc)
            if outcome == "error":
                log.exception("a front-end worker's weights table failed")
            return wire.TablesAnswer(msg.id, [], outcome, str(exc))

    def refused(self, msg: wire.Refused) -> None:
        telemetry = self.decider.telemetry
        if telemetry is not None:
            telemetry.pick_done(msg.outcome, msg.elapsed_s)
