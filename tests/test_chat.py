import pytest

from epick.chat import serialize_messages


def test_serialization_is_the_documented_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert serialize_messages(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n"


def test_a_conversation_is_a_prefix_of_its_continuation():
    base = [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "q1"}]
    longer = base + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert serialize_messages(longer).startswith(serialize_messages(base))


def test_list_content_parts_join_text_and_name_other_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert serialize_messages(msgs) == "<|user|>\nlook\n[image_url]\n"


def test_a_message_without_role_is_rejected_with_its_index():
    with pytest.raises(ValueError, match=r"messages\[1\] must be an object with a 'role'"):
        serialize_messages([{"role": "user", "content": ""}, {"content": "x"}])
