"""prefix-cache: block hashing (checked against Python's xxhash), leading-run scores,
the per-endpoint LRU, forgotten endpoints, capacity from num_gpu_blocks, state hand-over
(docs/scoring.md, "prefix-cache")."""

from __future__ import annotations

import random
import struct
from collections import OrderedDict

import msgspec
import numpy as np
import pytest
import xxhash
from policy_payloads import PolicyCallError, PolicyLoadError, ep, memory_bytes, score_input, snap
from policy_payloads import pre as _pre

from epick import abi


def pre(endpoint: str, **request) -> bytes:
    """A PreRequestEvent for model "m" unless told otherwise."""
    request.setdefault("model", "m")
    return _pre(endpoint, **request)


def block_hashes(prompt: str, model: str = "m", salt: str = "", block_size: int = 64, max_blocks: int = 256):
    """docs/scoring.md's hashing, written independently of the policy."""
    data = prompt.encode()
    out: list[int] = []
    for i in range(min(len(data) // block_size, max_blocks)):
        block = data[i * block_size:(i + 1) * block_size]
        if i == 0:
            salted = b"\0" + salt.encode() + b"\0" if salt else b""
            out.append(xxhash.xxh64_intdigest(model.encode() + salted + block, seed=0))
        else:
            out.append(xxhash.xxh64_intdigest(block + struct.pack("<Q", out[-1]), seed=0))
    return out


def exported_hashes(inst) -> dict[str, list[int]]:
    """address -> its LRU's hashes, least recently used first (from export_state)."""
    fmt, _bs, _mb, eps = msgspec.msgpack.decode(inst.export_state())
    assert fmt == 1
    return {addr: list(struct.unpack(f"<{len(raw) // 8}Q", raw)) for addr, raw in eps}


def resident(inst, endpoints, version=1):
    inst.set_snapshot(abi.encoder.encode(snap(endpoints, version=version)))


def scores(inst, n, prompt, **request):
    return inst.score(score_input(None, candidates=range(n), model=request.pop("model", "m"), prompt=prompt, **request), n)


# -- hashing ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("prompt", "salt", "block_size"),
    [
        ("a" * 64, "", 64),
        ("x" * 64 * 3 + "tail", "", 64),
        ("The quick brown fox jumps over the lazy dog. " * 40, "tenant-7", 64),
        ("ééé漢字🙂" * 30, "", 16),
        ("aaaabbbbcccc", "s", 4),
    ],
    ids=["one-block", "three-blocks-and-tail", "salted-long", "utf8-bytes", "block-4-salted"],
)
def test_block_hashes_match_python_xxhash(policy, prompt, salt, block_size):
    inst = policy("prefix-cache", block_size=block_size)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", model="llama", prompt=prompt, cache_salt=salt))
    assert exported_hashes(inst)["e0"] == block_hashes(prompt, "llama", salt, block_size)


def test_prompts_are_cut_at_max_blocks(policy):
    inst = policy("prefix-cache", block_size=4, max_blocks=3)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", prompt="aaaabbbbccccdddd"))
    assert exported_hashes(inst)["e0"] == block_hashes("aaaabbbbcccc", block_size=4)


# -- scores -----------------------------------------------------------------------------

def test_two_recorded_blocks_of_three_score_two_thirds(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0"), ep("e1")])
    inst.pre_request(pre("e0", prompt="aaaabbbb"))
    np.testing.assert_allclose(scores(inst, 2, "aaaabbbbcccc"), [2 / 3, 0.0])


def test_a_missing_leading_block_scores_zero(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", prompt="aaaabbbb"))
    assert scores(inst, 1, "ccccaaaa")[0] == 0.0


def test_prompts_shorter_than_a_block_score_zero_everywhere(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", prompt="aaaabbbb"))
    assert scores(inst, 1, "aaa")[0] == 0.0
    assert scores(inst, 1, "")[0] == 0.0


def test_the_salt_separates_tenants(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", prompt="aaaabbbb", cache_salt="t1"))
    assert scores(inst, 1, "aaaabbbb", cache_salt="t1")[0] == 1.0
    assert scores(inst, 1, "aaaabbbb", cache_salt="t2")[0] == 0.0
    assert scores(inst, 1, "aaaabbbb")[0] == 0.0


def test_model_and_salt_boundaries_cannot_be_shifted(policy):
    """("m", salt "x") must not share a cache with model "mx" or ("", salt "mx")."""
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", model="m", prompt="aaaabbbb", cache_salt="x"))
    assert scores(inst, 1, "aaaabbbb", model="m", cache_salt="x")[0] == 1.0
    assert scores(inst, 1, "aaaabbbb", model="mx")[0] == 0.0
    assert scores(inst, 1, "aaaabbbb", model="mx", cache_salt="")[0] == 0.0
    assert scores(inst, 1, "aaaabbbb", model="", cache_salt="mx")[0] == 0.0


def test_the_model_is_part_of_the_first_hash(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", model="m1", prompt="aaaabbbb"))
    assert scores(inst, 1, "aaaabbbb", model="m2")[0] == 0.0


def test_scoring_does_not_record(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0")])
    scores(inst, 1, "aaaabbbb")
    assert scores(inst, 1, "aaaabbbb")[0] == 0.0


def test_inline_snapshots_score_like_resident_ones(policy):
    inst = policy("prefix-cache", block_size=4)
    pool = snap([ep("e0"), ep("e1")], version=3)
    inst.score(score_input(pool, model="m", prompt="zzzz"), 2)  # delivers the snapshot
    inst.pre_request(pre("e1", prompt="aaaabbbb"))
    got = inst.score(score_input(pool, model="m", prompt="aaaabbbbcccc"), 2)
    np.testing.assert_allclose(got, [0.0, 2 / 3])


# -- the LRU ----------------------------------------------------------------------------

def test_the_least_recently_used_hash_is_evicted_at_capacity(policy):
    inst = policy("prefix-cache", block_size=4, lru_capacity=3)
    resident(inst, [ep("e0")])
    inst.pre_request(pre("e0", prompt="aaaabbbb"))  # h_a, h_ab
    inst.pre_request(pre("e0", prompt="cccc"))  # h_c: full
    inst.pre_request(pre("e0", prompt="aaaa"))  # h_a refreshed: h_ab is now the oldest
    inst.pre_request(pre("e0", prompt="dddd"))  # evicts h_ab
    assert scores(inst, 1, "aaaabbbb")[0] == 0.5
    assert scores(inst, 1, "cccc")[0] == 1.0
    assert len(exported_hashes(inst)["e0"]) == 3


def test_lru_order_matches_a_reference_model_through_growth(policy):
    # 1,500 > the 512 initial slots: the arrays double twice while the model is checked.
    cap = 1_500
    inst = policy("prefix-cache", block_size=4, lru_capacity=cap)
    resident(inst, [ep("e0")])
    model: OrderedDict[int, None] = OrderedDict()
    rng = random.Random(7)
    for _ in range(600):
        prompt = "".join(rng.choice("abcdefgh") * 4 for _ in range(rng.randint(1, 8)))
        prompt = f"{rng.randrange(400):04d}" + prompt
        inst.pre_request(pre("e0", prompt=prompt))
        for h in block_hashes(prompt, block_size=4):
            model.pop(h, None)
            model[h] = None
            if len(model) > cap:
                model.popitem(last=False)
    assert exported_hashes(inst)["e0"] == list(model)


def test_lrus_are_per_endpoint(policy):
    inst = policy("prefix-cache", block_size=4, lru_capacity=2)
    resident(inst, [ep("e0"), ep("e1")])
    inst.pre_request(pre("e0", prompt="aaaabbbb"))
    inst.pre_request(pre("e1", prompt="cccc"))
    inst.pre_request(pre("e1", prompt="dddd"))
    np.testing.assert_array_equal(scores(inst, 2, "aaaabbbb"), [1.0, 0.0])


def test_capacity_follows_num_gpu_blocks_when_asked(policy):
    inst = policy("prefix-cache", block_size=4, lru_capacity=100, capacity_from_gpu_blocks=True)
    resident(inst, [ep("e0", num_gpu_blocks=50)])
    inst.pre_request(pre("e0", prompt="aaaabbbbccccdddd"))
    resident(inst, [ep("e0", num_gpu_blocks=2)], version=2)  # shrinks: keeps the 2 newest
    assert exported_hashes(inst)["e0"] == block_hashes("aaaabbbbccccdddd", block_size=4)[2:]
    assert scores(inst, 1, "aaaabbbb")[0] == 0.0
    resident(inst, [ep("e0", num_gpu_blocks=0)], version=3)  # unknown again: lru_capacity
    inst.pre_request(pre("e0", prompt="aaaabbbbccccdddd"))
    assert scores(inst, 1, "aaaabbbbccccdddd")[0] == 1.0


def test_endpoints_that_leave_the_snapshot_are_forgotten(policy):
    inst = policy("prefix-cache", block_size=4)
    resident(inst, [ep("e0"), ep("e1")], version=1)
    inst.pre_request(pre("e0", prompt="aaaabbbb"))
    inst.pre_request(pre("e1", prompt="aaaabbbb"))
    resident(inst, [ep("e0")], version=2)
    resident(inst, [ep("e0"), ep("e1")], version=3)
    np.testing.assert_array_equal(scores(inst, 2, "aaaabbbb"), [1.0, 0.0])


def test_full_state_for_64_endpoints_fits_in_64_mib(policy):
    inst = policy("prefix-cache")
    addresses = [f"10.0.{i}.1:8000" for i in range(64)]
    resident(inst, [ep(a) for a in addresses])
    before = memory_bytes(inst)
    # 123 distinct 256-block prompts per endpoint = 31,488 hashes > 31,250: every LRU full.
    for a in addresses:
        for j in range(123):
            inst.pre_request(pre(a, prompt=f"{a}/{j:04d}/".ljust(64, "x") * 256))
    full = memory_bytes(inst)
    print(f"\nprefix-cache memory: {before / 2**20:.1f} MiB empty, {full / 2**20:.1f} MiB at 64 x 31,250 hashes")
    assert full <= 64 << 20
    # export_state needs 64 x 250,000 bytes more, and still fits under the cap.
    assert all(len(h) == 31_250 for h in exported_hashes(inst).values())
    print(f"prefix-cache memory after export_state: {memory_bytes(inst) / 2**20:.1f} MiB")


# -- params and state -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"block_size": 0}, "param 'block_size': 0 is not in [1, 1048576]"),
        ({"lru_capacity": 70_000}, "param 'lru_capacity': 70000 is not in [0, 65535]"),
        ({"max_blocks": "many"}, "param 'max_blocks': expected an int, got a string"),
        ({"capacity_from_gpu_blocks": "yes"}, "param 'capacity_from_gpu_blocks': expected a bool, got a string"),
    ],
    ids=["block-size-0", "capacity-too-big", "ill-typed-int", "ill-typed-bool"],
)
def test_bad_params_are_refused_naming_the_param(policy, params, message):
    with pytest.raises(PolicyLoadError) as info:
        policy("prefix-cache", **params)
    assert info.value.message == message


def test_describe_reports_every_default(policy):
    d = policy("prefix-cache").describe()
    assert (d.kind, d.params) == (
        "prefix-cache",
        {"block_size": 64, "max_blocks": 256, "lru_capacity": 31_250, "capacity_from_gpu_blocks": False,
         "max_imbalance": 8},
    )


def test_exported_cache_carries_over_to_a_new_instance(policy):
    old = policy("prefix-cache", block_size=4)
    resident(old, [ep("e0"), ep("e1")])
    old.pre_request(pre("e1", prompt="aaaabbbb"))
    new = policy("prefix-cache", block_size=4)
    new.import_state(old.export_state())
    resident(new, [ep("e0"), ep("e1")])
    np.testing.assert_allclose(scores(new, 2, "aaaabbbbcccc"), [0.0, 2 / 3])


def test_state_from_another_block_size_is_refused(policy):
    old = policy("prefix-cache", block_size=4)
    with pytest.raises(PolicyCallError) as info:
        policy("prefix-cache").import_state(old.export_state())
    assert info.value.message == "prefix-cache state was recorded with block_size 4, this instance uses 64"


def test_state_round_trips_with_recency_order_intact(policy):
    old = policy("prefix-cache", block_size=4, lru_capacity=600)
    resident(old, [ep("e0"), ep("e1")])
    rng = random.Random(3)
    for _ in range(200):
        prompt = "".join(rng.choice("abcd") * 4 for _ in range(rng.randint(1, 6)))
        old.pre_request(pre(rng.choice(["e0", "e1"]), prompt=f"{rng.randrange(50):04d}{prompt}"))
    new = policy("prefix-cache", block_size=4, lru_capacity=600)
    new.import_state(old.export_state())
    assert exported_hashes(new) == exported_hashes(old)
