"""The frames between front-end workers and the hub: cut anywhere, read whole."""

from __future__ import annotations

import pytest

from epick.frontend import wire


def _messages():
    return [wire.Hello(1, 4242),
            wire.Pick(7, b"\x0a\x04base" + bytes(range(256)) * 40, ["10.0.0.1:8000"], 0.00012,
                      True),
            wire.Refused("invalid", 0.5),
            wire.Complete("d-1", "10.0.0.1:8000", 2, None, 17, 0.25),
            wire.Report(8, b"\x0a\x03d-1")]


def test_frames_cut_at_every_byte_decode_to_the_same_messages():
    stream = b"".join(wire.frame(m) for m in _messages())
    for step in (1, 3, 7, 64, 4096, len(stream)):
        frames = wire.Frames(wire.ToHub)
        got = []
        for i in range(0, len(stream), step):
            got += frames.feed(stream[i:i + step])
        assert got == _messages(), step


def test_answers_keep_their_defaults_and_the_hub_side_kinds():
    frames = wire.Frames(wire.ToWorker)
    sent = [wire.Answer(1, "unavailable", "no endpoint"), wire.Health(True), wire.Ack(8, True),
            wire.Answer(2, "ok", "", "10.0.0.1:8000", ["10.0.0.2:8000"], "d-2", b"\x0a\x01x")]
    assert frames.feed(b"".join(wire.frame(m) for m in sent)) == sent
    assert sent[0].fallbacks == [] and sent[0].response == b""


def test_a_frame_over_the_limit_is_refused_before_it_is_read():
    frames = wire.Frames(wire.ToHub)
    with pytest.raises(ValueError, match="over the"):
        frames.feed((wire.MAX_FRAME + 1).to_bytes(4, "little") + b"\x00")


def test_an_answer_from_before_the_trace_fields_still_decodes():
    """The trace context was appended to Answer: a frame without it reads as untraced."""
    old = wire.frame(wire.Answer(3, "ok", "", "10.0.0.1:8000", [], "d-3", b""))
    # Re-encode as the shorter layout an older hub sent (7 positions, no trace).
    import msgspec

    short = msgspec.msgpack.encode([4, 3, "ok", "", "10.0.0.1:8000", [], "d-3", b""])
    frames = wire.Frames(wire.ToWorker)
    (got,) = frames.feed(len(short).to_bytes(4, "little") + short)
    assert got == frames.feed(old)[0] == wire.Answer(3, "ok", "", "10.0.0.1:8000", [], "d-3")
    assert got.traceparent == "" and got.tracestate == ""
    traced = wire.Answer(4, "ok", "", "e", [], "d-4", b"", "00-" + "1" * 32 + "-" + "2" * 16
                         + "-01", "v=1")
    assert frames.feed(wire.frame(traced)) == [traced]


def test_tables_frames_round_trip():
    ask = wire.Tables(9, [("m", "", 2), ("m", "a", 1)])
    (got,) = wire.Frames(wire.ToHub).feed(wire.frame(ask))
    assert got == ask
    no = wire.TablesAnswer(9, [], "invalid", "bad name")
    assert wire.Frames(wire.ToWorker).feed(wire.frame(no)) == [no]


def test_the_native_workers_frames_round_trip():
    """PickHttp (a native worker's request) and Routed (the hub's answer), and Complete
    with the raw usage a native worker sends."""
    ask = wire.PickHttp(5, {":path": "/v1/completions", "x-a": "é"}, b'{"model":"m"}',
                        [b"\x0a\x00"], 2, True, 0.001)
    trouble = wire.PickHttp(6, {}, b"", [], 0, False, 0.0, "too_large")
    done = wire.Complete("d-5", "10.0.0.1:8000", 0, None, None, 0.05, "sse",
                         [b' {"usage":{"prompt_tokens":3}}'])
    assert wire.Frames(wire.ToHub).feed(b"".join(
        wire.frame(m) for m in (ask, trouble, done))) == [ask, trouble, done]
    assert ask.problem == ""
    routed = wire.Routed(5, [b"\x0a\x00", b"\x2a\x00"], 1, False, "d-5", "10.0.0.1:8000")
    refused = wire.Routed(6, [b"\x3a\x00"], -1, True)
    got = wire.Frames(wire.ToWorker).feed(wire.frame(routed) + wire.frame(refused))
    assert got == [routed, refused] and got[1].decision_id == ""


def test_a_complete_without_the_usage_fields_still_decodes():
    """The Python worker's Complete (six positions) reads with no raw usage."""
    import msgspec

    short = msgspec.msgpack.encode([3, "d-1", "e", 1, 4, 5, None])
    (got,) = wire.Frames(wire.ToHub).feed(len(short).to_bytes(4, "little") + short)
    assert got == wire.Complete("d-1", "e", 1, 4, 5, None)
    assert got.usage_kind == "" and got.usage == []
