"""A real Envoy running the committed examples routes every request where epick says.

Every test runs twice (``envoy_mode``): ``buffered`` runs examples/envoy/envoy.yaml,
``streamed`` runs examples/envoy/envoy-streaming.yaml (FULL_DUPLEX_STREAMED, upstream's
mode). A few tests are streamed-only: in the buffered example the answer never passes
through epick (``response_body_mode: NONE``), so there is no usage to read there.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import httpx
import pytest
from envoy_harness import ALL_EXAMPLES, find_envoy
from epick_service import spy_complete
from fakes import vllm_page
from proxy_checks import (
    BUSY,
    IDLE,
    assert_adapter_requests_land_on,
    assert_sheddable_is_shed,
    assert_stream_passes_event_by_event,
    assert_usage_and_ttft_reported,
    completion,
    wait_for,
)


@pytest.fixture
def stack(replicas, epick, envoy):
    """Three replicas (the first one saturated), epick with the load policy, Envoy."""
    busy, *idle = replicas(1, BUSY) + replicas(2, IDLE)
    addresses = [busy.address, *(r.address for r in idle)]
    svc = epick(addresses, expose_endpoint=True)
    proxy = envoy(svc.ext_proc_port, addresses)
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        client.proxy_under_test = proxy
        yield client, svc, busy, idle


def test_requests_land_on_the_endpoint_epick_chose(stack):
    client, svc, busy, idle = stack
    served = set()
    for _ in range(12):
        resp = client.post("/v1/completions", json=completion())
        assert resp.status_code == 200, resp.text
        chosen = resp.headers["x-gateway-destination-endpoint"]  # set by epick on the response
        assert resp.headers["x-served-by"] == chosen
        assert resp.json()["served_by"] == chosen
        served.add(chosen)
    assert served <= {r.address for r in idle}, "epick never picks the saturated replica"
    assert busy.requests == []
    # Each replica saw the routing header carrying its own address (upstream's protocol).
    for r in idle:
        for _path, headers, _body in r.requests:
            assert headers["x-gateway-destination-endpoint"] == r.address


def test_a_client_cannot_pick_its_own_replica(stack):
    client, _svc, busy, idle = stack
    for _ in range(4):
        resp = client.post("/v1/completions", json=completion(),
                           headers={"x-gateway-destination-endpoint": busy.address})
        assert resp.status_code == 200
        assert resp.headers["x-served-by"] in {r.address for r in idle}
    assert busy.requests == []


def test_a_chat_request_and_a_body_less_request_are_routed_too(stack):
    client, _svc, _busy, idle = stack
    chat = client.post("/v1/chat/completions",
                       json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
    models = client.get("/v1/models")
    for resp in (chat, models):
        assert resp.status_code == 200
        assert resp.headers["x-served-by"] == resp.headers["x-gateway-destination-endpoint"]
        assert resp.headers["x-served-by"] in {r.address for r in idle}


def test_completion_is_reported_when_the_response_ends(stack):
    client, svc, _busy, _idle = stack
    resp = client.post("/v1/completions", json=completion())
    assert resp.status_code == 200
    decision_id = resp.headers["x-epick-decision-id"]
    deadline = time.monotonic() + 5
    while svc.call(lambda: svc.service.scheduler.pending_decisions) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0
    # Already reported by the adapter: a second report is unknown.
    assert svc.call(svc.service.scheduler.complete, decision_id=decision_id) is False


@pytest.mark.parametrize(("body", "headers", "message"), [
    (b"{not json", {}, "malformed request: the body is not valid JSON: Expecting property name "
                       "enclosed in double quotes: line 1 column 2 (char 1)"),
    (b'{"prompt": "hi"}', {}, "malformed request: body.model must be a non-empty string"),
    (b'["base"]', {}, "malformed request: the body must be a JSON object"),
    (b'{"model": "base", "prompt": 7}', {},
     "malformed request: body.prompt must be a string or a list of strings"),
    (b'{"model": "base", "prompt": ["a", 1]}', {},
     "malformed request: body.prompt must be a string or a list of strings"),
    (b'{"model": "base"}', {"x-criticality": "urgent"},
     "malformed request: x-criticality 'urgent' is not critical, standard or sheddable"),
], ids=["not-json", "no-model", "not-an-object", "prompt-not-text", "prompt-list-with-a-number",
        "bad-criticality"])
def test_a_malformed_request_is_a_400_with_a_json_error(stack, body, headers, message):
    client, _svc, busy, idle = stack
    resp = client.post("/v1/completions", content=body,
                       headers={"content-type": "application/json", **headers})
    assert resp.status_code == 400
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == {"error": {"message": message, "type": "invalid_request_error",
                                     "code": 400}}
    assert all(r.requests == [] for r in (busy, *idle))


def test_a_streamed_answer_passes_through_event_by_event(replicas, epick, envoy):
    (replica,) = replicas(1, IDLE, chunks=4, chunk_delay_s=0.3)
    proxy = envoy(epick([replica.address]).ext_proc_port, [replica.address])
    assert_stream_passes_event_by_event(proxy.url)


def test_an_adapter_request_goes_to_the_replica_that_has_it_loaded(replicas, epick, envoy):
    with_adapter = replicas(1, vllm_page(running_adapters="sql-lora", max_lora=2))[0]
    without = replicas(1, vllm_page(running_adapters="", max_lora=2))[0]
    addresses = [with_adapter.address, without.address]
    proxy = envoy(epick(addresses, policies=("lora-affinity", "load")).ext_proc_port, addresses)
    assert_adapter_requests_land_on(proxy.url, with_adapter)


def test_a_sheddable_request_is_shed_with_429_when_every_replica_is_saturated(
        replicas, epick, envoy):
    saturated = replicas(2, BUSY)
    addresses = [r.address for r in saturated]
    proxy = envoy(epick(addresses).ext_proc_port, addresses)
    assert_sheddable_is_shed(proxy.url)


def test_no_fresh_replica_is_a_503(replicas, epick, envoy):
    (gone,) = replicas(1, IDLE)
    address = gone.address
    gone.stop()  # epick's scrapes fail from the start: nothing is fresh
    proxy = envoy(epick([address]).ext_proc_port, [address])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        resp = client.post("/v1/completions", json=completion())
    assert resp.status_code == 503
    assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert resp.json()["error"]["message"].startswith("epick: no ")



def test_envoy_receives_the_choice_as_envoy_lb_metadata_too(stack):
    client, _svc, _busy, idle = stack
    for _ in range(3):
        assert client.post("/v1/completions", json=completion()).status_code == 200
    proxy = client.proxy_under_test
    deadline = time.monotonic() + 5  # Envoy flushes its access log about once a second
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = [ln for ln in proxy.log.splitlines() if '"POST /v1/completions"' in ln]
        if len(lines) >= 3:
            break
        time.sleep(0.1)
    assert len(lines) == 3, proxy.log
    for line in lines:  # the access log prints %UPSTREAM_HOST% and the envoy.lb metadata
        upstream = line.split("upstream=")[1].split()[0]
        chosen = line.split("epick=")[1].split()[0]
        assert upstream == chosen and upstream in {r.address for r in idle}, line


@pytest.mark.parametrize("name", sorted(ALL_EXAMPLES))
def test_the_committed_examples_are_valid_envoy_configs(name):
    path = ALL_EXAMPLES[name]
    result = subprocess.run([str(find_envoy()), "--mode", "validate", "-c", str(path),
                             "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"configuration '{path}' OK" in result.stdout + result.stderr


def test_a_body_near_the_limit_is_routed_and_a_larger_one_is_413(stack, envoy_mode):
    client, _svc, _busy, idle = stack
    big = completion(prompt="x" * (3_900_000))  # just under 4 MiB: Envoy's buffer, epick's limit
    resp = client.post("/v1/completions", json=big)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-served-by"] in {r.address for r in idle}
    too_big = client.post("/v1/completions", json=completion(prompt="x" * 4_300_000))
    assert too_big.status_code == 413
    if envoy_mode == "streamed":  # epick itself counts the streamed body
        assert too_big.json()["error"]["message"] == (
            "request body too large: over epick's limit of 4194304 bytes "
            "([ext_proc] max_body_bytes)")
    assert sum(len(r.requests) for r in idle) == 1



def test_the_backend_address_stays_inside_by_default(replicas, epick, envoy):
    pool = replicas(2, IDLE)
    addresses = [r.address for r in pool]
    proxy = envoy(epick(addresses).ext_proc_port, addresses)
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for body in (completion(), completion(stream=True)):
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200
            assert "x-gateway-destination-endpoint" not in resp.headers
            assert resp.headers["x-epick-decision-id"]
            assert resp.headers["x-served-by"] in addresses


def test_a_model_rewrite_reaches_the_replica_with_a_consistent_body(replicas, epick, envoy):
    (replica,) = replicas(1, IDLE)
    proxy = envoy(epick([replica.address], model_rewrites={"chat-model": "base"}).ext_proc_port,
                  [replica.address])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        by_table = client.post("/v1/completions", json=completion("chat-model"))
        by_header = client.post("/v1/completions", json=completion("whatever"),
                                headers={"x-llm-d-model-name-rewrite": "sql-lora"})
    assert (by_table.status_code, by_header.status_code) == (200, 200)
    # The replica parsed each body whole: its length header (when sent) matched the new body.
    assert [body["model"] for _p, _h, body in replica.requests] == ["base", "sql-lora"]
    for _p, headers, body in replica.requests:
        if "content-length" in headers:
            assert int(headers["content-length"]) == len(
                json.dumps(body, separators=(",", ":")).encode())


def test_a_pinned_request_goes_to_its_endpoint_when_pinning_is_on(replicas, epick, envoy):
    pool = replicas(3, IDLE)
    addresses = [r.address for r in pool]
    svc = epick(addresses, server={"allow_pinning": True})
    proxy = envoy(svc.ext_proc_port, addresses)
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for target in addresses * 2:
            resp = client.post("/v1/completions", json=completion(),
                               headers={"x-epick-pin-endpoint": target})
            assert resp.headers["x-served-by"] == target
        gone = client.post("/v1/completions", json=completion(),
                           headers={"x-epick-pin-endpoint": "10.9.9.9:1"})
    assert gone.status_code == 503
    assert gone.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


def test_pinning_is_a_400_naming_the_setting_when_off(replicas, epick, envoy):
    pool = replicas(1, IDLE)
    proxy = envoy(epick([pool[0].address]).ext_proc_port, [pool[0].address])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        resp = client.post("/v1/completions", json=completion(),
                           headers={"x-epick-pin-endpoint": pool[0].address})
    assert resp.status_code == 400
    assert "set [server] allow_pinning = true" in resp.json()["error"]["message"]
    assert pool[0].requests == []


def _with_subset_hint(addresses: list[str]):
    """An Envoy edit: a set_metadata filter (before ext_proc) writes the subset hint, as a
    data plane that knows the eligible endpoints would."""
    def edit(text: str) -> str:
        values = "".join(f"\n                    - {a!s}" for a in addresses)
        hint = (
            "          - name: envoy.filters.http.set_metadata\n"
            "            typed_config:\n"
            '              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n'
            "              metadata:\n"
            "              - metadata_namespace: envoy.lb.subset_hint\n"
            "                value:\n"
            f"                  x-gateway-destination-endpoint-subset:{values or ' []'}\n")
        anchor = "          - name: envoy.filters.http.ext_proc\n"
        assert text.count(anchor) == 1
        return text.replace(anchor, hint + anchor)
    return edit


def test_a_subset_hint_from_the_data_plane_restricts_the_pick(replicas, epick, envoy):
    pool = replicas(3, IDLE)
    addresses = [r.address for r in pool]
    svc = epick(addresses)
    proxy = envoy(svc.ext_proc_port, addresses, edit=_with_subset_hint(addresses[1:2]))
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        served = Counter(client.post("/v1/completions", json=completion()).headers["x-served-by"]
                         for _ in range(6))
    assert served == Counter({addresses[1]: 6})


def test_a_subset_hint_with_nothing_eligible_is_a_503(replicas, epick, envoy):
    pool = replicas(2, IDLE)
    addresses = [r.address for r in pool]
    proxy = envoy(epick(addresses).ext_proc_port, addresses,
                  edit=_with_subset_hint(["10.9.9.9:8000"]))
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        resp = client.post("/v1/completions", json=completion())
    assert resp.status_code == 503
    assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    assert resp.json()["error"]["message"] == (
        "epick: no endpoint in the subset hint [10.9.9.9:8000] is fresh and serves model "
        "'base'")
    assert all(r.requests == [] for r in pool)


def test_a_client_that_leaves_before_the_answer_is_reported_cancelled(replicas, epick, envoy):
    (slow,) = replicas(1, IDLE, delay_s=1.5)
    svc = epick([slow.address])
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, [slow.address])
    with httpx.Client(base_url=proxy.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=completion())
    assert wait_for(lambda: seen)
    assert [kw["status"] for kw in seen] == [2]  # CANCELLED


@pytest.mark.parametrize("envoy_mode", ["streamed"])
def test_a_client_that_leaves_mid_stream_is_reported_cancelled(replicas, epick, envoy):
    (replica,) = replicas(1, IDLE, chunks=30, chunk_delay_s=0.1)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, [replica.address])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status_code == 200
            next(resp.iter_raw())  # the first token, then the client hangs up
    assert wait_for(lambda: seen)
    assert [kw["status"] for kw in seen] == [2]


@pytest.mark.parametrize("envoy_mode", ["streamed"])
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_usage_and_ttft_are_read_from_the_answer_and_reported(replicas, epick, envoy, stream):
    (replica,) = replicas(1, IDLE, chunks=3, chunk_delay_s=0.05)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, [replica.address])
    assert_usage_and_ttft_reported(proxy.url, seen, stream=stream)
