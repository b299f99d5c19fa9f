"""The sampling decision epick takes before asking the SDK for a span: the same verdict
the SDK's own samplers give (ParentBased, TraceIdRatioBased), and the same headers its
W3C propagator accepts."""

from __future__ import annotations

import os
import random

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, TraceIdRatioBased
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epick.api.decide import Decider
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.scheduler.scheduler import Decision as PickDecision
from epick.tracing import PickTracer, parent_of

PROPAGATOR = TraceContextTextMapPropagator()


def tracer(**kw) -> PickTracer:
    return PickTracer(exporter=InMemorySpanExporter(), **kw)


def headers(rng: random.Random, n: int) -> list[str]:
    return [f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-0{rng.randrange(2)}"
            for _ in range(n)]


@pytest.mark.parametrize("header", [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # 00 has no tail
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    " \t00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 ",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
    "garbage", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" + " " * 600,
])
def test_a_header_is_valid_exactly_when_the_sdks_propagator_takes_it(header):
    span = get_current_span(PROPAGATOR.extract({"traceparent": header}, Context()))
    ctx = span.get_span_context()
    parent = parent_of(header)
    if not ctx.is_valid:
        assert parent is None
    else:
        assert parent == (ctx.trace_id, ctx.trace_flags.sampled)


@pytest.mark.parametrize("ratio", [0.0, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("parent_based", [True, False])
def test_the_verdict_is_the_sdk_samplers_on_the_same_trace(ratio, parent_based):
    sdk = TraceIdRatioBased(ratio)
    if parent_based:
        sdk = ParentBased(sdk)
    ours = tracer(sample_ratio=ratio, parent_based=parent_based)
    for header in headers(random.Random(7), 2000):
        parent = PROPAGATOR.extract({"traceparent": header}, Context())
        trace_id = get_current_span(parent).get_span_context().trace_id
        expected = sdk.should_sample(parent, trace_id, "x").decision == Decision.RECORD_AND_SAMPLE
        assert ours.sampled(header) == expected, header


def test_a_pick_without_a_caller_is_sampled_at_the_ratio():
    random.seed(1)
    ours = tracer(sample_ratio=0.1)
    assert 850 <= sum(ours.sampled(None) for _ in range(10_000)) <= 1150
    assert not any(tracer(sample_ratio=0.0).sampled(None) for _ in range(1000))


class _Scheduler:
    def __init__(self) -> None:
        self.explain: list[bool] = []

    def schedule(self, request, *, explain=False, **kw):
        self.explain.append(explain)
        return PickDecision(decision_id="d", endpoint="a:1", fallbacks=[], snapshot_version=1)


def test_an_unsampled_pick_makes_no_span_and_asks_for_no_explanation():
    exporter = InMemorySpanExporter()
    sched = _Scheduler()
    d = Decider(sched, tracer=PickTracer(exporter=exporter, sample_ratio=0.0,
                                        schedule_delay_ms=1))
    traceparent = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-00"
    verdict = d.decide(pb.PickRequest(model="m", headers={"traceparent": traceparent}))
    assert verdict.outcome == "ok" and verdict.trace is None
    assert sched.explain == [False]
    d.tracer.force_flush()
    assert exporter.get_finished_spans() == ()


def test_tracing_off_never_reads_the_carrier():
    class Untouchable:
        def invocation_metadata(self):
            raise AssertionError("read with tracing off")

    sched = _Scheduler()
    verdict = Decider(sched).decide(pb.PickRequest(model="m"), carrier=Untouchable())
    assert verdict.outcome == "ok" and verdict.trace is None
