"""The decision log's records, version 1: the schema, defined once (policies/DECISIONS.md).

A log file is ``MAGIC`` followed by frames; a frame is a little-endian u32 length and one
msgpack record of that many bytes. A length with :data:`CHUNK_FLAG` set is a chunk
instead: that many bytes of zlib data holding more frames. The chunks of a file are one
zlib stream, sync-flushed at the end of each chunk (the writer compresses each batch,
keeping the window across batches): decompress them in order. Each record is an array whose first element names its
kind (a msgspec tagged union). A file is self-contained: it starts with a :class:`Header`,
and every module, policy set and snapshot a decision refers to is written earlier in the
same file, once.

Records only ever grow at the end (new fields get defaults), so a reader of this version
reads logs of later versions of the same ``schema``.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MAGIC",
    "SCHEMA",
    "CHUNK_FLAG",
    "Header",
    "Module",
    "PolicyRef",
    "Policies",
    "EndpointFacts",
    "SnapshotRec",
    "RequestFeatures",
    "DecisionRec",
    "CompletionRec",
    "Gap",
    "Checkpoint",
    "Recovered",
    "Record",
    "encoder",
    "decoder",
]

#: The first bytes of every decision log file (format name and schema major version).
MAGIC = b"EPICKDL1"
#: Set in a frame's length: the frame is a zlib chunk of frames, not one record.
CHUNK_FLAG = 1 << 31
#: Version of the record layouts below.
SCHEMA = 1


class _Rec(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag_field="kind"):
    pass


class Header(_Rec, tag="header"):
    """First record of every file: how the decisions in it were made and recorded."""

    schema: int = SCHEMA
    boot: str = ""
    """The scheduler's boot id (the prefix of its decision ids): one per process start."""
    segment: int = 0
    """0 for the first file of a boot, then +1 per rotation."""
    started_ms: int = 0
    fresh_start: bool = False
    """The policies were freshly initialised when this file began (the first file of a
    service that logged from its start): replaying it from a fresh set is exact."""
    prompt: str = "hashes"
    """How prompts were recorded: ``hashes`` (block hash chain), ``full`` or ``none``."""
    block_bytes: int = 64
    max_blocks: int = 256
    fallbacks: int = 2
    picker: str = "max"
    admission_queue: int = 5
    admission_kv: float = 0.8
    decision_ttl_s: float = 600.0
    work_conserving: bool = False
    """The scheduler's work-conserving rule (``[server] work_conserving``); logs written
    before it existed have none, so they replay without it."""


class Module(_Rec, tag="module"):
    """A policy module's bytes, written once per file before the policy set that uses it."""

    sha256: str
    name: str = ""
    wasm: bytes = b""


class PolicyRef(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """One entry of a live policy set, in the set's order."""

    name: str
    sha256: str = ""
    """Empty for a policy that is not a WASM module (it cannot be replayed)."""
    weight: float = 1.0
    shadow: bool = False
    params: dict[str, object] = {}
    module_name: str = ""


class Policies(_Rec, tag="policies"):
    """The live policy set from here on (written whenever it changes)."""

    id: int
    entries: tuple[PolicyRef, ...] = ()


class EndpointFacts(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """The host-side facts about one endpoint that its host filters read."""

    fresh: bool = True
    models: tuple[str, ...] | None = None
    adapters: tuple[str, ...] | None = None


class SnapshotRec(_Rec, tag="snapshot"):
    """One pool snapshot version: the exact bytes policies received, plus host facts."""

    version: int
    encoded: bytes = b""
    """The msgpack ABI ``Snapshot`` (policies/ABI.md), as ``set_snapshot`` received it."""
    facts: tuple[EndpointFacts, ...] = ()


class RequestFeatures(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """What the policies saw of a request (the prompt as a hash chain by default)."""

    request_id: str = ""
    model: str = ""
    adapter: str = ""
    criticality: int = 1
    seed: int = 0
    cache_salt: str = ""
    headers: dict[str, str] = {}
    """Only the header names listed in ``[decisions] headers``."""
    prompt_bytes: int = 0
    blocks: bytes = b""
    """Little-endian u64 hash chain of the prompt's full blocks (``hashes`` mode)."""
    prompt: str | None = None
    """The prompt itself (``full`` mode)."""
    slo_ttft_ms: int = 0
    slo_tpot_ms: int = 0
    prompt_tokens: int = 0
    """As the policies' ``Request`` had them (the count or the host's estimate)."""
    session_id: str = ""


class DecisionRec(_Rec, tag="d"):
    """One pick. Endpoints are indices into the referenced snapshot's endpoints."""

    id: str
    t_ms: int
    """The decision's clock: the ``timestamp_ms`` every ``pre_request`` got."""
    snapshot: int
    policies: int
    request: RequestFeatures
    candidates: tuple[int, ...] = ()
    """Survivors of every filter, in the order they were scored."""
    scores: dict[str, bytes] = {}
    """Per scoring policy (shadows too): little-endian f32, one per candidate."""
    picked: tuple[int, ...] = ()
    """Primary first, then the fallbacks."""
    skipped: tuple[str, ...] = ()
    """``policy: reason`` for policies that failed on this request."""
    in_flight: tuple[int, ...] = ()
    """Per candidate, as the policies saw it (``ScoreInput.in_flight``); () = all 0."""
    picked_since_scrape: tuple[int, ...] = ()
    """Per candidate (``ScoreInput.picked_since_scrape``); () = all 0."""
    prefix_blocks: tuple[int, ...] = ()
    """Per candidate (``ScoreInput.prefix_blocks``); () = KV events off."""
    prefix_matched: tuple[int, ...] = ()
    """Per candidate (``ScoreInput.prefix_matched``); () = KV events off."""
    prefix_cleared_ms: tuple[int, ...] = ()
    """Per candidate (``ScoreInput.prefix_cleared_ms``); () = KV events off."""


class CompletionRec(_Rec, tag="c"):
    """The gateway's completion report for a decision (only for known decisions)."""

    id: str
    t_ms: int
    """The ``timestamp_ms`` the post_response hooks got."""
    status: int = 0
    endpoint: str = ""
    """The endpoint the gateway says served (may be a fallback); empty if not given."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None


class Gap(_Rec, tag="gap"):
    """Records were lost here (queue full or a write error): the log is not complete."""

    lost: int


class Checkpoint(_Rec, tag="checkpoint"):
    """A live policy captured its last good state here (before the next record)."""

    policy: str


class Recovered(_Rec, tag="recovered"):
    """A live policy's instance was re-created after a trap or timeout, back to its last
    checkpoint, during the next decision (or completion). A replay does the same there."""

    policy: str
    recoveries: int
    """The policy's total so far."""


Record = (Header | Module | Policies | SnapshotRec | DecisionRec | CompletionRec | Gap
          | Checkpoint | Recovered)

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Record)
