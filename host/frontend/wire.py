"""The frames between a front-end worker and the service's :class:`~epick.frontend.Hub`.

Each frame is a 4-byte little-endian length, then one msgpack message: a tagged,
positional msgspec Struct (no field names on the wire; layouts only grow at the end).
"""

from __future__ import annotations

import struct

import msgspec

__all__ = ["Hello", "Pick", "Refused", "Complete", "Report", "Answer", "Health", "Ack",
           "Tables", "TablesAnswer", "PickHttp", "Routed",
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
    usage_kind: str = ""
    """The native worker's raw usage (it does not decode JSON): ``"sse"`` — ``usage`` holds
    the payloads after ``data:`` of the answer's last lines naming ``"usage"``, in order —
    or ``"json"`` — ``usage`` holds the whole JSON body; the hub reads the tokens from
    them with :func:`epick.api.usage.tokens_from` (the Python reader's rules). ``""``: the
    tokens above are the ones."""
    usage: list[bytes] = []


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


class PickHttp(msgspec.Struct, tag=10, array_like=True):
    """native worker -> hub: route this ext_proc request (answered by a Routed). The hub
    reads the body and writes the routing answer with ext_proc.py's own code, so the
    native front end decides and answers as the Python one does."""

    id: int
    headers: dict[str, str]
    """The request headers as ext_proc.py reads them (later duplicates win)."""
    body: bytes
    metadata: list[bytes]
    """Each serialized ``metadata_context`` the stream carried before it routed, in order
    (the subset hint is read from them)."""
    end: int
    """0: the request has no body; 1: the body ended; 2: trailers follow the body."""
    duplex: bool
    elapsed_s: float
    problem: str = ""
    """Not a pick: the refusal the worker saw first — ``too_large``, ``not_buffered``,
    ``mode:<BodySendMode>``, ``unexpected`` — answered with the immediate response
    ext_proc.py writes for it."""


class Routed(msgspec.Struct, tag=11, array_like=True):
    """hub -> native worker: the answer to PickHttp ``id``."""

    id: int
    responses: list[bytes]
    """Serialized ``ProcessingResponse``s to send, in order."""
    echo_at: int
    """Where the worker streams the request body's own chunks back (index in
    ``responses``; -1: it does not)."""
    ended: bool
    """An immediate response: the stream ends after it."""
    decision_id: str = ""
    endpoint: str = ""


ToHub = Hello | Pick | Refused | Complete | Report | Tables | PickHttp
ToWorker = Answer | Health | Ack | TablesAnswer | Routed

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
