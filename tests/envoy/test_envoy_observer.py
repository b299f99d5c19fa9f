"""examples/envoy/envoy-observer.yaml with a real Envoy: the answer is only observed.

The routing filter decides as in envoy-streaming.yaml and SKIPs the answer's body; a
second ext_proc filter in ``observability_mode`` (Envoy sends, never waits) reads usage
and TTFT from the answer and reports the completion, once, for the decision id the
routing filter put on the answer. What must hold: requests land where epick chose, the
answer streams event by event, exactly one report per request with its usage, TTFT and
status, the in-flight count released, a client that leaves reported CANCELLED, and no
Envoy counter saying a stream to epick failed.
"""

from __future__ import annotations

import httpx
import pytest
from epick_service import spy_complete
from proxy_checks import (
    IDLE,
    assert_stream_passes_event_by_event,
    assert_usage_and_ttft_reported,
    completion,
    wait_for,
)

pytestmark = pytest.mark.parametrize("envoy_mode", ["observed"])


def pending(svc) -> int:
    return svc.call(lambda: svc.service.scheduler.pending_decisions)


def observer_stats(proxy) -> dict[str, int]:
    """The two ext_proc filters' counters: ``observer`` (its stat_prefix) and routing."""
    out = {}
    for key, value in proxy.stats("http.inference.ext_proc.").items():
        name = key.removeprefix("http.inference.ext_proc.")
        out[name] = value
    return out


def test_requests_land_where_epick_chose_and_each_is_reported_once(replicas, epick, envoy):
    reps = replicas(3, IDLE, chunks=3)
    addresses = [r.address for r in reps]
    svc = epick(addresses, expose_endpoint=True)
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, addresses)
    ids = []
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for _ in range(6):
            resp = client.post("/v1/completions",
                               json=completion(stream=True,
                                               stream_options={"include_usage": True}))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-served-by"] == resp.headers["x-gateway-destination-endpoint"]
            assert resp.text.endswith("data: [DONE]\n\n")
            ids.append(resp.headers["x-epick-decision-id"])
    assert wait_for(lambda: len(seen) >= 6)
    assert wait_for(lambda: pending(svc) == 0)
    assert sorted(kw["decision_id"] for kw in seen) == sorted(ids)  # once each, by the id
    assert {(kw["status"], kw["prompt_tokens"], kw["completion_tokens"]) for kw in seen} == {
        (0, 5, 3)}
    assert all(kw["ttft_s"] is not None and 0 <= kw["ttft_s"] < 10 for kw in seen)
    stats = observer_stats(proxy)
    assert stats["observer.streams_started"] == 6, stats
    assert stats.get("observer.streams_failed", 0) == 0, stats
    assert stats.get("streams_failed", 0) == 0, stats


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_usage_and_ttft_are_read_by_the_observer_and_reported(replicas, epick, envoy, stream):
    (replica,) = replicas(1, IDLE, chunks=3, chunk_delay_s=0.05)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, [replica.address])
    assert_usage_and_ttft_reported(proxy.url, seen, stream=stream)
    assert pending(svc) == 0


def test_the_answer_streams_event_by_event(replicas, epick, envoy):
    (replica,) = replicas(1, IDLE, chunks=4, chunk_delay_s=0.3)
    proxy = envoy(epick([replica.address]).ext_proc_port, [replica.address])
    assert_stream_passes_event_by_event(proxy.url)


def test_a_client_that_leaves_mid_answer_is_reported_cancelled(replicas, epick, envoy):
    (replica,) = replicas(1, IDLE, chunks=30, chunk_delay_s=0.1)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, [replica.address])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status_code == 200
            next(resp.iter_raw())  # the first token, then the client hangs up
    # Envoy closes the observer's stream after its deferred_close_timeout (5 s).
    assert wait_for(lambda: seen, timeout_s=15)
    assert [kw["status"] for kw in seen] == [2]
    assert pending(svc) == 0


def test_an_upstream_error_is_reported_as_error(replicas, epick, envoy):
    (replica,) = replicas(1, IDLE)
    svc = epick([replica.address])
    seen = spy_complete(svc)
    proxy = envoy(svc.ext_proc_port, [replica.address])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        resp = client.get("/v1/nope")  # body-less: routed on its headers; the replica's 404
    assert resp.status_code == 404
    assert wait_for(lambda: seen)
    assert [(kw["decision_id"], kw["status"]) for kw in seen] == [
        (resp.headers["x-epick-decision-id"], 1)]
    assert pending(svc) == 0
