"""KvSubscriber over real ZMQ sockets: order, gaps (replay or rebuild), late joiners,
restarts, bad frames, endpoints leaving, and a flood that must not starve the loop."""

import json
import time

import anyio
import pytest
from vllm_publisher import Publisher

from epick.kv.events import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch
from epick.kv.index import KvIndex
from epick.kv.subscriber import EventSource, KvSubscriber

ADDR = "127.0.0.1:8000"


def stored(*hashes, ts=0.0):
    return encode_batch(KVEventBatch(ts=ts, data_parallel_rank=0, events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=32,
        lora_id=None, medium="GPU", lora_name=None)]))


CLEARED = encode_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=0))


@pytest.fixture
def pub():
    p = Publisher()
    yield p
    p.close()


@pytest.fixture
def pub_noreplay():
    p = Publisher(replay=False)
    yield p
    p.close()


async def until(cond, what, timeout_s=20.0):
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.01)


async def wait_joined(sub, pub, addr=ADDR):
    """Publish probes until the subscription is live (ZMQ's slow joiner)."""
    idx = sub.index
    probe = 10**9
    with anyio.fail_after(20):
        while idx.matched(addr, [probe]) != 1:
            probe += 1
            pub.publish(stored(probe))
            await anyio.sleep(0.05)


def source(p, addr=ADDR):
    return EventSource(addr, p.events_endpoint, p.replay_endpoint, p.topic.decode())


async def run_sub(sources, body, **kw):
    idx = KvIndex(1000)
    sub = KvSubscriber(idx, lora_discovery=False, **kw)
    sub.set_endpoints(sources)
    async with anyio.create_task_group() as tg:
        await tg.start(sub.run)
        try:
            await body(sub, idx)
        finally:
            tg.cancel_scope.cancel()


async def test_in_order_frames_apply_and_clear(pub):
    async def body(sub, idx):
        await wait_joined(sub, pub)
        pub.publish(stored(1, 2))
        pub.publish(stored(3))
        await until(lambda: idx.matched(ADDR, [1, 2, 3]) == 3, "three blocks")
        pub.publish(CLEARED)
        await until(lambda: idx.size(ADDR) == 0, "cleared")
        st = sub.stats()[ADDR]
        assert st.gaps == 0 and st.bad_frames == 0 and st.restarts == 0
    await run_sub([source(pub)], body)


async def test_gap_is_filled_from_the_replay_socket(pub):
    async def body(sub, idx):
        await wait_joined(sub, pub)
        pub.publish(stored(1))
        pub.publish(stored(2), drop=True)  # lost on the way; still in vLLM's buffer
        pub.publish(stored(3))
        await until(lambda: idx.matched(ADDR, [1, 2, 3]) == 3, "gap filled")
        st = sub.stats()[ADDR]
        assert st.gaps == 1 and st.replays >= 2  # the initial one and the gap's
        assert pub.replays[0] == 0 and pub.replays[-1] >= 1
    await run_sub([source(pub)], body)


async def test_gap_without_replay_rebuilds(pub_noreplay):
    pub = pub_noreplay

    async def body(sub, idx):
        await wait_joined(sub, pub)
        pub.publish(stored(1))
        await until(lambda: idx.matched(ADDR, [1]) == 1, "first")
        pub.publish(stored(2), drop=True)
        pub.publish(stored(3))
        await until(lambda: idx.matched(ADDR, [3]) == 1, "after the gap")
        assert idx.matched(ADDR, [1]) == 0  # cleared: it may have been evicted unseen
        assert sub.stats()[ADDR].gaps == 1
    await run_sub([EventSource(ADDR, pub.events_endpoint)], body)


async def test_late_subscriber_catches_up_by_replay(pub):
    for h in range(1, 6):
        pub.publish(stored(h))  # before anyone listens

    async def body(sub, idx):
        await until(lambda: idx.matched(ADDR, [1, 2, 3, 4, 5]) == 5, "replayed history")
        await wait_joined(sub, pub)
        assert sub.stats()[ADDR].gaps == 0
    await run_sub([source(pub)], body)


async def test_engine_restart_clears(pub):
    async def body(sub, idx):
        await wait_joined(sub, pub)
        pub.publish(stored(1))
        await until(lambda: idx.matched(ADDR, [1]) == 1, "before restart")
        pub.restart()
        pub.publish(stored(7))
        await until(lambda: idx.matched(ADDR, [7]) == 1, "after restart")
        assert idx.matched(ADDR, [1]) == 0
        assert sub.stats()[ADDR].restarts == 1
    await run_sub([source(pub)], body)


async def test_an_engine_restart_is_stamped_with_the_new_engines_first_batch(pub):
    """prefix_cleared_ms: a restart the subscriber sees is when the new engine's cache
    started empty (its first batch's ts); joining the stream is no clear of the engine's."""
    async def body(sub, idx):
        await wait_joined(sub, pub)
        assert idx.cleared_ms(ADDR) == 0  # joined (and replayed): the engine lost nothing
        pub.publish(stored(1, ts=1_700_000_000.0))
        await until(lambda: idx.matched(ADDR, [1]) == 1, "before restart")
        assert idx.cleared_ms(ADDR) == 0
        pub.restart()
        pub.publish(stored(7, ts=1_700_000_012.345))
        await until(lambda: idx.matched(ADDR, [7]) == 1, "after restart")
        assert idx.cleared_ms(ADDR) == 1_700_000_012_345
    await run_sub([source(pub)], body)


