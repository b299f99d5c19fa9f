"""precise-prefix: the host's KV-event counts decide; without them the policy is exactly
prefix-cache (the same estimate, shared through sdk/prefix.zig); its state swaps with
prefix-cache's; bad counts are errors naming the field."""

from __future__ import annotations

import random

import pytest
from policy_payloads import PolicyCallError, PolicyLoadError, ep, pre, snap

from epick import abi


def score(inst, snapshot, prompt, *, blocks=(), matched=(), **kw) -> list[float]:
    blob = abi.encoder.encode(abi.ScoreInput(
        snapshot=snapshot, request=abi.Request(model="m", prompt=prompt),
        candidates=tuple(range(len(snapshot.endpoints))), prefix_blocks=tuple(blocks),
        prefix_matched=tuple(matched), **kw))
    return list(inst.score(blob, len(snapshot.endpoints)))


def test_event_counts_are_the_score(policy):
    inst = policy("precise-prefix")
    s = snap([ep("a:1"), ep("b:1"), ep("c:1")])
    assert score(inst, s, "x", blocks=(8, 8, 3), matched=(8, 2, 0)) == [1.0, 0.25, 0.0]


def test_without_counts_it_scores_exactly_as_prefix_cache(policy):
    """A random history of picks and scores over 4 endpoints: with no KV events the two
    policies must agree on every score (one estimate, not two copies)."""
    rng = random.Random(7)
    precise, approx = policy("precise-prefix", block_size=8), policy("prefix-cache", block_size=8)
    addrs = [f"e{i}:8000" for i in range(4)]
    s = snap([ep(a) for a in addrs])
    prefixes = ["".join(rng.choice("abc") for _ in range(40)) for _ in range(5)]
    for _ in range(300):
        prompt = rng.choice(prefixes)[: rng.randrange(0, 41)] + "zz"
        got_p = score(precise, s, prompt)
        got_a = score(approx, s, prompt)
        assert got_p == got_a, prompt
        if rng.random() < 0.6:
            event = pre(rng.choice(addrs), model="m", prompt=prompt)
            precise.pre_request(event)
            approx.pre_request(event)
    assert any(v > 0 for v in score(precise, s, prefixes[0] + "zz"))  # the history counted


def test_minus_one_falls_back_per_candidate(policy):
    # events alone where given (no recent picks, no cold spread)
    inst = policy("precise-prefix", block_size=4, recent_ttl_ms=0, cold_spread_ms=0)
    s = snap([ep("a:1"), ep("b:1")])
    inst.pre_request(pre("a:1", model="m", prompt="aaaabbbb"))
    assert score(inst, s, "aaaabbbb", blocks=(5, 5), matched=(-1, -1)) == [1.0, 0.0]
    assert score(inst, s, "aaaabbbb", blocks=(5, 5), matched=(-1, 5)) == [1.0, 1.0]
    assert score(inst, s, "aaaabbbb", blocks=(5, 5), matched=(0, -1)) == [0.0, 0.0]


def test_state_swaps_with_prefix_cache_both_ways(policy):
    s = snap([ep("a:1"), ep("b:1")])
    approx = policy("prefix-cache", block_size=4)
    approx.pre_request(pre("b:1", model="m", prompt="aaaabbbb"))
    precise = policy("precise-prefix", block_size=4)
    precise.import_state(approx.export_state())
    assert score(precise, s, "aaaabbbb") == [0.0, 1.0]
    back = policy("prefix-cache", block_size=4)
    back.import_state(precise.export_state())
    assert score(back, s, "aaaabbbb") == [0.0, 1.0]


@pytest.mark.parametrize("blocks, matched, words", [
    ((4,), (1, 1), "prefix_blocks has 1 values for 2 candidates"),
    ((4, 4), (1,), "prefix_matched has 1 values for 2 candidates"),
])
def test_counts_of_the_wrong_length_are_errors_naming_the_field(policy, blocks, matched, words):
    inst = policy("precise-prefix")
    s = snap([ep("a:1"), ep("b:1")])
    with pytest.raises(PolicyCallError) as info:
        score(inst, s, "x", blocks=blocks, matched=matched)
    assert words in info.value.message
    assert score(inst, s, "x", blocks=(2, 2), matched=(2, 1)) == [1.0, 0.5]  # still serving


def test_counts_that_are_not_ints_are_errors(policy):
    inst = policy("precise-prefix")
    s = snap([ep("a:1")])
    blob = abi.encoder.encode([s, abi.Request(), [0], [], [], ["x"], [1]])
    with pytest.raises(PolicyCallError) as info:
        inst.score(blob, 1)
    assert "prefix_blocks" in info.value.message


