"""epick.api.http_json.parse gives what json_format.Parse gives: the same message, or the
same error, for every body — the fast path only takes shapes it is sure of."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.http_json import parse

BODIES = [
    b'{"model": "m", "adapter": "a", "prompt": "p", "requestId": "r", "seed": "7"}',
    b'{"model": "m", "request_id": "r", "cache_salt": "s", "pin_endpoint": "h:1"}',
    b'{"model": "m", "seed": 18446744073709551615, "explain": true}',
    b'{"model": "m", "seed": 18446744073709551616}',
    b'{"model": "m", "seed": -1}',
    b'{"model": "m", "seed": 7.0}',
    b'{"model": "m", "seed": true}',
    b'{"model": "m", "criticality": "SHEDDABLE"}',
    b'{"model": "m", "criticality": 3}',
    b'{"model": "m", "criticality": 9}',
    b'{"model": "m", "criticality": "URGENT"}',
    b'{"model": "m", "headers": {"x-a": "1", "x-b": "2"}}',
    b'{"model": "m", "headers": {"x-a": 1}}',
    b'{"model": 5}',
    b'{"model": null}',
    b'{"model": "m", "explain": "yes"}',
    b'{"model": "m", "colour": 1}',
    b'{"model": "m", "requestId": "a", "request_id": "b"}',
    b'{"model": "caf\xc3\xa9 \\u00e9 \\ud83d\\ude00"}',
    b'{"model": "\\ud800"}',
    b'\xff\xfe{}',
    b'[]',
    b'{not json',
    b'',
]


def _reference(body: bytes, msg):
    try:
        return json_format.Parse(body, msg), None
    except (json_format.ParseError, UnicodeDecodeError) as exc:
        return None, (type(exc), str(exc))


def _fast(body: bytes, msg):
    try:
        return parse(body, msg), None
    except (json_format.ParseError, UnicodeDecodeError) as exc:
        return None, (type(exc), str(exc))


@pytest.mark.parametrize("body", BODIES)
def test_a_pick_request_parses_as_json_format_parses_it(body):
    assert _fast(body, pb.PickRequest()) == _reference(body, pb.PickRequest())


@pytest.mark.parametrize("body", [
    b'{"decisionId": "d", "status": "ERROR", "promptTokens": 3, "ttft_seconds": 0.5}',
    b'{"decision_id": "d", "completion_tokens": 4294967296}',
    b'{"decision_id": "d", "ttftSeconds": "NaN"}',
    b'{"decision_id": "d", "ttftSeconds": 1}',
])
def test_a_completion_report_parses_as_json_format_parses_it(body):
    assert _fast(body, pb.CompletionReport()) == _reference(body, pb.CompletionReport())


def test_optional_fields_keep_their_presence():
    msg = parse(b'{"model": "m", "seed": 0}', pb.PickRequest())
    assert msg.HasField("seed") and msg.seed == 0
    report = parse(b'{"decisionId": "d", "promptTokens": 0}', pb.CompletionReport())
    assert report.HasField("prompt_tokens") and not report.HasField("completion_tokens")


def test_a_flat_body_is_read_without_json_format(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("json_format.Parse was called")

    monkeypatch.setattr(json_format, "Parse", refuse)
    msg = parse(b'{"model": "m", "criticality": "CRITICAL", "headers": {"a": "b"}, '
                b'"seed": "9"}', pb.PickRequest())
    assert (msg.model, msg.criticality, dict(msg.headers), msg.seed) == ("m", pb.CRITICAL,
                                                                        {"a": "b"}, 9)
