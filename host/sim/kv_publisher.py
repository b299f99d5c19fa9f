"""A simulated replica's KV-cache events over real ZMQ sockets, as vLLM publishes them.

Follows vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, 0.32; the frames
as captured from real vLLM in tests/kv/fixtures/): a PUB socket sends three frames per engine step —
topic (UTF-8), sequence number (8 bytes big-endian, from 0), payload (msgpack
``KVEventBatch`` = ``[ts, [events...], data_parallel_rank]``, encoded by
:func:`epick.kv.events.encode_batch`) — and a ROUTER *replay* socket answers a request
``(id, "", start_seq)`` with ``(id, "", topic, seq, payload)`` for every buffered batch
with ``seq >= start_seq`` (the last ``buffer_steps``), then ``(id, "", "", -1, "")``.
A malformed replay request is ignored, as vLLM ignores it.

The PUB socket never blocks the engine: beyond its high-water mark ZMQ drops frames,
which a subscriber sees as a sequence gap (and fills from the replay socket). Both
sockets bind a free port on the server's host; :meth:`ZmqKvPublisher.sources` is what
``GET /kv_event_sources`` returns (vLLM's resolved config, data-parallel rank "0";
``tcp://*:PORT`` when bound on every interface, as vLLM reports it).

Owner: the replica's server (:mod:`epick.sim.server`) creates one per replica, runs
:meth:`serve_replay` in its task group and calls :meth:`close` when it stops.
"""

from __future__ import annotations

import collections
import time

import zmq
import zmq.asyncio

from epick.kv.events import KVEventBatch, encode_batch, seq_bytes

__all__ = ["ZmqKvPublisher", "END_SEQ_FRAME"]

END_SEQ_FRAME = seq_bytes(-1)
"""What ends a replay: sequence -1 (vLLM's ``END_SEQ``)."""


class ZmqKvPublisher:
    """One replica's publisher and replay service (see the module docstring)."""

    def __init__(self, ctx: zmq.asyncio.Context, *, host: str, topic: str,
                 buffer_steps: int = 10_000, hwm: int = 100_000, replay: bool = True) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.topic = topic
        self._topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        bind = f"tcp://{'*' if host in ('0.0.0.0', '*') else host}"
        shown = "*" if host in ("0.0.0.0", "*") else host
        # The PUB socket is a plain (sync) one: a send never waits, and the engine's
        # step loop calls it directly.
        self._pub = zmq.Socket(ctx, zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{shown}:{self._pub.bind_to_random_port(bind)}"
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = f"tcp://{shown}:{self._router.bind_to_random_port(bind)}"
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.seq = 0
        """The next sequence number."""
        self.dropped = 0
        """Batches ZMQ refused to queue (high-water mark): still in the replay buffer."""
        self.replays = 0

    def publish(self, events: list, ts: float | None = None) -> int:
        """Send one step's events as one batch; its sequence number."""
        payload = encode_batch(KVEventBatch(ts=time.time() if ts is None else ts,
                                            events=events, data_parallel_rank=0))
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (returns at once without a replay socket)."""
        router = self._router
        if router is None:
            return
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request: vLLM ignores it too
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
            await router.send_multipart((client, b"", b"", END_SEQ_FRAME, b""))

    def sources(self) -> dict:
        """``GET /kv_event_sources``: vLLM's resolved ``KVEventsConfig`` per DP rank."""
        return {"0": {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint, "buffer_steps": self.buffer_steps,
            "hwm": self.hwm, "max_queue_size": self.hwm, "topic": self.topic,
        }}

    def close(self) -> None:
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
