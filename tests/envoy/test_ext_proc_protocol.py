"""The ext_proc conversation message by message: a gRPC client plays Envoy's part.

What Envoy itself does with the answers is tested in test_envoy_routing.py (both body
modes, real Envoy); here are the exact messages in both modes, and the parts of the
protocol a stock Envoy config does not exercise (fallbacks in the value, the served
endpoint read back from metadata, a subset hint, malformed hints, partial bodies, a
stream that keeps sending after an immediate response).
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import msgspec
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from epick_service import make_config as service_config
from epick_service import running, spy_complete
from fakes import vllm_page
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epick import config as cfg
from epick import telemetry

HEADER = "x-gateway-destination-endpoint"
DROPPED = "x-llm-d-request-dropped-reason"
Mode = processing_mode_pb2.ProcessingMode
DUPLEX = Mode.FULL_DUPLEX_STREAMED


def headers_msg(path="/v1/completions", *, eos=False, extra=(), body_mode=None,
                response_mode=None, subset=None):
    hs = [(":method", "POST"), (":path", path), ("x-request-id", "req-1"), *extra]
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in hs]),
        end_of_stream=eos))
    if body_mode is not None:
        msg.protocol_config.request_body_mode = body_mode
    if response_mode is not None:
        msg.protocol_config.response_body_mode = response_mode
    if subset is not None:
        ns = struct_pb2.Struct()
        ns["x-gateway-destination-endpoint-subset"] = subset
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(ns)
    return msg


def duplex_headers(**kw):
    return headers_msg(body_mode=DUPLEX, response_mode=DUPLEX, **kw)


def body_msg(doc, *, eos=True):
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=eos))


def response_headers_msg(status="200", served=None, ctype="application/json"):
    msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=status.encode()),
                 base_pb2.HeaderValue(key="content-type", raw_value=ctype.encode())])))
    if served:
        ns = struct_pb2.Struct()
        ns["x-gateway-destination-endpoint-served"] = served
        msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(ns)
    return msg


def response_body_msg(raw: bytes, *, eos=False):
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=raw, end_of_stream=eos))


@pytest.fixture
def pool(replicas):
    return [r.address for r in replicas(3, vllm_page())]


def converse(svc, messages, *, observed=False):
    """The answers to ``messages`` on one stream; ``observed``: as the routing filter of
    envoy-observer.yaml (its gRPC initial metadata says an observer reports)."""
    metadata = [("x-epick-observed", "true")] if observed else None
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        return list(ep_grpc.ExternalProcessorStub(channel).Process(
            iter(messages), timeout=10, metadata=metadata))


def observing(msg):
    """``msg`` as an observer filter sends it (observability_mode)."""
    msg.observability_mode = True
    return msg


def response_headers_with_id(decision_id, status="200", ctype="text/event-stream", eos=False):
    msg = response_headers_msg(status, ctype=ctype)
    msg.response_headers.headers.headers.add(key="x-epick-decision-id",
                                             raw_value=decision_id.encode())
    msg.response_headers.end_of_stream = eos
    return observing(msg)


def pending(svc) -> int:
    return svc.call(lambda: svc.service.scheduler.pending_decisions)


def wait_reported(svc) -> None:
    deadline = time.monotonic() + 5
    while pending(svc) and time.monotonic() < deadline:
        time.sleep(0.02)


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def immediate_of(resp) -> tuple[int, dict, dict[str, str]]:
    imm = resp.immediate_response
    return (imm.status.code, json.loads(imm.body),
            {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers})



# -- BUFFERED ------------------------------------------------------------------------------

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


def test_the_backend_address_is_not_told_to_the_client_by_default(epick, pool):
    svc = epick(pool)
    _, _, answered = converse(svc, [headers_msg(), body_msg({"model": "base"}),
                                    response_headers_msg("200")])
    mutation = answered.response_headers.response.header_mutation
    assert list(set_headers(answered.response_headers.response)) == ["x-epick-decision-id"]
    assert list(mutation.remove_headers) == [HEADER]  # even if the backend echoed it


def test_the_served_endpoint_from_metadata_is_echoed_when_exposed_and_reported(epick, pool):
    svc = epick(pool, expose_endpoint=True)
    seen = spy_complete(svc)
    _, routed, answered = converse(svc, [
        headers_msg(), body_msg({"model": "base"}), response_headers_msg("200", served=pool[2])])
    headers = set_headers(answered.response_headers.response)
    assert headers[HEADER] == pool[2]
    assert headers["x-epick-decision-id"]
    wait_reported(svc)
    assert pending(svc) == 0
    assert [(kw["endpoint"], kw["status"]) for kw in seen] == [(pool[2], 0)]


def test_a_stream_that_ends_before_any_response_is_reported_cancelled(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    converse(svc, [headers_msg(), body_msg({"model": "base"})])  # the client went away
    wait_reported(svc)
    assert pending(svc) == 0
    assert [kw["status"] for kw in seen] == [2]  # CANCELLED


def test_a_body_less_request_is_scheduled_on_its_headers(epick, pool):
    svc = epick(pool)
    (resp,) = converse(svc, [headers_msg("/v1/models", eos=True)])
    value = resp.request_headers.response.header_mutation.set_headers[0].header.raw_value
    assert value.decode() in pool


def test_a_partial_buffered_body_is_refused_with_413(epick, pool):
    svc = epick(pool)
    _, resp = converse(svc, [headers_msg(), body_msg(b'{"model": "ba', eos=False)])
    status, body, _ = immediate_of(resp)
    assert status == 413
    assert body["error"]["message"] == (
        "request body too large for Envoy's buffer (in BUFFERED mode epick needs the whole "
        "body in one message; raise per_connection_buffer_limit_bytes or use "
        "FULL_DUPLEX_STREAMED)")
    assert pending(svc) == 0


@pytest.mark.parametrize("mode", [Mode.STREAMED, Mode.NONE], ids=["STREAMED", "NONE"])
def test_a_body_mode_epick_cannot_route_on_is_a_configuration_error(epick, pool, mode):
    svc = epick(pool)
    (resp,) = converse(svc, [headers_msg(body_mode=mode)])
    status, body, _ = immediate_of(resp)
    assert status == 500
    assert body["error"]["message"] == (
        "epick ext_proc reads the request body before it routes, and Envoy sends it in mode "
        f"{Mode.BodySendMode.Name(mode)}: set processing_mode.request_body_mode to "
        "FULL_DUPLEX_STREAMED (upstream's mode) or BUFFERED")


def test_a_buffered_model_rewrite_replaces_the_body_and_its_length(epick, pool):
    svc = epick(pool, model_rewrites={"chat": "base"})
    _, resp = converse(svc, [headers_msg(), body_msg({"model": "chat", "prompt": "hi"})])
    common = resp.request_body.response
    new = common.body_mutation.body
    assert json.loads(new) == {"model": "base", "prompt": "hi"}
    assert set_headers(common)["content-length"] == str(len(new))


# -- FULL_DUPLEX_STREAMED -------------------------------------------------------------------

def test_duplex_answers_the_headers_after_the_body_then_streams_the_body_back(epick, pool):
    svc = epick(pool)
    raw = json.dumps({"model": "base", "prompt": "hello " * 50}).encode()
    parts = [raw[:40], raw[40:100], raw[100:]]
    out = converse(svc, [duplex_headers(), body_msg(parts[0], eos=False),
                         body_msg(parts[1], eos=False), body_msg(parts[2], eos=True)])
    assert [r.WhichOneof("response") for r in out] == [
        "request_headers", "request_body", "request_body", "request_body"]
    headers = set_headers(out[0].request_headers.response)
    assert headers[HEADER] in pool
    assert out[0].request_headers.response.clear_route_cache
    assert out[0].dynamic_metadata["envoy.lb"][HEADER] == headers[HEADER]
    streamed = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert [s.body for s in streamed] == parts  # the same chunks, not re-cut
    assert [s.end_of_stream for s in streamed] == [False, False, True]


def test_duplex_streams_the_response_through_and_reports_usage_and_ttft(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    events = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n',
              b'\ndata: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n',
              b"data: [DONE]\n\n"]
    out = converse(svc, [
        duplex_headers(), body_msg({"model": "base", "prompt": "x", "stream": True}),
        response_headers_msg("200", ctype="text/event-stream"),
        *[response_body_msg(e, eos=i == len(events) - 1) for i, e in enumerate(events)]])
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "response_headers"] + [
        "response_body"] * 4
    streamed = [r.response_body.response.body_mutation.streamed_response for r in out[3:]]
    assert [s.body for s in streamed] == events
    assert [s.end_of_stream for s in streamed] == [False, False, False, True]
    wait_reported(svc)
    (kw,) = seen
    assert (kw["status"], kw["prompt_tokens"], kw["completion_tokens"]) == (0, 7, 2)
    assert 0 <= kw["ttft_s"] < 10


def test_duplex_reads_usage_from_a_json_answer(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    answer = json.dumps({"choices": [{"text": "hi"}],
                         "usage": {"prompt_tokens": 11, "completion_tokens": 3}}).encode()
    converse(svc, [duplex_headers(), body_msg({"model": "base", "prompt": "x"}),
                   response_headers_msg("200"), response_body_msg(answer[:9]),
                   response_body_msg(answer[9:], eos=True)])
    wait_reported(svc)
    (kw,) = seen
    assert (kw["status"], kw["prompt_tokens"], kw["completion_tokens"], kw["ttft_s"]) == (
        0, 11, 3, None)


def test_duplex_a_response_that_never_ends_is_cancelled(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    converse(svc, [duplex_headers(), body_msg({"model": "base", "stream": True}),
                   response_headers_msg("200", ctype="text/event-stream"),
                   response_body_msg(b'data: {"choices":[]}\n\n')])  # then the client left
    wait_reported(svc)
    assert [kw["status"] for kw in seen] == [2]


def test_duplex_an_error_status_is_reported_as_error(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    converse(svc, [duplex_headers(), body_msg({"model": "base"}), response_headers_msg("500"),
                   response_body_msg(b"oops", eos=True)])
    wait_reported(svc)
    assert [kw["status"] for kw in seen] == [1]


def test_duplex_a_body_over_the_limit_is_one_413_and_the_stream_ends(epick, pool):
    svc = epick(pool, max_body_bytes=2048)
    out = converse(svc, [duplex_headers(), body_msg(b"x" * 1500, eos=False),
                         body_msg(b"x" * 1500, eos=False), body_msg(b"x" * 1500, eos=True)])
    (resp,) = out
    status, body, _ = immediate_of(resp)
    assert status == 413
    assert body["error"]["message"] == (
        "request body too large: over epick's limit of 2048 bytes ([ext_proc] max_body_bytes)")
    assert pending(svc) == 0


def test_a_body_right_at_the_limit_is_routed(epick, pool):
    svc = epick(pool, max_body_bytes=2048)
    prefix = b'{"model": "base", "prompt": "'
    raw = prefix + b"y" * (2048 - len(prefix) - 2) + b'"}'
    assert len(raw) == 2048
    out = converse(svc, [duplex_headers(), body_msg(raw[:1000], eos=False),
                         body_msg(raw[1000:], eos=True)])
    assert set_headers(out[0].request_headers.response)[HEADER] in pool


def test_duplex_a_model_rewrite_streams_the_new_body_and_sets_its_length(epick, pool):
    svc = epick(pool)
    raw = json.dumps({"model": "chat", "prompt": "hi"}).encode()
    out = converse(svc, [duplex_headers(extra=[("x-llm-d-model-name-rewrite", "base")]),
                         body_msg(raw[:10], eos=False), body_msg(raw[10:], eos=True)])
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body
                    for r in out[1:])
    assert json.loads(body) == {"model": "base", "prompt": "hi"}
    assert set_headers(out[0].request_headers.response)["content-length"] == str(len(body))
    assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_duplex_a_body_that_ends_with_trailers_is_routed_at_the_trailers(epick, pool):
    svc = epick(pool)
    raw = json.dumps({"model": "base", "prompt": "hi"}).encode()
    trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())
    out = converse(svc, [duplex_headers(), body_msg(raw, eos=False), trailers])
    assert [r.WhichOneof("response") for r in out] == [
        "request_headers", "request_body", "request_trailers"]
    assert set_headers(out[0].request_headers.response)[HEADER] in pool
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (raw, False)  # the trailers end it


def test_only_one_immediate_response_is_sent_then_the_stream_ends(epick, pool):
    """The bug this replaces: after a 400 epick kept reading and sent a 413 and a 500 too."""
    svc = epick(pool)
    release = threading.Event()

    def messages():
        yield duplex_headers()
        yield body_msg(b"{not json", eos=True)
        yield body_msg(b"more", eos=False)
        release.wait(30)  # a data plane that keeps the stream open

    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
            out = list(ep_grpc.ExternalProcessorStub(channel).Process(messages(), timeout=20))
        assert not release.is_set()  # epick ended the stream itself
    finally:
        release.set()
    (resp,) = out
    assert immediate_of(resp)[0] == 400


# -- both modes: decisions and headers ------------------------------------------------------

@pytest.fixture(params=["buffered", "duplex"])
def mode(request):
    return request.param


def route(svc, mode, body, **headers_kw):
    make = duplex_headers if mode == "duplex" else headers_msg
    return converse(svc, [make(**headers_kw), body_msg(body)])


def destination(out, mode) -> str:
    common = (out[0].request_headers.response if mode == "duplex"
              else out[1].request_body.response)
    return set_headers(common)[HEADER]


def test_the_subset_hint_keeps_the_pick_inside_it(epick, pool, mode):
    svc = epick(pool)
    for target in pool:
        for _ in range(3):
            out = route(svc, mode, {"model": "base"}, subset=[target])
            assert destination(out, mode) == target
    # A bare host matches every endpoint on it.
    assert destination(route(svc, mode, {"model": "base"}, subset=["127.0.0.1"]), mode) in pool


@pytest.mark.parametrize("subset", [["10.9.9.9:8000"], []], ids=["not-in-pool", "empty"])
def test_a_subset_hint_with_nothing_eligible_is_a_503_with_a_reason(epick, pool, mode, subset):
    svc = epick(pool)
    out = route(svc, mode, {"model": "base"}, subset=subset)
    status, body, headers = immediate_of(out[-1])
    assert status == 503
    listed = ", ".join(subset)
    assert body["error"]["message"] == (
        f"epick: no endpoint in the subset hint [{listed}] is fresh and serves model 'base'")
    assert headers[DROPPED] == "rejected-no-endpoints"


def test_a_malformed_subset_hint_is_a_500_naming_the_key(epick, pool, mode):
    svc = epick(pool)
    out = route(svc, mode, {"model": "base"}, subset="127.0.0.1:1")
    status, body, headers = immediate_of(out[-1])
    assert status == 500
    assert body["error"]["message"] == (
        "epick ext_proc: metadata envoy.lb.subset_hint/x-gateway-destination-endpoint-subset "
        'must be a list of "host:port" strings, got a string_value')


def test_an_objective_maps_to_criticality_and_a_shed_is_a_429_with_a_reason(
        epick, replicas, mode):
    busy = [r.address for r in replicas(2, vllm_page(waiting=40, kv=0.95))]
    svc = epick(busy, objectives={"batch": "sheddable", "chat": "critical"})
    out = route(svc, mode, {"model": "base"},
                extra=[("x-llm-d-inference-objective", "batch")])
    status, body, headers = immediate_of(out[-1])
    assert status == 429
    assert headers[DROPPED] == "rejected-saturated"
    assert body["error"]["type"] == "rate_limit_exceeded"
    # The older header name works too; an unlisted objective is standard (not shed).
    for extra in ([("x-gateway-inference-objective", "batch")],):
        assert immediate_of(route(svc, mode, {"model": "base"}, extra=extra)[-1])[0] == 429
    for objective in ("chat", "unlisted"):
        out = route(svc, mode, {"model": "base"},
                    extra=[("x-llm-d-inference-objective", objective)])
        assert destination(out, mode) in busy
    # x-criticality wins over the objective.
    out = route(svc, mode, {"model": "base"}, extra=[("x-llm-d-inference-objective", "batch"),
                                                     ("x-criticality", "critical")])
    assert destination(out, mode) in busy


def test_pinning_is_refused_naming_the_setting_when_it_is_off(epick, pool, mode):
    svc = epick(pool)
    out = route(svc, mode, {"model": "base"}, extra=[("x-epick-pin-endpoint", pool[1])])
    status, body, _ = immediate_of(out[-1])
    assert status == 400
    assert body["error"]["message"] == (
        f"malformed request: PickRequest.pin_endpoint '{pool[1]}' is refused: pinning is off "
        "on this server (set [server] allow_pinning = true to allow it)")


def test_a_pinned_endpoint_is_used_and_a_missing_one_is_never_replaced(epick, pool, mode):
    svc = epick(pool, server={"allow_pinning": True}, fallbacks=2)
    for target in pool:
        out = route(svc, mode, {"model": "base"}, extra=[("x-epick-pin-endpoint", target)])
        assert destination(out, mode) == target  # alone: a pin has no fallbacks
    out = route(svc, mode, {"model": "base"}, extra=[("x-epick-pin-endpoint", "10.9.9.9:80")])
    status, body, headers = immediate_of(out[-1])
    assert (status, headers[DROPPED]) == (503, "rejected-no-endpoints")
    assert body["error"]["message"] == (
        "epick: pinned endpoint '10.9.9.9:80' is not in the pool (or has never reported "
        "metrics)")


def test_request_headers_reach_policies_but_not_the_adapters_own(epick, pool):
    svc = epick(pool)
    seen = []
    schedule = svc.service.scheduler.schedule

    def spy(request, **kw):
        seen.append(request)
        return schedule(request, **kw)

    svc.call(setattr, svc.service.scheduler, "schedule", spy)
    converse(svc, [headers_msg(extra=[("x-tenant", "acme"), (HEADER, "10.0.0.1:1"),
                                      ("x-criticality", "Critical")]),
                   body_msg({"model": "sql-lora", "prompt": ["a", "b"], "cache_salt": "s1"})])
    (req,) = seen
    assert (req.request_id, req.model, req.adapter, req.prompt, req.cache_salt,
            req.criticality) == ("req-1", "base", "sql-lora", "ab", "s1", 0)
    assert req.headers == {"x-request-id": "req-1", "x-tenant": "acme",
                           "x-criticality": "Critical"}


def test_the_ext_proc_port_answers_health_checks_under_upstreams_names(epick, pool):
    svc = epick(pool)
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor", "liveness",
                     "readiness"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_the_example_epick_config_matches_the_example_envoy_configs():
    import re

    from envoy_harness import ALL_EXAMPLES, EXAMPLE

    from epick import config as cfg

    conf = cfg.load(EXAMPLE.parent / "epick.toml")
    assert conf.ext_proc.listen == "127.0.0.1:9004"
    for path in ALL_EXAMPLES.values():
        envoy_yaml = path.read_text()
        assert "port_value: 9004}" in envoy_yaml
        block = envoy_yaml.split("# BEGIN replicas")[1].split("# END replicas")[0]
        replicas = [f"{h}:{p}"
                    for h, p in re.findall(r"address: ([\d.]+), port_value: (\d+)", block)]
        assert [e.address for e in conf.pool.endpoints] == replicas
        assert (conf.ext_proc.failure_mode == "closed") == (
            "failure_mode_allow: false" in envoy_yaml)


# -- the one pick path and the [openai] settings ---------------------------------------------

def picks_recorded() -> dict[str, float]:
    return {o: telemetry.REGISTRY.get_sample_value("epick_picks_total", {"outcome": o}) or 0.0
            for o in telemetry.PICK_OUTCOMES}


def test_the_openai_section_alone_configures_the_translation(pool, tmp_path):
    raw = msgspec.to_builtins(service_config(pool, policies=("load",), tmp=tmp_path))
    raw["ext_proc"] = {"listen": "127.0.0.1:0"}
    raw["openai"] = {"base_model": "base", "model_rewrites": {"chat": "base"},
                     "objectives": {"batch": "sheddable"}}
    with running(msgspec.convert(raw, cfg.Config)) as svc:
        out = converse(svc, [headers_msg(), body_msg({"model": "chat", "prompt": "hi"})])
        assert json.loads(out[1].request_body.response.body_mutation.body)["model"] == "base"
        assert set_headers(out[1].request_body.response)[HEADER] in pool


def test_a_failure_to_decide_fails_open_without_a_destination_and_is_counted(epick, pool):
    svc = epick(pool, failure_mode="open")

    def schedule(request, **kw):
        raise RuntimeError("policy set exploded")

    svc.call(setattr, svc.service.scheduler, "schedule", schedule)
    before = picks_recorded()
    out = converse(svc, [headers_msg(), body_msg({"model": "base", "prompt": "hi"})])
    assert not any(r.HasField("immediate_response") for r in out)
    mutation = out[1].request_body.response.header_mutation
    assert list(mutation.remove_headers) == [HEADER] and not mutation.set_headers
    assert picks_recorded()["error"] == before["error"] + 1


def test_a_body_that_is_not_json_is_counted_invalid_like_any_malformed_pick(epick, pool):
    svc = epick(pool)
    before = picks_recorded()
    out = converse(svc, [headers_msg(), body_msg(b"{not json")])
    status, body, _ = immediate_of(out[-1])
    assert status == 400 and body["error"]["message"].startswith(
        "malformed request: the body is not valid JSON")
    after = picks_recorded()
    assert {o: after[o] - before[o] for o in after if after[o] != before[o]} == {"invalid": 1}


# -- the observer (examples/envoy/envoy-observer.yaml) ------------------------------------

def routed_id(svc, *, observed=True, respond=True):
    """A routing stream as the observed example's routing filter runs it: its answers."""
    msgs = [headers_msg(body_mode=DUPLEX),
            body_msg({"model": "base", "prompt": "one two three", "stream": True})]
    if respond:
        msgs.append(response_headers_msg("200", ctype="text/event-stream"))
    return converse(svc, msgs, observed=observed)


