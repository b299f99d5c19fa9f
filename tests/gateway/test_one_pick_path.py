"""One pick path, three front ends: gRPC Pick, Envoy's ext_proc and the reference gateway
(which calls Pick) record the same outcome and the same telemetry for the same situation,
and say each refusal as epick.api.decide.REFUSALS says it.

One service serves all three (ext_proc configured through [openai] only); one replica,
fresh and busy: a pin to it is ok, a pin elsewhere unavailable, a malformed pin invalid,
a sheddable request shed, and a scheduler that raises an error.
"""

from __future__ import annotations

import json

import grpc
import httpx
import msgspec
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from epick_service import make_config, running
from fakes import vllm_page
from test_gateway_proxy import LoopThread

from epick import config as cfg
from epick import telemetry
from epick.api.decide import REFUSALS
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.gateway.proxy import Gateway, make_app

BASE = "base"
DROPPED = "x-llm-d-request-dropped-reason"
#: situation -> (the headers an OpenAI client sends, the outcome). {pin} is the replica.
SITUATIONS = {
    "pinned": ({"x-epick-pin-endpoint": "{pin}"}, "ok"),
    "malformed pin": ({"x-epick-pin-endpoint": "no-port"}, "invalid"),
    "pinned elsewhere": ({"x-epick-pin-endpoint": "10.9.9.9:80"}, "unavailable"),
    "shed": ({"x-criticality": "sheddable"}, "shed"),
}


def counts() -> dict[str, float]:
    value = telemetry.REGISTRY.get_sample_value
    out = {o: value("epick_picks_total", {"outcome": o}) or 0.0
           for o in telemetry.PICK_OUTCOMES}
    out["timed"] = value("epick_pick_latency_seconds_count", {"stage": "total"}) or 0.0
    return out


def recorded(fn, *args) -> tuple[object, dict[str, float]]:
    """``fn(*args)``'s answer and what it added to the pick metrics."""
    before = counts()
    answer = fn(*args)
    after = counts()
    return answer, {k: after[k] - before[k] for k in after if after[k] != before[k]}


def via_grpc(svc, headers: dict[str, str]):
    """Pick as a gRPC client sends it: the header's meaning in PickRequest fields."""
    msg = pb.PickRequest(model=BASE, pin_endpoint=headers.get("x-epick-pin-endpoint", ""))
    if headers.get("x-criticality") == "sheddable":
        msg.criticality = pb.SHEDDABLE
    try:
        return "ok", svc.picker.Pick(msg, timeout=10).endpoint
    except grpc.RpcError as exc:
        return "refused", exc.code()


def via_ext_proc(svc, headers: dict[str, str]):
    pairs = [(":method", "GET"), (":path", "/v1/models"), *headers.items()]
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in pairs]),
        end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        [out] = list(ep_grpc.ExternalProcessorStub(channel).Process(iter([msg]), timeout=10))
    if out.HasField("immediate_response"):
        imm = out.immediate_response
        sent = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
        return "refused", (imm.status.code, sent.get(DROPPED, ""),
                           json.loads(imm.body)["error"]["type"])
    mutation = out.request_headers.response.header_mutation
    sent = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return "ok", sent["x-gateway-destination-endpoint"]


def via_gateway(url: str, gateway: Gateway, headers: dict[str, str]):
    before = sum(gateway.stats.picks.values())
    r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "x"},
                   headers=headers, timeout=10)
    if r.status_code in (400, 429, 500, 503):
        return "refused", (r.status_code, r.headers.get(DROPPED, ""),
                           r.json()["error"]["type"])
    assert sum(gateway.stats.picks.values()) == before + 1  # forwarded where epick said
    [(endpoint, _)] = [(e, n) for e, n in gateway.stats.picks.items() if n]
    return "ok", endpoint


@pytest.fixture
def world(fake_vllm, tmp_path):
    replica = fake_vllm(vllm_page(waiting=50, model=BASE))
    raw = msgspec.to_builtins(make_config([replica.address], policies=("load",), tmp=tmp_path))
    raw["server"]["allow_pinning"] = True
    raw["ext_proc"] = {"listen": "127.0.0.1:0"}
    raw["openai"] = {"base_model": BASE}
    lt = LoopThread()
    try:
        with running(msgspec.convert(raw, cfg.Config)) as svc:
            async def start():
                gateway = Gateway(svc.target, BASE)
                runner = web.AppRunner(make_app(gateway))
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                return runner, gateway, f"http://127.0.0.1:{runner.addresses[0][1]}"

            runner, gateway, url = lt.run(start())
            fronts = {
                "grpc": lambda h: via_grpc(svc, h),
                "ext_proc": lambda h: via_ext_proc(svc, h),
                "gateway": lambda h: via_gateway(url, gateway, h),
            }
            yield svc, replica, fronts
            lt.run(runner.cleanup())
    finally:
        lt.close()


@pytest.mark.parametrize("situation", list(SITUATIONS))
def test_every_front_end_records_the_same_outcome_and_says_it_the_same_way(world, situation):
    svc, replica, fronts = world
    template, outcome = SITUATIONS[situation]
    headers = {k: v.format(pin=replica.address) for k, v in template.items()}
    for name, front in fronts.items():
        (kind, answer), added = recorded(front, headers)
        assert added == {outcome: 1.0, "timed": 1.0}, (name, added)
        if outcome == "ok":
            assert (kind, answer) == ("ok", replica.address), name
            continue
        row = REFUSALS[outcome]
        assert kind == "refused", name
        if name == "grpc":
            assert answer == row.grpc
        else:
            assert answer == (row.http, row.reason, row.kind), name


def test_a_failure_to_decide_is_an_error_on_every_front_end(world):
    svc, _, fronts = world

    def schedule(request, **kw):
        raise RuntimeError("policy set exploded")

    svc.call(setattr, svc.service.scheduler, "schedule", schedule)
    answers = {}
    for name, front in fronts.items():
        (kind, answers[name]), added = recorded(front, {})
        assert (kind, added) == ("refused", {"error": 1.0, "timed": 1.0}), name
    assert answers["grpc"] == grpc.StatusCode.INTERNAL
    assert answers["gateway"] == (500, "rejected-internal", "server_error")
    # ext_proc's failure_mode "closed" (the default) answers 503 instead: documented.
    assert answers["ext_proc"] == (503, "rejected-internal", "service_unavailable")
