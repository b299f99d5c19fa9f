"""Envoy -> ext_proc -> epick -> the simulated vLLM fleet (``python -m epick.sim serve``)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sim_fleet import SIM_MODEL
from sim_fleet import sim_fleet as start_sim_fleet


@pytest.fixture
def sim_fleet():
    """Three simulated replicas (tests/sim_fleet.py); their addresses."""
    with start_sim_fleet(3) as addresses:
        yield addresses


def test_streamed_requests_reach_the_simulated_replica_epick_chose(sim_fleet, epick, envoy):
    svc = epick(sim_fleet, policies=("load", "prefix-cache", "lora-affinity"),
                base_model=SIM_MODEL, expose_endpoint=True)
    proxy = envoy(svc.ext_proc_port, sim_fleet)
    served = []
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for i in range(8):
            model = SIM_MODEL if i % 2 else f"adapter-{i % 4}"
            body = {"model": model, "prompt": "the cat sat on the mat " * 40,
                    "max_tokens": 6, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                raw = b"".join(resp.iter_raw())
            events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"[DONE]"
            assert len([json.loads(e) for e in events[:-1]]) == 6  # one event per token
            assert resp.headers["x-epick-replica"] == resp.headers["x-gateway-destination-endpoint"]
            served.append(resp.headers["x-epick-replica"])
    assert set(served) <= set(sim_fleet)
    deadline = time.monotonic() + 5
    while svc.call(lambda: svc.service.scheduler.pending_decisions) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0


def test_an_adapter_the_fleet_does_not_serve_is_a_503_naming_what_it_serves(
        sim_fleet, epick, envoy):
    # epick learns each replica's models and adapters from its own /v1/models, so an
    # adapter no replica has is refused before it reaches one (it used to be the replica's 404)
    svc = epick(sim_fleet, base_model=SIM_MODEL)
    proxy = envoy(svc.ext_proc_port, sim_fleet)
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        resp = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert resp.status_code == 503
    assert "'nope'" in resp.text and "adapter-0" in resp.text
