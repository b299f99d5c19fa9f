"""Unary Pick answers with bytes built without a message (epick.api.picker.response_bytes):
they must be exactly what the PickResponse message would serialize to."""

from __future__ import annotations

import random

import pytest

from epick.api import picker
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.picker import response_bytes, to_response
from epick.scheduler.scheduler import Decision


def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.2:
        return ""
    if kind < 0.4:  # long: a length that needs two or three varint bytes
        return "h" * rng.choice([127, 128, 300, 16384, 20000])
    if kind < 0.5:
        return "ü-ß-" + "é" * rng.randrange(200)  # UTF-8 bytes, not characters, count
    return f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}:8000"


def test_the_bytes_are_the_messages_serialization_for_every_shape_of_decision():
    rng = random.Random(7)
    for _ in range(3000):
        d = Decision(decision_id=_text(rng), endpoint=_text(rng),
                     fallbacks=[_text(rng) for _ in range(rng.randrange(4))],
                     snapshot_version=rng.randrange(10), explanation=None, skipped=[])
        assert response_bytes(d) == to_response(d).SerializeToString(), d
        assert pb.PickResponse.FromString(response_bytes(d)) == to_response(d)


def test_the_field_caches_stay_bounded(monkeypatch):
    monkeypatch.setattr(picker, "_MAX_FIELDS", 8)
    picker._ENDPOINT_FIELD.clear()
    for k in range(50):
        d = Decision("id", f"10.0.0.{k}:8000", [f"10.0.1.{k}:8000"], 1, None, [])
        assert response_bytes(d) == to_response(d).SerializeToString()
        assert len(picker._ENDPOINT_FIELD) <= 8 and len(picker._FALLBACK_FIELD) <= 8


def test_picks_serializer_takes_the_bytes_or_a_message():
    d = Decision("b00-1", "10.0.0.1:8000", ["10.0.0.2:8000"], 3, None, [])
    msg = to_response(d)
    assert picker._serialize_pick(response_bytes(d)) == msg.SerializeToString()
    assert picker._serialize_pick(msg) == msg.SerializeToString()


class _Server:
    def __init__(self) -> None:
        self.generic, self.registered = [], {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic += handlers

    def add_registered_method_handlers(self, name, handlers) -> None:
        self.registered[name] = handlers


@pytest.mark.parametrize("method", ["Pick", "ReportCompletion", "PickStream", "WatchWeights"])
def test_add_to_server_registers_every_method_as_generated_but_picks_serializer(method):
    from epick.api.gen.epick.v1 import picker_pb2_grpc

    class Servicer(picker_pb2_grpc.EndpointPickerServicer):
        pass

    servicer = Servicer()
    ours, generated = _Server(), _Server()
    picker.add_to_server(servicer, ours)
    picker_pb2_grpc.add_EndpointPickerServicer_to_server(servicer, generated)
    assert list(ours.registered) == list(generated.registered) == ["epick.v1.EndpointPicker"]
    mine = ours.registered["epick.v1.EndpointPicker"][method]
    theirs = generated.registered["epick.v1.EndpointPicker"][method]
    assert mine.request_deserializer == theirs.request_deserializer
    if method == "Pick":
        assert mine.response_serializer is picker._serialize_pick
        assert mine._replace(response_serializer=None) == theirs._replace(
            response_serializer=None)
    else:
        assert mine == theirs
    assert len(ours.generic) == len(generated.generic) == 1
