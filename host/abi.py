"""The policy ABI payloads: the msgpack layouts the host hands to WASM policies.

These Structs *are* the ABI (policies/ABI.md documents them field by field and a test
checks the two agree). Every payload is a msgpack **array** (``array_like=True``): fields
are positional, in the order declared here. Layouts only ever grow at the end, so a
policy must ignore trailing elements it does not know — that is how ABI v1 stays
forward compatible.

Encode with :data:`encoder`; the host decodes nothing a policy produces except scores,
keep-masks, ``describe`` and exported state.
"""

from __future__ import annotations

import enum
import struct

import msgspec

__all__ = [
    "ABI_VERSION",
    "ABI_VERSIONS",
    "FRAME_ARRAYS",
    "FRAME_HEADER",
    "FRAME_EMPTY",
    "FRAME_EVENT_FAILED",
    "encode_frame",
    "pack_candidates",
    "frame_from_score_input",
    "Criticality",
    "CompletionStatus",
    "EndpointMetrics",
    "Snapshot",
    "Request",
    "ScoreInput",
    "PreRequestEvent",
    "PostResponseEvent",
    "Describe",
    "encoder",
]

#: The newest ABI version this host speaks (what the SDKs build).
ABI_VERSION = 2

#: Every ABI version this host speaks; a module whose ``epick_abi_version()`` returns
#: anything else is refused. Version 1 modules get msgpack ``ScoreInput``s and one
#: ``pre_request`` call per pick; version 2 modules get a flat frame (below).
ABI_VERSIONS = (1, 2)

#: Version of the :class:`Snapshot` layout (its first element).
SNAPSHOT_SCHEMA = 1


class Criticality(enum.IntEnum):
    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2


class CompletionStatus(enum.IntEnum):
    OK = 0
    ERROR = 1
    CANCELLED = 2


