"""The one pick path (epick.api.decide.Decider) on its own: a stand-in scheduler that
records how it was called and raises what it is told, and a telemetry that records."""

from __future__ import annotations

import logging

import grpc
import pytest

from epick.api.decide import REFUSALS, Decider, outcome_of, outcome_of_code
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.picker import PickerService, status_for
from epick.api.validate import InvalidArgument
from epick.scheduler.scheduler import Decision, SchedulingError, Shed, Unavailable
from epick.telemetry import PICK_OUTCOMES


class Scheduler:
    def __init__(self, raises: Exception | None = None) -> None:
        self.raises = raises
        self.calls: list[dict] = []

    def schedule(self, request, **kw):
        self.calls.append({"model": request.model, **kw})
        if self.raises is not None:
            raise self.raises
        return Decision(decision_id="d1", endpoint="10.0.0.1:8000", fallbacks=["10.0.0.2:8000"],
                        snapshot_version=3)


class Telemetry:
    def __init__(self) -> None:
        self.picks: list[tuple[str, float]] = []

    def pick_done(self, outcome: str, seconds: float) -> None:
        self.picks.append((outcome, seconds))


def decider(raises=None, *, allow_pinning=True):
    sched, tel = Scheduler(raises), Telemetry()
    return Decider(sched, tel, allow_pinning=allow_pinning), sched, tel


def test_an_ok_pick_is_the_decision_labelled_ok_and_recorded_once():
    d, sched, tel = decider()
    verdict = d.decide(pb.PickRequest(model="m"))
    assert verdict.decision.endpoint == "10.0.0.1:8000"
    assert (verdict.outcome, verdict.message) == ("ok", "")
    assert [o for o, _ in tel.picks] == ["ok"]
    # The common case passes no keyword it would ignore (no pin, no subset).
    assert sched.calls == [{"model": "m", "explain": False}]


def test_a_pin_wins_over_a_subset_and_a_subset_alone_is_passed_on():
    d, sched, _ = decider()
    d.decide(pb.PickRequest(model="m", pin_endpoint="10.0.0.9:80", explain=True),
             subset=["10.0.0.1:8000"])
    d.decide(pb.PickRequest(model="m"), subset=["10.0.0.1:8000"])
    assert sched.calls == [
        {"model": "m", "explain": True, "pin": "10.0.0.9:80"},
        {"model": "m", "explain": False, "subset": ["10.0.0.1:8000"]},
    ]


@pytest.mark.parametrize(("raises", "outcome", "message"), [
    (Shed("every endpoint is over the admission thresholds"), "shed",
     "every endpoint is over the admission thresholds"),
    (Unavailable("no endpoint has fresh metrics"), "unavailable",
     "no endpoint has fresh metrics"),
    (SchedulingError("nothing to pick"), "error", "nothing to pick"),
    (RuntimeError("policy set exploded"), "error",
     "internal error: RuntimeError('policy set exploded')"),
])
def test_a_scheduling_failure_is_one_verdict_with_its_outcome(raises, outcome, message):
    d, _, tel = decider(raises)
    verdict = d.decide(pb.PickRequest(model="m"))
    assert (verdict.decision, verdict.outcome, verdict.message) == (None, outcome, message)
    assert [o for o, _ in tel.picks] == [outcome]


def test_an_invalid_request_is_refused_before_scheduling_and_counted():
    d, sched, tel = decider(allow_pinning=False)
    verdict = d.decide(pb.PickRequest(model="m", pin_endpoint="10.0.0.9:80"))
    assert verdict.outcome == "invalid"
    assert "pinning is off on this server" in verdict.message
    verdict = d.decide(pb.PickRequest(model=""))
    assert (verdict.outcome, verdict.message) == ("invalid", "PickRequest.model is required")
    assert sched.calls == []
    assert [o for o, _ in tel.picks] == ["invalid", "invalid"]


def test_a_bug_is_logged_with_its_traceback_and_a_refusal_is_not(caplog):
    caplog.set_level(logging.INFO, logger="epick.api")
    decider(Shed("busy"))[0].decide(pb.PickRequest(model="m"))
    assert caplog.records == []
    decider(RuntimeError("boom"))[0].decide(pb.PickRequest(model="m"))
    [record] = caplog.records
    assert record.levelno == logging.ERROR and "pick failed" in record.getMessage()
    assert record.exc_info[0] is RuntimeError


def test_the_recorded_time_starts_when_the_front_end_says():
    d, _, tel = decider()
    d.decide(pb.PickRequest(model="m"), started=0.0)  # perf_counter's epoch: long ago
    d.refuse(InvalidArgument("body is not JSON"), started=0.0)
    assert all(seconds > 1.0 for _, seconds in tel.picks)
    assert [o for o, _ in tel.picks] == ["ok", "invalid"]


def test_a_front_ends_own_parse_error_is_counted_like_any_invalid_pick():
    d, sched, tel = decider()
    verdict = d.refuse(InvalidArgument("the body is not valid JSON"), started=0.0)
    assert (verdict.decision, verdict.outcome, verdict.message) == (
        None, "invalid", "the body is not valid JSON")
    assert sched.calls == [] and [o for o, _ in tel.picks] == ["invalid"]


def test_without_telemetry_nothing_is_recorded_and_nothing_breaks():
    verdict = Decider(Scheduler(Shed("busy"))).decide(pb.PickRequest(model="m"))
    assert verdict.outcome == "shed"


def test_every_refusal_outcome_has_one_row_and_the_codes_map_back():
    assert set(REFUSALS) == set(PICK_OUTCOMES) - {"ok"}
    for outcome, row in REFUSALS.items():
        # Flow control's refusals share shed's code: a gRPC client reads them as shed
        # (their own reason travels in x-llm-d-request-dropped-reason).
        expected = "shed" if outcome in ("queue_full", "queue_expired") else outcome
        assert outcome_of_code(row.grpc) == expected
    for outcome, row in REFUSALS.items():  # with the dropped reason, each row maps back
        assert outcome_of_code(row.grpc, row.reason) == outcome
    assert len({r.reason for r in REFUSALS.values() if r.reason}) == len(
        [r for r in REFUSALS.values() if r.reason])  # every reason says one thing
    # A code epick never answers with: the call did not reach it.
    assert outcome_of_code(grpc.StatusCode.DEADLINE_EXCEEDED) == "unavailable"
    assert outcome_of(InvalidArgument("x")) == "invalid"
    assert outcome_of(ValueError("x")) == "error"
    assert status_for(Shed("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(Unavailable("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_for(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(RuntimeError("x")) == grpc.StatusCode.INTERNAL


def test_the_grpc_answer_is_the_verdict_said_through_the_table():
    svc = PickerService(Scheduler(Unavailable("no endpoint has fresh metrics")), Telemetry())
    assert svc.answer_pick(pb.PickRequest(model="m")) == (
        None, (grpc.StatusCode.UNAVAILABLE, "no endpoint has fresh metrics"))
    svc = PickerService(Scheduler(), Telemetry())
    response, error = svc.answer_pick(pb.PickRequest(model="m"))
    assert error is None
    assert (response.endpoint, list(response.fallbacks), response.decision_id) == (
        "10.0.0.1:8000", ["10.0.0.2:8000"], "d1")
    assert svc.telemetry.picks[0][0] == "ok"
