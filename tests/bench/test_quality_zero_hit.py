"""`epick bench quality`: issue 30's zero-hit target (the defaults' p90 TTFT ≤ round-robin's)
and the multi-LoRA edge any fix for it must keep. Seeded, virtual time."""

from __future__ import annotations

import pytest

from epick.bench import quality


@pytest.fixture(scope="module")
def zero_hit():
    return quality.run(quick=True, workloads=("zero-hit",), routers=("round-robin", "epick"),
                       rates={"zero-hit": (60.0,)}, seed=1)["workloads"]["zero-hit"]


@pytest.fixture(scope="module")
def multi_lora():
    return quality.run(quick=True, workloads=("multi-lora",), routers=("legacy-v1", "epick"),
                       rates={"multi-lora": (40.0,)}, seed=2)["workloads"]["multi-lora"]


@pytest.mark.xfail(strict=True, reason="issue 30: not met by the defaults; every load change "
                   "tried so far cost multi-LoRA or shared prefix (docs/quality.md, 'Zero-hit')")
def test_zero_hit_p90_is_not_worse_than_round_robin(zero_hit):
    # measured (seed 1, quick, 60 QPS): 0.0741 s vs round-robin 0.0628 s (1.18x)
    assert zero_hit["epick"]["ttft_p90_s"][0] <= zero_hit["round-robin"]["ttft_p90_s"][0]


def test_multi_lora_keeps_its_affinity_edge(multi_lora):
    """The seed where load changes for zero-hit cost multi-LoRA most (quick, 40 QPS: p90
    0.142 s today; 0.160-0.183 s with the variants in docs/quality.md)."""
    epick, legacy = multi_lora["epick"], multi_lora["legacy-v1"]
    # measured: epick 0.1420 s, 55 adapter loads; legacy-v1 0.0923 s, 50 loads. A fix
    # for zero-hit may not make this worse by more than 2% (issue 30's brief).
    assert epick["ttft_p90_s"][0] <= 1.02 * 0.1420
    assert epick["adapter_loads"][0] <= 1.1 * legacy["adapter_loads"][0]
