"""The simulator's tokenizer: a deterministic byte-based approximation.

Contract:

* A prompt's tokens are its UTF-8 bytes cut into chunks of :data:`BYTES_PER_TOKEN` (4,
  the usual "~4 characters per token" of English BPE); a trailing partial chunk is one
  more token. So ``count_tokens("")`` is 0 and ``count_tokens("hello")`` is 2.
* A KV block of ``block_size`` tokens therefore covers ``4 * block_size`` prompt bytes
  (64 with vLLM's default 16) — the same 64-byte block the prefix-cache policy hashes, so
  the sim's cache and the policy's estimate agree on which prompts share blocks.
* Only *full* blocks are hashed (as vLLM caches only full blocks). Block ``i``'s hash
  chains over every earlier block, so two prompts share hash ``i`` exactly when their
  first ``(i + 1) * 4 * block_size`` bytes are equal — and they name the same adapter
  and cache salt, which are folded into the first hash (vLLM keys cached blocks by LoRA
  and ``cache_salt`` the same way).

Hashes are Python's built-in ``hash`` of tuples: fast, collision-free in practice at
64 bits, and although the values change between processes (``PYTHONHASHSEED``), nothing
in the simulation depends on the values — only on equality — so runs stay deterministic.

Token *ids* (:func:`token_ids`), for the KV-cache events a replica publishes (vLLM hashes
blocks over token ids): token ``i`` is ``int.from_bytes(utf8[4i:4i+4], "little")``, the
last partial chunk zero-padded, no BOS. The host's ``bytes`` tokenizer
(``host/kv/tokenize.py``) implements the same contract, and the two must agree: epick
matches the events by hashing the Pick's prompt the same way.
"""

from __future__ import annotations

import sys

__all__ = ["BYTES_PER_TOKEN", "count_tokens", "block_hashes", "token_ids"]

BYTES_PER_TOKEN = 4


def count_tokens(text: str | bytes) -> int:
    """Tokens in ``text``: ceil(UTF-8 bytes / 4)."""
    data = text.encode() if isinstance(text, str) else text
    return -(-len(data) // BYTES_PER_TOKEN)


def block_hashes(
    text: str | bytes, block_size: int, *, adapter: str = "", cache_salt: str = ""
) -> list[int]:
    """Hash chain over the full ``block_size``-token blocks of ``text``.

    Returns one hash per full block, in order; a prompt shorter than one block has none.
    """
    data = text.encode() if isinstance(text, str) else text
    step = block_size * BYTES_PER_TOKEN
    full = len(data) // step
    out: list[int] = []
    h = hash(("epick.sim", adapter, cache_salt))
    for i in range(full):
        h = hash((h, data[i * step : (i + 1) * step]))
        out.append(h)
    return out


def token_ids(text: str | bytes) -> list[int]:
    """The token ids of ``text``: each 4-byte chunk of its UTF-8 as a little-endian
    integer, the trailing partial chunk zero-padded; ``count_tokens(text)`` of them."""
    data = text.encode() if isinstance(text, str) else text
    pad = -len(data) % BYTES_PER_TOKEN
    if pad:
        data = data + b"\0" * pad
    if sys.byteorder == "little":  # one C-level cast instead of a call per token
        return list(memoryview(data).cast("I"))
    return [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
