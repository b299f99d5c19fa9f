"""The HTTP/JSON front end ([http] listen) over real sockets: a running service, real
scraped pages, real WASM policies, answers compared with the gRPC API's."""

from __future__ import annotations

import time
from contextlib import ExitStack

import grpc
import httpx
import msgspec
import pytest
from epick_service import make_config, running
from fakes import vllm_page

from epick import config as cfg
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.service import ListenError, Service

BASE = "m"


@pytest.fixture
def http(tmp_path):
    """``http(addresses, **kw)`` -> (Running, httpx.Client on its HTTP port)."""
    with ExitStack() as stack:
        def start(addresses, *, policies=("load", "lora-affinity"), max_body_bytes=8 << 20,
                  openai=None, server=None):
            base = make_config(addresses, policies=policies, tmp=tmp_path)
            config = msgspec.structs.replace(
                base,
                http=cfg.HttpConfig(listen="127.0.0.1:0", max_body_bytes=max_body_bytes),
                openai=cfg.OpenAIConfig(**({"base_model": BASE} | (openai or {}))),
                server=msgspec.structs.replace(base.server, **(server or {})))
            svc = stack.enter_context(running(config))
            assert svc.service.http_port
            client = stack.enter_context(httpx.Client(
                base_url=f"http://127.0.0.1:{svc.service.http_port}", timeout=10))
            return svc, client
        yield start


def idle_and_busy(fake_vllm):
    return fake_vllm(vllm_page(waiting=0)), fake_vllm(vllm_page(waiting=30, running=10, kv=0.95))


