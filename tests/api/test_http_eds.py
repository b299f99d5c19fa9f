"""POST /v3/discovery:endpoints (xDS REST-JSON EDS) over a real socket: the weights
tables as ClusterLoadAssignments (docs/weights.md)."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from epick_service import make_config, running
from fakes import vllm_page
from google.protobuf import json_format

from epick import config as cfg
from epick.api.eds import TYPE_URL, WEIGHT_SCALE

PATH = "/v3/discovery:endpoints"


@pytest.fixture
def serve(tmp_path):
    stack = []

    def start(addresses, *, policies=("load",)):
        base = make_config(addresses, policies=policies, tmp=tmp_path, scrape_in="loop")
        config = msgspec.structs.replace(base, http=cfg.HttpConfig(listen="127.0.0.1:0"))
        cm = running(config)
        stack.append(cm)
        svc = cm.__enter__()
        return f"http://127.0.0.1:{svc.service.http_port}"

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def discover(url, *names, **extra) -> discovery_pb2.DiscoveryResponse:
    body = {"node": {"id": "envoy-1", "cluster": "gw"}, "resourceNames": list(names),
            "typeUrl": TYPE_URL, **extra}
    resp = httpx.post(url + PATH, json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    return json_format.Parse(resp.text, discovery_pb2.DiscoveryResponse())


def assignment(resp, i=0) -> tuple[str, dict[str, int]]:
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert resp.resources[i].Unpack(cla)
    return cla.cluster_name, {
        f"{e.endpoint.address.socket_address.address}:"
        f"{e.endpoint.address.socket_address.port_value}": e.load_balancing_weight.value
        for loc in cla.endpoints for e in loc.lb_endpoints}


def test_each_resource_name_is_a_table_with_weights_from_the_shares(fake_vllm, serve):
    idle, less, busy = (fake_vllm(vllm_page(kv=kv)) for kv in (0.0, 0.2, 0.4))
    full = fake_vllm(vllm_page(waiting=50))
    url = serve([s.address for s in (idle, less, busy, full)])
    table = httpx.get(f"{url}/v1/weights", params={"model": "m"}).json()
    resp = discover(url, "model=m", "m")
    assert resp.type_url == TYPE_URL and resp.version_info
    for i in range(2):
        name, weights = assignment(resp, i)
        assert name == ("model=m", "m")[i]
        assert full.address not in weights  # saturated: weight 0, left out
        for e in table["endpoints"]:
            if e.get("weight", 0) > 0:
                assert weights[e["endpoint"]] == pytest.approx(e["weight"] * WEIGHT_SCALE,
                                                               abs=1)
        assert weights[idle.address] > weights[less.address] > weights[busy.address]


def test_an_adapter_table_and_an_empty_one(fake_vllm, serve):
    has = fake_vllm(vllm_page(running_adapters="sql-lora", max_lora=1))
    other = fake_vllm(vllm_page(running_adapters="x", max_lora=1))
    url = serve([has.address, other.address], policies=("load", "lora-affinity"))
    _name, weights = assignment(discover(url, "model=m,adapter=sql-lora"))
    assert weights[has.address] > weights.get(other.address, 0)
    has.page = other.page = vllm_page(waiting=50, running_adapters="sql-lora", max_lora=1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        _name, weights = assignment(discover(url, "model=m,criticality=SHEDDABLE"))
        if not weights:
            break
        time.sleep(0.05)
    assert weights == {}  # all saturated, SHEDDABLE: no endpoint, Envoy answers 503


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"resourceNames": []}, 400, "DiscoveryRequest.resource_names is empty"),
    ({"resourceNames": ["model=m,colour=red"]}, 400,
     "EDS resource name 'model=m,colour=red': 'colour=red' is not one of"),
    ({"resourceNames": ["model=m,criticality=URGENT"]}, 400, "Invalid enum value URGENT"),
    ({"resourceNames": ["adapter=x"]}, 400, "WeightsRequest.model is required"),
    ({"resourceNames": ["other"]}, 503, "other"),
    ({"resourceNames": ["m"], "typeUrl": "type.googleapis.com/envoy.config.cluster.v3.Cluster"},
     400, "epick serves only"),
])
def test_errors_name_what_is_wrong(fake_vllm, serve, body, status, message):
    url = serve([fake_vllm(vllm_page()).address])
    resp = httpx.post(url + PATH, json=body, timeout=10)
    assert resp.status_code == status, resp.text
    assert message in resp.json()["message"]


def test_malformed_json_is_a_400(fake_vllm, serve):
    url = serve([fake_vllm(vllm_page()).address])
    resp = httpx.post(url + PATH, content=b"{nope", timeout=10)
    assert resp.status_code == 400
    assert resp.json()["message"].startswith("malformed DiscoveryRequest JSON")
