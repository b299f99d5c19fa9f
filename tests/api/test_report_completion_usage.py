"""ReportCompletion's tokens and TTFT reach the service's completion metrics."""

from __future__ import annotations

from epick_service import make_config, running
from fakes import vllm_page

from epick import telemetry
from epick.api.gen.epick.v1 import picker_pb2 as pb

MODEL = "m"


def value(metric, *labels) -> float:
    child = metric.labels(*labels) if labels else metric
    return child._value.get()  # noqa: SLF001


def ttft_count() -> float:
    return next(s.value for m in telemetry.TTFT.collect() for s in m.samples
                if s.name == "epick_ttft_seconds_count")


def test_reported_tokens_and_ttft_are_counted_once_per_known_decision(fake_vllm, tmp_path):
    server = fake_vllm(vllm_page())
    with running(make_config([server.address], policies=("load",), tmp=tmp_path)) as svc:
        d = svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=5)
        before = (value(telemetry.COMPLETION_TOKENS, "prompt"),
                  value(telemetry.COMPLETION_TOKENS, "completion"),
                  value(telemetry.COMPLETIONS, "cancelled"), ttft_count())
        report = pb.CompletionReport(decision_id=d.decision_id, endpoint=d.endpoint,
                                     status=pb.CANCELLED, prompt_tokens=120,
                                     completion_tokens=7, ttft_seconds=0.25)
        assert svc.picker.ReportCompletion(report, timeout=5).known
        assert not svc.picker.ReportCompletion(report, timeout=5).known  # a retry: ignored
        after = (value(telemetry.COMPLETION_TOKENS, "prompt"),
                 value(telemetry.COMPLETION_TOKENS, "completion"),
                 value(telemetry.COMPLETIONS, "cancelled"), ttft_count())
    assert [a - b for a, b in zip(after, before)] == [120, 7, 1, 1]
