"""One ZMQ SUB task per endpoint feeding the :class:`~epick.kv.index.KvIndex`.

vLLM's publisher (``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``) sends
``(topic, seq: 8-byte big-endian from 0, payload)``; its optional replay socket is a
ROUTER: send ``("", start_seq)`` from a DEALER and it answers ``("", topic, seq, payload)``
for every buffered batch with ``seq >= start_seq`` (the last 10 000 by default), then
``("", "", -1, "")``. What each endpoint task does with a frame of sequence ``s``:

- ``s`` = the next expected: applied.
- ``s`` > expected (a gap: the SUB socket's high-water mark dropped some, or the network):
  with a replay socket the index is marked uncertain (``matched`` answers -1) while the
  missing batches are fetched and applied; without one (or if the replay fails or the
  engine no longer buffers them) the index is cleared and rebuilt from here.
- ``s`` < expected: duplicates right after a replay are skipped; otherwise the engine
  restarted (its sequence starts again at 0, its cache is empty): the index is cleared.
- With a replay socket a task starts by replaying from 0, so an epick started late (or
  restarted) knows what the engines already hold; without one, a task that joins a
  publisher mid-stream starts from what it sees.

Every frame is validated (three parts, an 8-byte sequence, the configured topic, a
decodable :class:`~epick.kv.events.KVEventBatch`); a bad one is counted and logged (rate
limited) with the endpoint and the reason, and the index keeps what it had. Decoding
runs on the event loop but yields every ``slice_ms`` so a flood of events never holds a
Pick back; beyond the SUB socket's high-water mark ZMQ drops frames, which is a gap.
An endpoint that leaves the pool has its task cancelled and its index dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import msgspec
import zmq
import zmq.asyncio

from epick.kv.events import END_SEQ, EventDecodeError, KVEventBatch, decode_batch, seq_bytes
from epick.kv.index import KvIndex, batch_ms
from epick.ratelog import RateLimitedLog

__all__ = ["EventSource", "EndpointStats", "KvSubscriber", "discover_source"]

log = logging.getLogger("epick.kv")


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one endpoint publishes. ``events == "discover"``: ask its /kv_event_sources."""

    address: str
    events: str
    replay: str = ""
    topic: str = ""


@dataclass(slots=True)
class EndpointStats:
    frames: int = 0
    """Frames received (live and replayed)."""
    batches: int = 0
    """Batches applied to the index."""
    events: int = 0
    bad_frames: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    last_seq: int = -1
    last_error: str = ""
    connected: str = ""
    """The resolved publisher endpoint (after discovery)."""


class _KvSources(msgspec.Struct):
    enable_kv_cache_events: bool = False
    publisher: str = ""
    endpoint: str = ""
    replay_endpoint: str | None = None
    topic: str = ""


def _resolve_bind(endpoint: str, host: str) -> str:
    """vLLM reports its bind address (``tcp://*:5557``); subscribers need a host there."""
    if endpoint.startswith("tcp://*:"):
        return f"tcp://{host}:{endpoint[len('tcp://*:'):]}"
    return endpoint


async def discover_source(address: str, *, timeout_s: float = 5.0) -> EventSource:
    """The endpoint's publisher from its ``GET /kv_event_sources`` (data-parallel rank 0)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.get(f"http://{address}/kv_event_sources")
    if resp.status_code != 200:
        raise ValueError(f"GET /kv_event_sources answered {resp.status_code}")
    try:
        ranks = msgspec.json.decode(resp.content, type=dict[str, _KvSources])
    except msgspec.DecodeError as exc:
        raise ValueError(f"/kv_event_sources: {exc}") from None
    src = ranks.get("0") or (next(iter(ranks.values())) if ranks else None)
    if src is None or not src.enable_kv_cache_events or src.publisher != "zmq":
        raise ValueError("/kv_event_sources: KV events are off or not published over zmq")
    host = urlsplit(f"//{address}").hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return EventSource(address, _resolve_bind(src.endpoint, host),
                       _resolve_bind(src.replay_endpoint or "", host), src.topic)


async def fetch_lora_paths(address: str, *, timeout_s: float = 5.0) -> dict[str, str]:
    """Adapter name → the path vLLM loaded it from (``root`` in ``/v1/models``)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.get(f"http://{address}/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data", [])
    return {m["id"]: m["root"] for m in data
            if isinstance(m, dict) and m.get("parent") and isinstance(m.get("root"), str)}


class _ReplayError(Exception):
    pass


@dataclass(slots=True)
class _Task:
    source: EventSource
    scope: anyio.CancelScope | None = None
    """Made when the task starts (a cancel scope needs a running loop)."""
    cancelled: bool = False
    stats: EndpointStats = field(default_factory=EndpointStats)


