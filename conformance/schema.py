"""The vector file format, as msgspec Structs: one declarative type is the schema.

A vector file is TOML that people edit by hand (see conformance/README.md)::

    kind = "load"                       # the policy kind these cases are for
    params = { queue_weight = 1.0 }     # optional: params every case starts from

    [[case]]
    name = "load/queue-only"
    params = { kv_weight = 0.0 }        # merged over the file's params
    request = { adapter = "a" }         # omitted fields take the ABI defaults
    candidates = [0, 1]                 # optional: default every endpoint, in order
    [[case.snapshot.endpoints]]
    address = "e0:8000"
    waiting = 10
    [[case.before]]                     # optional history, replayed in order
    event = "pre_request"
    endpoint = "e0:8000"
    [case.expect]
    scores = [0.0, 1.0]                 # or order = [...] or keep = [...]
    why = ["...", "..."]                # the derivation, quoted in failures

The Structs mirror :mod:`epick.abi`'s payloads field for field, but as TOML tables
instead of msgpack arrays; :func:`to_abi_snapshot` and friends convert. Validation
happens once, at load (:mod:`epick.conformance.vectors`); the runner never re-checks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from epick import abi

__all__ = [
    "KINDS",
    "Endpoint",
    "Request",
    "Snapshot",
    "SnapshotEvent",
    "PreRequest",
    "PostResponse",
    "Event",
    "Expect",
    "Case",
    "VectorFile",
    "to_abi_endpoint",
    "to_abi_request",
    "to_abi_snapshot",
]

#: The policy kinds ``describe`` may report; ``custom`` has no built-in vectors.
KINDS = ("lora-affinity", "prefix-cache", "load", "legacy-v1", "custom")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class _Table(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every vector table: a typo in a key is an error, not a silent default."""


class Endpoint(_Table, kw_only=True):
    """One endpoint of a snapshot; mirrors :class:`epick.abi.EndpointMetrics`."""

    address: str
    waiting: NonNegInt = 0
    running: NonNegInt = 0
    kv_usage: float = 0.0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_lora: NonNegInt = 0
    num_gpu_blocks: NonNegInt = 0
    block_size: NonNegInt = 0
    deferred: NonNegInt = 0


class Request(_Table, kw_only=True):
    """The request; mirrors :class:`epick.abi.Request`."""

    request_id: str = ""
    model: str = ""
    adapter: str = ""
    prompt: str = ""
    criticality: Annotated[int, msgspec.Meta(ge=0, le=2)] = abi.Criticality.STANDARD
    seed: NonNegInt = 0
    """u64 in the ABI; TOML integers stop at 2**63 - 1."""
    cache_salt: str = ""
    headers: dict[str, str] = {}


class Snapshot(_Table, kw_only=True):
    """The pool the case scores against. ``version`` is assigned by the runner."""

    timestamp_ms: NonNegInt = 0
    endpoints: tuple[Endpoint, ...] = ()


class SnapshotEvent(_Table, tag_field="event", tag="snapshot", kw_only=True):
    """An earlier snapshot the policy saw (``set_snapshot``, or a discarded ``score``)."""

    timestamp_ms: NonNegInt = 0
    endpoints: tuple[Endpoint, ...] = ()


class PreRequest(_Table, tag_field="event", tag="pre_request", kw_only=True):
    """The host picked ``endpoint`` for ``request`` (``pre_request``)."""

    request: Request = Request()
    endpoint: str
    timestamp_ms: NonNegInt = 0


class PostResponse(_Table, tag_field="event", tag="post_response", kw_only=True):
    """The gateway reported ``request_id`` finished (``post_response``)."""

    request_id: str = ""
    adapter: str = ""
    endpoint: str
    status: Annotated[int, msgspec.Meta(ge=0, le=2)] = abi.CompletionStatus.OK
    timestamp_ms: NonNegInt = 0
    model: str = ""


Event = SnapshotEvent | PreRequest | PostResponse


