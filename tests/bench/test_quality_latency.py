"""`epick bench quality` on the heterogeneous fleet (issue 30): the learning router beats
the defaults on TTFT p90 and SLO attainment, seeded."""

from __future__ import annotations

import pytest

from epick.bench import quality


@pytest.fixture(scope="module")
def results():
    return quality.run(quick=True, workloads=("heterogeneous",),
                       routers=("round-robin", "epick", "latency"),
                       rates={"heterogeneous": (20.0,)})


def test_the_heterogeneous_rows_carry_the_slo_attainment(results):
    rows = results["workloads"]["heterogeneous"]
    for row in rows.values():
        assert row["slo_ttft_ms"] == [quality.HETERO_SLO_TTFT_MS]
        assert 0.0 <= row["slo_attainment"][0] <= 1.0


def test_latency_beats_the_defaults_on_p90_and_attainment(results):
    rows = results["workloads"]["heterogeneous"]
    latency, epick = rows["latency"], rows["epick"]
    # measured (seed 1, quick, 20 QPS): 0.291 s vs 0.724 s; 99.8% vs 93.9%
    assert latency["ttft_p90_s"][0] < 0.7 * epick["ttft_p90_s"][0]
    assert latency["slo_attainment"][0] > epick["slo_attainment"][0]
    assert epick["ttft_p90_s"][0] < rows["round-robin"]["ttft_p90_s"][0]
