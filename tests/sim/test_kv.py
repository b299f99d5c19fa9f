import pytest

from epick.sim.kv import KVCache


def test_released_hashed_blocks_stay_cached_and_count_as_free():
    kv = KVCache(4)
    blocks = kv.allocate(2)
    kv.register(blocks[0], 111)
    kv.register(blocks[1], 222)
    assert kv.usage == 0.5
    kv.release(blocks)
    assert kv.usage == 0.0
    assert kv.match_prefix([111, 222, 333], limit=3) == blocks


def test_match_stops_at_the_first_miss_and_respects_the_limit():
    kv = KVCache(4)
    b = kv.allocate(3)
    for blk, h in zip(b, (1, 2, 3)):
        kv.register(blk, h)
    assert kv.match_prefix([1, 9, 3], limit=3) == [b[0]]
    assert kv.match_prefix([1, 2, 3], limit=2) == b[:2]


def test_allocation_evicts_the_least_recently_freed_unreferenced_block_first():
    kv = KVCache(3)
    first, second = kv.allocate(1), kv.allocate(1)
    kv.register(first[0], 10)
    kv.register(second[0], 20)
    kv.release(first)
    kv.release(second)
    kv.allocate(2)  # the never-used block, then the LRU cached one (hash 10)
    assert kv.match_prefix([10], 1) == []
    assert kv.match_prefix([20], 1) == second
    assert kv.evictions == 1


def test_referenced_blocks_are_never_evicted():
    kv = KVCache(2)
    held = kv.allocate(1)
    kv.register(held[0], 5)
    kv.allocate(1)
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with only 0 free"):
        kv.allocate(1)
    assert kv.match_prefix([5], 1) == held


def test_taking_a_cached_block_removes_it_from_the_free_pool():
    kv = KVCache(2)
    b = kv.allocate(1)
    kv.register(b[0], 7)
    kv.release(b)
    assert kv.free_needed_for(b, 1) == 2
    kv.take(b)
    assert kv.num_free == 1
