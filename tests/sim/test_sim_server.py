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

from epick.pool.parse import parse_page
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.metrics import CONTENT_TYPE
from epick.sim.server import serve_fleet

ADAPTERS = ("adapter-0", "adapter-1", "adapter-2")
cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=1)


@asynccontextmanager
async def running(config=cfg):
    """Two replicas and a client. Entered inside each test (not a fixture): the fleet's
    task group must be entered and exited by the same task."""
    async with serve_fleet(2, adapters=ADAPTERS, config=config) as fleet:
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
            assert resp.headers["content-type"] == CONTENT_TYPE == "text/plain; version=1.0.0; charset=utf-8"
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


def read(resp: httpx.Response, address: str):
    return parse_page(resp.text, engine="vllm", url=f"http://{address}/metrics", previous=None)


@pytest.mark.parametrize("fmt, waiting", [("current", ()), ("older", ("adapter-1",))])
async def test_a_request_deferred_for_a_slot_shows_in_the_scraped_metrics(fmt, waiting):
    async with running(msgspec.structs.replace(cfg, lora_metrics=fmt)) as (fleet, client):
        base = f"http://{fleet.addresses[0]}"

        async def complete(model: str, n: int) -> None:
            await client.post(f"{base}/v1/completions", json={"model": model, "prompt": "y" * 200, "max_tokens": n})

        async with anyio.create_task_group() as tg:
            tg.start_soon(complete, "adapter-0", 2000)  # ~12 s: still running when we look
            await anyio.sleep(0.05)
            tg.start_soon(complete, "adapter-1", 2)
            await anyio.sleep(0.15)
            page = read(await client.get(f"{base}/metrics"), fleet.addresses[0])
            m = page.metrics
            assert page.lora_format == fmt
            assert (m.running_adapters, m.waiting_adapters, m.waiting, m.deferred, m.max_lora) == (
                ("adapter-0",), waiting, 1, 1, 1)
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
        [sys.executable, "-m", "epick.sim", "serve", "--replicas", "2", "--adapters", "3", "--max-lora", "1",
         "--lora-metrics", "older"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert all(line.startswith("READY 127.0.0.1:") for line in lines), lines
        address = lines[0].split()[1]
        assert "# TYPE vllm:lora_requests_info gauge" in httpx.get(f"http://{address}/metrics", timeout=5).text
        done = httpx.post(f"http://{address}/v1/completions", timeout=10,
                          json={"model": "adapter-0", "prompt": "x" * 40, "max_tokens": 2})
        assert done.status_code == 200
        text = httpx.get(f"http://{address}/metrics", timeout=5).text
        # --max-lora 1 and the older format: the adapter ran and was never queued.
        assert 'max_lora="1",running_lora_adapters="adapter-0",waiting_lora_adapters=""' in text
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


async def test_sleep_aborts_what_runs_serves_nothing_and_wake_up_resumes():
    async with running() as (fleet, client):
        address = fleet.addresses[0]
        base = f"http://{address}"
        body = {"model": "sim-base", "prompt": "y" * 200, "max_tokens": 5000}

        async with anyio.create_task_group() as tg:
            result = {}

            async def long_request() -> None:
                result["resp"] = await client.post(f"{base}/v1/completions", json=body)

            tg.start_soon(long_request)
            await anyio.sleep(0.1)
            resp = await client.post(f"{base}/sleep", params={"level": "1"})
            assert resp.json() == {"status": "sleeping", "level": 1}
        assert result["resp"].status_code == 503
        assert "put to sleep" in result["resp"].json()["error"]["message"]
        assert (await client.get(f"{base}/is_sleeping")).json() == {"is_sleeping": True}
        page = read(await client.get(f"{base}/metrics"), address)
        assert page.sleeping and (page.metrics.running, page.metrics.waiting) == (0, 0)

        short = {"model": "sim-base", "prompt": "y" * 40, "max_tokens": 2}
        async with anyio.create_task_group() as tg:
            done = {}

            async def short_request() -> None:
                done["resp"] = await client.post(f"{base}/v1/completions", json=short)

            tg.start_soon(short_request)
            await anyio.sleep(0.3)
            assert "resp" not in done  # asleep: accepted, not served
            assert (await client.post(f"{base}/wake_up")).json()["status"] == "awake"
        assert done["resp"].status_code == 200
        assert done["resp"].json()["usage"]["completion_tokens"] == 2
        assert not read(await client.get(f"{base}/metrics"), address).sleeping
        bad = await client.post(f"{base}/sleep", params={"level": "7"})
        assert (bad.status_code, bad.json()["error"]["message"]) == (
            400, "level must be 0, 1 or 2, got '7'")


async def test_a_late_engine_wake_up_still_records_every_step():
    # vLLM records its LoRA stats after every step; a busy event loop that wakes the
    # engine late must not skip the steps in between (the adapter ran: it is on the page).
    async with running(msgspec.structs.replace(cfg, lora_metrics="older")) as (fleet, client):
        address = fleet.addresses[0]
        srv = fleet.replicas[0]
        async with anyio.create_task_group() as tg:
            body = {"model": "adapter-2", "prompt": "x" * 40, "max_tokens": 2}
            tg.start_soon(lambda: client.post(f"http://{address}/v1/completions", json=body))
            while srv.replica.num_in_flight == 0:
                await anyio.sleep(0.001)
            time.sleep(0.3)  # block the loop: every engine event is now overdue
        assert srv.replica.finished == 1
        text = (await client.get(f"http://{address}/metrics")).text
        assert 'running_lora_adapters="adapter-2",waiting_lora_adapters=""' in text
