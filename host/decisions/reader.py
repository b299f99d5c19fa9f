"""Read decision log files back as typed records (schema: :mod:`epick.decisions.schema`)."""

from __future__ import annotations

import logging
import struct
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
    pos = len(schema.MAGIC)
    end = len(data)
    decode = schema.decoder.decode
    view = memoryview(data)
    while pos < end:
        if pos + 4 > end:
            if partial_tail:
                log.warning("%s: truncated frame at byte %d ignored", path, pos)
                return
            raise LogError(path, pos, "truncated frame header")
        (n,) = _FRAME.unpack_from(data, pos)
        if n > MAX_RECORD_BYTES:
            raise LogError(path, pos, f"frame of {n} bytes: corrupt")
        if pos + 4 + n > end:
            if partial_tail:
                log.warning("%s: truncated record at byte %d ignored", path, pos)
                return
            raise LogError(path, pos, f"record of {n} bytes runs past the end")
        try:
            rec = decode(view[pos + 4:pos + 4 + n])
        except msgspec.ValidationError as exc:
            raise LogError(path, pos, f"invalid record: {exc}") from None
        except msgspec.DecodeError as exc:
            raise LogError(path, pos, f"not msgpack: {exc}") from None
        if pos == len(schema.MAGIC) and not isinstance(rec, schema.Header):
            raise LogError(path, pos, f"the first record is {type(rec).__name__}, "
                           "expected a header")
        if isinstance(rec, schema.Header) and rec.schema != schema.SCHEMA:
            raise LogError(path, pos, f"schema {rec.schema}; this epick reads schema "
                           f"{schema.SCHEMA}")
        yield rec
        pos += 4 + n


def read(paths: Iterable[str | Path]) -> Iterator[tuple[Path, schema.Record]]:
    """Every record of every file of the given logs, oldest file first."""
    for f in log_files(paths):
        for rec in read_file(f):
            yield f, rec
