"""The runtime's exceptions: what can go wrong loading or calling a policy module.

::

    PolicyError                 base; .policy (module name), .export (or None), .kind
                                (epick.interfaces.PolicyFailure: the one family)
    ├── PolicyLoadError         the module cannot go live: not wasm, missing/ill-typed
    │                           export, wrong ABI version, init refused its params,
    │                           validation failed
    ├── PolicyCallError         an export returned non-zero; .status, .message (the
    │                           guest's own error text)
    ├── PolicyTrap              the guest trapped (unreachable, out-of-bounds, stack
    │                           overflow, memory cap reached…); .trap_code
    ├── PolicyTimeout           the call ran past its epoch deadline (the wall-clock
    │                           backstop); .budget_ms
    ├── PolicyOutOfFuel         the call used up its instruction budget; .fuel
    └── PolicyOutputError       the guest's output is unusable: wrong count, NaN/inf,
                                a keep byte that is not 0/1, undecodable describe

Every message starts with ``policy '<name>':`` and names the export. After a
:class:`PolicyTrap`, :class:`PolicyTimeout` or :class:`PolicyOutOfFuel` the guest's
state is whatever it was when it stopped: callers should re-instantiate (``WasmPolicy``
does).
"""

from __future__ import annotations

from epick.interfaces.errors import FailureKind, PolicyFailure

__all__ = [
    "PolicyError",
    "PolicyLoadError",
    "PolicyCallError",
    "PolicyTrap",
    "PolicyTimeout",
    "PolicyOutOfFuel",
    "PolicyOutputError",
]


class PolicyError(PolicyFailure):
    """Something went wrong with policy ``policy`` (in ``export``, when one is known).

    ``kind`` (a :class:`~epick.interfaces.FailureKind`) is set by each subclass."""

    kind = FailureKind.ERROR

    def __init__(self, policy: str, export: str | None, detail: str) -> None:
        super().__init__(f"policy {policy!r}: {detail}", policy=policy)
        self.export = export
        self.detail = detail
        """The message without the ``policy '<name>': `` prefix."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(policy={self.policy!r}, export={self.export!r}, detail={self.detail!r})"


class PolicyLoadError(PolicyError):
    """The module cannot go live. ``message`` is the guest's text when ``init`` refused."""

    kind = FailureKind.INVALID_MODULE

    def __init__(
        self, policy: str, export: str | None, detail: str, *, message: str | None = None
    ) -> None:
        super().__init__(policy, export, detail)
        self.message = message


class PolicyCallError(PolicyError):
    """An export returned a non-zero status; ``message`` is what the guest said why."""

    kind = FailureKind.ERROR

    def __init__(self, policy: str, export: str, status: int, message: str) -> None:
        super().__init__(policy, export, f"{export} returned {status}: {message}")
        self.status = status
        self.message = message


class PolicyTrap(PolicyError):
    """The guest trapped; ``trap_code`` is wasmtime's name for why (``UNREACHABLE``…)."""

    kind = FailureKind.TRAP

    def __init__(self, policy: str, export: str, trap_code: str | None, detail: str) -> None:
        super().__init__(policy, export, detail)
        self.trap_code = trap_code


class PolicyTimeout(PolicyError):
    """The call was interrupted at its epoch deadline (``budget_ms`` plus up to one tick)."""

    kind = FailureKind.TIMEOUT

    def __init__(self, policy: str, export: str, budget_ms: float) -> None:
        super().__init__(policy, export, f"{export} exceeded its {budget_ms:g} ms budget")
        self.budget_ms = budget_ms


class PolicyOutOfFuel(PolicyError):
    """The call executed its whole instruction budget (``fuel``) without returning.

    Deterministic: the same input runs out again, so it is never retried.
    """

    kind = FailureKind.OUT_OF_FUEL

    def __init__(self, policy: str, export: str, fuel: int) -> None:
        super().__init__(
            policy, export, f"{export} ran out of fuel (its budget is {fuel:,} instructions)"
        )
        self.fuel = fuel


class PolicyOutputError(PolicyError):
    """The call succeeded but what the guest wrote cannot be used."""

    kind = FailureKind.INVALID_OUTPUT
