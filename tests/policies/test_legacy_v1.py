"""legacy-v1: the pre-v2 filter tree (docs/scoring.md, "legacy-v1") — hand-derived
outcomes, seeded LoRA affinity, shedding, and agreement with a Python reference on
random pools."""

from __future__ import annotations

import random

import numpy as np
import pytest
from policy_payloads import PolicyLoadError, ep, score_input, snap

M64 = 2**64 - 1
CRITICAL, STANDARD, SHEDDABLE = 0, 1, 2


def first_draw(seed: int) -> float:
    """The first SplitMix64 output of ``seed`` as a float in [0, 1)."""
    z = (seed + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


#: A seed whose draw keeps affinity at p = 0.999, and one whose draw does not.
AFFINE_SEED = next(s for s in range(100_000) if first_draw(s) < 0.5)
UNLUCKY_SEED = next(s for s in range(100_000) if first_draw(s) >= 0.999)


def survivors(inst, endpoints, **request) -> list[str]:
    keep = inst.filter(score_input(snap(endpoints), **request), len(endpoints))
    return [e.address for e, k in zip(endpoints, keep) if k]


def test_critical_requests_keep_the_least_queued_then_least_kv(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=3, kv_usage=0.2), ep("b", waiting=0, kv_usage=0.9), ep("c", waiting=10, kv_usage=0.0)]
    # least-queue: 0 + (10 - 0) // 3 = 3 -> a, b; least-KV over {a, b}: 0.2 + 0.7 / 2 -> a
    assert survivors(inst, pool, criticality=CRITICAL) == ["a"]


def test_least_queue_uses_integer_division(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=0), ep("b", waiting=1), ep("c", waiting=2)]
    # limit 0 + 2 // 3 = 0: only a (float division would admit nobody else either way; 5 // 3 below does)
    assert survivors(inst, pool, criticality=CRITICAL) == ["a"]
    pool = [ep("a", waiting=0), ep("b", waiting=1), ep("c", waiting=5)]
    assert survivors(inst, pool, criticality=CRITICAL) == ["a", "b"]


def test_the_low_queue_filter_passes_everything_when_all_are_queued(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=200), ep("b", waiting=130), ep("c", waiting=128)]
    # low-queue fails (none < 128) and passes all three; least-queue: 128 + 72 // 3 = 152
    assert survivors(inst, pool, criticality=CRITICAL) == ["b", "c"]


def test_the_low_queue_filter_drops_queued_endpoints(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=127, kv_usage=0.5), ep("b", waiting=128, kv_usage=0.0)]
    assert survivors(inst, pool, criticality=CRITICAL) == ["a"]


LORA_POOL = [
    ep("active", running_adapters=("A",), max_lora=2, waiting=1),
    ep("queued-for-A", waiting_adapters=("A",), max_lora=2, waiting=1),
    ep("room", running_adapters=("B",), max_lora=2, waiting=1),
    ep("full", running_adapters=("B", "C"), max_lora=2, waiting=1),
]


def test_affinity_wins_when_the_draw_is_below_the_probability(policy):
    inst = policy("legacy-v1")
    got = survivors(inst, LORA_POOL, criticality=CRITICAL, adapter="A", seed=AFFINE_SEED)
    assert got == ["active", "queued-for-A"]


def test_endpoints_with_room_win_when_the_draw_is_above_it(policy):
    inst = policy("legacy-v1")
    got = survivors(inst, LORA_POOL, criticality=CRITICAL, adapter="A", seed=UNLUCKY_SEED)
    assert got == ["room"]


@pytest.mark.parametrize(("probability", "expected"), [(0.0, ["room"]), (1.0, ["active", "queued-for-A"])])
def test_affinity_probability_is_a_param(policy, probability, expected):
    inst = policy("legacy-v1", affinity_probability=probability)
    assert survivors(inst, LORA_POOL, criticality=CRITICAL, adapter="A", seed=AFFINE_SEED if probability else UNLUCKY_SEED) == expected


def test_the_same_seed_gives_the_same_survivors(policy):
    inst = policy("legacy-v1", affinity_probability=0.5)
    for seed in (1, 2, 3, 2**64 - 1):
        first = survivors(inst, LORA_POOL, criticality=CRITICAL, adapter="A", seed=seed)
        assert survivors(inst, LORA_POOL, criticality=CRITICAL, adapter="A", seed=seed) == first
        assert first == (["active", "queued-for-A"] if first_draw(seed) < 0.5 else ["room"])


