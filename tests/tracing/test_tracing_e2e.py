"""Tracing end to end: epick's spans reach a real OpenTelemetry collector (rotel, OTLP/gRPC
in) and are read back from its OTLP export; every front end reads the caller's W3C trace
context, and ext_proc passes epick's own on to the model server."""

from __future__ import annotations

import json
import os
import urllib.request

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from fakes import vllm_page

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc

MODEL = "m"  # the fleet's model (conftest.MODEL)


def trace_context(sampled: bool = True) -> tuple[bytes, bytes, str]:
    """A fresh (trace id, parent span id, traceparent) as a caller would send them."""
    trace_id, parent = os.urandom(16), os.urandom(8)
    return trace_id, parent, f"00-{trace_id.hex()}-{parent.hex()}-{'01' if sampled else '00'}"


def attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = ([x.string_value for x in v.array_value.values] if kind == "array_value"
                       else getattr(v, kind))
    return out


def events(span) -> dict[str, dict]:
    return {e.name: attrs(e.attributes) for e in span.events}


@pytest.fixture
def fleet(fake_vllm):
    return [fake_vllm(vllm_page(waiting=q, model=MODEL)).address for q in (4, 0, 9)]


def test_a_pick_with_a_traceparent_arrives_as_its_child_with_the_stages(epick, fleet,
                                                                        collector):
    svc = epick(fleet)
    trace_id, parent, traceparent = trace_context()
    resp = svc.picker.Pick(pb.PickRequest(model=MODEL, seed=1), timeout=10, metadata=(
        ("traceparent", traceparent), ("tracestate", "vendor=abc")))
    [span] = collector.sink.wait(trace_id)
    assert span.name == "epick.pick" and span.kind == span.SPAN_KIND_SERVER
    assert span.parent_span_id == parent and span.trace_state == "vendor=abc"
    a = attrs(span.attributes)
    assert a["epick.decision_id"] == resp.decision_id
    assert a["epick.endpoint"] == resp.endpoint == fleet[1]
    assert a["epick.outcome"] == "ok" and a["epick.model"] == MODEL
    ev = events(span)
    assert list(ev) == ["filter", "score", "pick"]
    assert ev["filter"]["epick.endpoints"] == 3 and ev["filter"]["epick.kept"] == 3
    score = ev["score"]
    assert score["epick.chosen.endpoint"] == resp.endpoint
    assert score["epick.runner_up.endpoint"] == resp.fallbacks[0] == fleet[0]
    for role in ("chosen", "runner_up"):
        assert {f"epick.{role}.score.load", f"epick.{role}.score.prefix-cache",
                f"epick.{role}.total"} <= set(score)
    assert score["epick.chosen.score.load"] > score["epick.runner_up.score.load"]
    assert ev["pick"] == {"epick.endpoint": resp.endpoint,
                          "epick.fallbacks": list(resp.fallbacks)}
    assert span.start_time_unix_nano < span.end_time_unix_nano
    assert not resp.HasField("explanation")  # the trace's, not the client's


def test_a_refused_pick_is_an_error_span(epick, fleet, collector):
    svc = epick(fleet)
    trace_id, parent, traceparent = trace_context()
    with pytest.raises(grpc.RpcError) as info:
        svc.picker.Pick(pb.PickRequest(model="nobody-serves-this"), timeout=10,
                        metadata=(("traceparent", traceparent),))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    [span] = collector.sink.wait(trace_id)
    assert span.parent_span_id == parent
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert span.status.message.startswith("unavailable: ")
    assert attrs(span.attributes)["epick.outcome"] == "unavailable"


def test_pickstream_reads_each_messages_own_headers(epick, fleet, collector):
    svc = epick(fleet)
    calls = [trace_context() for _ in range(2)]
    stream_trace, stream_parent, stream_tp = trace_context()
    msgs = [pb.PickStreamRequest(id=i, pick=pb.PickRequest(
        model=MODEL, headers={"traceparent": tp})) for i, (_, _, tp) in enumerate(calls)]
    msgs.append(pb.PickStreamRequest(id=9, pick=pb.PickRequest(model=MODEL)))
    answers = list(svc.picker.PickStream(iter(msgs), timeout=10,
                                         metadata=(("traceparent", stream_tp),)))
    assert [a.WhichOneof("kind") for a in answers] == ["pick"] * 3
    for (trace_id, parent, _), answer in zip(calls, answers, strict=False):
        [span] = collector.sink.wait(trace_id)
        assert span.parent_span_id == parent
        assert attrs(span.attributes)["epick.decision_id"] == answer.pick.decision_id
    # a message without its own: the stream's metadata
    [span] = collector.sink.wait(stream_trace)
    assert span.parent_span_id == stream_parent
    assert attrs(span.attributes)["epick.decision_id"] == answers[2].pick.decision_id


