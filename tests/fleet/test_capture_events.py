"""fleet/capture_events.py's pieces that need no vLLM: the prompts, the SUB collector and
vLLM's replay protocol, against local ZMQ sockets."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from epick.fleet import capture_events as cap


def test_text_is_deterministic_per_seed_and_seeds_differ():
    assert cap.text(3, 40) == cap.text(3, 40)
    assert cap.text(3, 40) != cap.text(4, 40)
    assert len(cap.text(1, 40).split()) > 40 and cap.text(1, 40).endswith(".")


def test_the_collector_keeps_topic_sequence_and_payload_of_its_topic_only():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    c = cap.Collector(f"tcp://127.0.0.1:{port}", "kv@a")
    c.start()
    try:
        deadline = time.monotonic() + 10
        while not c.frames and time.monotonic() < deadline:  # a SUB joins late: resend
            pub.send_multipart([b"kv@a", (7).to_bytes(8, "big"), b"\x01\x02"])
            pub.send_multipart([b"other", (8).to_bytes(8, "big"), b"\x03"])
            time.sleep(0.05)
    finally:
        c.stop()
        pub.close(0)
        ctx.term()
    assert c.frames and {f["topic"] for f in c.frames} == {"kv@a"}
    assert c.frames[0] == {"topic": "kv@a", "seq": 7, "payload": "0102"}


def _replayer(sock: zmq.Socket, frames: int) -> None:
    ident, _empty, start = sock.recv_multipart()
    first = int.from_bytes(start, "big")
    for seq in range(first, first + frames):
        sock.send_multipart([ident, b"", b"kv@a", seq.to_bytes(8, "big"), b"\xff"])
    sock.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


def test_replay_asks_from_a_sequence_and_reads_until_the_end_marker():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    t = threading.Thread(target=_replayer, args=(router, 3))
    t.start()
    try:
        got = cap.replay(f"tcp://127.0.0.1:{port}", 5, timeout_s=10)
    finally:
        t.join(10)
        router.close(0)
        ctx.term()
    assert [f["seq"] for f in got] == [5, 6, 7]
    assert got[0] == {"topic": "kv@a", "seq": 5, "payload": "ff"}


def test_a_replay_that_never_ends_times_out_naming_the_endpoint():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # answers nothing
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(TimeoutError, match=f"replay from tcp://127.0.0.1:{port} did not end"):
            cap.replay(f"tcp://127.0.0.1:{port}", 0, timeout_s=0.5)
    finally:
        router.close(0)
        ctx.term()
