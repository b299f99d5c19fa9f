"""GET /v1/weights over a real socket: one table as JSON, or the stream as server-sent
events, from the same WeightsHub WatchWeights reads (real scraped pages, real policies)."""

from __future__ import annotations

import json
import queue
import threading
import time

import httpx
import msgspec
import pytest
from epick_service import make_config, running
from fakes import vllm_page

from epick import config as cfg
from epick.api import http as http_api
from epick.api.gen.epick.v1 import picker_pb2 as pb


def wait_for(predicate, timeout=5.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


@pytest.fixture
def serve(tmp_path):
    """``serve(addresses, policies=...)`` -> (Running, base URL of its HTTP port)."""
    stack = []

    def start(addresses, *, policies=("load",)):
        base = make_config(addresses, policies=policies, tmp=tmp_path, scrape_in="loop")
        config = msgspec.structs.replace(
            base, http=cfg.HttpConfig(listen="127.0.0.1:0"),
            weights=cfg.WeightsConfig(threshold=0.0, min_interval_ms=0))
        cm = running(config)
        stack.append(cm)
        svc = cm.__enter__()
        return svc, f"http://127.0.0.1:{svc.service.http_port}"

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def weights(doc) -> dict[str, float]:
    return {e["endpoint"]: e.get("weight", 0.0) for e in doc["endpoints"]}


class SseReader:
    """Reads GET /v1/weights as text/event-stream on a thread of its own."""

    def __init__(self, url: str, **params) -> None:
        self.client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        self.events: queue.Queue = queue.Queue()
        self.headers: dict = {}
        self._opened = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, params), daemon=True)
        self.thread.start()
        assert self._opened.wait(10)

    def _read(self, url, params) -> None:
        try:
            with self.client.stream("GET", f"{url}/v1/weights", params=params,
                                    headers={"Accept": "text/event-stream"}) as resp:
                self.status, self.headers = resp.status_code, resp.headers
                self._opened.set()
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.put(json.loads(line[len("data: "):]))
        except (httpx.HTTPError, RuntimeError) as exc:  # closed by the test
            self.events.put(exc)
        finally:
            self._opened.set()

    def next(self, timeout=5.0) -> dict:
        got = self.events.get(timeout=timeout)
        if isinstance(got, Exception):
            raise got
        return got

    def until(self, predicate, timeout=5.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.next(timeout=max(deadline - time.monotonic(), 0.01))
            if predicate(doc):
                return doc

    def close(self) -> None:
        self.client.close()
        self.thread.join(timeout=5)


def test_one_table_as_json_is_the_table_watch_weights_sends(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (0, 2, 4)]
    svc, url = serve([s.address for s in servers])
    resp = httpx.get(f"{url}/v1/weights", params={"model": "m"}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    doc = resp.json()
    assert {"endpoints", "snapshotVersion", "timestampMs"} <= set(doc)  # protobuf JSON
    w = weights(doc)
    assert sum(w.values()) == pytest.approx(1.0)
    assert w[servers[0].address] > w[servers[1].address] > w[servers[2].address] > 0
    call = svc.picker.WatchWeights(pb.WeightsRequest(model="m"), timeout=10)
    first = next(iter(call))
    call.cancel()
    assert {e.endpoint: e.weight for e in first.endpoints} == pytest.approx(w)


def test_criticality_by_name_or_number_and_a_sheddable_table_when_all_are_saturated(
        fake_vllm, serve):
    busy = fake_vllm(vllm_page(waiting=50))
    _svc, url = serve([busy.address])
    for crit in ("CRITICAL", "1"):
        doc = httpx.get(f"{url}/v1/weights", params={"model": "m", "criticality": crit}).json()
        assert weights(doc) == {busy.address: pytest.approx(1.0)}  # all saturated: scores
    doc = httpx.get(f"{url}/v1/weights",
                    params={"model": "m", "criticality": "SHEDDABLE"}).json()
    assert weights(doc) == {busy.address: 0.0}
    assert doc["reason"]


@pytest.mark.parametrize(("params", "status", "code", "message"), [
    ({}, 400, "INVALID_ARGUMENT", "WeightsRequest.model is required"),
    ({"model": "m", "colour": "red"}, 400, "INVALID_ARGUMENT",
     "GET /v1/weights: unknown query parameter 'colour'; it takes model, adapter, criticality"),
    ({"model": "m", "criticality": "URGENT"}, 400, "INVALID_ARGUMENT",
     "malformed WeightsRequest query: Failed to parse criticality field: Invalid enum value "
     "URGENT for enum type epick.v1.Criticality"),
    ({"model": "m", "criticality": "7"}, 400, "INVALID_ARGUMENT",
     "WeightsRequest.criticality 7 is not one of CRITICAL (1), STANDARD (2), SHEDDABLE (3)"),
    ({"model": "other"}, 503, "UNAVAILABLE", "other"),
])
@pytest.mark.parametrize("accept", ["application/json", "text/event-stream"])
def test_errors_are_json_with_the_grpc_code_as_the_other_routes(
        fake_vllm, serve, params, status, code, message, accept):
    _svc, url = serve([fake_vllm(vllm_page()).address])
    resp = httpx.get(f"{url}/v1/weights", params=params, headers={"Accept": accept},
                     timeout=10)
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    doc = resp.json()
    assert doc["code"] == code
    assert message in doc["message"]


def test_post_is_a_405_that_names_get(fake_vllm, serve):
    _svc, url = serve([fake_vllm(vllm_page()).address])
    resp = httpx.post(f"{url}/v1/weights", json={"model": "m"})
    assert resp.status_code == 405
    assert resp.json() == {"code": "UNIMPLEMENTED", "message": "POST /v1/weights: use GET"}


def test_the_stream_sends_one_event_per_table_as_the_pages_change(fake_vllm, serve):
    a, b, c = (fake_vllm(vllm_page(waiting=1)) for _ in range(3))
    svc, url = serve([a.address, b.address, c.address])
    reader = SseReader(url, model="m")
    assert reader.status == 200
    assert reader.headers["content-type"].startswith("text/event-stream")
    first = reader.next()
    assert all(v > 0 for v in weights(first).values())
    b.page = vllm_page(waiting=50)  # over the admission queue threshold: saturated
    doc = reader.until(lambda d: weights(d)[b.address] == 0)
    row = next(e for e in doc["endpoints"] if e["endpoint"] == b.address)
    assert row["filteredBy"] == "saturated"
    assert int(doc["snapshotVersion"]) > int(first["snapshotVersion"])
    assert svc.call(lambda: svc.service.weights.subscribers) == 1
    reader.close()


def test_a_client_that_goes_away_frees_its_subscription(fake_vllm, serve, monkeypatch):
    # Tables come only on change; the keepalive comment is what finds the closed socket.
    monkeypatch.setattr(http_api, "SSE_KEEPALIVE_S", 0.1)
    svc, url = serve([fake_vllm(vllm_page()).address])
    readers = [SseReader(url, model="m") for _ in range(3)]
    for r in readers:
        r.next()
    assert svc.call(lambda: svc.service.weights.subscribers) == 3
    for r in readers:
        r.close()
    assert wait_for(lambda: svc.call(lambda: svc.service.weights.subscribers) == 0)


def test_the_service_stops_with_streams_open(fake_vllm, tmp_path):
    base = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    config = msgspec.structs.replace(base, http=cfg.HttpConfig(listen="127.0.0.1:0"))
    with running(config) as svc:
        reader = SseReader(f"http://127.0.0.1:{svc.service.http_port}", model="m")
        reader.next()
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5  # running() asserts the service thread ended
    reader.close()