def test_recent_picks_stay_bounded_per_endpoint(policy):
    """recent_blocks caps what a burst of picks keeps: memory stays flat after the cap."""
    from policy_payloads import memory_bytes

    inst = policy("precise-prefix", block_size=4, recent_blocks=64, recent_ttl_ms=3_600_000,
                  lru_capacity=64, cold_spread_ms=0)
    s = snap([ep("a:1")])
    score(inst, s, "x")
    for i in range(200):
        inst.pre_request(pre("a:1", model="m", prompt=f"{i:04d}" * 16, timestamp_ms=i))
    settled = memory_bytes(inst)
    for i in range(200, 2000):
        inst.pre_request(pre("a:1", model="m", prompt=f"{i:04d}" * 16, timestamp_ms=i))
    assert memory_bytes(inst) == settled
    # the newest pick counts; one 19 picks back has been pushed out (a 16-block pick
    # records 7 sampled hashes: 64 keep the last 4 to 9 picks)
    newest, old = "1999" * 16, "1980" * 16
    assert score(inst, s, newest, blocks=(9,), matched=(0,)) == [1.0]
    assert score(inst, s, old, blocks=(9,), matched=(0,)) == [0.0]


def test_full_state_for_64_endpoints_fits_in_64_mib(policy):
    """Every estimate LRU full (64 x 31,250 hashes) and every recent-picks set full (64 x
    recent_blocks), then export_state: all under the 64 MiB instance cap."""
    from policy_payloads import memory_bytes

    inst = policy("precise-prefix")
    addresses = [f"10.0.{i}.1:8000" for i in range(64)]
    s = snap([ep(a) for a in addresses])
    inst.set_snapshot(abi.encoder.encode(s))
    for a in addresses:
        for j in range(123):  # 123 distinct 256-block prompts: 31,488 hashes > 31,250
            inst.pre_request(pre(a, model="m", prompt=f"{a}/{j:04d}/".ljust(64, "x") * 256,
                                 timestamp_ms=j))
    full = memory_bytes(inst)
    print(f"\nprecise-prefix memory before export_state: {full / 2**20:.1f} MiB")
    state = inst.export_state()
    print(f"\nprecise-prefix memory: {full / 2**20:.1f} MiB full, "
          f"{memory_bytes(inst) / 2**20:.1f} MiB after export_state ({len(state) / 2**20:.1f} MiB)")
    assert memory_bytes(inst) <= 64 << 20
    assert len(state) > 64 * 31_250 * 8


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"cold_spread_ms": -1}, "param 'cold_spread_ms': -1 is not in [0, 3600000]"),
        ({"cold_spread": 1.5}, "param 'cold_spread': 1.5 is not in [0, 1]"),
        ({"cold_spread": float("nan")}, "param 'cold_spread': nan is not in [0, 1]"),
    ],
    ids=["cold-ms-negative", "cold-spread-above-1", "cold-spread-nan"],
)
def test_bad_cold_spread_params_are_refused_naming_the_param(policy, params, message):
    with pytest.raises(PolicyLoadError) as info:
        policy("precise-prefix", **params)
    assert info.value.message == message


def test_cold_requests_spread_over_engines_not_prefilling_one(policy):
    """Three cold requests in a row on three endpoints: each goes where no cold pick is
    under way; after cold_spread_ms an endpoint is free again."""
    inst = policy("precise-prefix", block_size=4)
    addrs = ["a:1", "b:1", "c:1"]
    picked = []
    for k, t in enumerate((1000, 1100, 1200)):
        s = snap([ep(a) for a in addrs], timestamp_ms=t)
        got = score(inst, s, f"{k}" * 8, blocks=(2, 2, 2), matched=(0, 0, 0))
        free = [a for a, v in zip(addrs, got) if v == 0.25]
        assert [v for v in got if v != 0.25] == [0.0] * k  # the ones already prefilling
        picked.append(free[0])
        inst.pre_request(pre(free[0], model="m", prompt=f"{k}" * 8, timestamp_ms=t))
    assert picked == addrs
    # at 1601 a's and b's cold picks are 601 and 501 ms old (> cold_spread_ms 500), c's 401
    late = snap([ep(a) for a in addrs], timestamp_ms=1601)
    assert score(inst, late, "zzzzzzzz", blocks=(2, 2, 2), matched=(0, 0, 0)) == [0.25, 0.25, 0.0]