def test_v1_pick_answers_what_grpc_pick_answers_in_json(fake_vllm, http):
    idle, busy = idle_and_busy(fake_vllm)
    svc, client = http([idle.address, busy.address])
    resp = client.post("/v1/pick", json={"model": BASE, "prompt": "hi", "seed": "7"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    doc = resp.json()
    assert set(doc) == {"endpoint", "fallbacks", "decisionId"}  # lowerCamelCase, as grpcurl
    grpc_answer = svc.picker.Pick(pb.PickRequest(model=BASE, prompt="hi", seed=7), timeout=5)
    assert doc["endpoint"] == grpc_answer.endpoint == idle.address
    assert doc["fallbacks"] == list(grpc_answer.fallbacks) == [busy.address]


def test_v1_pick_takes_proto_field_names_and_camel_case_alike(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    svc, client = http([idle.address])
    for body in ({"model": BASE, "request_id": "r1", "cache_salt": "s", "explain": True},
                 {"model": BASE, "requestId": "r1", "cacheSalt": "s", "explain": True}):
        resp = client.post("/v1/pick", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["explanation"]["candidates"][0]["endpoint"] == idle.address


@pytest.mark.parametrize(("body", "status", "code", "message"), [
    (b"{not json", 400, "INVALID_ARGUMENT", "malformed PickRequest JSON: Failed to load JSON"),
    (b'{"model": "m", "colour": 1}', 400, "INVALID_ARGUMENT",
     'malformed PickRequest JSON: Message type "epick.v1.PickRequest" has no field named '
     '"colour"'),
    (b'{"model": "m", "criticality": "URGENT"}', 400, "INVALID_ARGUMENT",
     "malformed PickRequest JSON: Failed to parse criticality field: Invalid enum "
     "value URGENT for enum type epick.v1.Criticality"),
    (b'{"prompt": "hi"}', 400, "INVALID_ARGUMENT", "PickRequest.model is required"),
    (b'{"model": "m", "pinEndpoint": "127.0.0.1:1"}', 400, "INVALID_ARGUMENT",
     "PickRequest.pin_endpoint '127.0.0.1:1' is refused: pinning is off"),
], ids=["not-json", "unknown-field", "bad-enum", "no-model", "pin-refused"])
def test_a_bad_pick_is_a_400_naming_what_is_wrong(fake_vllm, http, body, status, code, message):
    (idle, _busy) = idle_and_busy(fake_vllm)
    _svc, client = http([idle.address])
    resp = client.post("/v1/pick", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    assert resp.json()["code"] == code
    assert resp.json()["message"].startswith(message), resp.json()


def test_shed_is_429_and_nothing_eligible_503_with_the_dropped_reason(fake_vllm, http):
    busy = fake_vllm(vllm_page(waiting=30, running=10, kv=0.95))
    svc, client = http([busy.address])
    shed = client.post("/v1/pick", json={"model": BASE, "criticality": "SHEDDABLE"})
    assert shed.status_code == 429
    assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert shed.json()["code"] == "RESOURCE_EXHAUSTED"
    assert "SHEDDABLE request shed" in shed.json()["message"]
    gone = client.post("/v1/pick", json={"model": "other-model"})
    with pytest.raises(grpc.RpcError) as info:
        svc.picker.Pick(pb.PickRequest(model="other-model"), timeout=5)
    assert gone.status_code == 503
    assert gone.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    assert gone.json() == {"code": "UNAVAILABLE", "message": info.value.details()}


def test_a_body_over_the_limit_is_413(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    _svc, client = http([idle.address], max_body_bytes=4096)
    ok = client.post("/v1/pick", json={"model": BASE, "prompt": "x" * 3000})
    big = client.post("/v1/pick", json={"model": BASE, "prompt": "x" * 5000})
    route = client.post("/v1/route", json={"model": BASE, "prompt": "x" * 5000})
    assert ok.status_code == 200
    for resp in (big, route):
        assert resp.status_code == 413
        assert resp.json()["message"] == (
            "request body too large: over epick's limit of 4096 bytes ([http] max_body_bytes)")


def test_v1_completion_reports_a_decision_once(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    svc, client = http([idle.address])
    decision = client.post("/v1/pick", json={"model": BASE}).json()["decisionId"]
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 1
    first = client.post("/v1/completion", json={"decisionId": decision, "status": "OK",
                                                "completion_tokens": 3})
    again = client.post("/v1/completion", json={"decision_id": decision, "status": "ERROR"})
    assert (first.status_code, first.json()) == (200, {"known": True})
    assert (again.status_code, again.json()) == (200, {})  # known=false: grpcurl prints {}
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0
    minimal = client.post("/v1/completion", json={"decisionId": decision},
                          headers={"Prefer": "return=minimal"})
    assert (minimal.status_code, minimal.content) == (204, b"")
    empty = client.post("/v1/completion", json={})
    assert empty.status_code == 400
    assert empty.json()["message"] == (
        "CompletionReport needs decision_id or request_id; both are empty")


def test_v1_route_translates_an_openai_body_like_ext_proc(fake_vllm, http):
    with_adapter = fake_vllm(vllm_page(running_adapters="sql-lora", max_lora=2))
    without = fake_vllm(vllm_page(running_adapters="", max_lora=2))
    svc, client = http([with_adapter.address, without.address],
                       openai={"model_rewrites": {"alias": "sql-lora"}})
    for body in ({"model": "sql-lora", "prompt": "hi"}, {"model": "alias", "prompt": ["h", "i"]},
                 {"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}],
                  "stream": True}):
        resp = client.post("/v1/route", json=body, headers={"x-request-id": "abc"})
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        assert set(doc) == {"endpoint", "fallbacks", "decisionId", "model"}
        assert doc["endpoint"] == with_adapter.address
        assert doc["model"] == "sql-lora"
        assert doc["fallbacks"] == [without.address]
        assert resp.headers["x-gateway-destination-endpoint"] == (
            f"{with_adapter.address},{without.address}")
        assert resp.headers["x-epick-decision-id"] == doc["decisionId"]
    # A body-less request (GET /v1/models through a proxy) is a base-model pick.
    empty = client.post("/v1/route", content=b"")
    assert empty.status_code == 200 and empty.json()["model"] == BASE


def test_v1_route_objective_header_maps_to_criticality(fake_vllm, http):
    busy = fake_vllm(vllm_page(waiting=30, running=10, kv=0.95))
    _svc, client = http([busy.address], openai={"objectives": {"batch": "sheddable"}})
    body = {"model": BASE, "prompt": "hi"}
    shed = client.post("/v1/route", json=body, headers={"x-llm-d-inference-objective": "batch"})
    kept = client.post("/v1/route", json=body, headers={"x-llm-d-inference-objective": "chat"})
    assert shed.status_code == 429
    assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert kept.status_code == 200


@pytest.mark.parametrize(("body", "headers", "message"), [
    (b"{not json", {}, "malformed request: the body is not valid JSON: Expecting property name "
                       "enclosed in double quotes: line 1 column 2 (char 1)"),
    (b'{"prompt": "hi"}', {}, "malformed request: body.model must be a non-empty string"),
    (b'{"model": "m", "messages": 3}', {}, "malformed request: body.messages must be a list"),
    (b'{"model": "m"}', {"x-criticality": "urgent"},
     "malformed request: x-criticality 'urgent' is not critical, standard or sheddable"),
], ids=["not-json", "no-model", "messages-not-a-list", "bad-criticality"])
def test_v1_route_malformed_is_400_with_ext_procs_message(fake_vllm, http, body, headers,
                                                          message):
    (idle, _busy) = idle_and_busy(fake_vllm)
    _svc, client = http([idle.address])
    resp = client.post("/v1/route", content=body, headers=headers)
    assert resp.status_code == 400
    assert resp.json() == {"code": "INVALID_ARGUMENT", "message": message}


def test_health_follows_the_grpc_health_status(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    svc, client = http([idle.address])
    assert client.get("/health").status_code == 200
    idle.stop()  # the only endpoint goes stale: NOT_SERVING
    deadline = time.monotonic() + 5
    while client.get("/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    resp = client.get("/health")
    assert (resp.status_code, resp.json()) == (503, {"status": "NOT_SERVING"})


def test_picks_over_http_are_counted_in_the_pick_metrics(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    svc, client = http([idle.address])
    metrics = httpx.get(f"http://127.0.0.1:{svc.service.metrics_port}/metrics").text

    def count(outcome: str, text: str) -> float:
        for line in text.splitlines():
            if line.startswith("epick_picks_total{") and f'outcome="{outcome}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    client.post("/v1/pick", json={"model": BASE})
    client.post("/v1/route", content=b"{oops")
    after = httpx.get(f"http://127.0.0.1:{svc.service.metrics_port}/metrics").text
    assert count("ok", after) == count("ok", metrics) + 1
    assert count("invalid", after) == count("invalid", metrics) + 1


def test_a_busy_http_port_is_one_clear_error(fake_vllm, tmp_path):
    import socket
    (idle, _busy) = idle_and_busy(fake_vllm)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = msgspec.structs.replace(
            make_config([idle.address], tmp=tmp_path),
            http=cfg.HttpConfig(listen=f"127.0.0.1:{port}"))
        with pytest.raises(ListenError, match=rf"cannot listen on 127.0.0.1:{port} "
                                              r"\(\[http\] listen\): the port is already in use"):
            import anyio
            anyio.run(Service(config).run)


def test_the_http_section_is_off_by_default_and_validated():
    assert cfg.loads("version = 1").http.listen == ""
    with pytest.raises(cfg.ConfigError, match=r"\$\.http\.max_body_bytes"):
        cfg.loads("version = 1\n[http]\nmax_body_bytes = 10\n")
    with pytest.raises(cfg.ConfigError, match=r"\$\.http\.listen"):
        cfg.loads('version = 1\n[http]\nlisten = "nowhere"\n')


def test_an_unknown_route_or_method_is_a_json_error(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    _svc, client = http([idle.address])
    wrong_method = client.get("/v1/pick")
    unknown = client.post("/v2/pick", json={})
    assert (wrong_method.status_code, wrong_method.json()) == (
        405, {"code": "UNIMPLEMENTED", "message": "GET /v1/pick: use POST"})
    assert unknown.status_code == 404
    assert unknown.json()["message"] == (
        "no route POST /v2/pick; epick serves POST /v1/pick, POST /v1/completion, "
        "POST /v1/route, GET /v1/weights, POST /v3/discovery:endpoints, GET /health")


def test_v1_route_without_a_base_model_is_404_naming_the_key(fake_vllm, http):
    (idle, _busy) = idle_and_busy(fake_vllm)
    _svc, client = http([idle.address], openai={"base_model": ""})
    resp = client.post("/v1/route", json={"model": BASE})
    assert (resp.status_code, resp.json()) == (404, {
        "code": "NOT_FOUND",
        "message": "/v1/route is off: it needs the base model ([openai] base_model)"})
    assert client.post("/v1/pick", json={"model": BASE}).status_code == 200


def test_the_http_headers_are_ext_procs_names():
    from epick.api import ext_proc
    from epick.api import http as http_api
    assert (http_api.DESTINATION_HEADER, http_api.DECISION_HEADER,
            http_api.DROPPED_REASON_HEADER) == (ext_proc.DESTINATION_HEADER,
                                                ext_proc.DECISION_HEADER,
                                                ext_proc.DROPPED_REASON_HEADER)


@pytest.mark.parametrize("endpoint,fallbacks,decision_id,explain", [
    ("10.0.0.1:8000", ["10.0.0.2:8000", "10.0.0.3:8000"], "ab12cd34-1f", False),
    ("10.0.0.1:8000", [], "ab12cd34-2", False),                 # no fallbacks: left out
    ("", [], "", False),                                        # every field at its default
    ("[::1]:8000", ["h\u00e9te:1", 'q"uo\\te:2', "tab\t\n:3"], "\u2603", False),  # escaped
    ("10.0.0.1:8000", ["10.0.0.2:8000"], "x-1", True),          # explanation: the slow path
])
def test_a_pick_answer_is_the_json_message_to_json_writes(endpoint, fallbacks, decision_id,
                                                          explain):
    from google.protobuf import json_format

    from epick.api.http import _pick_json

    response = pb.PickResponse(endpoint=endpoint, fallbacks=fallbacks,
                               decision_id=decision_id)
    if explain:
        response.explanation.snapshot_version = 7
        response.explanation.candidates.add(endpoint=endpoint, total=0.5, scores={"a": 0.5})
    assert _pick_json(response) == json_format.MessageToJson(response, indent=None)