def test_the_http_front_end_reads_the_request_headers(epick, fleet, collector):
    svc = epick(fleet)
    base = f"http://127.0.0.1:{svc.service.http_port}"
    for path, body in (("/v1/pick", {"model": MODEL}),
                       ("/v1/route", {"model": MODEL, "prompt": "hi"})):
        trace_id, parent, traceparent = trace_context()
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Traceparent": traceparent})
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        [span] = collector.sink.wait(trace_id)
        assert span.parent_span_id == parent, path
        assert attrs(span.attributes)["epick.decision_id"] == answer["decisionId"], path


def _ext_proc(svc, traceparent: str) -> dict[str, str]:
    hs = [(":method", "POST"), (":path", "/v1/completions"), ("traceparent", traceparent)]
    msgs = [ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]))),
            ep.ProcessingRequest(request_body=ep.HttpBody(
                body=json.dumps({"model": MODEL, "prompt": "x"}).encode(), end_of_stream=True))]
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        _, routed = ep_grpc.ExternalProcessorStub(channel).Process(iter(msgs), timeout=10)
    return {h.header.key: h.header.raw_value.decode()
            for h in routed.request_body.response.header_mutation.set_headers}


def test_ext_proc_passes_its_own_span_on_to_the_model_server(epick, fleet, collector):
    svc = epick(fleet)
    trace_id, parent, traceparent = trace_context()
    sent = _ext_proc(svc, traceparent)
    [span] = collector.sink.wait(trace_id)
    assert span.parent_span_id == parent
    # the model server's parent is epick's span, in the same trace
    assert sent["traceparent"] == f"00-{trace_id.hex()}-{span.span_id.hex()}-01"
    assert sent["x-gateway-destination-endpoint"] == attrs(span.attributes)["epick.endpoint"]


def test_an_unsampled_pick_sends_no_span_and_leaves_the_callers_context_alone(
        epick, fleet, collector):
    svc = epick(fleet, sample_ratio=1.0)  # parent_based: the caller's flag decides
    trace_id, _, traceparent = trace_context(sampled=False)
    sent = _ext_proc(svc, traceparent)
    # no mutation: Envoy forwards the caller's own traceparent to the model server
    assert "traceparent" not in sent and "x-gateway-destination-endpoint" in sent
    # a sampled pick after it is exported, the unsampled one never was
    sampled_id, _, sampled_tp = trace_context()
    svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=10,
                    metadata=(("traceparent", sampled_tp),))
    assert collector.sink.wait(sampled_id)
    assert collector.sink.wait(trace_id, timeout=0.5) == []


def test_the_ratio_decides_without_a_caller(epick, fleet, collector):
    svc = epick(fleet, sample_ratio=0.0)
    resp = svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=10)
    trace_id, _, traceparent = trace_context()
    svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=10,
                    metadata=(("traceparent", traceparent),))
    assert collector.sink.wait(trace_id)  # a sampled caller is followed (parent_based)
    ids = {attrs(s.attributes).get("epick.decision_id") for s in collector.sink.spans}
    assert resp.decision_id not in ids  # ratio 0: the caller-less pick was not traced


def test_service_name_and_resource_reach_the_collector(epick, fleet, collector):
    svc = epick(fleet, service_name="picker-eu", resource={"deployment.environment": "test"})
    trace_id, _, traceparent = trace_context()
    svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=10,
                    metadata=(("traceparent", traceparent),))
    [span] = collector.sink.wait(trace_id)
    resource = attrs(collector.sink.resources[collector.sink.spans.index(span)].attributes)
    assert resource["service.name"] == "picker-eu"
    assert resource["deployment.environment"] == "test"


def test_tracing_off_builds_no_tracer(tmp_path, fleet):
    from epick_service import make_config, running

    with running(make_config(fleet, tmp=tmp_path)) as svc:
        assert svc.service.tracer is None
        picker = picker_pb2_grpc.EndpointPickerStub(svc.channel)
        picker.Pick(pb.PickRequest(model=MODEL), timeout=10,
                    metadata=(("traceparent", trace_context()[2]),))
        assert svc.call(lambda: svc.service.scheduler is not None)
