"""``[server] workers`` > 1: ext_proc served by worker processes that hand only the
decision to the service's process (epick.frontend).

A gRPC client plays Envoy's part (test_ext_proc_protocol.py's helpers); the decisions
must be the very ones the single process makes, workers must come back when killed and
go when the service stops.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from epick_service import running, spy_complete
from fakes import vllm_page
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_ext_proc_protocol import (
    DUPLEX,
    HEADER,
    body_msg,
    converse,
    duplex_headers,
    headers_msg,
    immediate_of,
    observing,
    pending,
    response_body_msg,
    response_headers_msg,
    response_headers_with_id,
    set_headers,
    wait_reported,
)

from epick import config as cfg

PROMPTS = [f"{'shared system prompt ' * (i % 3 + 1)} question {i}" for i in range(24)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait(predicate, timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _stream_once(stub, prompt: str, *, duplex: bool) -> str:
    """One whole request (streamed answer, usage in the last event): its destination."""
    start = duplex_headers() if duplex else headers_msg()
    answer = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n')
    messages = [start, body_msg({"model": "base", "prompt": prompt, "stream": True}),
                response_headers_msg(ctype="text/event-stream"),
                response_body_msg(answer, eos=True)]
    responses = list(stub.Process(iter(messages), timeout=15))
    common = (responses[0].request_headers.response if duplex
              else responses[1].request_body.response)
    return set_headers(common)[HEADER]


def _picks(svc, *, duplex: bool) -> list[str]:
    out = []
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for prompt in PROMPTS:
            out.append(_stream_once(stub, prompt, duplex=duplex))
            wait_reported(svc)  # the completion is in before the next pick (same state)
    return out


@pytest.mark.parametrize("duplex", [False, True], ids=["buffered", "streamed"])
def test_decisions_are_the_same_with_one_and_with_two_workers(epick, replicas, seeded,
                                                              duplex):
    pool = [r.address for r in replicas(3, vllm_page())]
    runs = {}
    for workers in (1, 2):
        seeded()
        svc = epick(pool, policies=("load", "prefix-cache"), server={"workers": workers})
        runs[workers] = _picks(svc, duplex=duplex)
        assert svc.service.scheduler.pending_decisions == 0
    assert runs[1] == runs[2]
    assert len(set(runs[1])) > 1  # the picks vary, so agreeing means something


def test_an_observer_reports_through_whichever_worker_holds_its_stream(epick, replicas):
    """envoy-observer.yaml's two streams per request, each on its own connection (so the
    kernel may hand them to different workers): every completion reported once, with the
    observer's usage and TTFT, and nothing left in flight."""
    pool = [r.address for r in replicas(3, vllm_page())]
    svc = epick(pool, server={"workers": 2})
    seen = spy_complete(svc)
    answer = [b'data: {"choices":[{"text":"a"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n']
    ids = []
    for i in range(6):
        out = converse(svc, [duplex_headers(),
                             body_msg({"model": "base", "prompt": PROMPTS[i], "stream": True}),
                             response_headers_msg(ctype="text/event-stream")], observed=True)
        decision_id = set_headers(out[-1].response_headers.response)["x-epick-decision-id"]
        ids.append(decision_id)
        assert converse(svc, [observing(headers_msg()), response_headers_with_id(decision_id),
                              *[observing(response_body_msg(e, eos=j == 1))
                                for j, e in enumerate(answer)]]) == []
    _wait(lambda: len(seen) == 6 and pending(svc) == 0, what="six reports")
    assert sorted(kw["decision_id"] for kw in seen) == sorted(ids)
    assert {(kw["status"], kw["prompt_tokens"], kw["completion_tokens"]) for kw in seen} == {
        (0, 3, 1)}
    assert all(kw["ttft_s"] is not None for kw in seen)


def test_workers_share_the_port_restart_when_killed_and_stop_with_the_service(
        tmp_path, replicas):
    pool = [r.address for r in replicas(2, vllm_page())]
    config = msgspec.convert({
        "version": 1, "server": {"listen": "127.0.0.1:0", "metrics_listen": "", "workers": 2},
        "pool": {"scrape_interval_ms": 20, "stale_after_ms": 5000,
                 "endpoints": [{"address": a} for a in pool]},
        "policies": [{"name": "load", "module": "load"}],
        "runtime": {"cache_dir": str(tmp_path / "cache")}, "admin": {"listen": ""},
        "ext_proc": {"listen": "127.0.0.1:0", "base_model": "base"}}, cfg.Config)
    with running(config) as svc:
        now = _kill_one_and_serve(svc, pool)
    assert not any(_alive(p) for p in now.values()), "a worker outlived the service"