def test_an_observed_routing_stream_leaves_the_report_to_the_observer(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    out = routed_id(svc)
    decision_id = set_headers(out[-1].response_headers.response)["x-epick-decision-id"]
    time.sleep(0.3)  # the routing stream has ended: it reported nothing
    assert seen == [] and pending(svc) == 1
    events = [b'data: {"choices":[{"text":"a"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
              b"data: [DONE]\n\n"]
    answers = converse(svc, [
        observing(headers_msg()), response_headers_with_id(decision_id),
        *[observing(response_body_msg(e, eos=i == len(events) - 1))
          for i, e in enumerate(events)]])
    assert answers == []  # an observer is never answered
    wait_reported(svc)
    assert pending(svc) == 0
    (kw,) = seen
    assert (kw["decision_id"], kw["status"], kw["prompt_tokens"], kw["completion_tokens"]) == (
        decision_id, 0, 3, 1)
    assert 0 <= kw["ttft_s"] < 10


def test_an_observed_request_with_no_answer_is_reported_cancelled_by_the_routing_stream(
        epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    routed_id(svc, respond=False)  # the client left before the answer: no id to observe
    wait_reported(svc)
    assert pending(svc) == 0
    assert [kw["status"] for kw in seen] == [2]


def test_without_the_metadata_the_routing_stream_reports_as_before(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    routed_id(svc, observed=False)
    wait_reported(svc)
    assert [kw["status"] for kw in seen] == [0]


def test_an_observer_whose_answer_never_ends_reports_cancelled_once(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    out = routed_id(svc)
    decision_id = set_headers(out[-1].response_headers.response)["x-epick-decision-id"]
    converse(svc, [observing(headers_msg()), response_headers_with_id(decision_id, "500"),
                   observing(response_body_msg(b"data: {}\n\n"))])  # then the stream closes
    wait_reported(svc)
    assert [(kw["decision_id"], kw["status"]) for kw in seen] == [(decision_id, 2)]


def test_an_observer_reports_an_error_status_and_a_body_less_answer_at_its_headers(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    out = routed_id(svc)
    decision_id = set_headers(out[-1].response_headers.response)["x-epick-decision-id"]
    converse(svc, [observing(headers_msg()),
                   response_headers_with_id(decision_id, "503", eos=True)])
    wait_reported(svc)
    assert [(kw["decision_id"], kw["status"], kw["ttft_s"]) for kw in seen] == [
        (decision_id, 1, None)]


def test_an_observer_without_a_decision_id_reports_nothing(epick, pool):
    svc = epick(pool)
    seen = spy_complete(svc)
    routed_id(svc)
    converse(svc, [observing(headers_msg()), observing(response_headers_msg("200")),
                   observing(response_body_msg(b"x", eos=True))])
    time.sleep(0.3)
    assert seen == [] and pending(svc) == 1


def test_an_observed_routing_stream_without_a_decision_strips_an_upstream_decision_id(
        epick, pool):
    svc = epick(pool)
    # Not routed yet (BUFFERED headers, then an answer): no decision, so the answer must
    # not carry an id (an upstream's) that the observer would report for.
    out = converse(svc, [headers_msg(), response_headers_msg("200")], observed=True)
    assert out[-1].response_headers.response.header_mutation.remove_headers == [
        "x-epick-decision-id"]