class Expect(_Table, kw_only=True):
    """What the case must produce — exactly one of ``scores``, ``order`` or ``keep``.

    ``scores``: one score per candidate, each within ``tolerance``.
    ``order``: candidate positions (0-based, into ``candidates``) from best to worst;
    each must score strictly higher than the next. ``keep``: the ``filter`` keep-mask.
    ``why``: the hand derivation — one string per candidate, or one for all — quoted
    beside every mismatch.
    """

    scores: tuple[float, ...] | None = None
    order: tuple[NonNegInt, ...] | None = None
    keep: tuple[bool, ...] | None = None
    tolerance: Annotated[float, msgspec.Meta(ge=0)] = 1e-9
    why: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        given = [k for k in ("scores", "order", "keep") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "expect needs exactly one of `scores`, `order`, `keep`; "
                f"got {', '.join(f'`{g}`' for g in given) or 'none'}"
            )
        if self.order is not None and len(set(self.order)) != len(self.order):
            raise ValueError(f"expect.order repeats a position: {list(self.order)}")

    @property
    def call(self) -> Literal["score", "filter"]:
        """The export this expectation checks."""
        return "filter" if self.keep is not None else "score"


class Case(_Table, kw_only=True):
    """One conformance case: state to build, one call to make, what it must return."""

    name: str
    snapshot: Snapshot
    request: Request = Request()
    params: dict[str, Any] = {}
    before: tuple[Event, ...] = ()
    candidates: tuple[NonNegInt, ...] | None = None
    in_flight: tuple[NonNegInt, ...] = ()
    """Per candidate: what the host has in flight there (ScoreInput.in_flight); () = 0s."""
    picked_since_scrape: tuple[NonNegInt, ...] = ()
    """Per candidate: picks since its last scrape (ScoreInput.picked_since_scrape)."""
    expect: Expect

    def __post_init__(self) -> None:
        n_endpoints = len(self.snapshot.endpoints)
        for field_name in ("in_flight", "picked_since_scrape"):
            given = getattr(self, field_name)
            if given and len(given) != len(self.candidate_indices):
                raise ValueError(
                    f"case {self.name!r}: {field_name} has {len(given)} values for "
                    f"{len(self.candidate_indices)} candidates"
                )
        for c in self.candidates or ():
            if c >= n_endpoints:
                raise ValueError(
                    f"case {self.name!r}: candidate {c} is not an endpoint index "
                    f"(the snapshot has {n_endpoints})"
                )
        n = len(self.candidate_indices)
        e = self.expect
        for field in ("scores", "keep"):
            values = getattr(e, field)
            if values is not None and len(values) != n:
                raise ValueError(
                    f"case {self.name!r}: expect.{field} has {len(values)} values "
                    f"for {n} candidates"
                )
        if e.order is not None:
            bad = [p for p in e.order if p >= n]
            if bad:
                raise ValueError(
                    f"case {self.name!r}: expect.order position {bad[0]} is out of range "
                    f"for {n} candidates"
                )
        if isinstance(e.why, tuple) and len(e.why) != n:
            raise ValueError(
                f"case {self.name!r}: expect.why has {len(e.why)} entries for {n} "
                "candidates (give one per candidate, or a single string)"
            )

    @property
    def assigned(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.in_flight, self.picked_since_scrape

    @property
    def candidate_indices(self) -> tuple[int, ...]:
        """The candidates, defaulting to every endpoint in snapshot order."""
        if self.candidates is None:
            return tuple(range(len(self.snapshot.endpoints)))
        return self.candidates

    def why(self, position: int) -> str:
        """The derivation for the candidate at ``position``."""
        w = self.expect.why
        return w[position] if isinstance(w, tuple) else w


class VectorFile(_Table, kw_only=True):
    """One TOML file of cases for one policy kind."""

    kind: Literal["lora-affinity", "prefix-cache", "load", "legacy-v1", "custom"]
    description: str = ""
    params: dict[str, Any] = {}
    """Params every case starts from; a case's own ``params`` override them key by key."""
    cases: tuple[Case, ...] = msgspec.field(name="case", default=())


def to_abi_endpoint(e: Endpoint) -> abi.EndpointMetrics:
    return abi.EndpointMetrics(**msgspec.structs.asdict(e))


def to_abi_request(r: Request) -> abi.Request:
    return abi.Request(**msgspec.structs.asdict(r))


def to_abi_snapshot(
    endpoints: tuple[Endpoint, ...], *, version: int, timestamp_ms: int
) -> abi.Snapshot:
    return abi.Snapshot(
        version=version,
        timestamp_ms=timestamp_ms,
        endpoints=tuple(to_abi_endpoint(e) for e in endpoints),
    )
