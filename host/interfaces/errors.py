"""The one error family for a policy that failed, its kinds, and the one status table.

Every way a policy can fail is a :class:`PolicyFailure` with a :class:`FailureKind`::

    PolicyFailure                     .kind, .policy (None when no policy is known)
    ├── runtime.PolicyError           a call into a module failed (trap, timeout, …)
    │                                 or the module cannot load (invalid-module)
    ├── interfaces.PluginError        a plugin failed one call of a scheduling cycle
    ├── interfaces.PluginSpecError    a plugin is not what it declares (spec)
    ├── policy_manager.PolicyRejected a module was refused on its way to live
    │   └── LoadsBusy                 too many loads waiting (busy)
    └── conformance.ConformanceError  the conformance run cannot start (uncheckable)

and :data:`STATUS` maps each kind to the status a front end answers with: a gRPC code
(by name: this leaf imports no gRPC; ``epick.api.status`` turns it into a
``grpc.StatusCode``) and an HTTP status. The kinds' values are the ``kind`` label of
``epick_policy_errors_total`` and what ``Explanation.skipped_policies`` says, so the
kinds that existed as strings keep their spelling.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["FailureKind", "PolicyFailure", "Status", "STATUS", "status_of"]


class FailureKind(enum.StrEnum):
    """Why a policy failed. A ``str``: it is a metric label and reads as its value."""

    # -- on the way to live (load, reload, hot swap) ----------------------------------
    INVALID_MODULE = "invalid-module"
    """Not usable WebAssembly, over a cap, a missing or ill-typed export, a wrong ABI
    version, ``init`` refused its params, or the smoke run failed."""
    UNREADABLE = "unreadable"
    """The module file cannot be read (missing, not a regular file, a symlink, over the
    file cap)."""
    NONCONFORMANT = "nonconformant"
    """It fails the conformance vectors or properties for its kind."""
    UNCHECKABLE = "uncheckable"
    """The conformance run cannot start: an unknown kind, a bad vector file."""
    SPEC = "spec"
    """A plugin does not implement what its capabilities declare."""
    BAD_ARGUMENT = "bad-argument"
    """What was asked is malformed: a name off the pattern, a negative weight."""
    BUSY = "busy"
    """Too many loads are waiting to be vetted; try again later."""
    CONFLICT = "conflict"
    """The live set changed while this change was prepared; try again."""
    # -- one call into a module (while serving, or the smoke run of a load) ----------
    ERROR = "error"
    """An export returned a non-zero status (the guest's own error)."""
    TRAP = "trap"
    TIMEOUT = "timeout"
    """The wall-clock backstop interrupted the call."""
    OUT_OF_FUEL = "out-of-fuel"
    INVALID_OUTPUT = "invalid-output"
    """The call returned, but what the guest wrote cannot be used."""
    CIRCUIT_OPEN = "circuit-open"
    """The policy is benched by its breaker; the call was not made."""
    RECOVERING = "recovering"
    """The policy's instance is being re-created; the call was not made."""
    FAILED_LIVE = "failed-live"
    """Replay: the policy failed at this point of the recorded run."""


class PolicyFailure(Exception):
    """A policy failed; ``kind`` says how, ``policy`` names it (when one is known).

    Subclasses set ``kind`` as a class default or pass it per instance."""

    kind: FailureKind = FailureKind.ERROR
    policy: str | None = None

    def __init__(self, message: str, *, kind: FailureKind | str | None = None,
                 policy: str | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = FailureKind(kind)
        if policy is not None:
            self.policy = policy


class Status(NamedTuple):
    """What a front end answers for a failure: the gRPC code's name and an HTTP status."""

    grpc: str
    http: int


_REFUSED = Status("FAILED_PRECONDITION", 422)  # the request was fine; the module is not

#: The one table: every kind's status. A call-time kind (trap, timeout, …) reaches a
#: client only when a load's smoke run or ``init`` fails (at pick time the policy is
#: skipped for that request), so it is the load's refusal.
STATUS: MappingProxyType[FailureKind, Status] = MappingProxyType({
    FailureKind.INVALID_MODULE: _REFUSED,
    FailureKind.UNREADABLE: _REFUSED,
    FailureKind.NONCONFORMANT: _REFUSED,
    FailureKind.UNCHECKABLE: _REFUSED,
    FailureKind.SPEC: _REFUSED,
    FailureKind.BAD_ARGUMENT: Status("INVALID_ARGUMENT", 400),
    FailureKind.BUSY: Status("RESOURCE_EXHAUSTED", 429),
    FailureKind.CONFLICT: Status("ABORTED", 409),
    FailureKind.ERROR: _REFUSED,
    FailureKind.TRAP: _REFUSED,
    FailureKind.TIMEOUT: _REFUSED,
    FailureKind.OUT_OF_FUEL: _REFUSED,
    FailureKind.INVALID_OUTPUT: _REFUSED,
    FailureKind.CIRCUIT_OPEN: Status("UNAVAILABLE", 503),
    FailureKind.RECOVERING: Status("UNAVAILABLE", 503),
    FailureKind.FAILED_LIVE: _REFUSED,
})


def status_of(failure: PolicyFailure | FailureKind) -> Status:
    """The status for a failure (or a kind), from :data:`STATUS`."""
    kind = failure if isinstance(failure, FailureKind) else failure.kind
    return STATUS[kind]