async def test_bad_frames_are_counted_and_lose_nothing(pub):
    async def body(sub, idx):
        await wait_joined(sub, pub)
        pub.publish(stored(1))
        await until(lambda: idx.matched(ADDR, [1]) == 1, "good frame")
        topic = pub.topic
        pub.send_raw(topic, b"\x00" * 8)                           # 2 parts
        pub.send_raw(topic, b"\x00" * 7, stored(9))                # short seq
        pub.send_raw(topic + b"-other", (99).to_bytes(8, "big"), stored(9))  # other topic
        pub.publish(b"\x93\xff garbage")                            # undecodable payload
        pub.publish(stored(2))
        await until(lambda: idx.matched(ADDR, [1, 2]) == 2, "good frame after bad ones")
        st = sub.stats()[ADDR]
        assert st.bad_frames == 4, st
        assert st.gaps == 0 and idx.matched(ADDR, [9]) == 0
        assert "undecodable" not in st.last_error and "not a vLLM KV event batch" in st.last_error
    await run_sub([source(pub)], body)


async def test_endpoint_leaving_is_dropped(pub):
    async def body(sub, idx):
        await wait_joined(sub, pub)
        assert idx.matched(ADDR, []) == 0
        sub.set_endpoints([])
        assert idx.matched(ADDR, []) == -1 and sub.stats() == {}
        pub.publish(stored(5))
        await anyio.sleep(0.2)
        assert idx.matched(ADDR, [5]) == -1
    await run_sub([source(pub)], body)


async def test_a_flood_does_not_starve_the_event_loop(pub):
    n = 20_000

    async def body(sub, idx):
        await wait_joined(sub, pub)
        ticks = 0
        done = anyio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await anyio.sleep(0)

        before = sub.stats()[ADDR].batches
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for i in range(n):
                pub.publish(stored(i))
            t0 = time.perf_counter()
            await until(lambda: sub.stats()[ADDR].batches - before >= n
                        or sub.stats()[ADDR].gaps > 0, "flood absorbed", timeout_s=120)
            elapsed = time.perf_counter() - t0
            done.set()
        # Other tasks ran all along (a pick would have): many ticks, not one at the end.
        assert ticks > 50, ticks
        assert elapsed > 0
    await run_sub([source(pub)], body)


async def test_discovery_from_kv_event_sources_and_adapter_paths(fake_vllm, pub):
    fake = fake_vllm()
    port = pub.events_endpoint.rsplit(":", 1)[1]
    rport = pub.replay_endpoint.rsplit(":", 1)[1]
    # What vLLM 0.32 answers (tests/kv/fixtures/vllm_events.json kv_event_sources).
    fake.documents["/kv_event_sources"] = json.dumps({"0": {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{rport}", "buffer_steps": 10000, "hwm": 100000,
        "max_queue_size": 100000, "topic": pub.topic.decode()}})
    fake.documents["/v1/models"] = json.dumps({"data": [
        {"id": "m", "root": "/models/m", "parent": None},
        {"id": "sql", "root": "/adapters/sql", "parent": "m"}]})
    pub.publish(stored(42))
    seen = {}
    idx = KvIndex(100)
    sub = KvSubscriber(idx, on_lora_paths=lambda a, p: seen.update({a: p}))
    sub.set_endpoints([EventSource(fake.address, "discover")])
    async with anyio.create_task_group() as tg:
        await tg.start(sub.run)
        await until(lambda: idx.matched(fake.address, [42]) == 1, "replayed via discovery")
        tg.cancel_scope.cancel()
    assert seen == {fake.address: {"sql": "/adapters/sql"}}
    assert sub.stats()[fake.address].connected == f"tcp://127.0.0.1:{port}"


async def test_discovery_failures_are_reported_and_retried(fake_vllm):
    fake = fake_vllm()
    fake.documents["/kv_event_sources"] = json.dumps({"0": {"enable_kv_cache_events": False}})
    idx = KvIndex(100)
    sub = KvSubscriber(idx, lora_discovery=False)
    sub.set_endpoints([EventSource(fake.address, "discover")])
    async with anyio.create_task_group() as tg:
        await tg.start(sub.run)
        await until(lambda: "KV events are off" in sub.stats()[fake.address].last_error,
                    "the reason")
        fake.documents["/kv_event_sources"] = "not json"
        await until(lambda: "/kv_event_sources" in sub.stats()[fake.address].last_error
                    and "off" not in sub.stats()[fake.address].last_error, "a retry")
        tg.cancel_scope.cancel()
    assert idx.matched(fake.address, []) == -1  # never subscribed: unknown, not empty


async def test_an_unreachable_endpoint_does_not_end_the_subscriber(pub):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    idx = KvIndex(100)
    sub = KvSubscriber(idx, lora_discovery=False)
    sub.set_endpoints([EventSource(dead, "discover"), source(pub)])
    async with anyio.create_task_group() as tg:
        await tg.start(sub.run)
        await until(lambda: sub.stats()[dead].last_error != "", "the failure")
        await wait_joined(sub, pub)  # the other endpoint still works
        tg.cancel_scope.cancel()
