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
