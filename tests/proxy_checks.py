"""What every real proxy in front of epick must do, checked the same way for each: Envoy
(tests/envoy, ext_proc) and NGINX / HAProxy (tests/dataplanes, the HTTP API). Each test
file builds its own stack (replicas, epick, the proxy) and calls these with the proxy's
URL; they assert on what the client and the replicas saw.
"""

from __future__ import annotations

import json
import time

import httpx
from fakes import vllm_page

__all__ = ["BUSY", "IDLE", "completion", "wait_for", "assert_stream_passes_event_by_event",
           "assert_adapter_requests_land_on", "assert_sheddable_is_shed",
           "assert_usage_and_ttft_reported"]

BUSY = vllm_page(waiting=40, running=20, kv=0.95)
IDLE = vllm_page(waiting=0, running=0, kv=0.05)


def completion(model: str = "base", **extra) -> dict:
    return {"model": model, "prompt": "Say hello to the proxy", "max_tokens": 5, **extra}


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def assert_stream_passes_event_by_event(url: str) -> None:
    """The replica sends 4 events 0.3 s apart (``replicas(1, IDLE, chunks=4,
    chunk_delay_s=0.3)``): each reaches the client before the replica writes the next."""
    arrivals, events = [], []
    with httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream"
            pending = b""
            for chunk in resp.iter_raw():  # (iter_lines holds a line back until the next one)
                pending += chunk
                *complete, pending = pending.split(b"\n\n")
                for event in complete:
                    arrivals.append(time.time())
                    events.append(event.decode().removeprefix("data: "))
    docs = [json.loads(e) for e in events[:-1]]
    assert [d["choices"][0]["text"] for d in docs] == ["t0", "t1", "t2", "t3"]
    assert events[-1] == "[DONE]"
    # Nothing on the way buffers the stream.
    sent = [d["sent_at"] for d in docs]
    assert all(got < next_sent for got, next_sent in zip(arrivals, sent[1:])), (arrivals, sent)


def assert_adapter_requests_land_on(url: str, with_adapter, count: int = 5) -> None:
    """``sql-lora`` requests all reach ``with_adapter`` (the replica that has it loaded)."""
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(count):
            resp = client.post("/v1/completions", json=completion("sql-lora"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-served-by"] == with_adapter.address
    assert [body["model"] for _p, _h, body in with_adapter.requests] == ["sql-lora"] * count


def assert_sheddable_is_shed(url: str) -> None:
    """Every replica saturated: a SHEDDABLE request is a 429 with epick's reason and
    message; a standard one still goes through."""
    with httpx.Client(base_url=url, timeout=10) as client:
        shed = client.post("/v1/completions", json=completion(),
                           headers={"x-criticality": "sheddable"})
        standard = client.post("/v1/completions", json=completion())
    assert shed.status_code == 429, shed.text
    assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert shed.json()["error"]["type"] == "rate_limit_exceeded"
    assert shed.json()["error"]["message"] == (
        "epick: SHEDDABLE request shed: every endpoint is over the admission thresholds "
        "(queue <= 5, kv <= 0.8)")
    assert standard.status_code == 200


def assert_usage_and_ttft_reported(url: str, seen: list[dict], *, stream: bool,
                                   ttft_at_least_s: float = 0.0) -> None:
    """One completion through the proxy (prompt of 5 words; the replica streams 3 events,
    or answers JSON): the report carries its usage and, streamed, its TTFT (None for
    JSON). ``seen``: :func:`epick_service.spy_complete`'s list."""
    body = completion(prompt="one two three four five", stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(base_url=url, timeout=10) as client:
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, (resp.status_code, resp.text)
    assert wait_for(lambda: seen)
    (kw,) = seen
    assert (kw["status"], kw["prompt_tokens"], kw["completion_tokens"]) == (
        0, 5, 3 if stream else 1)
    if stream:
        assert ttft_at_least_s <= kw["ttft_s"] < 10, kw
    else:
        assert kw["ttft_s"] is None
