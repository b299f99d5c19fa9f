from epick.sim.tokens import block_hashes, count_tokens


def test_tokens_are_four_byte_chunks_rounded_up():
    assert count_tokens("") == 0
    assert count_tokens("hello") == 2
    assert count_tokens("abcd" * 16) == 16
    assert count_tokens("é") == 1  # two UTF-8 bytes


def test_only_full_blocks_are_hashed():
    assert block_hashes("x" * 63, 16) == []
    assert len(block_hashes("x" * 64, 16)) == 1
    assert len(block_hashes("x" * 200, 16)) == 3


def test_shared_text_prefix_shares_exactly_the_leading_full_blocks():
    common = "s" * 130  # two full 64-byte blocks and 2 bytes of a third
    a = block_hashes(common + "a" * 70, 16)
    b = block_hashes(common + "b" * 70, 16)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_adapter_and_cache_salt_separate_otherwise_equal_prompts():
    text = "t" * 256
    base = block_hashes(text, 16)
    assert block_hashes(text, 16, adapter="a") != base
    assert block_hashes(text, 16, cache_salt="tenant-1")[0] != base[0]
    assert block_hashes(text, 16, adapter="a") == block_hashes(text, 16, adapter="a")