class KvSubscriber:
    """Owns one task per endpoint (inside :meth:`run`'s task group) and the ZMQ context.

    ``set_endpoints`` may be called before or while running (config reloads).
    ``on_models`` receives each endpoint's adapter paths when ``lora_discovery`` is on.
    """

    def __init__(
        self,
        index: KvIndex,
        *,
        replay_timeout_s: float = 5.0,
        slice_ms: float = 2.0,
        rcvhwm: int = 10_000,
        lora_discovery: bool = True,
        on_lora_paths: Callable[[str, dict[str, str]], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.slice_s = slice_ms / 1000.0
        self.rcvhwm = rcvhwm
        self.lora_discovery = lora_discovery
        self.on_lora_paths = on_lora_paths
        self.on_drop = on_drop
        self._tasks: dict[str, _Task] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._rlog = RateLimitedLog(log)

    # -- lifecycle --------------------------------------------------------------------

    def set_endpoints(self, sources: Sequence[EventSource]) -> None:
        """Subscribe to exactly these (by address); an address that left is dropped."""
        want = {s.address: s for s in sources}
        for address in list(self._tasks):
            if want.get(address) != self._tasks[address].source:
                task = self._tasks.pop(address)
                task.cancelled = True
                if task.scope is not None:
                    task.scope.cancel()
                self.index.drop(address)
                if self.on_drop is not None:
                    self.on_drop(address)
        for address, src in want.items():
            if address not in self._tasks:
                self._tasks[address] = _Task(src)
                if self._tg is not None:
                    self._tg.start_soon(self._endpoint, self._tasks[address])

    def stats(self) -> dict[str, EndpointStats]:
        return {a: t.stats for a, t in self._tasks.items()}

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Run every endpoint task until cancelled; sockets and context closed on exit."""
        self._ctx = zmq.asyncio.Context()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for task in self._tasks.values():
                    tg.start_soon(self._endpoint, task)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- one endpoint ------------------------------------------------------------------

    async def _endpoint(self, task: _Task) -> None:
        with anyio.CancelScope() as task.scope:
            if task.cancelled:
                return
            backoff = 0.5
            while True:
                try:
                    await self._subscribe(task)
                except Exception as exc:  # noqa: BLE001 - this task must outlive any failure
                    # Discovery (HTTP) or the socket failed: say so, keep the index, retry.
                    task.stats.last_error = str(exc)
                    self._rlog.warning(("kv-setup", task.source.address),
                                       "kv events of %s: %s (retrying)", task.source.address, exc)
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)

    async def _subscribe(self, task: _Task) -> None:
        src = task.source
        address = src.address
        if src.events == "discover":
            src = await discover_source(address)
        if self.lora_discovery and self.on_lora_paths is not None:
            try:
                self.on_lora_paths(address, await fetch_lora_paths(address))
            except Exception as exc:  # adapters then hash with their names; say why
                self._rlog.warning(("kv-models", address), "adapter paths of %s: %s",
                                   address, exc)
        task.stats.connected = src.events
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
            sock.connect(src.events)
            log.info("kv events of %s: subscribed to %s (replay %s)", address, src.events,
                     src.replay or "off")
            state = _Stream(task, src, self)
            if src.replay:
                await state.replay_from(0, initial=True)
            t0 = time.perf_counter()
            while True:
                frames = await sock.recv_multipart(copy=True)
                await state.live(frames)
                if time.perf_counter() - t0 > self.slice_s:
                    await anyio.sleep(0)  # a flood must not hold picks back
                    t0 = time.perf_counter()
        finally:
            sock.close(linger=0)

    def bad(self, task: _Task, reason: str) -> None:
        task.stats.bad_frames += 1
        task.stats.last_error = reason
        self._rlog.warning(("kv-bad", task.source.address), "kv events of %s: bad frame: %s",
                           task.source.address, reason)


class _Stream:
    """Sequence tracking for one subscription (one publisher incarnation at a time)."""

    def __init__(self, task: _Task, src: EventSource, owner: KvSubscriber) -> None:
        self.task = task
        self.src = src
        self.owner = owner
        self.address = src.address
        self.index = owner.index
        self.expected: int | None = None
        self.after_replay = False
        self.replay_start = 0

    def _parse(self, frames: list[bytes], where: str) -> tuple[int, KVEventBatch] | None:
        st = self.task.stats
        st.frames += 1
        if len(frames) != 3:
            self.owner.bad(self.task, f"{where}: {len(frames)} parts, want 3 (topic, seq, payload)")
            return None
        topic, seq_b, payload = frames
        if self.src.topic and topic != self.src.topic.encode():
            self.owner.bad(self.task, f"{where}: topic {topic[:64]!r}, want {self.src.topic!r}")
            return None
        if len(seq_b) != 8:
            self.owner.bad(self.task, f"{where}: sequence frame is {len(seq_b)} bytes, want 8")
            return None
        seq = int.from_bytes(seq_b, "big")
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.owner.bad(self.task, f"{where} seq {seq}: {exc}")
            # Its events are unknown: consume the number so it is not taken for a gap.
            return seq, KVEventBatch(ts=0.0, events=[])
        return seq, batch

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.index.apply(self.address, batch)
        st = self.task.stats
        st.batches += 1
        st.events += len(batch.events)
        st.last_seq = seq
        self.expected = seq + 1

    async def live(self, frames: list[bytes]) -> None:
        got = self._parse(frames, "live")
        if got is None:
            return
        seq, batch = got
        st = self.task.stats
        if self.expected is None:
            self.index.clear(self.address)
            if seq != 0:
                log.info("kv events of %s: joined at seq %d without replay; blocks stored "
                         "before are unknown", self.address, seq)
            self._apply(seq, batch)
        elif seq == self.expected:
            self.after_replay = False
            self._apply(seq, batch)
        elif seq > self.expected:
            self.after_replay = False
            st.gaps += 1
            log.info("kv events of %s: gap, seq %d..%d missing", self.address,
                     self.expected, seq - 1)
            if self.src.replay:
                await self.replay_from(self.expected)
            self._catch_up(seq, batch)
        elif self.after_replay and seq >= self.replay_start:
            pass  # already applied from the replay
        else:
            st.restarts += 1
            log.info("kv events of %s: sequence went back from %d to %d: engine restarted",
                     self.address, self.expected - 1, seq)
            self.after_replay = False
            # The new engine's first batch: its cache started empty by then.
            self.index.clear(self.address, at_ms=batch_ms(batch.ts))
            self.expected = 0
            if seq != 0 and self.src.replay:
                await self.replay_from(0)
            self._catch_up(seq, batch)

    def _catch_up(self, seq: int, batch: KVEventBatch) -> None:
        """After a gap was (or could not be) filled: apply ``seq`` unless a replay did."""
        if seq == self.expected:
            self._apply(seq, batch)
        elif seq > self.expected:  # still missing batches: rebuild from here
            self._rebuild(seq, batch)

    def _rebuild(self, seq: int, batch: KVEventBatch) -> None:
        self.index.clear(self.address)
        self.index.mark_uncertain(self.address)
        self._apply(seq, batch)

    async def replay_from(self, start: int, *, initial: bool = False) -> bool:
        """Fetch and apply batches ``>= start``; True if the history from ``start`` is whole."""
        st = self.task.stats
        st.replays += 1
        if not initial:
            self.index.mark_uncertain(self.address)
        try:
            with anyio.fail_after(self.owner.replay_timeout_s):
                got = await self._fetch(start)
        except (TimeoutError, _ReplayError, zmq.ZMQError) as exc:
            st.replay_failures += 1
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            self.owner._rlog.warning(("kv-replay", self.address),
                                     "kv events of %s: replay from %d failed: %s",
                                     self.address, start, reason)
            if initial:
                self.expected = None  # start from what arrives live
            return False
        whole = not got or got[0][0] == start
        if initial or not whole:
            self.index.clear(self.address)
        if not whole:
            log.info("kv events of %s: replay starts at seq %d, not %d: rebuilt from there",
                     self.address, got[0][0], start)
        for seq, batch in got:
            self._apply(seq, batch)
        if not got and initial:
            self.expected = start
        self.after_replay = True
        self.replay_start = start
        if not got and not initial:
            self.index.apply(self.address, KVEventBatch(ts=0.0, events=[]))  # certain again
        return whole

    async def _fetch(self, start: int) -> list[tuple[int, KVEventBatch]]:
        sock = self.owner._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.src.replay)
            await sock.send_multipart((b"", seq_bytes(start)))
            out: list[tuple[int, KVEventBatch]] = []
            t0 = time.perf_counter()
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise _ReplayError(f"replay reply has {len(frames)} parts, want 4")
                if len(frames[2]) == 8 and int.from_bytes(frames[2], "big", signed=True) == END_SEQ:
                    return out
                got = self._parse(frames[1:], "replay")
                if got is not None and got[0] >= start:
                    out.append(got)
                if time.perf_counter() - t0 > self.owner.slice_s:
                    await anyio.sleep(0)
                    t0 = time.perf_counter()
        finally:
            sock.close(linger=0)
