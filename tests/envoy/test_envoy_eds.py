"""A real Envoy taking epick's weights over REST-JSON EDS (examples/envoy-eds/envoy.yaml,
no ext_proc): requests spread by the shares, and a replica that turns saturated stops
getting requests."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import pytest
from envoy_harness import Envoy
from epick_service import make_config, running
from fakes import vllm_page

from epick import config as cfg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envoy-eds" / "envoy.yaml"


def render(epick_http_port: int, model: str) -> str:
    text = EXAMPLE.read_text()
    for old, new in [("port_value: 9901", "port_value: 0"), ("port_value: 8080", "port_value: 0"),
                     ("port_value: 9005", f"port_value: {epick_http_port}"),
                     ("model=meta-llama/Llama-3.1-8B-Instruct", f"model={model}")]:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def served(client: httpx.Client, n: int) -> Counter:
    return Counter(client.get("/v1/models").headers["x-served-by"] for _ in range(n))


def test_envoy_spreads_by_the_weights_and_drops_a_saturated_replica(replicas, tmp_path):
    pool = [r for kv in (0.0, 0.2, 0.4) for r in replicas(1, vllm_page(kv=kv))]
    addresses = [r.address for r in pool]
    base = make_config(addresses, tmp=tmp_path, policies=("load",), stale_after_ms=5000,
                       timeout_ms=2000)
    config = msgspec.structs.replace(base, http=cfg.HttpConfig(listen="127.0.0.1:0"))
    with running(config) as svc, Envoy(render(svc.service.http_port, "m")) as envoy, \
            httpx.Client(base_url=envoy.url, timeout=10) as client:
        url = f"http://127.0.0.1:{svc.service.http_port}/v1/weights"
        weights = {e["endpoint"]: e["weight"]
                   for e in httpx.get(url, params={"model": "m"}).json()["endpoints"]}
        counts = served(client, 600)
        for a in addresses:
            assert counts[a] / 600 == pytest.approx(weights[a], abs=0.05), (counts, weights)
        busy = pool[0]
        busy.page = vllm_page(waiting=50)
        changed = time.monotonic()
        while served(client, 20)[busy.address] and time.monotonic() - changed < 5:
            pass
        took = time.monotonic() - changed
        after = served(client, 200)
    assert after[busy.address] == 0 and sum(after.values()) == 200
    assert took < 2.0
