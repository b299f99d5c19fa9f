"""What the log keeps of a request's prompt, and how a replay gives policies a prompt back.

In ``hashes`` mode the log keeps the prompt's block hash chain, the one the prefix-cache
policy computes (policies/ABI.md, DESIGN "Prefix cache"): blocks of ``block_bytes``
bytes, a trailing partial block ignored, at most ``max_blocks``;
h0 = xxh64(model ‖ 0x00 ‖ salt ‖ 0x00 ‖ block0) with a salt, xxh64(model ‖ block0)
without; hi = xxh64(block_i ‖ le64(h(i−1))).

A replay cannot invert hashes, so :func:`synthetic_prompt` builds a stand-in: one
``block_bytes``-byte block per recorded hash, derived from that hash. Two stand-ins share
their first k blocks exactly when the real prompts did (same model, salt and first
k blocks), so a prefix policy with the same block size scores them as it scored the real
ones (up to 64-bit hash collisions). Policies that read the prompt's text itself need
``prompt = "full"``.
"""

from __future__ import annotations

import struct

import xxhash

__all__ = ["block_hashes", "pack_hashes", "unpack_hashes", "synthetic_prompt"]


# Shared prefixes repeat blocks across requests: build each stand-in block once.
_BLOCKS: dict[int, dict[int, str]] = {}
_BLOCK_CACHE = 1 << 18


def block_hashes(model: str, salt: str, prompt: str, block_bytes: int,
                 max_blocks: int) -> list[int]:
    """The prompt's block hash chain (see the module docstring)."""
    data = prompt.encode()
    n = min(len(data) // block_bytes, max_blocks)
    out: list[int] = []
    if n == 0:
        return out
    head = model.encode() + (b"\0" + salt.encode() + b"\0" if salt else b"")
    h = xxhash.xxh64_intdigest(head + data[:block_bytes])
    out.append(h)
    pack = struct.Struct("<Q").pack
    for i in range(1, n):
        h = xxhash.xxh64_intdigest(data[i * block_bytes:(i + 1) * block_bytes] + pack(h))
        out.append(h)
    return out


def pack_hashes(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(blob: bytes) -> tuple[int, ...]:
    if len(blob) % 8:
        raise ValueError(f"block hashes: {len(blob)} bytes is not a multiple of 8")
    return struct.unpack(f"<{len(blob) // 8}Q", blob)


def synthetic_prompt(hashes: tuple[int, ...], block_bytes: int, prompt_bytes: int = 0,
                     tail: str = "") -> str:
    """A prompt whose blocks stand for ``hashes`` (one block per hash, ASCII).

    ``prompt_bytes`` pads the end so the stand-in is as long as the real prompt was, for
    token estimates: full blocks past the recorded ones (the real prompt had more than
    ``max_blocks``) are made unique with ``tail`` (say, the decision id) — whether the
    real ones were shared is unknown, so none is assumed — then a partial block of
    filler, which no policy hashes.
    """
    cache = _BLOCKS.get(block_bytes)
    if cache is None or len(cache) > _BLOCK_CACHE:
        cache = _BLOCKS[block_bytes] = {}
    parts = []
    for h in hashes:
        block = cache.get(h)
        if block is None:
            word = f"{h:016x}"
            block = cache[h] = (word * (block_bytes // 16 + 1))[:block_bytes]
        parts.append(block)
    size = len(parts) * block_bytes
    extra = max(0, prompt_bytes - size) // block_bytes
    for i in range(extra):
        parts.append(f"~{tail}~{i}~".ljust(block_bytes, "~")[-block_bytes:])
    size += extra * block_bytes
    if prompt_bytes > size:
        parts.append("." * (prompt_bytes - size))
    return "".join(parts)
