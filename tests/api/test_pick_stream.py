"""PickStream end to end: many picks and completions on one real gRPC stream."""

from __future__ import annotations

import time

import grpc
import pytest
from fakes import vllm_page

from epick import telemetry
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc

MODEL = "m"


def pick_msg(id_: int, **kw) -> pb.PickStreamRequest:
    kw.setdefault("model", MODEL)
    return pb.PickStreamRequest(id=id_, pick=pb.PickRequest(**kw))


def stream(svc, messages, timeout=30):
    return list(svc.picker.PickStream(iter(messages), timeout=timeout))


def picks_answered() -> float:
    return sum(telemetry.REGISTRY.get_sample_value("epick_picks_total", {"outcome": o}) or 0.0
               for o in telemetry.PICK_OUTCOMES)


@pytest.fixture
def three(fake_vllm, serve):
    """A service with the load policy over queues 10, 5, 0 (the idle one wins)."""
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (10, 5, 0)]
    return serve([s.address for s in servers], policies=("load",)), servers


def test_every_message_gets_one_answer_with_its_id_in_order(three):
    svc, servers = three
    ids = [7, 3, 2**64 - 1, 0, 42]
    answers = stream(svc, [pick_msg(i, seed=1) for i in ids])
    assert [a.id for a in answers] == ids
    assert all(a.WhichOneof("kind") == "pick" for a in answers)
    assert {a.pick.endpoint for a in answers} == {servers[2].address}
    assert list(answers[0].pick.fallbacks) == [servers[1].address, servers[0].address]
    assert len({a.pick.decision_id for a in answers}) == len(ids)


def test_a_stream_pick_answers_like_the_unary_pick(fake_vllm, serve):
    # load's recent picks off: with them, the unary pick would rightly make its endpoint
    # look busier to the stream pick that follows it within milliseconds
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (10, 5, 0)]
    svc = serve([s.address for s in servers], policies=("load",),
                params={"load": {"recent_requests": 0.0}})
    unary = svc.picker.Pick(pb.PickRequest(model=MODEL, seed=5, explain=True), timeout=5)
    # completed first, so the stream pick sees the same in-flight counts (none)
    svc.picker.ReportCompletion(pb.CompletionReport(decision_id=unary.decision_id), timeout=5)
    svc.call(lambda: [svc.service.scheduler.assignments.scraped(c.endpoint)
                      for c in unary.explanation.candidates])
    (answer,) = stream(svc, [pick_msg(1, seed=5, explain=True)])
    assert answer.pick.endpoint == unary.endpoint
    assert list(answer.pick.fallbacks) == list(unary.fallbacks)
    assert [(c.endpoint, c.total, c.rank) for c in answer.pick.explanation.candidates] == [
        (c.endpoint, c.total, c.rank) for c in unary.explanation.candidates]


def test_completions_ride_the_same_stream_and_unknown_ids_are_acknowledged(three):
    svc, _ = three
    (first,) = stream(svc, [pick_msg(1, seed=1)])
    answers = stream(svc, [
        pb.PickStreamRequest(id=2, completion=pb.CompletionReport(
            decision_id=first.pick.decision_id)),
        pb.PickStreamRequest(id=3, completion=pb.CompletionReport(
            decision_id=first.pick.decision_id)),
        pick_msg(4, request_id="r-4", seed=2),
        pb.PickStreamRequest(id=5, completion=pb.CompletionReport(request_id="r-4")),
    ])
    assert [(a.id, a.WhichOneof("kind")) for a in answers] == [
        (2, "completion"), (3, "completion"), (4, "pick"), (5, "completion")]
    assert [answers[0].completion.known, answers[1].completion.known,
            answers[3].completion.known] == [True, False, True]


def test_a_bad_message_gets_its_own_error_and_the_stream_goes_on(three):
    svc, servers = three
    answers = stream(svc, [
        pick_msg(1, seed=1),
        pick_msg(2, model=""),
        pick_msg(3, adapter="a,b"),
        pb.PickStreamRequest(id=4),
        pb.PickStreamRequest(id=5, completion=pb.CompletionReport()),
        pb.PickStreamRequest(id=6, completion=pb.CompletionReport(decision_id="x", status=9)),
        pick_msg(7, seed=1),
    ])
    assert [(a.id, a.WhichOneof("kind")) for a in answers] == [
        (1, "pick"), (2, "error"), (3, "error"), (4, "error"), (5, "error"), (6, "error"),
        (7, "pick")]
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [(a.error.code, a.error.message) for a in answers[1:6]] == [
        (invalid, "PickRequest.model is required"),
        (invalid, "PickRequest.adapter 'a,b' contains a comma, which no model server allows"),
        (invalid, "PickStreamRequest 4 has neither pick nor completion"),
        (invalid, "CompletionReport needs decision_id or request_id; both are empty"),
        (invalid, "CompletionReport.status 9 is not one of OK (0), ERROR (1), CANCELLED (2)"),
    ]
    assert answers[6].pick.endpoint == servers[2].address


