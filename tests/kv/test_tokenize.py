"""epick.kv.tokenize: the simulator's bytes contract, the chat round trip, clear errors."""

import json
import pathlib

import pytest

from epick.chat import serialize_messages
from epick.kv.tokenize import (
    BytesTokenizer,
    HfTokenizer,
    TokenizerError,
    load_tokenizer,
    parse_serialized_messages,
)

FIX = pathlib.Path(__file__).parent / "fixtures"


def test_bytes_contract():
    t = BytesTokenizer()
    assert t.encode_prompt("") == []
    assert t.encode_prompt("abcd") == [int.from_bytes(b"abcd", "little")]
    assert t.encode_prompt("abcdé") == [int.from_bytes(b"abcd", "little"),
                                        int.from_bytes("é".encode() + b"\0\0", "little")]
    msgs = [{"role": "user", "content": "hi"}]
    assert t.encode_pick(serialize_messages(msgs)) == t.encode_prompt("<|user|>\nhi\n")
    assert t.encode_chat(msgs) == t.encode_pick(serialize_messages(msgs))


@pytest.mark.parametrize("msgs", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "a\nb\n"}, {"role": "user", "content": ""},
     {"role": "assistant", "content": "x <|y|> z"}],
])
def test_serialized_messages_round_trip(msgs):
    assert parse_serialized_messages(serialize_messages(msgs)) == msgs


@pytest.mark.parametrize("prompt", ["", "hello", "<|user|>\nno final newline", "x<|user|>\nhi\n",
                                    "<|us|er|>\nhi\n"])
def test_plain_prompts_are_not_chat(prompt):
    assert parse_serialized_messages(prompt) is None


def test_hf_completion_adds_bos_chat_uses_template():
    t = HfTokenizer(FIX / "tiny-llama")
    assert t.has_chat_template
    assert t.encode_prompt("hello")[0] == 0  # <s>
    chat = t.encode_chat([{"role": "user", "content": "hello"}])
    assert chat[0] == 0 and chat.count(0) == 1  # the template's BOS, no second one
    assert t.encode_pick("hello") == t.encode_prompt("hello")


def test_errors_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: no such file"):
        HfTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{nope")
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        HfTokenizer(tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    (good / "tokenizer.json").write_bytes((FIX / "tiny-llama" / "tokenizer.json").read_bytes())
    (good / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        HfTokenizer(good)
    (good / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(TokenizerError, match="no chat template"):
        HfTokenizer(good).encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer("missing", tmp_path)
    assert isinstance(load_tokenizer("bytes"), BytesTokenizer)
    assert isinstance(load_tokenizer("tiny-llama", FIX), HfTokenizer)
