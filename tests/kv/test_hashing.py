"""epick.kv.hashing reproduces vLLM's hash_block_tokens (golden values from vLLM itself)."""

import pickle

import pytest

from epick.kv.hashing import BlockHasher, HashConfigError

TOKENS = list(range(70))

# Computed with vLLM 0.32's own code in .venv-vllm:
#   init_none_hash(sha256); a = hash_block_tokens(sha256, None, TOKENS[:32], extra0)
#   b = hash_block_tokens(sha256, a, TOKENS[32:64], extra1); low 64 bits of each.
PLAIN = [13907755898995373680, 17701127471491950661]
LORA_SALT = [7461830070651333777, 6135586697950722464]  # lora ("x", "/p"), salt "s"


def test_plain_and_lora_salt_match_vllm():
    h = BlockHasher()
    assert h.block_hashes(TOKENS, 32) == PLAIN
    assert h.block_hashes(TOKENS, 32, lora_name="x", lora_path="/p", cache_salt="s") == LORA_SALT
    mapped = BlockHasher(lora_paths={"x": "/p"})
    assert mapped.block_hashes(TOKENS, 32, lora_name="x", cache_salt="s") == LORA_SALT


def test_only_full_blocks_and_chaining():
    h = BlockHasher()
    assert h.block_hashes(TOKENS[:31], 32) == []
    assert h.block_hashes(TOKENS[:64], 32) == PLAIN
    # A different first block changes every later hash (the chain).
    other = h.block_hashes([9] + TOKENS[1:], 32)
    assert other[0] != PLAIN[0] and other[1] != PLAIN[1]
    # The salt keys block 0 only, but the chain carries it on.
    salted = h.block_hashes(TOKENS, 32, cache_salt="s")
    assert salted[0] != PLAIN[0] and salted[1] != PLAIN[1]


def test_seed_is_pythonhashseed():
    import hashlib

    seeded = BlockHasher(seed="42").block_hashes(TOKENS, 32)
    assert seeded != PLAIN
    none_hash = hashlib.sha256(pickle.dumps("42", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    first = hashlib.sha256(pickle.dumps((none_hash, tuple(TOKENS[:32]), None),
                                        protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert seeded[0] == int.from_bytes(first[-8:], "big")


def test_other_algorithms_run_and_differ():
    base = BlockHasher().block_hashes(TOKENS, 32)
    for algo in ("sha256_cbor", "xxhash", "xxhash_cbor"):
        got = BlockHasher(algo, seed="1").block_hashes(TOKENS, 32)
        assert len(got) == 2 and got != base


def test_config_errors():
    with pytest.raises(HashConfigError, match="unknown block hash algorithm 'md5'"):
        BlockHasher("md5")
    with pytest.raises(HashConfigError, match="PYTHONHASHSEED"):
        BlockHasher("xxhash")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher().block_hashes(TOKENS, 0)
