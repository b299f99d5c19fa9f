"""The simulator publishes vLLM's KV-cache events: what it stores, evicts and clears, with
vLLM's block hashes over the sim's token ids — so a KvIndex fed by them knows exactly
what each replica's cache holds."""

from __future__ import annotations

import msgspec
import pytest

from epick.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from epick.kv.hashing import BlockHasher
from epick.kv.index import KvIndex
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.fleet import CLOCK_ORIGIN, Fleet
from epick.sim.replica import Replica
from epick.sim.routers import RandomRouter, RoundRobinRouter
from epick.sim.tokens import block_hashes as sim_hashes
from epick.sim.tokens import count_tokens, token_ids
from epick.sim.workload import SimRequest, shared_prefix

small = msgspec.structs.replace(DEFAULT_CONFIG, num_gpu_blocks=600, max_loras=2)


def test_token_ids_are_little_endian_4_byte_chunks_zero_padded():
    assert token_ids("") == []
    assert token_ids("abcd") == [int.from_bytes(b"abcd", "little")] == [0x64636261]
    assert token_ids("hello") == [int.from_bytes(b"hell", "little"), ord("o")]
    assert token_ids("é") == [0xA9C3]  # UTF-8 bytes, not characters
    text = "any text at all, ünïcödé included"
    assert len(token_ids(text)) == count_tokens(text)


def drain(replica: Replica, until: float = 1e9) -> None:
    while (t := replica.next_event_time()) is not None and t <= until:
        replica.advance(t)


def test_stored_blocks_carry_vllm_hashes_over_the_token_ids():
    got: list[list] = []
    r = Replica(small, kv_events=got.append)
    prompt = "tok " * 100  # 100 tokens: 6 full blocks of 16, 4 tokens over
    r.submit("a", prompt, 3, 0.0, adapter="sql", cache_salt="tenant-1")
    drain(r)
    stored = [e for batch in got for e in batch]
    assert all(isinstance(e, BlockStored) for e in stored)
    ids = token_ids(prompt)
    expect = BlockHasher().block_hashes(ids, 16, lora_name="sql", cache_salt="tenant-1")
    assert [h for e in stored for h in e.block_hashes] == expect
    assert len(expect) == 6
    e = stored[0]
    assert e.parent_block_hash is None and e.block_size == 16 and e.medium == "GPU"
    assert e.token_ids == ids[: 16 * len(e.block_hashes)]
    assert e.lora_name == "sql" and e.lora_id == 1 and e.group_idx == 0
    assert e.extra_keys[0] == ("sql", "tenant-1") and set(e.extra_keys[1:]) <= {("sql",)}


def test_a_chunked_prefill_continues_the_chain_with_its_parent():
    cfg = msgspec.structs.replace(small, max_num_batched_tokens=64)  # 4 blocks a step
    got: list[list] = []
    r = Replica(cfg, kv_events=got.append)
    r.submit("a", "abcd" * 200, 1, 0.0)
    drain(r)
    stored = [e for batch in got for e in batch]
    assert len(stored) > 1 and len(got) == len(stored)  # one batch per step
    flat = [h for e in stored for h in e.block_hashes]
    assert flat == BlockHasher().block_hashes(token_ids("abcd" * 200), 16)
    for prev, e in zip(stored, stored[1:]):
        assert e.parent_block_hash == prev.block_hashes[-1]


def test_a_cached_hit_is_not_stored_again():
    got: list[list] = []
    r = Replica(small, kv_events=got.append)
    prefix = "pre " * 64  # 4 blocks
    r.submit("a", prefix + "one " * 20, 1, 0.0)
    drain(r)
    first = [h for b in got for e in b for h in e.block_hashes]
    got.clear()
    r.submit("b", prefix + "two " * 20, 1, 1.0)
    drain(r)
    second = [e for b in got for e in b]
    assert len(second) == 1 and second[0].parent_block_hash == first[3]
    assert set(second[0].block_hashes).isdisjoint(first)


def test_evictions_are_removed_events_and_a_reset_clears_all():
    cfg = msgspec.structs.replace(small, num_gpu_blocks=40)
    got: list[list] = []
    r = Replica(cfg, kv_events=got.append)
    r.submit("a", "aaaa" * 16 * 20, 1, 0.0)  # 20 blocks, cached when done
    drain(r)
    # b takes 30 blocks of the 40: 19 never used, a's unhashed last one, then 10 of a's
    # cached blocks, its tail first (released in reverse order)
    r.submit("b", "bbbb" * 16 * 30, 1, 1.0)
    drain(r)
    removed = [e for b in got for e in b if isinstance(e, BlockRemoved)]
    assert len(removed) == r.kv.evictions == 10
    assert all(len(e.block_hashes) == 1 and e.medium == "GPU" for e in removed)
    a_hashes = BlockHasher().block_hashes(token_ids("aaaa" * 16 * 20), 16)
    assert {e.block_hashes[0] for e in removed} == set(a_hashes[-10:])
    r.sleep(1)
    assert isinstance(got[-1][-1], AllBlocksCleared)


