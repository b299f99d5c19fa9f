"""`epick bench quality`: a seeded small run shows the main directions."""

from __future__ import annotations

import json

import pytest

from epick.bench import quality


@pytest.fixture(scope="module")
def results():
    return quality.run(
        quick=True,
        workloads=("multi-lora", "shared-prefix", "zero-hit"),
        routers=("round-robin", "least-queue", "legacy-v1", "epick", "epick-no-prefix"),
        rates={"multi-lora": (40.0,), "shared-prefix": (60.0,), "zero-hit": (20.0,)},
    )


def test_results_have_the_documented_json_shape(results):
    keys = {"rate", "throughput_tok_s", "ttft_p90_s", "adapter_loads", "hit_rate",
            "decision_cpu_us"}
    for wname, per_router in results["workloads"].items():
        for router, row in per_router.items():
            assert keys <= set(row), (wname, router)
            assert len(row["rate"]) == 1
    json.dumps(results)  # serialisable as --json writes it


def test_prefix_aware_routing_beats_round_robin_on_shared_prefixes(results):
    sp = results["workloads"]["shared-prefix"]
    assert sp["epick"]["hit_rate"][0] > sp["round-robin"]["hit_rate"][0] + 0.3
    assert sp["epick"]["ttft_p90_s"][0] * 3 < sp["round-robin"]["ttft_p90_s"][0]
    assert sp["epick"]["throughput_tok_s"][0] > 1.2 * sp["round-robin"]["throughput_tok_s"][0]


def test_lora_affinity_loads_far_fewer_adapters_than_least_queue(results):
    ml = results["workloads"]["multi-lora"]
    assert ml["epick"]["adapter_loads"][0] < 0.7 * ml["least-queue"]["adapter_loads"][0]
    assert ml["epick"]["ttft_p90_s"][0] <= ml["legacy-v1"]["ttft_p90_s"][0] * 1.1


def test_epick_routers_report_their_decision_cost_and_baselines_do_not(results):
    zh = results["workloads"]["zero-hit"]
    assert zh["epick"]["decision_cpu_us"][0] > 0
    assert zh["epick-no-prefix"]["decision_cpu_us"][0] > 0
    assert zh["round-robin"]["decision_cpu_us"][0] == 0


def test_plots_are_written(results, tmp_path):
    paths = quality.plot(results, tmp_path)
    assert sorted(p.name for p in paths) == ["multi-lora.png", "shared-prefix.png",
                                             "zero-hit.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_unknown_router_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        quality.make_router("nope", None, 0)


def test_the_seed_sweep_reports_median_and_worst_per_seed():
    got = quality.sweep_seeds(
        (1, 2), quick=True, workloads=("zero-hit",), routers=("round-robin", "epick"),
        rates={"zero-hit": (10.0,)})
    cell = got["workloads"]["zero-hit"]["epick"]["ttft_p90_s"][0]
    assert len(cell["values"]) == 2
    assert cell["worst"] == max(cell["values"])
    assert min(cell["values"]) <= cell["median"] <= cell["worst"]
    assert any("round-robin" in line for line in quality.seed_table(got))
