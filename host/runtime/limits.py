"""Per-instance resource limits and the failure policy built on them."""

from __future__ import annotations

import msgspec

__all__ = ["Limits", "CONTROL_BUDGET_FACTOR"]

#: Control-plane calls (``init``, ``import_state``, ``export_state``, ``describe``,
#: ``alloc``, ``epick_abi_version``) run off the request path and may touch all of a
#: policy's state (a prefix LRU per endpoint), so they get this many budgets.
CONTROL_BUDGET_FACTOR = 100


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much time and memory one policy call / instance may use, and when to give up.

    Validated on construction; a bad value raises ``ValueError`` naming the field.
    """

    budget_ms: float = 1.0
    """Wall-clock budget of one request-path call (``score``, ``filter``, ``set_snapshot``,
    hooks), enforced by epoch interruption: a call is stopped after ``budget_ms`` plus at
    most one ticker period (``budget_ms``, at least 0.5 ms)."""
    memory_bytes: int = 64 << 20
    """Cap on one instance's linear memory; ``memory.grow`` past it returns -1."""
    breaker_failures: int = 5
    """Consecutive failures that open a ``WasmPolicy``'s circuit breaker."""
    breaker_cooldown_s: float = 10.0
    """How long an open breaker rejects calls before one half-open trial."""

    def __post_init__(self) -> None:
        if not 0.01 <= self.budget_ms <= 60_000:
            raise ValueError(f"Limits.budget_ms must be in [0.01, 60000], got {self.budget_ms!r}")
        if not 1 << 16 <= self.memory_bytes <= 4 << 30:
            raise ValueError(
                f"Limits.memory_bytes must be in [65536, 4 GiB] (one wasm page at least), "
                f"got {self.memory_bytes!r}"
            )
        if self.breaker_failures < 1:
            raise ValueError(f"Limits.breaker_failures must be >= 1, got {self.breaker_failures!r}")
        if not self.breaker_cooldown_s >= 0:
            raise ValueError(
                f"Limits.breaker_cooldown_s must be >= 0, got {self.breaker_cooldown_s!r}"
            )

    @property
    def control_budget_ms(self) -> float:
        return self.budget_ms * CONTROL_BUDGET_FACTOR