def test_the_stream_error_text_is_the_unary_status_details(three):
    svc, _ = three
    with pytest.raises(grpc.RpcError) as info:
        svc.picker.Pick(pb.PickRequest(model=MODEL, cache_salt="a\0b"), timeout=5)
    (answer,) = stream(svc, [pick_msg(1, cache_salt="a\0b")])
    assert (answer.error.code, answer.error.message) == (
        info.value.code().value[0], info.value.details())


def test_a_shed_pick_is_resource_exhausted_for_that_message_only(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=6)), fake_vllm(vllm_page(kv=0.9))]
    svc = serve([s.address for s in servers])
    answers = stream(svc, [pick_msg(1, criticality=pb.SHEDDABLE),
                           pick_msg(2, criticality=pb.CRITICAL)])
    assert answers[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "SHEDDABLE request shed" in answers[0].error.message
    assert answers[1].pick.endpoint in {s.address for s in servers}


def test_no_fresh_endpoint_is_unavailable_per_message(fake_vllm, serve):
    server = fake_vllm(vllm_page())
    svc = serve([server.address], policies=("load",))
    server.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the endpoint goes stale (400 ms)
        (answer,) = stream(svc, [pick_msg(1)])
        if answer.WhichOneof("kind") == "error":
            break
        time.sleep(0.05)
    assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert answer.error.message.startswith("no endpoint has fresh metrics (all stale)")
    (again,) = stream(svc, [pick_msg(2)])
    assert (again.id, again.error.message) == (2, answer.error.message)


def test_a_client_that_stops_reading_stops_being_read(three):
    """Backpressure: with the answers unread, epick stops picking well before the end."""
    svc, servers = three
    total = 20_000
    # No BDP probing: the client's receive window stays at its initial size, so unread
    # answers fill it (explained answers are ~0.4 KB each).
    channel = grpc.insecure_channel(svc.target, options=[("grpc.http2.bdp_probe", 0)])
    # (The client library buffers what the server does not read; that is its business.)
    messages = (pick_msg(i, seed=i, explain=True) for i in range(total))

    before = picks_answered()
    answers = picker_pb2_grpc.EndpointPickerStub(channel).PickStream(messages, timeout=120)
    try:
        # Wait until the server has answered some and then stops (its count holds still
        # for two seconds; a busy machine may starve it for a while).
        last, still_since = -1.0, time.monotonic()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = picks_answered() - before
            if now != last:
                last, still_since = now, time.monotonic()
            elif last > 0 and time.monotonic() - still_since > 2.0:
                break
            time.sleep(0.05)
        assert 0 < last < total / 2, f"{last:.0f} of {total} picks answered while unread"
        got = [a.id for a in answers]  # reading again lets the whole stream through
    finally:
        channel.close()
    assert got == list(range(total))
    assert picks_answered() - before == total


def test_a_stream_whose_client_is_done_sending_ends_after_every_answer(three):
    """The client sends everything and half-closes while its answers wait unread (the
    window full): the stream still ends, after all of them."""
    svc, servers = three
    from epick.api.picker import STREAM_WINDOW

    total = 20 * STREAM_WINDOW
    answers = svc.picker.PickStream(iter([pick_msg(i, seed=i) for i in range(total)]),
                                    timeout=60)
    time.sleep(1.0)  # the server fills its window and waits for the writer
    assert [a.id for a in answers] == list(range(total))


def test_a_client_leaving_mid_stream_is_no_error_and_the_service_keeps_serving(
        three, caplog):
    svc, servers = three

    def endless():
        i = 0
        while True:
            yield pick_msg(i, seed=i)
            i += 1

    answers = svc.picker.PickStream(endless(), timeout=30)
    assert [next(answers).id for _ in range(5)] == [0, 1, 2, 3, 4]
    answers.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(answers)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    (again,) = stream(svc, [pick_msg(9, seed=1)])
    # Which endpoint is not the point: the endless stream's picks before the cancel are
    # in flight on the idle one, and how many the server read before it saw the cancel
    # depends on how busy the machine is (a clean-clone CI run read enough to tip it).
    assert again.WhichOneof("kind") == "pick"
    assert again.pick.endpoint in {s.address for s in servers}
    assert [r.getMessage() for r in caplog.records
            if r.levelname in ("ERROR", "CRITICAL")] == []
