"""Per-instance resource limits and the failure policy built on them."""

from __future__ import annotations

import msgspec

__all__ = ["Limits", "CONTROL_BUDGET_FACTOR", "VETTING_BACKSTOP_FACTOR"]

#: Control-plane calls (``init``, ``import_state``, ``export_state``, ``describe``,
#: ``alloc``, ``epick_abi_version``, the start function) run off the request path and may
#: touch all of a policy's state (a prefix LRU per endpoint), so they get this many
#: budgets (of fuel and of wall-clock backstop).
CONTROL_BUDGET_FACTOR = 100
#: While a module is vetted (smoke run, conformance gate) every call's wall-clock
#: backstop is this many ``budget_ms``: the verdict comes from fuel, which does not
#: depend on how busy the machine is.
VETTING_BACKSTOP_FACTOR = 100


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one policy call / instance may use, and when to give up on a policy.

    Two limits stop a call. **Fuel** is the primary one: an instruction budget, so the
    same input always gets the same verdict, however busy the machine is. The **epoch**
    deadline is a coarse wall-clock backstop for what fuel does not count (bulk memory
    and table operations, host time). Validated on construction; a bad value raises
    ``ValueError`` naming the field.
    """

    fuel: int = 10_000_000
    """Instructions one request-path call (``score``, ``filter``, ``set_snapshot``, hooks)
    may execute (wasmtime fuel: about one unit per wasm instruction). The costliest
    shipped policy uses 0.27 M on the smoke run's largest case (64 endpoints); a call
    that runs out is a ``PolicyOutOfFuel``."""
    budget_ms: float = 50.0
    """Wall-clock backstop of one request-path call, enforced by epoch interruption: a
    call is stopped after ``budget_ms`` plus at most one ticker period (``budget_ms``,
    clamped to [0.5, 100] ms). Coarse on purpose: a preempted thread must not trip it."""
    memory_bytes: int = 64 << 20
    """Cap on the instance's linear memory. A policy has exactly one memory (a second
    one is refused), so this is also the cap on all of its linear memory together;
    ``memory.grow`` past it returns -1."""
    table_elements: int = 10_000
    """Cap on the elements of any one table (``table.grow`` past it returns -1). Shipped
    policies use a few dozen."""
    tables: int = 4
    """Tables one instance may define. Tables hold at most
    ``tables * table_elements`` entries (8-16 bytes each) next to ``memory_bytes``."""
    module_bytes: int = 8 << 20
    """Largest module accepted (shipped policies: 12-115 KiB)."""
    functions: int = 10_000
    """Most functions a module may define: compile time and memory grow with them, and
    a compile cannot be interrupted (shipped policies: 14-87)."""
    globals: int = 10_000
    """Most globals a module may define."""
    breaker_failures: int = 5
    """Consecutive failures of one stage that open that stage's circuit breaker."""
    breaker_error_rate: float = 0.5
    """Share of failed calls, over the last ``breaker_window`` calls of one stage, that
    also opens its breaker (a policy failing every 2nd call never fails 5 in a row)."""
    breaker_window: int = 20
    """Calls the error rate is measured over (the rate is judged once the window is full)."""
    breaker_cooldown_s: float = 10.0
    """How long an open breaker rejects calls before one half-open trial."""
    breaker_burn_ms: float = 100.0
    """Wall-clock time a policy's failing calls may take within any one second; past
    it the policy is benched (every stage's breaker opens for ``breaker_cooldown_s``).
    A failing call may burn its whole fuel (10 M instructions: milliseconds) or its
    backstop, and each one holds a pick: this keeps a policy that fails slowly from
    holding the picks' tail for more than a moment."""

    def __post_init__(self) -> None:
        if not 1_000 <= self.fuel <= 10_000_000_000:
            raise ValueError(f"Limits.fuel must be in [1000, 1e10], got {self.fuel!r}")
        if not 0.01 <= self.budget_ms <= 60_000:
            raise ValueError(f"Limits.budget_ms must be in [0.01, 60000], got {self.budget_ms!r}")
        if not 1 << 16 <= self.memory_bytes <= 4 << 30:
            raise ValueError(
                f"Limits.memory_bytes must be in [65536, 4 GiB] (one wasm page at least), "
                f"got {self.memory_bytes!r}"
            )
        for field, low in (("table_elements", 0), ("tables", 0), ("module_bytes", 8),
                           ("functions", 1), ("globals", 0), ("breaker_window", 1)):
            value = getattr(self, field)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"Limits.{field} must be an int >= {low}, got {value!r}")
        if self.breaker_failures < 1:
            raise ValueError(f"Limits.breaker_failures must be >= 1, got {self.breaker_failures!r}")
        if not 0 < self.breaker_error_rate <= 1:
            raise ValueError(
                f"Limits.breaker_error_rate must be in (0, 1], got {self.breaker_error_rate!r}"
            )
        if not self.breaker_burn_ms > 0:
            raise ValueError(f"Limits.breaker_burn_ms must be > 0, got {self.breaker_burn_ms!r}")
        if not self.breaker_cooldown_s >= 0:
            raise ValueError(
                f"Limits.breaker_cooldown_s must be >= 0, got {self.breaker_cooldown_s!r}"
            )

    @property
    def control_budget_ms(self) -> float:
        return self.budget_ms * CONTROL_BUDGET_FACTOR

    @property
    def control_fuel(self) -> int:
        return self.fuel * CONTROL_BUDGET_FACTOR
