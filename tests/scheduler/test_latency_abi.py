"""Latency in the ABI (issue 30): SLOs, prompt tokens and the session key reach `score`;
the completion's TTFT and token counts reach `post_response`."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.validate import InvalidArgument, estimate_tokens, to_request
from epick.interfaces import Capabilities, Cycle, PoolView
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler


def test_pick_request_fields_win_over_headers():
    q = to_request(pb.PickRequest(
        model="m", prompt="x" * 10, slo_ttft_ms=200, slo_tpot_ms=30, prompt_tokens=77,
        session_id="s1", headers={"x-llm-d-slo-ttft-ms": "900", "x-session-id": "h"}))
    assert (q.slo_ttft_ms, q.slo_tpot_ms, q.prompt_tokens, q.session_id) == (200, 30, 77, "s1")


def test_headers_fill_what_the_request_leaves_unset():
    q = to_request(pb.PickRequest(model="m", prompt="x" * 10, headers={
        "x-llm-d-slo-ttft-ms": "250", "x-slo-tpot-ms": " 40.4 ", "x-session-id": "conv-9"}))
    assert (q.slo_ttft_ms, q.slo_tpot_ms, q.session_id) == (250, 40, "conv-9")
    assert q.prompt_tokens == estimate_tokens("x" * 10) == 3


def test_no_slo_is_zero_and_an_empty_prompt_has_no_tokens():
    q = to_request(pb.PickRequest(model="m"))
    assert (q.slo_ttft_ms, q.slo_tpot_ms, q.prompt_tokens, q.session_id) == (0, 0, 0, "")


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "1e12"])
def test_a_bad_slo_header_is_refused_naming_it(value):
    with pytest.raises(InvalidArgument, match="x-llm-d-slo-ttft-ms"):
        to_request(pb.PickRequest(model="m", headers={"x-llm-d-slo-ttft-ms": value}))


def test_request_fields_are_appended_in_order():
    q = abi.Request(model="m", slo_ttft_ms=1, slo_tpot_ms=2, prompt_tokens=3, session_id="s")
    assert msgspec.msgpack.decode(abi.encoder.encode(q))[8:] == [1, 2, 3, "s"]


class FakeKv:
    def counts(self, request, endpoints, candidates):
        return (10, 10, 10), (4, -1, 0)

    def cleared(self, endpoints, candidates):
        return (0, 0, 0)


def test_uncached_tokens_come_from_the_engines_kv_counts():
    eps = (abi.EndpointMetrics(address="a:1", block_size=16),
           abi.EndpointMetrics(address="b:1", block_size=16),
           abi.EndpointMetrics(address="c:1", block_size=0))
    view = PoolView.build(abi.Snapshot(version=1, endpoints=eps))
    cycle = Cycle(view, abi.Request(model="m", prompt_tokens=100), kv=FakeKv())
    decoded = msgspec.msgpack.decode(cycle.score_input((0, 1, 2), inline_snapshot=False))
    # a: 100 - 4*16; b: no events (-1); c: no block size (-1)
    assert decoded[8] == [36, -1, -1]
    assert msgspec.msgpack.decode(Cycle(view, abi.Request(model="m")).score_input(
        (0, 1, 2), inline_snapshot=False))[8] == []


class Hooks:
    name = "hooks"
    capabilities = Capabilities.SCORE | Capabilities.POST_RESPONSE

    def __init__(self):
        self.events = []

    def score(self, cycle, candidates):
        return np.ones(len(candidates))

    def post_response(self, event):
        self.events.append(event)


def test_completion_ttft_and_tokens_reach_post_response():
    view = PoolView.build(abi.Snapshot(version=1, endpoints=(abi.EndpointMetrics(address="a:1"),)))
    hooks = Hooks()
    s = Scheduler(lambda: view, PolicySet.of(PolicyEntry("hooks", hooks)))
    d1 = s.schedule(abi.Request(model="m", request_id="r1", seed=1))
    d2 = s.schedule(abi.Request(model="m", request_id="r2", seed=2))
    assert s.complete(decision_id=d1.decision_id, prompt_tokens=120, completion_tokens=7,
                      ttft_s=0.25)
    assert s.complete(decision_id=d2.decision_id)
    a, b = hooks.events
    assert (a.ttft_ms, a.prompt_tokens, a.completion_tokens) == (250.0, 120, 7)
    assert (b.ttft_ms, b.prompt_tokens, b.completion_tokens) == (-1.0, -1, -1)
    assert msgspec.msgpack.decode(abi.encoder.encode(a))[6:] == [250.0, 120, 7]
