"""A real Envoy in front of a traced epick: the model server is told epick's decision span
as its parent, and that span reaches a real OpenTelemetry collector (rotel) as the child
of the client's own trace (docs/tracing.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from epick_service import make_config, running
from fakes import vllm_page

from epick import config as cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tracing"))
from otlp_receiver import Collector  # noqa: E402


@pytest.fixture
def collector(tmp_path):
    c = Collector(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("frontend", ["python", "native"])
def test_the_model_server_gets_epicks_span_as_its_parent(replicas, envoy, collector,
                                                          tmp_path, frontend, request):
    if frontend == "native":
        request.getfixturevalue("native_binary")  # `make native`
    reps = replicas(2, vllm_page(waiting=0))
    addresses = [r.address for r in reps]
    base = make_config(addresses, policies=("load",), tmp=tmp_path)
    config = msgspec.structs.replace(
        base, server=msgspec.structs.replace(base.server, frontend=frontend),
        ext_proc=cfg.ExtProcConfig(listen="127.0.0.1:0"),
        openai=cfg.OpenAIConfig(base_model="base"),
        tracing=cfg.TracingConfig(enabled=True, endpoint=collector.grpc_endpoint,
                                  sample_ratio=1.0, schedule_delay_ms=20))
    with running(config) as svc:
        proxy = envoy(svc.ext_proc_port, addresses)
        trace_id, parent = os.urandom(16), os.urandom(8)
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            resp = client.post("/v1/completions",
                               json={"model": "base", "prompt": "hi", "max_tokens": 5},
                               headers={"traceparent": f"00-{trace_id.hex()}-{parent.hex()}-01",
                                        "tracestate": "client=1"})
        assert resp.status_code == 200, resp.text
        [span] = collector.sink.wait(trace_id)
        assert span.parent_span_id == parent and span.name == "epick.pick"
        [(_, headers, _)] = [req for r in reps for req in r.requests]
        assert headers["traceparent"] == f"00-{trace_id.hex()}-{span.span_id.hex()}-01"
        assert headers["tracestate"] == "client=1"
        served = {a.key: a.value.string_value for a in span.attributes}["epick.endpoint"]
        assert served in {r.address for r in reps if r.requests}
