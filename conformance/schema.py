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

A case may check a sequence instead (``steps``: events, ``check``, ``pick`` and ``state``
steps), shares of picks over seeds (``stats``) or the host stage (``host``); see
conformance/README.md for each.

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
    "FILE_KINDS",
    "Check",
    "Pick",
    "State",
    "Step",
    "Stats",
    "Host",
    "HostPolicy",
    "HostExpect",
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
KINDS = ("lora-affinity", "prefix-cache", "load", "legacy-v1", "precise-prefix", "latency",
         "custom")
#: What a vector file may be for: a policy kind, or ``host`` — host-stage cases only,
#: checking the host itself (no module under test).
FILE_KINDS = (*KINDS, "host")

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
    slo_ttft_ms: NonNegInt = 0
    slo_tpot_ms: NonNegInt = 0
    prompt_tokens: NonNegInt = 0
    session_id: str = ""


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
    ttft_ms: float = -1.0
    """The measured TTFT in ms; -1 = not reported."""
    prompt_tokens: int = -1
    completion_tokens: int = -1


Event = SnapshotEvent | PreRequest | PostResponse


class Check(_Table, tag_field="event", tag="check", kw_only=True):
    """A step: one ``score``/``filter`` call on the current snapshot, compared with
    ``expect`` (as a case's final call is)."""

    request: Request = Request()
    candidates: tuple[NonNegInt, ...] | None = None
    prefix_blocks: tuple[NonNegInt, ...] = ()
    """Per candidate, as the case's own (ScoreInput.prefix_blocks); () = not computed."""
    prefix_matched: tuple[Annotated[int, msgspec.Meta(ge=-1)], ...] = ()
    """Per candidate, as the case's own (ScoreInput.prefix_matched); () = all -1."""
    expect: Expect


class Pick(_Table, tag_field="event", tag="pick", kw_only=True):
    """A step: what the host does for one request with this policy alone — ``filter``
    (when exported), ``score`` the survivors, the host's picker (seeded by
    ``request.seed``), then ``pre_request`` for the endpoint picked. ``expect`` is the
    address that must be picked."""

    request: Request = Request()
    candidates: tuple[NonNegInt, ...] | None = None
    picker: Literal["max", "weighted-random"] = "max"
    expect: str | None = None
    why: str = ""


StatePath = tuple[int | str, ...]


class State(_Table, tag_field="event", tag="state", kw_only=True):
    """A step: an assertion on the policy's observable state — its ``export_state``
    bytes decoded as msgpack. ``path`` walks into it (array indices, map keys); then
    exactly one of ``equals`` (the value there) or ``length`` (its element count)."""

    path: StatePath = ()
    equals: Any | msgspec.UnsetType = msgspec.UNSET
    length: NonNegInt | None = None
    why: str = ""

    def __post_init__(self) -> None:
        if (self.equals is msgspec.UNSET) == (self.length is None):
            raise ValueError("a state step needs exactly one of `equals`, `length`")


Step = SnapshotEvent | PreRequest | PostResponse | Check | Pick | State


class Stats(_Table, kw_only=True):
    """A statistical case: the same request over ``seeds`` consecutive seeds from
    ``first_seed``, each picked as a :class:`Pick` step picks (without its
    ``pre_request``), or by the host stage when the case has ``[case.host]``. Each
    candidate's share of the picks must be within ``tolerance`` of ``frequencies``."""

    seeds: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000
    first_seed: NonNegInt = 0
    picker: Literal["max", "weighted-random"] = "max"
    frequencies: tuple[Annotated[float, msgspec.Meta(ge=0, le=1)], ...]
    tolerance: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.02
    why: str | tuple[str, ...] = ""


class HostPolicy(_Table, kw_only=True):
    """One policy of a host-stage case: a module (``self`` = the module under test, a
    built-in name, or a path relative to the vector file), or fixed ``scores`` /
    ``keep`` per endpoint (a stand-in that makes the host's arithmetic checkable)."""

    name: str
    module: str | None = None
    params: dict[str, Any] = {}
    scores: tuple[float, ...] | None = None
    keep: tuple[bool, ...] | None = None
    weight: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    shadow: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("module", "scores", "keep") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"host policy {self.name!r} needs exactly one of `module`, `scores`, `keep`; "
                f"got {', '.join(f'`{g}`' for g in given) or 'none'}"
            )


