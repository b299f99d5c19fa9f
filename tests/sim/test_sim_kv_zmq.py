"""The HTTP-mode simulator publishes its KV-cache events over real ZMQ sockets in vLLM's
three frames, serves /kv_event_sources and a replay socket — and epick's own subscriber
(epick.kv.subscriber, discovery included) builds an index that matches its cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import httpx
import msgspec
import zmq
import zmq.asyncio

from epick.kv.events import BlockStored, decode_batch
from epick.kv.hashing import BlockHasher
from epick.kv.index import KvIndex
from epick.kv.subscriber import EventSource, KvSubscriber
from epick.kv.tokenize import BytesTokenizer
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.kv_publisher import END_SEQ_FRAME
from epick.sim.server import serve_fleet
from epick.sim.tokens import token_ids

cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=1)
PROMPT = "abcd" * 16 * 5 + "tail"  # 5 full blocks of 16 tokens


def test_the_sim_and_the_host_bytes_tokenizer_agree():
    tok = BytesTokenizer()
    for text in ("", "a", "abcd", "hello world", "ünïcödé ✓ 🙂", PROMPT):
        assert token_ids(text) == tok.encode_prompt(text)


async def wait_for(cond, what: str, timeout: float = 10.0):
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.02)


async def test_frames_are_vllms_and_sources_say_where():
    async with serve_fleet(1, config=cfg, kv_events=True) as fleet, \
            httpx.AsyncClient(timeout=10) as client:
        address = fleet.addresses[0]
        src = (await client.get(f"http://{address}/kv_event_sources")).json()["0"]
        assert src["enable_kv_cache_events"] and src["publisher"] == "zmq"
        assert src["topic"] == f"kv@{address}"
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(src["endpoint"])
            await anyio.sleep(0.3)  # PUB/SUB: a late joiner misses what was sent before
            r = await client.post(f"http://{address}/v1/completions",
                                  json={"model": "sim-base", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200
            with anyio.fail_after(10):
                topic, seq, payload = await sub.recv_multipart()
            assert topic == f"kv@{address}".encode() and len(seq) == 8
            batch = decode_batch(payload)
            assert batch.data_parallel_rank == 0
            stored = [e for e in batch.events if isinstance(e, BlockStored)]
            assert [h for e in stored for h in e.block_hashes] == BlockHasher().block_hashes(
                token_ids(PROMPT), 16)
            # the replay socket: everything from 0, then the end marker
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(src["replay_endpoint"])
            await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            with anyio.fail_after(10):
                first = await dealer.recv_multipart()
                end = await dealer.recv_multipart()
            assert first == [b"", topic, (0).to_bytes(8, "big"), payload]
            assert end == [b"", b"", END_SEQ_FRAME, b""]
            dealer.close(0)
        finally:
            sub.close(0)
            ctx.destroy(0)
    # events off: no sources
    async with serve_fleet(1, config=cfg) as fleet, httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"http://{fleet.addresses[0]}/kv_event_sources")).json() == {}


async def test_epicks_subscriber_tracks_the_sim_through_a_reset_and_catches_up_late():
    hashes = BlockHasher().block_hashes(token_ids(PROMPT), 16)
    async with serve_fleet(2, config=cfg, kv_events=True) as fleet, \
            httpx.AsyncClient(timeout=10) as client:
        a, b = fleet.addresses
        index = KvIndex(10_000)
        subscriber = KvSubscriber(index, lora_discovery=False)
        subscriber.set_endpoints([EventSource(x, "discover") for x in fleet.addresses])
        async with anyio.create_task_group() as tg:
            await tg.start(subscriber.run)
            await wait_for(lambda: index.matched(a, hashes) == 0 and index.matched(b, hashes) == 0,
                           "both subscribed (replayed an empty history)")
            r = await client.post(f"http://{a}/v1/completions",
                                  json={"model": "sim-base", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200
            await wait_for(lambda: index.matched(a, hashes) == 5, "a's blocks indexed")
            assert index.matched(b, hashes) == 0
            # a late epick replays from 0 and agrees
            late = KvIndex(10_000)
            late_sub = KvSubscriber(late, lora_discovery=False)
            late_sub.set_endpoints([EventSource(a, "discover")])
            await tg.start(late_sub.run)
            await wait_for(lambda: late.matched(a, hashes) == 5, "the late subscriber caught up")
            # sleep level 1 resets the prefix cache: AllBlocksCleared
            assert (await client.post(f"http://{a}/sleep?level=1")).status_code == 200
            await wait_for(lambda: index.matched(a, hashes) == 0, "the reset reached the index")
            await wait_for(lambda: late.matched(a, hashes) == 0, "and the late one")
            assert subscriber.stats()[a].bad_frames == 0 and subscriber.stats()[a].gaps == 0
            tg.cancel_scope.cancel()


def test_cli_serve_kv_events():
    proc = subprocess.Popen(
        [sys.executable, "-m", "epick.sim", "serve", "--replicas", "1", "--kv-events"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("READY 127.0.0.1:"), line
        src = httpx.get(f"http://{line.split()[1]}/kv_event_sources", timeout=5).json()["0"]
        assert src["endpoint"].startswith("tcp://127.0.0.1:") and src["replay_endpoint"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