class EndpointMetrics(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """One model-server replica as the last good scrape saw it."""

    address: str
    """``host:port`` — the identity policies key their state by."""
    waiting: int = 0
    """Requests queued (``vllm:num_requests_waiting``)."""
    running: int = 0
    """Requests in the running batch (``vllm:num_requests_running``)."""
    kv_usage: float = 0.0
    """KV-cache use, 0..1."""
    running_adapters: tuple[str, ...] = ()
    """LoRA adapters currently loaded and serving."""
    waiting_adapters: tuple[str, ...] = ()
    """LoRA adapters with requests waiting for a slot."""
    max_lora: int = 0
    """Adapter slots (0 = the engine reports no LoRA support)."""
    num_gpu_blocks: int = 0
    """KV blocks on the device (0 = unknown)."""
    block_size: int = 0
    """Tokens per KV block (0 = unknown)."""
    deferred: int = 0
    """Requests waiting for a transient constraint, above all a free LoRA slot (vLLM
    ``num_requests_waiting_by_reason{reason="deferred"}``); 0 where not reported."""


class Snapshot(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """The pool as one consistent view: rebuilt once per metrics change, never per request."""

    schema: int = SNAPSHOT_SCHEMA
    version: int = 0
    """Increases by one on every rebuild; policies may use it to skip re-decoding."""
    timestamp_ms: int = 0
    """Unix time of the rebuild in ms — the only clock a policy sees."""
    endpoints: tuple[EndpointMetrics, ...] = ()


class Request(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """What the gateway asked, as policies see it."""

    request_id: str = ""
    model: str = ""
    adapter: str = ""
    """LoRA adapter name; empty means the base model."""
    prompt: str = ""
    """The text the prefix policy hashes (chat: see ``epick.chat.serialize``)."""
    criticality: int = Criticality.STANDARD
    seed: int = 0
    """u64; every random choice a policy makes derives from it."""
    cache_salt: str = ""
    """Tenant isolation for the prefix cache: hashed into the first block when set."""
    headers: dict[str, str] = {}
    slo_ttft_ms: int = 0
    """The request's time-to-first-token objective in ms (``PickRequest.slo_ttft_ms``, else
    the ``x-llm-d-slo-ttft-ms`` / ``x-slo-ttft-ms`` header); 0 = none."""
    slo_tpot_ms: int = 0
    """Its time-per-output-token objective in ms (``PickRequest.slo_tpot_ms``, else
    ``x-llm-d-slo-tpot-ms`` / ``x-slo-tpot-ms``); 0 = none."""
    prompt_tokens: int = 0
    """The prompt's token count: ``PickRequest.prompt_tokens`` when the gateway sent it,
    else the host's estimate (one token per 4 bytes of prompt, rounded up)."""
    session_id: str = ""
    """The conversation this request belongs to (``PickRequest.session_id``, else the
    header ``[server] session_header`` names, ``x-session-id`` by default); empty = none."""


class ScoreInput(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """Input of ``score`` and ``filter``.

    ``snapshot`` is ``None`` when the policy exports ``set_snapshot`` and the host has
    already delivered the snapshot the candidate indices refer to.
    """

    snapshot: Snapshot | None = None
    request: Request = Request()
    candidates: tuple[int, ...] = ()
    """Indices into ``snapshot.endpoints``; one result per candidate, in this order."""
    in_flight: tuple[int, ...] = ()
    """Per candidate: requests the host picked it for and has not seen complete (its own
    count, fresh at every pick). Empty = all 0."""
    picked_since_scrape: tuple[int, ...] = ()
    """Per candidate: picks since its last good scrape — work its metrics cannot show yet.
    Empty = all 0."""
    prefix_blocks: tuple[int, ...] = ()
    """Per candidate: full KV blocks in the request as that endpoint's engine hashes them
    (its tokenizer and block size). Empty = not computed (no KV events configured)."""
    prefix_matched: tuple[int, ...] = ()
    """Per candidate: leading request blocks the endpoint's own KV-cache events say it holds;
    -1 = no event stream or its index is uncertain (policies fall back to an estimate).
    Empty = all -1."""
    prefix_cleared_ms: tuple[int, ...] = ()
    """Per candidate: Unix ms when that endpoint's engine last emptied its cache — an
    ``AllBlocksCleared`` (its batch's time) or a restart the host saw (the new engine's
    first batch) — on the engine's clock, which NTP keeps near the host's; a clear of the
    host's own making (joining, a rebuild after a gap) does not move it. A policy drops
    what it believed about the endpoint before then; 0 = never. Empty = all 0
    (policies/ABI.md)."""
    uncached_tokens: tuple[int, ...] = ()
    """Per candidate: prompt tokens that endpoint would have to prefill, by the engines'
    KV-cache events (``prompt_tokens`` − ``prefix_matched`` × its block size, at least 0);
    -1 = unknown there (no event stream, an uncertain index, no block size). Empty = not
    computed (KV events off): a policy estimates it itself."""


class PreRequestEvent(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """Input of ``pre_request``: the host picked ``endpoint`` for ``request``."""

    request: Request = Request()
    endpoint: str = ""
    timestamp_ms: int = 0


class PostResponseEvent(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """Input of ``post_response``: the gateway reported the request finished.

    May arrive without a matching ``pre_request`` (restart, lost state) or twice (gateway
    retries): policies must tolerate both.
    """

    request_id: str = ""
    adapter: str = ""
    endpoint: str = ""
    status: int = CompletionStatus.OK
    timestamp_ms: int = 0
    model: str = ""
    ttft_ms: float = -1.0
    """Time to first token the gateway measured (``CompletionReport.ttft_seconds``, the
    ext_proc stream, the HTTP front end), in ms; -1 = not reported."""
    prompt_tokens: int = -1
    """Prompt tokens the engine reported (usage); -1 = not reported."""
    completion_tokens: int = -1
    """Output tokens the engine reported (usage); -1 = not reported."""


class Describe(msgspec.Struct, frozen=True, kw_only=True):
    """What ``describe`` returns: a msgpack **map** (read by tools, not the hot path)."""

    name: str
    version: str = "0.0.0"
    kind: str = "custom"
    """lora-affinity | prefix-cache | load | legacy-v1 | precise-prefix | latency | custom"""
    params: dict[str, object] = {}
    """The defaults of every parameter ``init`` accepts."""


encoder = msgspec.msgpack.Encoder()


# -- ABI v2: the flat score frame ------------------------------------------------------------
#
# A version 2 module's ``score``/``filter`` input (policies/ABI.md, "The score frame"):
# a header of FRAME_HEADER_WORDS little-endian u32s, the candidates as u32 (padded to 8
# bytes), each per-candidate array the host sends as little-endian i64 (FRAME_ARRAYS, in
# ScoreInput's order: appended ScoreInput fields carry over), then the msgpack Request, the
# msgpack Snapshot (absent when resident) and a msgpack PreRequestEvent the policy must
# apply before scoring (absent when none is pending). Fixed-width parts start 8-aligned.

#: The per-candidate arrays after ``candidates``: ScoreInput's fields from there on.
FRAME_ARRAYS: tuple[str, ...] = ScoreInput.__struct_fields__[
    ScoreInput.__struct_fields__.index("candidates") + 1:]

#: What each array means when the host sends it empty (policies/ABI.md, ScoreInput).
FRAME_EMPTY: dict[str, int] = {
    "in_flight": 0, "picked_since_scrape": 0, "prefix_blocks": -1, "prefix_matched": -1,
    "prefix_cleared_ms": 0, "uncached_tokens": -1,
}

#: The header's u32 words, in order.
FRAME_HEADER: tuple[str, ...] = (
    "candidates", "arrays", "present", "request_len", "snapshot_len", "event_len",
    "reserved0", "reserved1",
)
FRAME_HEADER_BYTES = 4 * len(FRAME_HEADER)
#: Byte offset of ``event_len`` in the header (the host sets it per policy).
FRAME_EVENT_LEN_AT = 4 * FRAME_HEADER.index("event_len")

#: Status a v2 ``score``/``filter`` returns when the PreRequestEvent the frame carried
#: failed (its message is that failure's; nothing was scored): the host reports a
#: ``pre_request`` failure and calls again without the event.
FRAME_EVENT_FAILED = 2

_request_encoder = msgspec.msgpack.Encoder()
_score_input_decoder = msgspec.msgpack.Decoder(ScoreInput)


def encode_frame(request: bytes, snapshot: bytes | None, candidates: tuple[int, ...],
                 arrays: tuple[tuple[int, ...], ...], *, packed: bytes | None = None) -> bytes:
    """The frame without an event: ``request`` and ``snapshot`` (``None``: resident) are
    msgpack bytes, ``arrays`` the per-candidate values in :data:`FRAME_ARRAYS` order
    (each empty or one value per candidate); ``packed`` is :func:`pack_candidates` of
    ``candidates`` when the caller kept it."""
    n = len(candidates)
    present = 0
    parts = [b"", packed if packed is not None else pack_candidates(candidates)]
    for k, arr in enumerate(arrays):
        if arr:
            if len(arr) != n:
                raise ValueError(f"{FRAME_ARRAYS[k]} has {len(arr)} values for {n} candidates")
            present |= 1 << k
            parts.append(_pack_i64(arr))
    snap = snapshot or b""
    parts[0] = _HEAD.pack(n, len(arrays), present, len(request), len(snap), 0, 0, 0)
    parts.append(request)
    parts.append(snap)
    return b"".join(parts)


_HEAD = struct.Struct("<8I")


def pack_candidates(values: tuple[int, ...]) -> bytes:
    """The frame's candidates: little-endian u32, padded to a multiple of 8 bytes."""
    n = len(values)
    return _struct(n + (n & 1), "I").pack(*values, *_PAD[: n & 1])


def _pack_i64(values: tuple[int, ...]) -> bytes:
    return _struct(len(values), "q").pack(*values)


_PAD = (0,)
_STRUCTS: dict[tuple[int, str], struct.Struct] = {}


def _struct(n: int, code: str) -> struct.Struct:
    """A cached little-endian ``Struct`` of ``n`` values (``Struct.pack(*ints)`` is ~3×
    faster than ``array(...).tobytes()`` on a tuple of Python ints)."""
    got = _STRUCTS.get((n, code))
    if got is None:
        if len(_STRUCTS) >= 256:
            _STRUCTS.clear()
        got = _STRUCTS[(n, code)] = struct.Struct(f"<{n}{code}")
    return got


def frame_from_score_input(blob: bytes) -> bytes:
    """The v2 frame carrying what the msgpack ``ScoreInput`` ``blob`` does (tools, tests
    and conformance hand v2 modules msgpack; the request path encodes frames directly).
    A nil snapshot stays nil (resident). Raises ``msgspec.DecodeError``, ``ValueError``
    or ``struct.error`` (a negative candidate, a value past i64) on bytes that are not a
    ScoreInput."""
    si = _score_input_decoder.decode(blob)
    snap = None if si.snapshot is None else _request_encoder.encode(si.snapshot)
    return encode_frame(_request_encoder.encode(si.request), snap, si.candidates,
                        tuple(getattr(si, f) for f in FRAME_ARRAYS))

