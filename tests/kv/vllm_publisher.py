"""vLLM's ZmqEventPublisher protocol over real ZMQ sockets, for tests without vLLM.

Follows ``vllm/distributed/kv_events.py`` (0.32): PUB sends ``(topic, seq 8 bytes
big-endian, payload)``, a ROUTER replay socket answers ``(id, "", start_seq)`` with
``(id, "", topic, seq, payload)`` per buffered batch ``>= start`` and
``(id, "", "", -1, "")``. ``drop`` publishes nothing for a sequence number but keeps it in
the buffer (what a subscriber's full high-water mark does); ``restart`` starts again at 0
with an empty buffer (a new engine process).
"""

from __future__ import annotations

import collections
import threading

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    def __init__(self, topic: str = "kv@test", *, replay: bool = True, buffer_steps: int = 10_000):
        self.topic = topic.encode()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.events_endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = ""
        self.router = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.seq = 0
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.replays: list[int] = []
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, payload: bytes, *, drop: bool = False) -> int:
        with self.lock:
            seq = self.seq
            self.seq += 1
            if not drop:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))
        return seq

    def send_raw(self, *frames: bytes) -> None:
        with self.lock:
            self.pub.send_multipart(frames)

    def restart(self) -> None:
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        if self.router is None:
            return
        while not self.halt.is_set():
            if not self.router.poll(50):
                continue
            frame = self.router.recv_multipart()
            if len(frame) != 3:
                continue
            client, _, start = frame
            start_seq = int.from_bytes(start, "big")
            with self.lock:
                self.replays.append(start_seq)
                for seq, buf in list(self.buffer):
                    if seq >= start_seq:
                        self.router.send_multipart((client, b"", self.topic,
                                                    seq.to_bytes(8, "big"), buf))
                self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.halt.set()
        self.thread.join()
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()
