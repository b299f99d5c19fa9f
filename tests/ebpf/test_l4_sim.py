"""The eBPF L4 load balancer in front of the simulated vLLM fleet (``epick.sim serve``):
real simulated engines whose pages move with the requests they run."""

from __future__ import annotations

import threading
import time

import httpx
import msgspec
from ebpf_results import result
from epick_service import make_config, running
from test_l4_balancer import VIP, epick_weights

from epick.config import WeightsConfig

SIM_MODEL = "sim-base"


def test_the_simulated_fleet_behind_a_base_and_an_adapter_address(
        sim_fleet, tmp_path, agent, connect_many):
    # Each replica's one LoRA slot held by a long request: adapter-2 is resident on
    # replica 0 only, the others hold adapter-0 and adapter-1 (a busy multi-LoRA fleet,
    # where sending adapter-2 elsewhere means waiting for a slot).
    first = sim_fleet[0]
    holders = [threading.Thread(target=lambda a=address, m=model: httpx.post(
        f"http://{a}/v1/completions", timeout=60,
        json={"model": m, "prompt": "hold the slot", "max_tokens": 3000}))
        for address, model in zip(sim_fleet, ("adapter-2", "adapter-0", "adapter-1"))]
    for h in holders:
        h.start()
    config = make_config(sim_fleet, policies=("load", "prefix-cache", "lora-affinity"),
                         tmp=tmp_path, scrape_interval_ms=50, stale_after_ms=5000,
                         timeout_ms=2000)
    base_vip, adapter_vip = f"{VIP}:8010", f"{VIP}:8011"
    try:
        with running(msgspec.structs.replace(config, weights=WeightsConfig())) as svc:
            lb = agent(svc.target, [f"{base_vip},model={SIM_MODEL}",
                                    f"{adapter_vip},model={SIM_MODEL},adapter=adapter-2"])
            lb.table(adapter_vip, lambda e: e["slots"].get(first, 0) >= 0.9 * 1024,
                     timeout=15)
            lb.table(base_vip)
            time.sleep(0.2)
            base_weights = epick_weights(svc, model=SIM_MODEL)
            on_base = connect_many(base_vip, 1000)
            on_adapter = connect_many(adapter_vip, 1000)
    finally:
        for h in holders:
            h.join(timeout=60)
    result("sim", base_weights={a: round(w, 3) for a, w in base_weights.items()},
           base_vip=dict(on_base), adapter_vip=dict(on_adapter),
           resident_share=on_adapter[first] / 1000)
    assert sum(on_base.values()) == 1000 and set(on_base) <= set(sim_fleet)
    for a in sim_fleet:
        assert abs(on_base[a] / 1000 - base_weights[a]) <= 0.05, (on_base, base_weights)
    assert on_adapter[first] >= 900
