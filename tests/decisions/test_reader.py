"""Reading logs back: a torn tail is survivable, anything else names the file and byte."""

from __future__ import annotations

import pytest

from epick.decisions import LogError, read_file, replay, schema
from epick.decisions.writer import _FRAME


def frame(rec) -> bytes:
    blob = schema.encoder.encode(rec)
    return _FRAME.pack(len(blob)) + blob


def test_a_torn_last_record_is_ignored_and_the_rest_is_read(tmp_path):
    p = tmp_path / "d.log"
    whole = frame(schema.Header(boot="b")) + frame(schema.Gap(lost=3))
    p.write_bytes(schema.MAGIC + whole + frame(schema.Gap(lost=4))[:-2])
    assert list(read_file(p)) == [schema.Header(boot="b"), schema.Gap(lost=3)]
    with pytest.raises(LogError, match="truncated record"):
        list(read_file(p, partial_tail=False))


def test_a_file_that_is_not_a_log_is_refused_with_its_name(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_bytes(b"hello world")
    with pytest.raises(LogError) as info:
        list(read_file(p))
    assert str(info.value) == (f"{p}: at byte 0: not an epick decision log (starts with "
                               "b'hello wo', expected b'EPICKDL1')")


def test_a_corrupt_record_names_its_byte_offset(tmp_path):
    p = tmp_path / "d.log"
    good = frame(schema.Header(boot="b"))
    p.write_bytes(schema.MAGIC + good + _FRAME.pack(3) + b"\xc1\xc1\xc1")
    with pytest.raises(LogError, match=rf"at byte {8 + len(good)}: not msgpack"):
        list(read_file(p))


def test_a_log_must_start_with_its_header(tmp_path):
    p = tmp_path / "d.log"
    p.write_bytes(schema.MAGIC + frame(schema.Gap(lost=1)))
    with pytest.raises(LogError, match="at byte 8: the first record is Gap, expected a header"):
        list(read_file(p))


def test_a_later_schema_is_refused_not_misread(tmp_path):
    p = tmp_path / "d.log"
    p.write_bytes(schema.MAGIC + frame(schema.Header(schema=2)))
    with pytest.raises(LogError, match="schema 2; this epick reads schema 1"):
        list(read_file(p))


def test_replaying_a_missing_log_says_so(tmp_path):
    with pytest.raises(LogError, match="no such decision log"):
        replay([tmp_path / "nothing.log"])


def test_chunks_are_one_stream_or_whole_streams_each(tmp_path):
    import zlib

    frames = [frame(schema.Header(boot="b")), frame(schema.Gap(lost=1)),
              frame(schema.Gap(lost=2))]

    def chunk(data: bytes) -> bytes:
        return _FRAME.pack(len(data) | schema.CHUNK_FLAG) + data

    z = zlib.compressobj(3)
    one_stream = b"".join(chunk(z.compress(f) + z.flush(zlib.Z_SYNC_FLUSH)) for f in frames)
    whole_each = b"".join(chunk(zlib.compress(f)) for f in frames)
    for name, body in (("stream", one_stream), ("whole", whole_each)):
        p = tmp_path / name
        p.write_bytes(schema.MAGIC + body)
        assert [getattr(r, "lost", None) for r in read_file(p)] == [None, 1, 2], name


def test_a_corrupt_chunk_names_its_offset(tmp_path):
    p = tmp_path / "d.log"
    good = frame(schema.Header(boot="b"))
    p.write_bytes(schema.MAGIC + good + _FRAME.pack(4 | schema.CHUNK_FLAG) + b"nope")
    with pytest.raises(LogError, match=rf"at byte {8 + len(good)}: corrupt chunk"):
        list(read_file(p))
