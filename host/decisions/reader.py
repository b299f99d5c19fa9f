"""Read decision log files back as typed records (schema: :mod:`epick.decisions.schema`)."""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from epick.decisions import schema
from epick.decisions.writer import segments

__all__ = ["LogError", "read", "read_file", "log_files"]

log = logging.getLogger("epick.decisions")

_FRAME = struct.Struct("<I")
#: A frame longer than this is corruption, not a record (prompts are capped at 4 MiB).
MAX_RECORD_BYTES = 64 << 20


class LogError(ValueError):
    """A decision log cannot be read; the message names the file and the byte offset."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"{path}: at byte {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


def log_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand each path: a log's active file also brings its rotated files, oldest first.

    A path naming one rotated file (``LOG.<ms>``) is just that file.
    """
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        found = segments(p)
        if p.exists() and p not in found:
            found = [p]
        if not found:
            raise LogError(p, 0, "no such decision log (nor rotated files of it)")
        out += [f for f in found if f not in out]
    return out


def read_file(path: Path, *, partial_tail: bool = True) -> Iterator[schema.Record]:
    """The records of one file, in order.

    A truncated last frame (the writer was killed, or the disk filled mid-write) ends the
    file with a warning when ``partial_tail``; anything else malformed is a
    :class:`LogError`.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LogError(path, 0, f"cannot read: {exc.strerror}") from None
    if not data.startswith(schema.MAGIC):
        raise LogError(path, 0, f"not an epick decision log (starts with {data[:8]!r}, "
                       f"expected {schema.MAGIC!r})")
    first = True
    for offset, rec in _frames(path, data, len(schema.MAGIC), partial_tail, None,
                               _Inflater()):
        if first and not isinstance(rec, schema.Header):
            raise LogError(path, offset, f"the first record is {type(rec).__name__}, "
                           "expected a header")
        first = False
        if isinstance(rec, schema.Header) and rec.schema != schema.SCHEMA:
            raise LogError(path, offset, f"schema {rec.schema}; this epick reads schema "
                           f"{schema.SCHEMA}")
        yield rec


class _Inflater:
    """Decompresses a file's chunks in order: one zlib stream across chunks, or a new
    stream whenever the previous one ended (a chunk that is a whole stream)."""

    def __init__(self) -> None:
        self._z = zlib.decompressobj()

    def inflate(self, body) -> bytes:
        if self._z.eof:
            self._z = zlib.decompressobj()
        out = self._z.decompress(body)
        if self._z.unused_data:
            raise zlib.error(f"{len(self._z.unused_data)} bytes after the end of the stream")
        return out


def _frames(path: Path, data: bytes, pos: int, partial_tail: bool, chunk_at: int | None,
            stream) -> Iterator[tuple[int, schema.Record]]:
    """(file offset, record) for each frame of ``data`` from ``pos``; chunks expanded.

    Inside a chunk (``chunk_at`` = its file offset) every offset reported is the chunk's.
    """
    end = len(data)
    decode = schema.decoder.decode
    view = memoryview(data)
    while pos < end:
        at = pos if chunk_at is None else chunk_at
        if pos + 4 > end or pos + 4 + (_FRAME.unpack_from(data, pos)[0]
                                       & ~schema.CHUNK_FLAG) > end:
            if partial_tail and chunk_at is None:
                log.warning("%s: truncated record at byte %d ignored", path, pos)
                return
            raise LogError(path, at, "truncated record")
        (n,) = _FRAME.unpack_from(data, pos)
        body = view[pos + 4:pos + 4 + (n & ~schema.CHUNK_FLAG)]
        if n & schema.CHUNK_FLAG:
            if chunk_at is not None:
                raise LogError(path, at, "a chunk inside a chunk: corrupt")
            try:
                inner = stream.inflate(body)
            except zlib.error as exc:
                raise LogError(path, at, f"corrupt chunk: {exc}") from None
            yield from _frames(path, inner, 0, False, pos, None)
        else:
            if n > MAX_RECORD_BYTES:
                raise LogError(path, at, f"frame of {n} bytes: corrupt")
            try:
                yield at, decode(body)
            except msgspec.ValidationError as exc:
                raise LogError(path, at, f"invalid record: {exc}") from None
            except msgspec.DecodeError as exc:
                raise LogError(path, at, f"not msgpack: {exc}") from None
        pos += 4 + (n & ~schema.CHUNK_FLAG)


def read(paths: Iterable[str | Path]) -> Iterator[tuple[Path, schema.Record]]:
    """Every record of every file of the given logs, oldest file first."""
    for f in log_files(paths):
        for rec in read_file(f):
            yield f, rec