def _kill_one_and_serve(svc, pool) -> dict[int, int]:
    service = svc.service
    pids = dict(service.workers.pids)
    assert sorted(pids) == [0, 1] and all(_alive(p) for p in pids.values())
    assert service.hub.connected == 2
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        # The workers answer Envoy's health check as the service would.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
            service="envoy.service.ext_proc.v3.ExternalProcessor"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = ep_grpc.ExternalProcessorStub(channel)
        assert _stream_once(stub, "hello", duplex=True) in pool

    os.kill(pids[0], signal.SIGKILL)
    _wait(lambda: service.workers.pids.get(0) not in (None, pids[0])
          and service.hub.connected == 2, what="worker 0 to be restarted")
    assert service.workers.restarts == 1
    assert service.workers.pids[1] == pids[1]
    for _ in range(6):  # fresh connections land on either worker; each one answers
        with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}",
                                   options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            assert _stream_once(ep_grpc.ExternalProcessorStub(ch), "again",
                                duplex=False) in pool
    wait_reported(svc)
    return dict(service.workers.pids)


def test_a_worker_refusal_is_said_and_counted_by_the_service(epick, replicas):
    from epick import telemetry

    pool = [r.address for r in replicas(1, vllm_page())]
    svc = epick(pool, server={"workers": 2})
    before = telemetry.PICKS.labels("invalid")._value.get()
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        (resp,) = stub.Process(iter([duplex_headers(), body_msg(b"{not json")]), timeout=10)
    status, body, _headers = immediate_of(resp)
    assert status == 400 and "malformed request" in body["error"]["message"]
    _wait(lambda: telemetry.PICKS.labels("invalid")._value.get() == before + 1,
          timeout_s=5, what="the refusal to be counted")
    assert DUPLEX  # (the helpers' mode constant: streamed requests above)


def test_the_http_front_end_in_workers_answers_as_the_service_does(tmp_path, fake_vllm):
    """/v1/pick (with an explanation), /v1/completion, /v1/route and /health from two
    worker processes. (tests/api/test_http.py passes whole with ``workers = 2`` too: it
    was run that way once; it is not parametrized, to keep the suite's time.)"""
    import httpx
    from epick_service import make_config as service_config

    from epick.api.gen.epick.v1 import picker_pb2 as pb

    idle = fake_vllm(vllm_page(waiting=0, model="m"))
    base = service_config([idle.address], policies=("load",), tmp=tmp_path)
    config = msgspec.structs.replace(
        base, http=cfg.HttpConfig(listen="127.0.0.1:0"),
        openai=cfg.OpenAIConfig(base_model="m"),
        server=msgspec.structs.replace(base.server, workers=2))
    with running(config) as svc, httpx.Client(
            base_url=f"http://127.0.0.1:{svc.service.http_port}", timeout=10) as client:
        assert sorted(svc.service.workers.pids) == [0, 1]
        _wait(lambda: client.get("/health").status_code == 200, what="/health")
        doc = client.post("/v1/pick", json={"model": "m", "prompt": "hi", "seed": "7",
                                            "explain": True}).json()
        grpc_answer = svc.picker.Pick(pb.PickRequest(model="m", prompt="hi", seed=7),
                                      timeout=5)
        assert doc["endpoint"] == grpc_answer.endpoint == idle.address
        assert doc["explanation"]["candidates"][0]["endpoint"] == idle.address
        ack = client.post("/v1/completion", json={"decisionId": doc["decisionId"],
                                                  "status": "OK"})
        assert ack.status_code == 200 and ack.json() == {"known": True}, ack.text
        again = client.post("/v1/completion", json={"decisionId": doc["decisionId"],
                                                    "status": "OK"})
        assert again.json() == {}  # known: false (already reported), as gRPC answers
        routed = client.post("/v1/route", json={"model": "m", "prompt": "hello"})
        assert routed.status_code == 200 and routed.json()["endpoint"] == idle.address
        bad = client.post("/v1/route", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_ARGUMENT"
        refused = client.post("/v1/pick", json={"prompt": "no model"})
        assert refused.status_code == 400
        assert refused.json()["message"] == "PickRequest.model is required"


def _workers_with_http(tmp_path, fake_vllm, *, flow: bool = False):
    """A service with two workers serving ext_proc and HTTP over one idle replica."""
    from epick_service import make_config as service_config

    idle = fake_vllm(vllm_page(waiting=0, model="m"))
    base = service_config([idle.address], policies=("load",), tmp=tmp_path)
    config = msgspec.structs.replace(
        base, http=cfg.HttpConfig(listen="127.0.0.1:0"),
        ext_proc=cfg.ExtProcConfig(listen="127.0.0.1:0"),
        openai=cfg.OpenAIConfig(base_model="m"),
        flow_control=msgspec.structs.replace(base.flow_control, enabled=flow),
        server=msgspec.structs.replace(base.server, workers=2))
    return idle, config


@pytest.mark.parametrize("flow", [False, True], ids=["direct", "flow_control"])
def test_a_pick_decided_for_a_worker_keeps_its_trace(tmp_path, fake_vllm, flow):
    """ext_proc in a worker names the service's span as the model server's parent, and
    the HTTP front end's trace headers reach the service's tracer (with flow control on
    too: the queued path)."""
    import httpx
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from epick.tracing import PickTracer

    idle, config = _workers_with_http(tmp_path, fake_vllm, flow=flow)
    exporter = InMemorySpanExporter()
    tracer = PickTracer(exporter=exporter, schedule_delay_ms=10)
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent}-01"
    try:
        with running(config) as svc, httpx.Client(
                base_url=f"http://127.0.0.1:{svc.service.http_port}", timeout=10) as client:
            svc.service.hub.decider.tracer = tracer  # [tracing] on, spans kept in memory
            _wait(lambda: client.get("/health").status_code == 200, what="/health")
            with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
                stub = ep_grpc.ExternalProcessorStub(channel)
                start = headers_msg(extra=(("traceparent", traceparent),
                                           ("tracestate", "vendor=abc")))
                responses = list(stub.Process(iter([start, body_msg(
                    {"model": "m", "prompt": "hi"})]), timeout=10))
            sent = set_headers(responses[1].request_body.response)
            assert sent[HEADER] == idle.address
            doc = client.post("/v1/pick", json={"model": "m", "prompt": "hello"},
                              headers={"Traceparent": traceparent}).json()
            assert doc["endpoint"] == idle.address
            assert "explanation" not in doc  # asked for by the trace, not by the client
            tracer.force_flush()
            spans = exporter.get_finished_spans()
    finally:
        tracer.shutdown()
    assert len(spans) == 2, [s.name for s in spans]
    ext_span, http_span = sorted(spans, key=lambda s: s.start_time)
    for span in spans:  # each a child of the caller's span, in the caller's trace
        assert f"{span.context.trace_id:032x}" == trace_id
        assert f"{span.parent.span_id:016x}" == parent
        assert span.attributes["epick.endpoint"] == idle.address
        assert [e.name for e in span.events][-3:] == ["filter", "score", "pick"]
    # The model server's parent is the service's span (and the caller's tracestate).
    assert sent["traceparent"] == (f"00-{trace_id}-{ext_span.context.span_id:016x}-01")
    assert sent["tracestate"] == "vendor=abc"
    assert http_span.context.span_id != ext_span.context.span_id