class HostExpect(_Table, kw_only=True):
    """What the host stage must decide: ``pick`` (and optionally ``fallbacks``, the
    weighted ``totals`` per endpoint — 0 for a filtered one — and ``filtered``, endpoint
    -> the filter that removed it), or ``outcome`` for a refusal."""

    pick: str | None = None
    fallbacks: tuple[str, ...] | None = None
    totals: tuple[float, ...] | None = None
    filtered: dict[str, str] | None = None
    outcome: Literal["shed", "unavailable"] | None = None
    tolerance: Annotated[float, msgspec.Meta(ge=0)] = 1e-9
    why: str = ""

    def __post_init__(self) -> None:
        if (self.pick is None) == (self.outcome is None):
            raise ValueError("host.expect needs exactly one of `pick`, `outcome`")
        if self.outcome is not None and any(
                v is not None for v in (self.fallbacks, self.totals, self.filtered)):
            raise ValueError("host.expect: `outcome` cannot go with `fallbacks`, `totals` "
                             "or `filtered` (nothing was picked)")


class Host(_Table, kw_only=True):
    """A host-stage case: the real scheduler (host filters -> filter policies -> weighted
    scores -> picker) over the case's snapshot. ``stale``: addresses whose metrics are
    stale; ``serves``: address -> the models (and adapters) it is pinned to."""

    policies: tuple[HostPolicy, ...] = (HostPolicy(name="self", module="self"),)
    picker: Literal["max", "weighted-random"] = "max"
    fallbacks: Annotated[int, msgspec.Meta(ge=0, le=64)] = 2
    queue_threshold: NonNegInt = 5
    kv_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.8
    stale: tuple[str, ...] = ()
    serves: dict[str, dict[Literal["models", "adapters"], tuple[str, ...]]] = {}
    expect: HostExpect | None = None

    @property
    def uses_self(self) -> bool:
        return any(p.module == "self" for p in self.policies)


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
    """One conformance case: state to build, then what to check — one call (``expect``),
    a sequence of steps (``steps``), a statistical expectation (``stats``) or the host
    stage (``host``)."""

    name: str
    snapshot: Snapshot
    request: Request = Request()
    params: dict[str, Any] = {}
    before: tuple[Event, ...] = ()
    steps: tuple[Step, ...] = ()
    """Run after the case's snapshot is delivered, in order: events and checks."""
    candidates: tuple[NonNegInt, ...] | None = None
    in_flight: tuple[NonNegInt, ...] = ()
    """Per candidate: what the host has in flight there (ScoreInput.in_flight); () = 0s."""
    picked_since_scrape: tuple[NonNegInt, ...] = ()
    """Per candidate: picks since its last scrape (ScoreInput.picked_since_scrape)."""
    prefix_blocks: tuple[NonNegInt, ...] = ()
    """Per candidate: the request's full KV blocks as its engine hashes them
    (ScoreInput.prefix_blocks); () = not computed."""
    prefix_matched: tuple[Annotated[int, msgspec.Meta(ge=-1)], ...] = ()
    """Per candidate: leading blocks its KV events say it holds, -1 = no stream
    (ScoreInput.prefix_matched); () = all -1."""
    prefix_cleared_ms: tuple[NonNegInt, ...] = ()
    """Per candidate: when its engine last emptied its cache, 0 = never
    (ScoreInput.prefix_cleared_ms); () = all 0."""
    expect: Expect | None = None
    stats: Stats | None = None
    host: Host | None = None

    def __post_init__(self) -> None:
        n_endpoints = len(self.snapshot.endpoints)
        for field_name in ("in_flight", "picked_since_scrape", "prefix_blocks", "prefix_matched",
                           "prefix_cleared_ms"):
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
        self._check_shape()
        n = len(self.candidate_indices)
        for i, step in enumerate(self.steps):
            if isinstance(step, (Check, Pick)):
                for c in step.candidates or ():
                    if c >= n_endpoints:
                        raise ValueError(f"case {self.name!r}: steps[{i}]: candidate {c} is "
                                         f"not an endpoint index (the snapshot has "
                                         f"{n_endpoints})")
            if isinstance(step, Check):
                k = len(step.candidates) if step.candidates is not None else n_endpoints
                _check_expect(f"case {self.name!r}: steps[{i}]", step.expect, k)
                for field_name in ("prefix_blocks", "prefix_matched"):
                    given = getattr(step, field_name)
                    if given and len(given) != k:
                        raise ValueError(f"case {self.name!r}: steps[{i}]: {field_name} has "
                                         f"{len(given)} values for {k} candidates")
        if self.stats is not None:
            _check_counts(f"case {self.name!r}: stats", self.stats, n)
        h = self.host
        if h is not None:
            for p in h.policies:
                for field in ("scores", "keep"):
                    values = getattr(p, field)
                    if values is not None and len(values) != n_endpoints:
                        raise ValueError(
                            f"case {self.name!r}: host policy {p.name!r} has {len(values)} "
                            f"{field} for {n_endpoints} endpoints")
            if h.expect is not None and h.expect.totals is not None and len(
                    h.expect.totals) != n_endpoints:
                raise ValueError(f"case {self.name!r}: host.expect.totals has "
                                 f"{len(h.expect.totals)} values for {n_endpoints} endpoints")
        if self.expect is not None:
            _check_expect(f"case {self.name!r}", self.expect, n)

    def _check_shape(self) -> None:
        what = {"expect": self.expect is not None, "steps": bool(self.steps),
                "stats": self.stats is not None,
                "host.expect": self.host is not None and self.host.expect is not None}
        if self.stats is not None and (what["expect"] or what["steps"] or what["host.expect"]):
            raise ValueError(f"case {self.name!r}: `stats` is a case of its own: no `expect`, "
                             "`steps` or `host.expect` beside it")
        if self.host is not None and not self.stats and self.host.expect is None:
            raise ValueError(f"case {self.name!r}: `host` needs `host.expect` (or `stats`)")
        if self.host is not None and (what["expect"] or what["steps"] or self.before):
            raise ValueError(f"case {self.name!r}: a host-stage case takes `host.expect` (or "
                             "`stats`), not `expect`, `steps` or `before`")
        if self.host is not None and self.candidates is not None:
            raise ValueError(f"case {self.name!r}: a host-stage case scores every endpoint "
                             "(the host filters decide): leave out `candidates`")
        if not any(what.values()):
            raise ValueError(f"case {self.name!r}: nothing to check: give `expect`, `steps` "
                             "(with a check, pick or state step), `stats` or `host`")
        if what["steps"] and not what["expect"] and not any(
                isinstance(s, (Check, Pick, State)) for s in self.steps):
            raise ValueError(f"case {self.name!r}: its steps check nothing: add a `check`, "
                             "`pick` or `state` step, or `expect`")

    @property
    def assigned(self) -> tuple[tuple[int, ...], ...]:
        """The host's per-candidate counts: (in_flight, picked_since_scrape,
        prefix_blocks, prefix_matched, prefix_cleared_ms)."""
        return (self.in_flight, self.picked_since_scrape, self.prefix_blocks, self.prefix_matched,
                self.prefix_cleared_ms)

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


