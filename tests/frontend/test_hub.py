"""The hub's own tasks: a pick waiting in flow control is answered by a task the hub
owns, cancelled when its worker goes away or the hub stops (none is left pending)."""

from __future__ import annotations

import asyncio

import anyio

from epick.api.gen.epick.v1 import picker_pb2
from epick.frontend.hub import Hub
from epick.frontend.remote import RemoteDecider


class _WaitingDecider:
    """Flow control that never has room: every pick waits until it is cancelled."""

    telemetry = None
    tracer = None

    def __init__(self) -> None:
        self.flow = object()  # on: the hub answers through decide_async
        self.waiting = 0
        self.cancelled = 0

    async def decide_async(self, msg, *, subset=None, started=None):
        self.waiting += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1  # the flow controller takes it out of the queue here
            raise


class _Picker:
    def __init__(self) -> None:
        self.decider = _WaitingDecider()
        self.scheduler = None
        self.weights = None


async def _until(predicate, what: str) -> None:
    with anyio.fail_after(5):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


def _others() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_stopping_the_hub_with_a_queued_pick_leaves_no_pending_task(tmp_path):
    picker = _Picker()
    hub = Hub(picker, tmp_path / "hub.sock")
    before = _others()
    async with anyio.create_task_group() as tg:
        await tg.start(hub.run)
        remote = RemoteDecider()
        await remote.connect(str(hub.path))
        asked = asyncio.get_running_loop().create_task(
            remote.decide_async(picker_pb2.PickRequest(model="m")))
        await _until(lambda: hub.waiting == 1, "the pick to wait in the hub")
        tg.cancel_scope.cancel()
    # The hub's run returned: its waiting pick was cancelled (out of the queue) and done.
    assert hub.waiting == 0 and picker.decider.cancelled == 1
    verdict = await asyncio.wait_for(asked, 5)  # the worker hears its hub went away
    assert verdict.decision is None and verdict.outcome == "error"
    remote.close()
    await asyncio.sleep(0)
    assert _others() - before == set(), "a task outlived the hub"


async def test_a_worker_going_away_cancels_its_waiting_picks(tmp_path):
    picker = _Picker()
    hub = Hub(picker, tmp_path / "hub.sock")
    async with anyio.create_task_group() as tg:
        await tg.start(hub.run)
        remote = RemoteDecider()
        await remote.connect(str(hub.path))
        for _ in range(3):
            tg.start_soon(remote.decide_async, picker_pb2.PickRequest(model="m"))
        await _until(lambda: hub.waiting == 3, "three picks to wait in the hub")
        remote.close()
        await _until(lambda: hub.waiting == 0, "the picks to leave with their worker")
        assert picker.decider.cancelled == 3
        tg.cancel_scope.cancel()


class _Transport:
    """Records what the hub writes, one entry a ``write`` call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


def test_the_answers_to_one_reads_frames_leave_in_one_write_in_order(tmp_path):
    """One read carrying many frames (a busy worker's): every answer, in order, in one
    write — not one system call a pick (docs/performance.md); the next read's in the next."""
    from epick.frontend import wire
    from epick.frontend.hub import _Connection

    conn = _Connection(Hub(_Picker(), tmp_path / "hub.sock"))
    conn.transport = _Transport()
    asks = [wire.Tables(i, [("m", "", 0)]) for i in range(1, 6)]
    conn.data_received(b"".join(wire.frame(a) for a in asks))
    assert len(conn.transport.writes) == 1
    answers = wire.Frames(wire.ToWorker).feed(conn.transport.writes[0])
    assert [a.id for a in answers] == [1, 2, 3, 4, 5]
    assert {a.outcome for a in answers} == {"error"}  # the picker has no weights stream
    conn.data_received(wire.frame(wire.Tables(6, [("m", "", 0)])))
    assert len(conn.transport.writes) == 2
    assert [a.id for a in wire.Frames(wire.ToWorker).feed(conn.transport.writes[1])] == [6]
    conn.send(wire.Health(True))  # outside a read (a later answer): written at once
    assert len(conn.transport.writes) == 3