def test_non_critical_requests_are_shed_without_capacity(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=6), ep("b", waiting=0, kv_usage=0.81)]
    for criticality in (STANDARD, SHEDDABLE):
        keep = inst.filter(score_input(snap(pool), criticality=criticality), 2)
        assert not keep.any()


def test_non_critical_requests_go_to_endpoints_with_capacity(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=5, kv_usage=0.8), ep("b", waiting=6), ep("c", waiting=1, kv_usage=0.9), ep("d", waiting=4, kv_usage=0.1)]
    # capacity: a, d; least-queue over them: 4 + 1 // 2 = 4 -> d
    assert survivors(inst, pool, criticality=SHEDDABLE) == ["d"]


def test_score_is_one_for_every_candidate(policy):
    inst = policy("legacy-v1")
    pool = snap([ep("a", waiting=9), ep("b")])
    np.testing.assert_array_equal(inst.score(score_input(pool), 2), [1.0, 1.0])


def test_bad_params_are_refused_naming_the_param(policy):
    with pytest.raises(PolicyLoadError) as info:
        policy("legacy-v1", affinity_probability=1.5)
    assert info.value.message == "param 'affinity_probability': 1.5 is not in [0, 1]"


def test_describe_reports_every_default(policy):
    d = policy("legacy-v1").describe()
    assert (d.kind, d.params) == (
        "legacy-v1",
        {"queue_threshold_lora": 128, "affinity_probability": 0.999, "capacity_queue": 5, "capacity_kv": 0.8},
    )


# -- agreement with a reference on random pools -----------------------------------------

def reference(endpoints, adapter, criticality, seed, p=0.999):
    """The tree as docs/scoring.md states it, in plain Python."""

    def least_queue(s):
        lo, hi = min(e.waiting for e in s), max(e.waiting for e in s)
        return [e for e in s if e.waiting <= lo + (hi - lo) // len(s)]

    def least_kv(s):
        lo, hi = min(e.kv_usage for e in s), max(e.kv_usage for e in s)
        return [e for e in s if e.kv_usage <= lo + (hi - lo) / len(s)]

    def lora(s):
        aff = [e for e in s if adapter in e.running_adapters or adapter in e.waiting_adapters]
        av = [e for e in s if e not in aff and len(e.running_adapters) + len(e.waiting_adapters) < e.max_lora]
        if aff and av:
            return aff if first_draw(seed) < p else av
        return aff or av

    def chain(s, *nodes):
        for node in nodes:
            s = node(s) or s
        return s

    s = list(endpoints)
    if criticality == CRITICAL:
        return chain(s, lambda s: [e for e in s if e.waiting < 128], lora, least_queue, least_kv)
    s = [e for e in s if e.waiting <= 5 and e.kv_usage <= 0.8]
    return chain(s, least_queue, lora, least_kv) if s else []


def test_the_tree_agrees_with_the_reference_on_random_pools(policy):
    inst = policy("legacy-v1")
    rng = random.Random(42)
    adapters = ["A", "B", "C", "D"]
    for case in range(300):
        pool = [
            ep(f"e{i}", waiting=rng.choice([0, 1, 2, 5, 6, 50, 127, 128, 300]),
               kv_usage=rng.choice([0.0, 0.1, 0.5, 0.8, 0.81, 1.0]),
               running_adapters=tuple(rng.sample(adapters, rng.randint(0, 2))),
               waiting_adapters=tuple(rng.sample(adapters, rng.randint(0, 1))),
               max_lora=rng.randint(0, 3))
            for i in range(rng.randint(1, 8))
        ]
        request = dict(adapter=rng.choice(adapters + [""]), criticality=rng.choice([0, 1, 2]),
                       seed=rng.choice([AFFINE_SEED, UNLUCKY_SEED, rng.getrandbits(64)]))
        expected = [e.address for e in reference(pool, request["adapter"], request["criticality"], request["seed"])]
        assert survivors(inst, pool, **request) == expected, (case, pool, request)


def test_queues_at_the_int64_limits_do_not_overflow(policy):
    inst = policy("legacy-v1")
    pool = [ep("a", waiting=-(2**63)), ep("b", waiting=2**63 - 1)]
    # least-queue: min + (max - min) // 2 = -1: only a
    assert survivors(inst, pool, criticality=CRITICAL) == ["a"]
