"""Flow control through a running service over real sockets: gRPC Pick and HTTP /v1/pick
against a scraped fake engine whose queue the test fills and drains."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import grpc
import httpx
import msgspec
import pytest
from epick_service import config_text, make_config, running
from fakes import vllm_page

from epick import config as cfg
from epick.api.gen.epick.v1 import picker_pb2 as pb

BASE = "m"
BUSY_WAITING = 9
BUSY = vllm_page(waiting=BUSY_WAITING, model=BASE)
IDLE = vllm_page(waiting=0, model=BASE)


@pytest.fixture
def served(tmp_path):
    """``served(engine_page, **flow_control)`` -> (Running, engine, httpx.Client)."""
    with ExitStack() as stack:
        def start(engine, **flow):
            base = make_config([engine.address], policies=("load",), tmp=tmp_path)
            config = msgspec.structs.replace(
                base, http=cfg.HttpConfig(listen="127.0.0.1:0"),
                flow_control=cfg.FlowControlConfig(enabled=True, **flow))
            svc = stack.enter_context(running(config))
            client = stack.enter_context(httpx.Client(
                base_url=f"http://127.0.0.1:{svc.service.http_port}", timeout=10))
            return svc, client
        yield start


def wait_fresh(svc, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return svc.picker.Pick(pb.PickRequest(model=BASE, explain=True), timeout=2)
        except grpc.RpcError:
            time.sleep(0.02)
    raise AssertionError("the engine never became fresh")


# The service's state is polled, not slept on: a scrape or a queued call can take far
# longer than usual on a loaded machine (fixed 0.1-0.3 s sleeps failed there).
def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.01)


def wait_saturated(svc) -> None:
    """Until the busy page has been scraped and the flow controller sees no room. The page
    itself is checked: a test's own pick also fills the threshold until the next scrape, so
    "no room" alone can be seen before the busy page arrives (and room come back after)."""
    def busy() -> bool:
        decider = svc.service._decider
        eps = decider.scheduler.current_view().snapshot.endpoints
        return bool(eps) and all(e.waiting >= BUSY_WAITING for e in eps) \
            and not decider.flow.has_room()
    wait_until(lambda: svc.call(busy), "the busy page scraped")


def wait_queued(svc, n: int) -> None:
    wait_until(lambda: svc.call(lambda: svc.service._decider.flow.waiting) >= n,
               f"{n} requests waiting")


def test_unsaturated_goes_straight_through(fake_vllm, served):
    engine = fake_vllm(IDLE)
    svc, _ = served(engine)
    answer = wait_fresh(svc)
    assert answer.endpoint == engine.address
    assert answer.explanation.queue_wait_ms == 0 and answer.explanation.queue_reason == ""


def test_ttl_refuses_with_the_reason_over_grpc_and_http(fake_vllm, served):
    engine = fake_vllm(IDLE)
    svc, client = served(engine, ttl_ms=300, queue_threshold=2)
    wait_fresh(svc)
    engine.page = BUSY
    wait_saturated(svc)  # scraped: 9 waiting >= 2
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        svc.picker.Pick(pb.PickRequest(model=BASE), timeout=5)
    waited = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("x-llm-d-request-dropped-reason", "evicted-ttl") in err.value.trailing_metadata()
    assert 0.25 <= waited < 3, waited
    resp = client.post("/v1/pick", json={"model": BASE, "prompt": "hi"})
    assert resp.status_code == 429, resp.text
    assert resp.headers["x-llm-d-request-dropped-reason"] == "evicted-ttl"


def test_the_callers_deadline_ends_the_wait_sooner(fake_vllm, served):
    engine = fake_vllm(BUSY)
    svc, _ = served(engine, ttl_ms=60_000)
    wait_saturated(svc)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        svc.picker.Pick(pb.PickRequest(model=BASE), timeout=0.4)
    assert time.monotonic() - t0 < 2
    # Either side may notice first: epick's refusal or the client's own deadline.
    assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.DEADLINE_EXCEEDED)
    # Whichever side noticed first, the request does not stay queued (the server expires
    # it at the deadline or drops it when the call is cancelled: a moment later, loaded).
    deadline = time.monotonic() + 3
    while svc.call(lambda: svc.service._decider.flow.waiting):
        assert time.monotonic() < deadline, "the expired request is still queued"
        time.sleep(0.02)


def test_a_full_band_refuses_at_once(fake_vllm, served):
    engine = fake_vllm(BUSY)
    svc, _ = served(engine, max_requests=1, ttl_ms=10_000)
    wait_saturated(svc)
    first = svc.picker.Pick.future(pb.PickRequest(model=BASE), timeout=15)
    wait_queued(svc, 1)
    with pytest.raises(grpc.RpcError) as err:
        svc.picker.Pick(pb.PickRequest(model=BASE), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("x-llm-d-request-dropped-reason",
            "rejected-queue-full") in err.value.trailing_metadata()
    # Another band has its own room: a CRITICAL request waits instead of being refused.
    critical = svc.picker.Pick.future(pb.PickRequest(model=BASE, criticality=pb.CRITICAL),
                                      timeout=15)
    wait_queued(svc, 2)
    assert not critical.done()
    engine.page = IDLE
    assert first.result().endpoint == engine.address
    assert critical.result().endpoint == engine.address


def test_critical_is_dispatched_before_the_sheddable_backlog(fake_vllm, served):
    engine = fake_vllm(IDLE)
    svc, client = served(engine, queue_threshold=1, starvation_limit=0)
    wait_fresh(svc)
    engine.page = BUSY
    wait_saturated(svc)
    done: list[str] = []
    lock = threading.Lock()

    def record(name):
        def cb(_future):
            with lock:
                done.append(name)
        return cb

    futures = []
    for i in range(4):
        f = svc.picker.Pick.future(pb.PickRequest(model=BASE, criticality=pb.SHEDDABLE,
                                                  fairness_id="batch"), timeout=10)
        f.add_done_callback(record(f"shed{i}"))
        futures.append(f)
    wait_queued(svc, 4)
    http_answer: dict = {}

    def over_http():
        http_answer["resp"] = client.post(
            "/v1/pick", json={"model": BASE, "criticality": "CRITICAL", "explain": True})
        with lock:
            done.append("critical")
    t = threading.Thread(target=over_http)
    t.start()
    wait_queued(svc, 5)
    time.sleep(0.06)  # the explanation's wait is measurably > 50 ms
    engine.page = IDLE  # room: one dispatch per scrape (threshold 1)
    t.join(timeout=10)
    for f in futures:
        f.result()
    assert done[0] == "critical", done
    doc = http_answer["resp"].json()
    assert doc["explanation"]["queueReason"] == "saturated"
    assert doc["explanation"]["queueWaitMs"] > 50


def test_pick_stream_answers_queued_picks_in_order(fake_vllm, served):
    engine = fake_vllm(IDLE)
    svc, _ = served(engine, queue_threshold=1)
    wait_fresh(svc)
    engine.page = BUSY
    wait_saturated(svc)

    def free_later():  # 0.3 s after the first pick queued: every answer waited > 200 ms
        wait_queued(svc, 1)
        time.sleep(0.3)
        engine.page = IDLE
    threading.Thread(target=free_later, daemon=True).start()
    messages = [pb.PickStreamRequest(id=i, pick=pb.PickRequest(model=BASE, explain=True))
                for i in range(3)]
    answers = list(svc.picker.PickStream(iter(messages), timeout=10))
    assert [a.id for a in answers] == [0, 1, 2]
    assert all(a.WhichOneof("kind") == "pick" for a in answers), answers
    assert all(a.pick.explanation.queue_reason == "saturated" for a in answers)
    assert answers[0].pick.explanation.queue_wait_ms > 200


def test_ext_proc_refuses_an_expired_request_with_429_and_the_reason(fake_vllm, tmp_path):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    engine = fake_vllm(BUSY)
    base = make_config([engine.address], policies=("load",), tmp=tmp_path)
    config = msgspec.structs.replace(
        base, ext_proc=cfg.ExtProcConfig(listen="127.0.0.1:0"),
        openai=cfg.OpenAIConfig(base_model=BASE),
        flow_control=cfg.FlowControlConfig(enabled=True, ttl_ms=300))
    headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                 for k, v in ((":method", "POST"), (":path", "/v1/completions"))])))
    body = ep.ProcessingRequest(request_body=ep.HttpBody(
        body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
    with running(config) as svc:
        wait_saturated(svc)
        with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
            t0 = time.monotonic()
            answers = list(ep_grpc.ExternalProcessorStub(channel).Process(
                iter([headers, body]), timeout=10))
        waited = time.monotonic() - t0
    imm = answers[-1].immediate_response
    assert imm.status.code == 429, answers
    sent = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert sent["x-llm-d-request-dropped-reason"] == "evicted-ttl"
    assert waited >= 0.25


def test_a_reload_that_turns_flow_control_off_dispatches_what_waits(fake_vllm, tmp_path):
    engine = fake_vllm(BUSY)
    path = tmp_path / "epick.toml"
    text = config_text([engine.address], tmp=tmp_path)
    path.write_text(text + "[flow_control]\nenabled = true\nttl_ms = 60000\n")
    with running(cfg.load(path), config_path=path) as svc:
        wait_saturated(svc)
        waiting = svc.picker.Pick.future(pb.PickRequest(model=BASE), timeout=20)
        wait_queued(svc, 1)
        assert not waiting.done()
        assert svc.call(lambda: svc.service._decider.flow.waiting) == 1
        path.write_text(text + "[flow_control]\nenabled = false\n")
        assert svc.reload()
        assert waiting.result().endpoint == engine.address  # dispatched, not dropped
        assert svc.call(lambda: svc.service._decider.flow) is None
