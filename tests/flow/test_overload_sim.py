"""The overload workload's simulated runs (epick.bench.overload), small: flow control
serves or refuses every request, puts CRITICAL first and bounds the engines' queues."""

from __future__ import annotations

import msgspec
import pytest

from epick.bench import overload
from epick.bench.quality import BENCH_LIMITS, wasm_set
from epick.config import FlowControlConfig
from epick.runtime import Runtime
from epick.sim.config import DEFAULT_CONFIG


@pytest.fixture(scope="module")
def runtime():
    with Runtime(limits=BENCH_LIMITS) as rt:
        yield rt


def test_flow_control_orders_and_bounds_and_loses_nothing(runtime):
    config = msgspec.structs.replace(DEFAULT_CONFIG, max_num_seqs=8)
    arrivals = overload.workload(100.0, 3.0, 3)  # ~3x two replicas' capacity
    results = {}
    for mode, flow in (("off", None), ("on", FlowControlConfig(enabled=True, ttl_ms=2000))):
        run = overload._Run(wasm_set(runtime, {"load": 1.0}), 2, config, 0.05, flow, 3)
        copy = [overload.Arrival(a.request_id, a.t, a.prompt, a.max_tokens, a.tenant,
                                 a.criticality) for a in arrivals]
        results[mode] = overload.summarize(run.go(copy), run.samples)
    off, on = results["off"], results["on"]
    assert off["lost"] == on["lost"] == 0
    assert on["queue_expired"] > 0  # a 2 s TTL against 3 s of 3x overload
    assert on["critical_ttft_p90_s"] < off["critical_ttft_p90_s"] / 2
    assert on["engine_waiting_max"] < off["engine_waiting_max"]
    assert on["engine_waiting_max"] <= 5 + 4  # threshold + what the front end held


def test_in_flight_cap_reserve_and_fairness_first_protect_critical_and_the_quiet_tenant(
        runtime):
    config = msgspec.structs.replace(DEFAULT_CONFIG, max_num_seqs=8)
    arrivals = overload.workload(100.0, 3.0, 3)  # ~3x two replicas' capacity
    base = FlowControlConfig(enabled=True, ttl_ms=20_000)
    modes = {"on": base,
             "new": msgspec.structs.replace(base, max_in_flight=8, reserved_in_flight=3,
                                            precedence="fairness")}
    results = {}
    for mode, flow in modes.items():
        run = overload._Run(wasm_set(runtime, {"load": 1.0}), 2, config, 0.05, flow, 3)
        copy = [overload.Arrival(a.request_id, a.t, a.prompt, a.max_tokens, a.tenant,
                                 a.criticality) for a in arrivals]
        results[mode] = overload.summarize(run.go(copy), run.samples)
    on, new = results["on"], results["new"]
    assert on["lost"] == new["lost"] == 0
    # Bands first: the quiet tenant's SHEDDABLE requests wait behind the noisy STANDARD.
    assert new["quiet_ttft_p90_s"] < on["quiet_ttft_p90_s"] / 5
    assert new["quiet_ttft_p90_s"] < new["noisy_ttft_p90_s"] / 5  # the noisy one waits
    # CRITICAL no longer waits in the engine for a batch slot.
    assert new["critical_engine_p90_s"] < on["critical_engine_p90_s"]
    assert new["critical_ttft_p90_s"] < on["critical_ttft_p90_s"]
    assert new["engine_waiting_max"] <= 1
