"""The streamed body chunk ext_proc writes back by hand is the message protobuf writes."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from epick.api.ext_proc import _serialize, _streamed, _streamed_message


@pytest.mark.parametrize("kind", ["request", "response"])
@pytest.mark.parametrize("size", [0, 1, 100, 127, 128, 300, 16_383, 16_384, 62_000, 3 << 20])
@pytest.mark.parametrize("eos", [False, True])
def test_the_hand_encoded_chunk_is_protobufs_own(kind, size, eos):
    chunk = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    message = _streamed_message(kind, chunk, eos)
    encoded = _streamed(kind, chunk, eos)
    assert encoded == message.SerializeToString()
    assert ep.ProcessingResponse.FromString(encoded) == message
    assert _serialize(encoded) is encoded
    assert _serialize(message) == encoded
