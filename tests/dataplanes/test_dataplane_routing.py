"""Real NGINX (njs) and HAProxy (Lua) running the committed examples route every request
where epick's HTTP API says — the routing tests tests/envoy runs for Envoy."""

from __future__ import annotations

import httpx
import pytest
from dataplane_config import make_config
from epick_service import running, spy_complete
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


def test_requests_land_on_the_endpoint_epick_chose(replicas, epick, proxy):
    busy, *idle = replicas(1, BUSY) + replicas(2, IDLE)
    addresses = [busy.address, *(r.address for r in idle)]
    svc = epick(addresses)
    p = proxy(svc, addresses)
    with httpx.Client(base_url=p.url, timeout=10) as client:
        for _ in range(8):
            resp = client.post("/v1/completions", json=completion())
            assert resp.status_code == 200, resp.text + p.log
            assert resp.json()["served_by"] in {r.address for r in idle}
            assert resp.headers["x-epick-decision-id"]
        chat = client.post("/v1/chat/completions",
                           json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
        models = client.get("/v1/models")
    for resp in (chat, models):
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-served-by"] in {r.address for r in idle}
    assert busy.requests == []
    # Each replica saw upstream's routing header carrying its own address.
    for r in idle:
        for _path, headers, _body in r.requests:
            assert headers["x-gateway-destination-endpoint"] == r.address


def test_an_adapter_request_goes_to_the_replica_that_has_it_loaded(replicas, epick, proxy):
    with_adapter = replicas(1, vllm_page(running_adapters="sql-lora", max_lora=2))[0]
    without = replicas(1, vllm_page(running_adapters="", max_lora=2))[0]
    addresses = [with_adapter.address, without.address]
    p = proxy(epick(addresses, policies=("lora-affinity", "load")), addresses)
    assert_adapter_requests_land_on(p.url, with_adapter)


def test_a_repeated_prompt_sticks_to_its_replica(replicas, epick, proxy):
    pool = replicas(3, IDLE)
    addresses = [r.address for r in pool]
    p = proxy(epick(addresses, policies=("prefix-cache", "load")), addresses)
    prompt = "You are a helpful assistant. " * 40
    with httpx.Client(base_url=p.url, timeout=10) as client:
        served = [client.post("/v1/completions", json=completion(prompt=prompt))
                  .headers["x-served-by"] for _ in range(6)]
    assert len(set(served)) == 1, served


def test_a_sheddable_request_is_shed_with_429_when_every_replica_is_saturated(
        replicas, epick, proxy):
    saturated = replicas(2, BUSY)
    addresses = [r.address for r in saturated]
    p = proxy(epick(addresses), addresses)
    assert_sheddable_is_shed(p.url)
    assert all(len(r.requests) <= 1 for r in saturated)


def test_no_fresh_replica_is_a_503_with_the_reason(replicas, epick, proxy):
    (gone,) = replicas(1, IDLE)
    address = gone.address
    gone.stop()
    p = proxy(epick([address]), [address])
    with httpx.Client(base_url=p.url, timeout=10) as client:
        resp = client.post("/v1/completions", json=completion())
    assert resp.status_code == 503
    assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    assert resp.json()["error"]["message"].startswith("epick: no ")


def test_a_malformed_request_is_a_400_and_reaches_no_replica(replicas, epick, proxy):
    pool = replicas(1, IDLE)
    p = proxy(epick([pool[0].address]), [pool[0].address])
    with httpx.Client(base_url=p.url, timeout=10) as client:
        resp = client.post("/v1/completions", content=b'{"prompt": "hi"}',
                           headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "epick: malformed request: body.model must be a non-empty string")
    assert pool[0].requests == []


def test_a_streamed_answer_passes_through_event_by_event(replicas, epick, proxy):
    (replica,) = replicas(1, IDLE, chunks=4, chunk_delay_s=0.3)
    p = proxy(epick([replica.address]), [replica.address])
    assert_stream_passes_event_by_event(p.url)


def test_a_killed_replica_sends_requests_to_the_fallback(replicas, epick, proxy):
    first, second = replicas(2, IDLE)
    addresses = [first.address, second.address]
    svc = epick(addresses, server={"fallbacks": 1})
    p = proxy(svc, addresses)
    first.stop()  # epick still thinks it is fresh (stale_after_ms = 5 s): it is picked
    with httpx.Client(base_url=p.url, timeout=10) as client:
        for _ in range(6):
            resp = client.post("/v1/completions", json=completion())
            assert resp.status_code == 200, resp.text + p.log
            assert resp.headers["x-served-by"] == second.address


def test_the_completion_is_reported(replicas, epick, proxy):
    (replica,) = replicas(1, IDLE)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    p = proxy(svc, [replica.address])
    with httpx.Client(base_url=p.url, timeout=10) as client:
        resp = client.post("/v1/completions", json=completion())
    assert resp.status_code == 200
    assert wait_for(lambda: seen)
    (kw,) = seen
    assert kw["decision_id"] == resp.headers["x-epick-decision-id"]
    assert (kw["endpoint"], kw["status"]) == (replica.address, 0)
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0


@pytest.mark.parametrize("fail_open", [False, True], ids=["closed", "open"])
def test_epick_stopped_gives_the_configured_behaviour(replicas, proxy, tmp_path, fail_open):
    (replica,) = replicas(1, IDLE)
    with running(make_config([replica.address], tmp_path)) as svc:
        p = proxy(svc, [replica.address], fail_open=fail_open)
    # epick is stopped: its HTTP port refuses connections.
    with httpx.Client(base_url=p.url, timeout=10) as client:
        resp = client.post("/v1/completions", json=completion())
    if fail_open:
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-served-by"] == replica.address
    else:
        assert resp.status_code == 503
        assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-internal"
        assert resp.json()["error"]["message"].startswith("epick unreachable")
        assert replica.requests == []


def test_a_body_larger_than_the_proxy_takes_is_413_and_reaches_no_replica(
        replicas, epick, proxy, proxy_kind):
    (replica,) = replicas(1, IDLE)
    p = proxy(epick([replica.address]), [replica.address])
    # Over HAProxy's buffer (tune.bufsize 1 MiB) and NGINX's client_max_body_size (8 MiB).
    size = (2 << 20) if proxy_kind == "haproxy" else (9 << 20)
    with httpx.Client(base_url=p.url, timeout=30) as client:
        resp = client.post("/v1/completions", json=completion(prompt="x" * size))
    assert resp.status_code == 413
    assert replica.requests == []


def test_a_streamed_answer_is_reported_and_an_error_status_is_error(replicas, epick, proxy):
    (replica,) = replicas(1, IDLE, chunks=3)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    p = proxy(svc, [replica.address])
    with httpx.Client(base_url=p.url, timeout=10) as client:
        streamed = client.post("/v1/completions", json=completion(stream=True))
        # The replica answers 404 for an unknown path: the completion is an ERROR.
        missing = client.post("/v2/nothing", json=completion())
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert missing.status_code == 404
    assert wait_for(lambda: len(seen) == 2)
    by_decision = {kw["decision_id"]: kw["status"] for kw in seen}
    assert by_decision == {streamed.headers["x-epick-decision-id"]: 0,
                           missing.headers["x-epick-decision-id"]: 1}


def test_the_committed_examples_are_valid_and_keep_their_addresses(proxy_kind):
    import subprocess

    from epick import config as cfg
    from epick.bench.dataplanes import KINDS, find
    folder, name, listen = KINDS[proxy_kind]
    argv = ([str(find("nginx")), "-t", "-p", str(folder), "-c", name] if proxy_kind == "nginx"
            else [str(find("haproxy")), "-c", "-f", name])
    result = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (folder / name).read_text()
    assert listen in text and "127.0.0.1:9005" in text and "/v1/route" in text
    config = cfg.load(folder / "epick.toml")
    envoy = cfg.load(folder.parent / "envoy" / "epick.toml")
    assert config.http.listen == "127.0.0.1:9005"
    assert config.openai.base_model == envoy.openai.base_model
    assert [e.address for e in config.pool.endpoints] == ["127.0.0.1:8001", "127.0.0.1:8002"]


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_usage_and_ttft_are_read_from_the_answer_and_reported(replicas, epick, proxy, stream):
    # The answer starts 0.2 s after the request: the TTFT cannot be less.
    (replica,) = replicas(1, IDLE, chunks=3, chunk_delay_s=0.05, delay_s=0.2)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    p = proxy(svc, [replica.address])
    assert_usage_and_ttft_reported(p.url, seen, stream=stream, ttft_at_least_s=0.2)


def test_a_fallback_that_served_is_reported_as_the_endpoint(replicas, epick, proxy):
    first, second = replicas(2, IDLE)
    addresses = [first.address, second.address]
    svc = epick(addresses, server={"fallbacks": 1})
    seen = spy_complete(svc)
    p = proxy(svc, addresses)
    first.stop()
    with httpx.Client(base_url=p.url, timeout=10) as client:
        for _ in range(4):
            assert client.post("/v1/completions", json=completion()).status_code == 200
    assert wait_for(lambda: len(seen) == 4)
    assert {(kw["endpoint"], kw["status"]) for kw in seen} == {(second.address, 0)}
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0


@pytest.mark.parametrize("proxy_kind", ["haproxy"])
def test_a_client_that_leaves_mid_stream_is_reported_cancelled(replicas, epick, proxy):
    (replica,) = replicas(1, IDLE, chunks=30, chunk_delay_s=0.1)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    p = proxy(svc, [replica.address])
    with httpx.Client(base_url=p.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status_code == 200
            next(resp.iter_raw())  # the first token, then the client hangs up
    assert wait_for(lambda: seen)
    assert [kw["status"] for kw in seen] == [2]  # CANCELLED
