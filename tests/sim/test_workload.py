import collections

import pytest

from epick.sim.tokens import block_hashes, count_tokens
from epick.sim.workload import multi_lora, shared_prefix, zero_hit


def test_generators_are_deterministic_for_a_seed_and_differ_across_seeds():
    assert multi_lora(qps=20, duration_s=5, seed=1) == multi_lora(qps=20, duration_s=5, seed=1)
    assert multi_lora(qps=20, duration_s=5, seed=1) != multi_lora(qps=20, duration_s=5, seed=2)


def test_arrivals_are_poisson_at_the_rate_and_in_order():
    wl = zero_hit(qps=100, duration_s=30, seed=4)
    times = [r.arrival_s for r in wl]
    assert times == sorted(times)
    assert 0 <= times[0] and times[-1] < 30
    assert len(wl) == pytest.approx(3000, rel=0.05)


def test_multi_lora_splits_traffic_over_adapter_groups():
    wl = multi_lora(qps=200, duration_s=30, adapters=15, split=(0.6, 0.3, 0.1), seed=5)
    groups = collections.Counter(r.group for r in wl)
    assert groups["g0"] / len(wl) == pytest.approx(0.6, abs=0.03)
    assert groups["g2"] / len(wl) == pytest.approx(0.1, abs=0.02)
    assert {r.adapter for r in wl if r.group == "g2"} == {"adapter-2", "adapter-5", "adapter-8", "adapter-11", "adapter-14"}


def test_prompt_and_output_lengths_are_exact_token_counts():
    wl = zero_hit(qps=50, duration_s=2, prompt_tokens=123, output_tokens=(7, 9), seed=1)
    assert {count_tokens(r.prompt) for r in wl} == {123}
    assert {r.max_tokens for r in wl} <= {7, 8, 9}


def test_shared_prefix_requests_of_a_tenant_share_the_prefix_blocks_only():
    wl = shared_prefix(qps=50, duration_s=5, tenants=3, prefix_tokens=320, suffix_tokens=64, seed=2)
    by_tenant = collections.defaultdict(list)
    for r in wl:
        by_tenant[r.group].append(block_hashes(r.prompt, 16))
    a, b = by_tenant["tenant-0"][:2]
    assert a[:20] == b[:20] and a[20] != b[20]
    other = by_tenant["tenant-1"][0]
    assert other[0] != a[0]


def test_zero_hit_prompts_share_no_block():
    wl = zero_hit(qps=50, duration_s=2, seed=3)
    firsts = [block_hashes(r.prompt, 16)[0] for r in wl]
    assert len(set(firsts)) == len(firsts)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="qps must be positive, got 0"):
        zero_hit(qps=0, duration_s=1)
    with pytest.raises(ValueError, match=r"prompt_tokens: range \(9, 3\) has low > high"):
        zero_hit(qps=1, duration_s=10, prompt_tokens=(9, 3))
    with pytest.raises(ValueError, match=r"adapters \(2\) must be at least the number of groups \(3\)"):
        multi_lora(qps=1, duration_s=1, adapters=2)
