"""Which band, flow and deadline a PickRequest gets (epick.api.decide)."""

from __future__ import annotations

import asyncio

import pytest

from epick import abi
from epick.api.decide import Decider, fairness_of, priority_of, slo_ttft_of
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.validate import InvalidArgument, to_request
from epick.config import FlowControlConfig
from epick.interfaces import PoolView
from epick.scheduler.scheduler import Scheduler

OBJECTIVES = {"batch": -5, "chat": 7}


def classify(**kw):
    msg = pb.PickRequest(model="m", **kw)
    request = to_request(msg)
    return priority_of(msg, request, OBJECTIVES), fairness_of(msg, request)


def test_priority_field_then_objective_then_criticality():
    assert classify(priority=3, headers={"x-llm-d-inference-objective": "chat"})[0] == 3
    assert classify(priority=0, criticality=pb.CRITICAL)[0] == 0  # set, even to 0
    assert classify(headers={"x-llm-d-inference-objective": "chat"})[0] == 7
    assert classify(headers={"x-gateway-inference-objective": " batch "})[0] == -5
    # An objective not in the table: the criticality decides.
    assert classify(headers={"x-llm-d-inference-objective": "other"},
                    criticality=pb.SHEDDABLE)[0] == -1
    assert classify(criticality=pb.CRITICAL)[0] == 1
    assert classify()[0] == 0


def test_fairness_field_then_header_then_default():
    assert classify(fairness_id="t1", headers={"x-llm-d-inference-fairness-id": "t2"})[1] == "t1"
    assert classify(headers={"x-llm-d-inference-fairness-id": "t2"})[1] == "t2"
    assert classify()[1] == ""


def test_slo_from_the_field_or_the_header_and_a_bad_header_is_invalid():
    def slo(**kw):
        msg = pb.PickRequest(model="m", **kw)
        return slo_ttft_of(msg, to_request(msg))
    assert slo(slo_ttft_ms=250) == 250
    assert slo(headers={"x-llm-d-slo-ttft-ms": "400"}) == 400
    assert slo() is None
    with pytest.raises(InvalidArgument, match="x-llm-d-slo-ttft-ms"):
        slo(headers={"x-llm-d-slo-ttft-ms": "soon"})


def test_a_bad_slo_header_is_refused_invalid_through_the_async_path():
    eps = (abi.EndpointMetrics(address="10.0.0.1:8000"),)
    view = PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=eps))
    d = Decider(Scheduler(lambda: view))
    d.configure_flow(FlowControlConfig(enabled=True), metrics=False)
    verdict = asyncio.run(d.decide_async(pb.PickRequest(
        model="m", headers={"x-llm-d-slo-ttft-ms": "-"})))
    assert verdict.outcome == "invalid" and "x-llm-d-slo-ttft-ms" in verdict.message
    ok = asyncio.run(d.decide_async(pb.PickRequest(model="m")))
    assert ok.outcome == "ok" and ok.queue_reason == ""