def _check_counts(where: str, stats: Stats, n: int) -> None:
    if len(stats.frequencies) != n:
        raise ValueError(f"{where}.frequencies has {len(stats.frequencies)} values for {n} "
                         "candidates")
    if isinstance(stats.why, tuple) and len(stats.why) != n:
        raise ValueError(f"{where}.why has {len(stats.why)} entries for {n} candidates")


def _check_expect(where: str, e: Expect, n: int) -> None:
    for field in ("scores", "keep"):
        values = getattr(e, field)
        if values is not None and len(values) != n:
            raise ValueError(f"{where}: expect.{field} has {len(values)} values for {n} candidates")
    if e.order is not None:
        bad = [p for p in e.order if p >= n]
        if bad:
            raise ValueError(
                f"{where}: expect.order position {bad[0]} is out of range for {n} candidates"
            )
    if isinstance(e.why, tuple) and len(e.why) != n:
        raise ValueError(
            f"{where}: expect.why has {len(e.why)} entries for {n} "
            "candidates (give one per candidate, or a single string)"
        )


class VectorFile(_Table, kw_only=True):
    """One TOML file of cases for one policy kind."""

    kind: Literal["lora-affinity", "prefix-cache", "load", "legacy-v1", "precise-prefix", "latency",
                  "custom",
                  "host"]
    description: str = ""
    params: dict[str, Any] = {}
    """Params every case starts from; a case's own ``params`` override them key by key."""
    cases: tuple[Case, ...] = msgspec.field(name="case", default=())

    def __post_init__(self) -> None:
        if self.kind != "host":
            return
        for c in self.cases:
            if c.host is None:
                raise ValueError(f"case {c.name!r}: a `kind = \"host\"` file holds host-stage "
                                 "cases only (give it `[case.host]`)")
            if c.host.uses_self:
                raise ValueError(f"case {c.name!r}: a `kind = \"host\"` file has no module "
                                 "under test: name a built-in or a path instead of `self`")


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