def test_events_off_changes_nothing():
    wl = shared_prefix(qps=40, duration_s=4, tenants=6, prefix_tokens=2000, seed=3)
    plain = Fleet(3, small, seed=1).run(wl, RandomRouter(1))
    batches: list = []
    with_events = Fleet(3, small, seed=1).run(
        wl, RandomRouter(1), kv_events=lambda a, s, b: batches.append(b))
    assert plain.records == with_events.records
    assert batches  # and it did publish


def test_an_index_fed_by_the_fleet_knows_exactly_what_each_replica_caches(monkeypatch):
    """Under eviction pressure, after the run: for every prompt and replica, the index's
    leading-match count equals the replica's cache's own (vLLM hashes vs the sim's)."""
    cfg = msgspec.structs.replace(small, num_gpu_blocks=500)
    wl = shared_prefix(qps=30, duration_s=6, tenants=10, prefix_tokens=1500, seed=5)
    index = KvIndex(100_000)
    seqs: dict[str, list[int]] = {}
    replicas: list[Replica] = []
    real_init = Replica.__init__

    def keep(self, *a, **kw):  # capture the fleet's replicas to look inside them
        real_init(self, *a, **kw)
        replicas.append(self)

    def on_batch(address: str, seq: int, batch: KVEventBatch) -> None:
        seqs.setdefault(address, []).append(seq)
        index.apply(address, decode_batch(encode_batch(batch)))  # through the wire format

    monkeypatch.setattr(Replica, "__init__", keep)
    res = Fleet(3, cfg, seed=2).run(wl, RandomRouter(2), kv_events=on_batch)
    assert sum(r.kv_evictions for r in res.replicas) > 0
    assert all(s == list(range(len(s))) for s in seqs.values()) and len(seqs) == 3
    hasher = BlockHasher()
    checked = 0
    for req in wl:
        hashes = hasher.block_hashes(token_ids(req.prompt), cfg.block_size)
        internal = sim_hashes(req.prompt, cfg.block_size)
        for addr, rep in zip(Fleet(3, cfg).addresses, replicas):
            own = len(rep.kv.match_prefix(internal, len(internal)))
            assert index.matched(addr, hashes[: len(internal)]) == own
            checked += own > 0
    assert checked > 0


def test_delivery_waits_the_configured_delay():
    wl = [SimRequest(request_id=f"r{i}", arrival_s=i * 0.5, prompt="abcd" * 64, max_tokens=2)
          for i in range(6)]
    seen_at_route: list[int] = []
    delivered: list[KVEventBatch] = []

    class Watch(RoundRobinRouter):
        def route(self, req, view):
            seen_at_route.append(len(delivered))
            return super().route(req, view)

    Fleet(2, small, seed=1).run(wl, Watch(), kv_events=lambda a, s, b: delivered.append(b),
                                kv_event_delay_s=0.0)
    assert seen_at_route[0] == 0 and seen_at_route[-1] > 0  # prompt-time deliveries
    first_ts = delivered[0].ts - CLOCK_ORIGIN
    seen_at_route.clear()
    delivered.clear()
    Fleet(2, small, seed=1).run(wl, Watch(), kv_events=lambda a, s, b: delivered.append(b),
                                kv_event_delay_s=100.0)
    assert seen_at_route == [0] * 6  # nothing arrives within the run's 3 s of arrivals
    assert delivered == []  # and the run ends before they would (nothing waits for them)
    assert first_ts == pytest.approx(0.024, abs=1e-6)  # stamped when the first step started


def test_a_restart_aborts_retries_and_clears_the_cache():
    wl = shared_prefix(qps=20, duration_s=4, tenants=4, prefix_tokens=1000, seed=1)
    events: list = []
    res = Fleet(2, small, seed=1).run(
        wl, RoundRobinRouter(), kv_events=lambda a, s, b: events.append((a, b)),
        restarts=[(2.0, 0)])
    assert len(res.records) == len(wl)  # every aborted request was retried and finished
    cleared = [(a, b.ts - CLOCK_ORIGIN) for a, b in events
               if any(isinstance(e, AllBlocksCleared) for e in b.events)]
    assert cleared == [("10.0.0.1:8000", pytest.approx(2.0))]


def test_bad_restarts_and_delays_are_refused():
    wl = shared_prefix(qps=5, duration_s=1, seed=1)
    with pytest.raises(ValueError, match="restart"):
        Fleet(2, small).run(wl, RoundRobinRouter(), restarts=[(1.0, 2)])
    with pytest.raises(ValueError, match="kv_event_delay_s"):
        Fleet(2, small).run(wl, RoundRobinRouter(), kv_event_delay_s=-1)
