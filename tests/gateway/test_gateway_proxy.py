"""The reference gateway end to end: HTTP client -> gateway -> Pick -> simulated vLLM."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import msgspec
import pytest
from aiohttp import web
from epick_service import make_config, running, spy_complete
from fakes import vllm_page

from epick import config as cfg
from epick.gateway.proxy import Gateway, make_app
from epick.sim.server import serve_fleet

BASE = "sim-base"


class LoopThread:
    """An asyncio loop on a thread of its own; ``hold(cm)`` keeps an async context
    manager entered (in one task, as anyio requires) until :meth:`close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop")
        self.thread.start()
        self._holders: list[tuple[asyncio.Event, asyncio.Future]] = []

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def hold(self, cm):
        async def start():
            entered = self.loop.create_future()
            release = asyncio.Event()

            async def holder():
                try:
                    async with cm as value:
                        entered.set_result(value)
                        await release.wait()
                except BaseException as exc:
                    if not entered.done():
                        entered.set_exception(exc)
                    raise

            done = asyncio.ensure_future(holder())
            self._holders.append((release, done))
            return await entered

        return self.run(start())

    def close(self) -> None:
        async def stop():
            for release, done in reversed(self._holders):
                release.set()
                await done

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def _start_gateway(target: str, **kw) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_app(Gateway(target, BASE, **kw)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
def world(tmp_path):
    """3 simulated replicas, epick (load + lora-affinity + prefix-cache), the gateway."""
    lt = LoopThread()
    try:
        fleet = lt.hold(serve_fleet(3, adapters=["adapter-0", "adapter-1"]))
        with running(make_config(fleet.addresses, tmp=tmp_path)) as svc:
            runner, url = lt.run(_start_gateway(svc.target))
            yield fleet, svc, url
            lt.run(runner.cleanup())
    finally:
        lt.close()


def test_a_completion_is_served_by_the_endpoint_epick_picked(world):
    fleet, svc, url = world
    r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "Hello there",
                                                  "max_tokens": 5}, timeout=30)
    assert r.status_code == 200, r.text
    assert "x-gateway-destination-endpoint" not in r.headers  # not told by default
    assert r.headers["x-epick-replica"] in fleet.addresses
    assert r.json()["usage"]["completion_tokens"] == 5


def test_streaming_chat_passes_through_and_the_completion_is_reported(world):
    fleet, svc, url = world
    body = {"model": "adapter-1", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) == 4
    # The completion is reported (right after the stream ends): no decision left waiting.
    deadline = time.monotonic() + 5
    while svc.call(lambda: svc.service.scheduler.pending_decisions) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0


def test_an_adapter_request_sticks_to_the_replica_that_has_it(world):
    fleet, svc, url = world
    seen = set()
    for _ in range(6):
        r = httpx.post(f"{url}/v1/completions", json={"model": "adapter-0", "prompt": "x",
                                                      "max_tokens": 1}, timeout=30)
        assert r.status_code == 200
        seen.add(r.headers["x-epick-replica"])
    assert len(seen) == 1


@pytest.mark.parametrize("body, message", [
    (b"{not json", "malformed request"),
    (b"[]", "the body must be a JSON object"),
    (b'{"prompt": "x"}', "body.model must be a non-empty string"),
    (b'{"model": "sim-base", "messages": "hi"}', "body.messages must be a list"),
    # refused, never silently dropped: the same rule as the ext_proc adapter
    (b'{"model": "sim-base", "prompt": ["a", 1]}',
     "body.prompt must be a string or a list of strings"),
], ids=["not-json", "array", "no-model", "bad-messages", "prompt-list-with-a-number"])
def test_malformed_bodies_are_400_with_a_json_error(world, body, message):
    _, _, url = world
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=body, timeout=10)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_refusing_primary_fails_over_to_the_next_fallback(fake_vllm, tmp_path):
    """Endpoint A looks idle (so epick picks it) but refuses connections."""
    lt = LoopThread()
    try:
        fleet = lt.hold(serve_fleet(1))
        metrics_only = fake_vllm(vllm_page(waiting=0))
        dead = f"127.0.0.1:{_closed_port()}"
        c = make_config([fleet.addresses[0]], policies=("load",), tmp=tmp_path)
        import msgspec

        from epick.pool import EndpointSpec

        eps = [EndpointSpec(address=dead, metrics_url=metrics_only.url),
               *c.pool.endpoints]
        c = msgspec.structs.replace(c, pool=msgspec.structs.replace(c.pool, endpoints=eps))
        with running(c) as svc:
            runner, url = lt.run(_start_gateway(svc.target))
            r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "x",
                                                          "max_tokens": 1}, timeout=30)
            assert r.status_code == 200
            assert r.headers["x-epick-replica"] == fleet.addresses[0]
            lt.run(runner.cleanup())
    finally:
        lt.close()


def test_shed_and_unavailable_become_429_and_503(fake_vllm, tmp_path):
    busy = fake_vllm(vllm_page(waiting=50, model=BASE))
    lt = LoopThread()
    try:
        with running(make_config([busy.address], policies=("load",), tmp=tmp_path)) as svc:
            runner, url = lt.run(_start_gateway(svc.target))
            r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "x"},
                           headers={"x-criticality": "sheddable"}, timeout=10)
            assert r.status_code == 429 and "shed" in r.json()["error"]["message"]
            assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
            busy.stop()
            for _ in range(100):
                r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "x"},
                               timeout=10)
                if r.status_code == 503:
                    break
                time.sleep(0.05)
            assert r.status_code == 503
            assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
            assert "no endpoint has fresh metrics" in r.json()["error"]["message"]
            lt.run(runner.cleanup())
    finally:
        lt.close()


def test_flow_controls_expiry_reaches_the_client_as_429_evicted_ttl(fake_vllm, tmp_path):
    busy = fake_vllm(vllm_page(waiting=50, model=BASE))
    config = msgspec.structs.replace(
        make_config([busy.address], policies=("load",), tmp=tmp_path),
        flow_control=cfg.FlowControlConfig(enabled=True, ttl_ms=300))
    lt = LoopThread()
    try:
        with running(config) as svc:
            runner, url = lt.run(_start_gateway(svc.target))
            time.sleep(0.3)
            r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "x"},
                           timeout=10)
            assert r.status_code == 429, r.text
            assert r.headers["x-llm-d-request-dropped-reason"] == "evicted-ttl"
            assert "ttl_ms" in r.json()["error"]["message"]
            lt.run(runner.cleanup())
    finally:
        lt.close()


def test_models_lists_the_base_model_and_adapters_of_a_picked_replica(world):
    fleet, svc, url = world
    r = httpx.get(f"{url}/v1/models", timeout=10)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [BASE, "adapter-0", "adapter-1"]
    deadline = time.monotonic() + 5
    while svc.call(lambda: svc.service.scheduler.pending_decisions) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0


def test_a_client_that_leaves_mid_stream_is_reported_and_not_logged_as_an_error(world, caplog):
    fleet, svc, url = world
    body = {"model": BASE, "prompt": "z" * 400, "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 10
    while svc.call(lambda: svc.service.scheduler.pending_decisions) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0
    assert "Error handling request" not in caplog.text



def _wait(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_usage_and_ttft_read_from_the_answer_are_reported(world, stream):
    fleet, svc, url = world
    seen = spy_complete(svc)
    body = {"model": BASE, "prompt": "Hello there", "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert _wait(lambda: seen)
    (kw,) = seen
    assert kw["status"] == 0 and kw["completion_tokens"] == 4 and kw["prompt_tokens"] > 0
    assert kw["endpoint"] == r.headers["x-epick-replica"]
    if stream:
        assert 0 < kw["ttft_s"] < 30
    else:
        assert kw["ttft_s"] is None


def test_a_client_that_leaves_mid_stream_is_reported_cancelled(world):
    fleet, svc, url = world
    seen = spy_complete(svc)
    body = {"model": BASE, "prompt": "z" * 400, "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    assert _wait(lambda: seen)
    assert [kw["status"] for kw in seen] == [2]


def test_the_gateway_rewrites_models_and_exposes_the_endpoint_when_told(tmp_path):
    lt = LoopThread()
    try:
        fleet = lt.hold(serve_fleet(2, adapters=["adapter-0"]))
        with running(make_config(fleet.addresses, tmp=tmp_path)) as svc:
            runner, url = lt.run(_start_gateway(svc.target, expose_endpoint=True,
                                                model_rewrites={"friendly": "adapter-0"}))
            r = httpx.post(f"{url}/v1/completions", json={"model": "friendly", "prompt": "x",
                                                          "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "adapter-0"  # the replica served the rewritten model
            assert r.headers["x-gateway-destination-endpoint"] == r.headers["x-epick-replica"]
            lt.run(runner.cleanup())
    finally:
        lt.close()


def test_pinning_through_the_gateway_follows_the_servers_setting(tmp_path):
    lt = LoopThread()
    try:
        fleet = lt.hold(serve_fleet(3))
        for allow in (False, True):
            config = make_config(fleet.addresses, tmp=tmp_path)
            import msgspec

            config = msgspec.structs.replace(
                config, server=msgspec.structs.replace(config.server, allow_pinning=allow))
            with running(config) as svc:
                runner, url = lt.run(_start_gateway(svc.target))
                target = fleet.addresses[2]
                r = httpx.post(f"{url}/v1/completions",
                               json={"model": BASE, "prompt": "x", "max_tokens": 1},
                               headers={"x-epick-pin-endpoint": target}, timeout=30)
                if allow:
                    assert r.status_code == 200
                    assert r.headers["x-epick-replica"] == target
                else:
                    assert r.status_code == 400
                    assert r.json()["error"]["message"] == (
                        f"malformed request: PickRequest.pin_endpoint '{target}' is refused: "
                        "pinning is off on this server (set [server] allow_pinning = true "
                        "to allow it)")
                lt.run(runner.cleanup())
    finally:
        lt.close()