def test_weights_and_eds_from_workers(tmp_path, fake_vllm):
    """GET /v1/weights (one table) and POST /v3/discovery:endpoints answer from a worker
    as from the service's process; the stream is refused, naming ``[server] workers``."""
    import httpx

    idle, config = _workers_with_http(tmp_path, fake_vllm)
    with running(config) as svc, httpx.Client(
            base_url=f"http://127.0.0.1:{svc.service.http_port}", timeout=10) as client:
        _wait(lambda: client.get("/health").status_code == 200, what="/health")
        _wait(lambda: client.get("/v1/weights", params={"model": "m"}).status_code == 200,
              what="a weights table")
        table = client.get("/v1/weights", params={"model": "m"}).json()
        assert [(e["endpoint"], e["weight"]) for e in table["endpoints"]] == [
            (idle.address, 1.0)]
        assert int(table["snapshotVersion"]) > 0
        eds = client.post("/v3/discovery:endpoints", json={"resourceNames": ["model=m"]})
        assert eds.status_code == 200, eds.text
        (cla,) = eds.json()["resources"]
        lb = cla["endpoints"][0]["lbEndpoints"]
        assert [e["endpoint"]["address"]["socketAddress"]["portValue"] for e in lb] == [
            int(idle.address.rsplit(":", 1)[1])]
        # A refusal made in the service's process (no model: WeightsHub's check) is said
        # as there; one the worker makes itself (a bad criticality) too.
        nameless = client.get("/v1/weights")
        assert nameless.status_code == 400, nameless.text
        assert nameless.json()["message"] == "WeightsRequest.model is required"
        bad = client.post("/v3/discovery:endpoints",
                          json={"resourceNames": ["model=m,criticality=7"]})
        assert bad.status_code == 400 and "criticality" in bad.json()["message"]
        stream = client.get("/v1/weights", params={"model": "m"},
                            headers={"Accept": "text/event-stream"})
        assert stream.status_code == 501
        assert "[server] workers" in stream.json()["message"]
