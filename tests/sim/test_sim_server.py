import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epick.sim.config import DEFAULT_CONFIG
from epick.sim.metrics import parse_metrics
from epick.sim.server import serve_fleet

ADAPTERS = ("adapter-0", "adapter-1", "adapter-2")
cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=1)


@asynccontextmanager
async def running():
    """Two replicas and a client. Entered inside each test (not a fixture): the fleet's
    task group must be entered and exited by the same task."""
    async with serve_fleet(2, adapters=ADAPTERS, config=cfg) as fleet:
        async with httpx.AsyncClient(timeout=10) as client:
            yield fleet, client


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


async def test_every_replica_listens_on_its_own_port_and_serves_vllm_metrics():
    async with running() as (fleet, client):
        assert len(set(fleet.addresses)) == 2
        for address in fleet.addresses:
            resp = await client.get(f"http://{address}/metrics")
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert resp.headers["x-epick-replica"] == address
            names = {f.name for f in text_string_to_metric_families(resp.text)}
            assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                    "vllm:lora_requests_info", "vllm:cache_config_info"} <= names


async def test_streaming_completion_sends_one_openai_chunk_per_token():
    async with running() as (fleet, client):
        address = fleet.addresses[0]
        body = {"model": "adapter-1", "prompt": "tell me a story " * 20, "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", f"http://{address}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream"
            assert resp.headers["x-epick-replica"] == address
            text = (await resp.aread()).decode()
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        tokens, usage = chunks[:5], chunks[5]
        assert [c["object"] for c in tokens] == ["text_completion"] * 5
        assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
        assert "".join(c["choices"][0]["text"] for c in tokens) == " lorem ipsum dolor sit amet"
        assert all(c["model"] == "adapter-1" for c in chunks)
        assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 80, "completion_tokens": 5, "total_tokens": 85}


async def test_stream_is_paced_by_the_simulated_steps():
    async with running() as (fleet, client):
        # First request of adapter-2 loads it from disk (150 ms) before the first token;
        # then 20 decode steps of ~6 ms each.
        body = {"model": "adapter-2", "prompt": "x" * 400, "max_tokens": 20, "stream": True}
        t0 = time.monotonic()
        arrivals = []
        async with client.stream("POST", f"http://{fleet.addresses[1]}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic() - t0)
        assert len(arrivals) == 20
        assert arrivals[0] >= cfg.frontend_overhead_s + cfg.lora_load_disk_s
        # Lower bounds only: a token is never sent before its simulated step ends.
        assert arrivals[-1] >= cfg.frontend_overhead_s + cfg.lora_load_disk_s + 20 * cfg.decode_step_base_s


async def test_chat_streaming_starts_with_the_assistant_role():
    async with running() as (fleet, client):
        body = {"model": "sim-base", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True}
        resp = await client.post(f"http://{fleet.addresses[0]}/v1/chat/completions", json=body)
        events = sse_events(resp.text)
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["delta"] for c in chunks[1:]] == [{"content": " lorem"}, {"content": " ipsum"}]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


async def test_non_streaming_chat_and_completion_return_whole_responses():
    async with running() as (fleet, client):
        base = f"http://{fleet.addresses[0]}"
        chat = (await client.post(f"{base}/v1/chat/completions", json={
            "model": "sim-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})).json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"] == {"role": "assistant", "content": " lorem ipsum dolor"}
        assert chat["usage"]["completion_tokens"] == 3
        comp = (await client.post(f"{base}/v1/completions", json={"model": "sim-base", "prompt": "hello"})).json()
        assert comp["choices"][0]["finish_reason"] == "length"
        assert comp["usage"] == {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}


async def test_unknown_model_is_a_404_in_openai_error_format():
    async with running() as (fleet, client):
        resp = await client.post(f"http://{fleet.addresses[0]}/v1/completions",
                                 json={"model": "adapter-9", "prompt": "x"})
        assert resp.status_code == 404
        assert resp.json() == {"error": {"message": "The model `adapter-9` does not exist.",
                                         "type": "NotFoundError", "param": None, "code": 404}}


@pytest.mark.parametrize(("body", "message"), [
    (b'{"model": "sim-base", "prompt": "x", "max_tokens": "many"}',
     "Expected `int | null`, got `str` - at `$.max_tokens`"),
    (b'{"prompt": "x"}', "Object missing required field `model`"),
    (b'{"model": "sim-base", "prompt": "x", "max_tokens": 0}', "max_tokens must be at least 1, got 0"),
    (b"{not json", "Invalid JSON body: JSON is malformed: object keys must be strings (byte 1)"),
], ids=["wrong-type", "missing-model", "zero-tokens", "not-json"])
async def test_bad_completion_bodies_are_400s_that_say_where(body, message):
    async with running() as (fleet, client):
        resp = await client.post(f"http://{fleet.addresses[0]}/v1/completions", content=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == message


async def test_waiting_adapter_shows_in_the_scraped_metrics():
    async with running() as (fleet, client):
        base = f"http://{fleet.addresses[0]}"

        async def complete(model: str, n: int) -> None:
            await client.post(f"{base}/v1/completions", json={"model": model, "prompt": "y" * 200, "max_tokens": n})

        async with anyio.create_task_group() as tg:
            tg.start_soon(complete, "adapter-0", 2000)  # ~12 s: still running when we look
            await anyio.sleep(0.05)
            tg.start_soon(complete, "adapter-1", 2)
            await anyio.sleep(0.15)
            m = parse_metrics((await client.get(f"{base}/metrics")).content, fleet.addresses[0])
            assert (m.running_adapters, m.waiting_adapters, m.waiting, m.max_lora) == (("adapter-0",), ("adapter-1",), 1, 1)
            tg.cancel_scope.cancel()


async def test_a_client_that_goes_away_mid_stream_frees_its_request(caplog):
    async with running() as (fleet, client):
        srv = fleet.replicas[0]
        body = {"model": "sim-base", "prompt": "z" * 400, "max_tokens": 5000, "stream": True}
        async with client.stream("POST", f"http://{fleet.addresses[0]}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    break
        with anyio.fail_after(5):
            while srv.replica.num_in_flight:
                await anyio.sleep(0.02)
        assert srv.replica.kv.usage == 0.0
    assert "Error handling request" not in caplog.text  # a disconnect is not an error


def test_cli_serve_prints_ready_lines_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "epick.sim", "serve", "--replicas", "2", "--adapters", "3", "--max-lora", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert all(line.startswith("READY 127.0.0.1:") for line in lines), lines
        address = lines[0].split()[1]
        text = httpx.get(f"http://{address}/metrics", timeout=5).text
        assert 'max_lora="1"' in text
        assert [m["id"] for m in httpx.get(f"http://{address}/v1/models").json()["data"]] == [
            "sim-base", "adapter-0", "adapter-1", "adapter-2"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_cli_serve_stops_after_duration():
    out = subprocess.run(
        [sys.executable, "-m", "epick.sim", "serve", "--replicas", "1", "--duration", "0.3"],
        capture_output=True, text=True, timeout=20,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("READY 127.0.0.1:")


async def test_a_taken_port_is_reported_with_the_address():
    async with serve_fleet(1) as first:
        port = int(first.addresses[0].rsplit(":", 1)[1])
        with pytest.raises(OSError, match=f"^\\[Errno 98\\] cannot listen on 127.0.0.1:{port}: Address already in use$"):
            async with serve_fleet(1, base_port=port):
                pass
