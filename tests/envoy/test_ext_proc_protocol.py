"""The ext_proc conversation message by message: a gRPC client plays Envoy's part.

What Envoy itself does with the answers is tested in test_envoy_routing.py; here are the
parts of the protocol a stock Envoy config does not exercise (fallbacks in the value, the
served endpoint read back from metadata, partial bodies, cancelled streams).
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from fakes import vllm_page
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEADER = "x-gateway-destination-endpoint"


def headers_msg(path="/v1/completions", *, eos=False, extra=(), body_mode=None):
    hs = [(":method", "POST"), (":path", path), ("x-request-id", "req-1"), *extra]
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in hs]),
        end_of_stream=eos))
    if body_mode is not None:
        msg.protocol_config.request_body_mode = body_mode
    return msg


def body_msg(doc, *, eos=True):
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=eos))


def response_headers_msg(status="200", served=None):
    msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=status.encode())])))
    if served:
        ns = struct_pb2.Struct()
        ns["x-gateway-destination-endpoint-served"] = served
        msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(ns)
    return msg


@pytest.fixture
def pool(replicas):
    return [r.address for r in replicas(3, vllm_page())]


def converse(svc, messages):
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        return list(ep_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))


def pending(svc) -> int:
    return svc.call(lambda: svc.service.scheduler.pending_decisions)


def wait_reported(svc) -> None:
    deadline = time.monotonic() + 5
    while pending(svc) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_value_lists_the_primary_then_the_configured_fallbacks(epick, pool):
    svc = epick(pool, fallbacks=2)
    first, second = converse(svc, [headers_msg(), body_msg({"model": "base", "prompt": "x"})])
    assert first.WhichOneof("response") == "request_headers"
    mutation = second.request_body.response.header_mutation.set_headers
    assert [(h.header.key, h.append_action) for h in mutation] == [
        (HEADER, base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]
    value = mutation[0].header.raw_value.decode()
    assert sorted(value.split(",")) == sorted(pool)  # primary + 2 fallbacks = the pool
    assert second.request_body.response.clear_route_cache
    assert second.dynamic_metadata["envoy.lb"][HEADER] == value


def test_the_fallbacks_are_capped_by_the_servers_fallbacks(epick, pool):
    svc = epick(pool, fallbacks=5)  # [server].fallbacks is 2 by default
    _, resp = converse(svc, [headers_msg(), body_msg({"model": "base"})])
    assert len(resp.dynamic_metadata["envoy.lb"][HEADER].split(",")) == 3


def test_a_custom_metadata_namespace_is_used(epick, pool):
    svc = epick(pool, metadata_namespace="epick.route")
    _, resp = converse(svc, [headers_msg(), body_msg({"model": "base"})])
    assert list(resp.dynamic_metadata.keys()) == ["epick.route"]


def test_the_served_endpoint_from_metadata_is_echoed_and_reported(epick, pool):
    svc = epick(pool)
    _, routed, answered = converse(svc, [
        headers_msg(), body_msg({"model": "base"}), response_headers_msg("200", served=pool[2])])
    set_headers = {h.header.key: h.header.raw_value.decode()
                   for h in answered.response_headers.response.header_mutation.set_headers}
    assert set_headers[HEADER] == pool[2]
    assert set_headers["x-epick-decision-id"]
    wait_reported(svc)
    assert pending(svc) == 0


def test_a_stream_that_ends_before_any_response_is_reported_too(epick, pool):
    svc = epick(pool)
    converse(svc, [headers_msg(), body_msg({"model": "base"})])  # the client went away
    wait_reported(svc)
    assert pending(svc) == 0


def test_a_body_less_request_is_scheduled_on_its_headers(epick, pool):
    svc = epick(pool)
    (resp,) = converse(svc, [headers_msg("/v1/models", eos=True)])
    value = resp.request_headers.response.header_mutation.set_headers[0].header.raw_value
    assert value.decode() in pool


def test_a_partial_body_is_refused_with_413(epick, pool):
    svc = epick(pool)
    _, resp = converse(svc, [headers_msg(), body_msg(b'{"model": "ba', eos=False)])
    imm = resp.immediate_response
    assert imm.status.code == 413
    assert json.loads(imm.body)["error"]["message"] == (
        "request body too large for Envoy's buffer (epick ext_proc needs the whole body; "
        "request_body_mode must be BUFFERED)")
    assert pending(svc) == 0


def test_a_streamed_request_body_mode_is_a_configuration_error(epick, pool):
    svc = epick(pool)
    (resp,) = converse(svc, [headers_msg(body_mode=processing_mode_pb2.ProcessingMode.STREAMED)])
    assert resp.immediate_response.status.code == 500
    assert json.loads(resp.immediate_response.body)["error"]["message"] == (
        "epick ext_proc needs the whole request body: set processing_mode.request_body_mode "
        "to BUFFERED in Envoy")


def test_request_headers_reach_policies_but_not_the_adapters_own(epick, pool):
    svc = epick(pool)
    seen = []
    schedule = svc.service.scheduler.schedule

    def spy(request, *, explain=False):
        seen.append(request)
        return schedule(request, explain=explain)

    svc.call(setattr, svc.service.scheduler, "schedule", spy)
    converse(svc, [headers_msg(extra=[("x-tenant", "acme"), (HEADER, "10.0.0.1:1"),
                                      ("x-criticality", "Critical")]),
                   body_msg({"model": "sql-lora", "prompt": ["a", "b"], "cache_salt": "s1"})])
    (req,) = seen
    assert (req.request_id, req.model, req.adapter, req.prompt, req.cache_salt,
            req.criticality) == ("req-1", "base", "sql-lora", "ab", "s1", 0)
    assert req.headers == {"x-request-id": "req-1", "x-tenant": "acme",
                           "x-criticality": "Critical"}


def test_the_ext_proc_port_answers_health_checks_for_the_ext_proc_service(epick, pool):
    svc = epick(pool)
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_the_example_epick_config_matches_the_example_envoy_config():
    import re

    from epick import config as cfg
    from epick.api.ext_proc_envoy import EXAMPLE

    conf = cfg.load(EXAMPLE.parent / "epick.toml")
    envoy_yaml = EXAMPLE.read_text()
    assert conf.ext_proc.listen == "127.0.0.1:9004"
    assert "port_value: 9004}" in envoy_yaml
    block = envoy_yaml.split("# BEGIN replicas")[1].split("# END replicas")[0]
    replicas = [f"{h}:{p}" for h, p in re.findall(r"address: ([\d.]+), port_value: (\d+)", block)]
    assert [e.address for e in conf.pool.endpoints] == replicas
    assert (conf.ext_proc.failure_mode == "closed") == ("failure_mode_allow: false" in envoy_yaml)
