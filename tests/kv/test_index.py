"""epick.kv.index: leading matches, removals, clears, uncertainty, the memory cap."""

import pytest

from epick.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from epick.kv.index import KvIndex


def stored(*hashes, medium="GPU", group_idx=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=32, lora_id=None, medium=medium, lora_name=None,
                       group_idx=group_idx)


def batch(*events):
    return KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)


def test_unknown_endpoint_is_minus_one_then_leading_matches():
    idx = KvIndex(100)
    assert idx.matched("a", [1, 2]) == -1
    idx.apply("a", batch(stored(1, 2, 3)))
    assert idx.matched("a", [1, 2, 3, 4]) == 3
    assert idx.matched("a", [2, 3]) == 2
    assert idx.matched("a", [9, 1, 2]) == 0  # leading only
    assert idx.matched("a", []) == 0
    assert idx.matched("b", [1]) == -1


def test_removed_cleared_and_other_tiers():
    idx = KvIndex(100)
    idx.apply("a", batch(stored(1, 2, 3), BlockRemoved(block_hashes=[2], medium="GPU")))
    assert idx.matched("a", [1, 2, 3]) == 1
    idx.apply("a", batch(stored(7, medium="CPU"), stored(8, group_idx=1),
                         BlockRemoved(block_hashes=[1], medium="CPU")))
    assert idx.matched("a", [1]) == 1 and idx.matched("a", [7]) == 0 and idx.matched("a", [8]) == 0
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.size("a") == 0 and idx.matched("a", [1]) == 0


def test_cleared_ms_is_when_the_engine_emptied_its_cache():
    idx = KvIndex(100)
    assert idx.cleared_ms("a") == 0  # never seen
    idx.apply("a", KVEventBatch(ts=1_700_000_001.5, events=[stored(1)], data_parallel_rank=0))
    assert idx.cleared_ms("a") == 0  # stores are no clear
    idx.apply("a", KVEventBatch(ts=1_700_000_002.25, events=[AllBlocksCleared(), stored(2)],
                                data_parallel_rank=0))
    assert idx.cleared_ms("a") == 1_700_000_002_250 and idx.matched("a", [2]) == 1
    idx.clear("a")  # epick's own clear (a rebuild): the engine lost nothing
    assert idx.cleared_ms("a") == 1_700_000_002_250
    idx.clear("a", at_ms=1_700_000_009_000)  # a restart the subscriber saw
    assert idx.cleared_ms("a") == 1_700_000_009_000
    # a late batch stamped earlier (clocks) never moves it back; garbage ts is no stamp
    idx.apply("a", KVEventBatch(ts=1_700_000_003.0, events=[AllBlocksCleared()],
                                data_parallel_rank=0))
    idx.apply("a", KVEventBatch(ts=float("nan"), events=[AllBlocksCleared()], data_parallel_rank=0))
    assert idx.cleared_ms("a") == 1_700_000_009_000
    assert idx.cleared_ms("b") == 0


def test_uncertain_until_fresh_events_clear_and_drop():
    idx = KvIndex(100)
    idx.apply("a", batch(stored(1)))
    idx.clear("a")
    idx.mark_uncertain("a")
    assert idx.matched("a", [1]) == -1
    idx.apply("a", batch(stored(5)))
    assert idx.matched("a", [5]) == 1 and idx.matched("a", [1]) == 0
    idx.drop("a")
    assert idx.matched("a", [5]) == -1 and idx.size("a") == 0 and idx.addresses() == []


def test_cap_evicts_oldest_and_restore_refreshes():
    idx = KvIndex(3)
    idx.apply("a", batch(stored(1, 2, 3)))
    idx.apply("a", batch(stored(1)))  # re-stored (reused): now the newest
    idx.apply("a", batch(stored(4)))
    assert idx.size("a") == 3 and idx.evicted == 1
    assert idx.matched("a", [2]) == 0 and idx.matched("a", [1]) == 1
    assert idx.matched("a", [3, 4]) == 2
    idx.apply("a", batch(stored(*range(10, 20))))
    assert idx.size("a") == 3 and idx.matched("a", [17, 18, 19]) == 3


def test_block_size_from_the_events():
    idx = KvIndex(10)
    assert idx.block_size("a") == 0
    idx.apply("a", batch(stored(1)))
    assert idx.block_size("a") == 32


def test_byte_hashes_fold_to_ints():
    idx = KvIndex(10)
    digest = bytes(range(32))
    idx.apply("a", batch(stored(digest)))
    assert idx.matched("a", [int.from_bytes(digest[-8:], "big")]) == 1


def test_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_blocks_per_endpoint"):
        KvIndex(0)
