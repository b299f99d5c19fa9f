"""The frames between a front-end worker and the service's :class:`~epick.frontend.Hub`.

Each frame is a 4-byte little-endian length, then one msgpack message: a tagged,
positional msgspec Struct (no field names on the wire; layouts only grow at the end).
"""

from __future__ import annotations

import struct

import msgspec

__all__ = ["Hello", "Pick", "Refused", "Complete", "Report", "Answer", "Health", "Ack",
           "Tables", "TablesAnswer",
           "ToHub", "ToWorker", "frame", "Frames"]

_LEN = struct.Struct("<I")
#: Largest frame accepted (a PickRequest carries the prompt: the Pick API's own cap).
MAX_FRAME = 33 << 20


class Hello(msgspec.Struct, tag=0, array_like=True):
    """worker -> hub, once its servers listen."""

    worker: int
    pid: int


class Pick(msgspec.Struct, tag=1, array_like=True):
    """worker -> hub: decide this ``PickRequest`` (serialized); answered by an Answer."""

    id: int
    pick: bytes
    subset: list[str] | None
    elapsed_s: float
    """Time the worker already spent on the request (its parsing): part of the pick's
    recorded latency, as in the single process."""
    full: bool = False
    """Answer with the whole ``PickResponse`` (``Answer.response``: the HTTP front end's
    ``/v1/pick``, which may ask for an explanation); ext_proc needs only the endpoints."""


class Refused(msgspec.Struct, tag=2, array_like=True):
    """worker -> hub: a request the worker refused before it had a PickRequest (counted)."""

    outcome: str
    elapsed_s: float


class Complete(msgspec.Struct, tag=3, array_like=True):
    """worker -> hub: ReportCompletion for a decision."""

    decision_id: str
    endpoint: str
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None


class Answer(msgspec.Struct, tag=4, array_like=True):
    """hub -> worker: the verdict on Pick ``id``."""

    id: int
    outcome: str
    message: str
    endpoint: str = ""
    fallbacks: list[str] = []
    decision_id: str = ""
    response: bytes = b""
    """The serialized ``PickResponse`` when the Pick asked for it (``full``)."""
    traceparent: str = ""
    """A traced decision: the ``traceparent`` naming its span (the hub's
    ``PickTracer.outgoing``), which ext_proc in the worker sets on the request it sends
    on; ``""``: not traced."""
    tracestate: str = ""
    """The traced decision's ``tracestate`` (``""``: none)."""


class Health(msgspec.Struct, tag=5, array_like=True):
    """hub -> worker: the service's health (the worker's health servicer says the same)."""

    serving: bool


class Report(msgspec.Struct, tag=6, array_like=True):
    """worker -> hub: a serialized ``CompletionReport`` (HTTP ``/v1/completion``), answered
    by an Ack as gRPC ReportCompletion would be."""

    id: int
    report: bytes


class Ack(msgspec.Struct, tag=7, array_like=True):
    """hub -> worker: the answer to Report ``id``: ``known``, or the error's gRPC code
    name and message."""

    id: int
    known: bool
    code: str = ""
    message: str = ""


class Tables(msgspec.Struct, tag=8, array_like=True):
    """worker -> hub: the weights tables now (HTTP ``GET /v1/weights`` without a stream,
    ``POST /v3/discovery:endpoints``), one per ``(model, adapter, criticality)`` key;
    answered by a TablesAnswer."""

    id: int
    keys: list[tuple[str, str, int]]


class TablesAnswer(msgspec.Struct, tag=9, array_like=True):
    """hub -> worker: the answer to Tables ``id``: each table as a serialized
    ``epick.v1.WeightsTable`` (in the keys' order), or the refusal's outcome (a
    ``REFUSALS`` row: ``invalid``, ``unavailable``...) and message."""

    id: int
    tables: list[bytes]
    outcome: str = ""
    message: str = ""


ToHub = Hello | Pick | Refused | Complete | Report | Tables
ToWorker = Answer | Health | Ack | TablesAnswer

_encoder = msgspec.msgpack.Encoder()


def frame(msg: msgspec.Struct) -> bytes:
    payload = _encoder.encode(msg)
    return _LEN.pack(len(payload)) + payload


class Frames:
    """Bytes in (``feed``), whole decoded messages out: for ``asyncio.Protocol``s."""

    __slots__ = ("_buf", "_decoder")

    def __init__(self, kind) -> None:
        self._buf = bytearray()
        self._decoder = msgspec.msgpack.Decoder(kind)

    def feed(self, data: bytes) -> list:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        end = len(buf)
        with memoryview(buf) as view:  # released before the buffer is trimmed
            while end - pos >= 4:
                (size,) = _LEN.unpack_from(buf, pos)
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes is over the {MAX_FRAME} limit")
                if end - pos - 4 < size:
                    break
                out.append(self._decoder.decode(view[pos + 4:pos + 4 + size]))
                pos += 4 + size
        if pos:
            del buf[:pos]
        return out
