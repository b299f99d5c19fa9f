"""`epick bench quality` on the heterogeneous fleet (issue 30): the learning router beats
the defaults on TTFT p90 and SLO attainment, seeded."""

from __future__ import annotations

import json

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


def test_slo_ms_replaces_the_workloads_slo_and_the_attainment_follows(results):
    """`--slo-ms`: every request carries it, and attainment is counted against it. The
    defaults route without looking at the SLO, so the same run at 500 ms has the same
    p90 and a lower attainment."""
    tight = quality.run(quick=True, workloads=("heterogeneous",), routers=("epick",),
                        rates={"heterogeneous": (20.0,)}, slo_ttft_ms=500)
    row, wide = tight["workloads"]["heterogeneous"]["epick"], results["workloads"]["heterogeneous"]["epick"]
    assert row["slo_ttft_ms"] == [500]
    assert row["ttft_p90_s"] == wide["ttft_p90_s"]
    assert row["slo_attainment"][0] < wide["slo_attainment"][0]


def test_slo_ms_zero_drops_the_attainment_and_a_workload_without_one_gains_it():
    out = quality.run(quick=True, workloads=("zero-hit",), routers=("round-robin",),
                      rates={"zero-hit": (5.0,)}, slo_ttft_ms=100)
    assert out["workloads"]["zero-hit"]["round-robin"]["slo_ttft_ms"] == [100]
    none = quality.run(quick=True, workloads=("zero-hit",), routers=("round-robin",),
                       rates={"zero-hit": (5.0,)}, slo_ttft_ms=0)
    assert "slo_attainment" not in none["workloads"]["zero-hit"]["round-robin"]


def test_the_cli_takes_slo_ms(tmp_path):
    path = tmp_path / "q.json"
    assert quality.main(["--quick", "--workloads", "zero-hit", "--routers", "round-robin",
                         "--rates", "zero-hit=5", "--slo-ms", "100", "--json", str(path)]) == 0
    row = json.loads(path.read_text())["workloads"]["zero-hit"]["round-robin"]
    assert row["slo_ttft_ms"] == [100] and 0.0 <= row["slo_attainment"][0] <= 1.0


@pytest.mark.parametrize(("slo_ms", "rate"), [(500, 30.0), (300, 20.0)])
def test_latency_meets_issue_30s_attainment_target_where_the_fleet_can_meet_the_slo(slo_ms, rate):
    """Issue 30: >= 15 points above the defaults at a TTFT SLO the fleet can meet for most
    requests (docs/quality.md; measured seed 1: 500 ms at 30 QPS 95.3% vs 79.5%, 300 ms
    at 20 QPS 92.0% vs 70.5%)."""
    out = quality.run(quick=True, workloads=("heterogeneous",), routers=("epick", "latency"),
                      rates={"heterogeneous": (rate,)}, slo_ttft_ms=slo_ms)
    rows = out["workloads"]["heterogeneous"]
    latency, epick = rows["latency"]["slo_attainment"][0], rows["epick"]["slo_attainment"][0]
    assert latency >= 0.9
    assert latency - epick >= 0.15
    assert rows["latency"]["ttft_p90_s"][0] < 0.7 * rows["epick"]["ttft_p90_s"][0]
