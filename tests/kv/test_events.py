"""epick.kv.events decodes and re-encodes vLLM's KV event batches byte for byte."""

import msgspec
import pytest

from epick.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
    hash64,
    seq_bytes,
    seq_from_bytes,
)

# Encoded by vLLM 0.32's own classes (vllm.distributed.kv_events) with msgspec:
# KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[1, 2**64-1], parent_block_hash=None,
#   token_ids=[1, 2], block_size=32, lora_id=1, medium="GPU", lora_name="a",
#   extra_keys=[("a",), ("a", "s")], group_idx=0), BlockRemoved(block_hashes=[5],
#   medium="GPU"), AllBlocksCleared()], data_parallel_rank=0)
VLLM_BYTES = bytes.fromhex(
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
    "01cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa"
    "626c6f636b5f73697a6520a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a161"
    "aa65787472615f6b6579739291a16192a161a173a967726f75705f6964780083a474797065ac426c6f636b"
    "52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da347505581a474797065b0416c6c"
    "426c6f636b73436c656172656400"
)


def test_decodes_vllm_bytes_and_reencodes_identically():
    batch = decode_batch(VLLM_BYTES)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [1, 2**64 - 1]
    assert stored.parent_block_hash is None and stored.lora_name == "a"
    assert stored.extra_keys == [("a",), ("a", "s")] and stored.group_idx == 0
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [5]
    assert isinstance(cleared, AllBlocksCleared)
    assert encode_batch(batch) == VLLM_BYTES


def test_none_rank_round_trips():
    b = KVEventBatch(ts=2.0, events=[])
    # vLLM encodes this exact batch as 93 cb4000000000000000 90 c0.
    assert encode_batch(b) == bytes.fromhex("93cb400000000000000090c0")
    assert decode_batch(encode_batch(b)) == b


def test_unknown_fields_from_newer_vllm_are_ignored():
    raw = msgspec.msgpack.encode(
        [0.0, [{"type": "BlockRemoved", "block_hashes": [7], "medium": None, "new": 1}], 0]
    )
    assert decode_batch(raw).events == [BlockRemoved(block_hashes=[7], medium=None)]


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"", "0 bytes"),
        (b"\xff\x00garbage", "not a vLLM KV event batch"),
        (msgspec.msgpack.encode({"ts": 1}), "Expected `array`"),
        (msgspec.msgpack.encode([0.0, [{"type": "Nope"}], 0]), "Nope"),
        (msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "medium": None}], 0]),
         "block_hashes"),
        (msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1],
                                        "parent_block_hash": None, "token_ids": [],
                                        "block_size": 0, "lora_id": None, "medium": None,
                                        "lora_name": None}], 0]), "block_size 0"),
        (msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1, 2],
                                        "parent_block_hash": None, "token_ids": [],
                                        "block_size": 32, "lora_id": None, "medium": None,
                                        "lora_name": None, "extra_keys": [None]}], 0]),
         "1 extra_keys for 2"),
    ],
)
def test_bad_payloads_say_what_is_wrong(payload, words):
    with pytest.raises(EventDecodeError, match=words):
        decode_batch(payload)


def test_hash64_folds_digest_bytes_like_vllm():
    digest = bytes(range(32))
    assert hash64(digest) == int.from_bytes(digest[-8:], "big")
    assert hash64(2**64 + 5) == 5


def test_sequence_frames():
    assert seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert seq_from_bytes(seq_bytes(258)) == 258
    assert seq_from_bytes(b"\xff" * 8) == -1  # vLLM's end-of-replay marker
    with pytest.raises(ValueError, match="7 bytes"):
        seq_from_bytes(b"\x00" * 7)
