"""Usage and TTFT read from OpenAI answers as they stream past (epick.api.usage)."""

from __future__ import annotations

import json

from epick.api.usage import UsageReader


def read(ctype: str, chunks: list[bytes], *, limit: int = 1 << 20) -> UsageReader:
    r = UsageReader(ctype, started=10.0, limit=limit)
    for i, c in enumerate(chunks):
        r.feed(c, now=10.5 + i)
    r.finish()
    return r


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
                    for e in events)


def test_sse_usage_from_the_last_event_and_ttft_from_the_first_chunk():
    raw = sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": 4}}, "[DONE]")
    cuts = [raw[:7], raw[7:40], raw[40:41], raw[41:]]  # events split anywhere
    r = read("text/event-stream; charset=utf-8", cuts)
    assert (r.prompt_tokens, r.completion_tokens, r.ttft_s) == (9, 4, 0.5)


def test_continuous_usage_keeps_the_last_one_and_null_usage_is_ignored():
    raw = sse({"usage": {"prompt_tokens": 9, "completion_tokens": 1}},
              {"usage": {"prompt_tokens": 9, "completion_tokens": 2}}, {"usage": None})
    r = read("text/event-stream", [raw])
    assert (r.prompt_tokens, r.completion_tokens) == (9, 2)


def test_an_unterminated_last_event_is_read_at_the_end():
    r = read("text/event-stream", [b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 2}}'])
    assert (r.prompt_tokens, r.completion_tokens) == (1, 2)


def test_json_usage_is_read_at_the_end_and_has_no_ttft():
    raw = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 5}}).encode()
    r = read("application/json", [raw[:5], raw[5:]])
    assert (r.prompt_tokens, r.completion_tokens, r.ttft_s) == (3, 5, None)


def test_what_cannot_be_read_yields_nothing_and_never_raises():
    too_big = read("application/json", [b'{"usage": {"prompt_tokens": 1}, "x": "' + b"y" * 100 +
                                         b'"}'], limit=50)
    broken = read("application/json", [b'{"usage": '])
    bad_values = read("application/json", [b'{"usage": {"prompt_tokens": -1, '
                                           b'"completion_tokens": true}}'])
    html = read("text/html", [b"<html>usage</html>"])
    bad_sse = read("text/event-stream", [b'data: {"usage": nope}\n\n'])
    for r in (too_big, broken, bad_values, html, bad_sse):
        assert (r.prompt_tokens, r.completion_tokens) == (None, None)


def test_usage_is_found_wherever_the_chunks_are_cut():
    """Whole events per chunk take the no-copy path; any other cut goes through the held
    tail. Every cut of the same answer gives the same usage."""
    answer = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[{"text":"b"}],"usage":null}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
              b"data: [DONE]\n\n")
    for cut in range(1, len(answer)):
        for second in (cut, min(len(answer), cut + 13), len(answer)):
            reader = UsageReader("text/event-stream", 0.0)
            for part in (answer[:cut], answer[cut:second], answer[second:]):
                reader.feed(part, 1.0)
            reader.finish()
            assert (reader.prompt_tokens, reader.completion_tokens) == (7, 2), (cut, second)


def test_tokens_from_a_native_workers_raw_usage_follow_the_readers_rules():
    from epick.api.usage import tokens_from

    good = b' {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}'
    later = b'{"usage":{"prompt_tokens":7,"completion_tokens":3}}'
    # The last good event wins; a malformed one or one without counts changes nothing.
    assert tokens_from("sse", [good, later, b' {"usage": nope', b' {"usage":{}}']) == (7, 3)
    assert tokens_from("sse", []) == (None, None)
    assert tokens_from("sse", [b'{"usage":{"prompt_tokens":true,"completion_tokens":-1}}']) \
        == (None, None)
    body = b'{"id":"x","usage":{"prompt_tokens":11,"completion_tokens":4}}'
    assert tokens_from("json", [body]) == (11, 4)
    assert tokens_from("json", [b"{not json"]) == (None, None)
