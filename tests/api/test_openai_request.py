"""The one OpenAI -> PickRequest translation both gateways use (epick.api.openai_request)."""

from __future__ import annotations

import json

import pytest

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.openai_request import InvalidArgument, translate

BASE = "base"


def tr(body, *, path="/v1/completions", headers=None, **kw):
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return translate(headers or {}, path, raw, base_model=BASE, **kw)


def test_a_base_model_completion_and_an_adapter_chat_request():
    base = tr({"model": BASE, "prompt": ["a", "b"], "cache_salt": "s"})
    assert (base.pick.model, base.pick.adapter, base.pick.prompt, base.pick.cache_salt) == (
        BASE, "", "ab", "s")
    assert not base.rewritten and not base.stream
    chat = tr({"model": "sql", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
              path="/v1/chat/completions")
    assert (chat.pick.adapter, chat.pick.prompt, chat.stream) == ("sql", "<|user|>\nhi\n", True)


def test_a_body_less_request_is_a_base_model_request():
    out = tr(None, headers={"x-request-id": "r1"})
    assert (out.pick.model, out.pick.adapter, out.pick.prompt, out.pick.request_id) == (
        BASE, "", "", "r1")


@pytest.mark.parametrize(("body", "message"), [
    (b"{nope", "the body is not valid JSON: Expecting property name enclosed in double "
               "quotes: line 1 column 2 (char 1)"),
    (b"[1]", "the body must be a JSON object"),
    ({"prompt": "x"}, "body.model must be a non-empty string"),
    ({"model": BASE, "prompt": [1, 2]}, "body.prompt must be a string or a list of strings"),
    ({"model": BASE, "cache_salt": 3}, "body.cache_salt must be a string"),
], ids=["not-json", "not-object", "no-model", "token-ids", "salt"])
def test_malformed_bodies_name_what_is_wrong(body, message):
    with pytest.raises(InvalidArgument) as info:
        tr(body)
    assert str(info.value) == message


def test_criticality_comes_from_x_criticality_then_the_objective_table():
    objectives = {"batch": "sheddable", "live": "critical"}

    def crit(**headers):
        return tr({"model": BASE}, headers=headers, objectives=objectives).pick.criticality

    assert crit() == pb.STANDARD
    assert crit(**{"x-llm-d-inference-objective": "batch"}) == pb.SHEDDABLE
    assert crit(**{"x-gateway-inference-objective": "live"}) == pb.CRITICAL
    assert crit(**{"x-llm-d-inference-objective": "unknown"}) == pb.STANDARD
    assert crit(**{"x-llm-d-inference-objective": "batch", "x-criticality": "Critical"}) == (
        pb.CRITICAL)
    with pytest.raises(InvalidArgument, match="x-criticality 'urgent' is not critical"):
        crit(**{"x-criticality": "urgent"})


def test_a_model_rewrite_changes_the_body_and_the_pick():
    table = tr({"model": "friendly", "prompt": "hi"}, rewrites={"friendly": "sql"})
    assert table.rewritten and json.loads(table.body) == {"model": "sql", "prompt": "hi"}
    assert table.pick.adapter == "sql"
    header = tr({"model": "friendly"}, rewrites={"friendly": "sql"},
                headers={"x-llm-d-model-name-rewrite": BASE})
    assert header.pick.adapter == "" and json.loads(header.body) == {"model": BASE}
    same = tr({"model": "x"}, rewrites={"y": "z"})
    assert not same.rewritten and same.body == b'{"model": "x"}'


def test_own_headers_never_reach_policies_and_the_pin_header_becomes_the_field():
    out = tr({"model": BASE}, headers={":path": "/v1/completions", "x-tenant": "a",
                                       "x-gateway-destination-endpoint": "1.2.3.4:5",
                                       "x-epick-pin-endpoint": " 10.0.0.1:80 "})
    assert dict(out.pick.headers) == {"x-tenant": "a"}
    assert out.pick.pin_endpoint == "10.0.0.1:80"
