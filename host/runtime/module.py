"""A compiled, checked policy module: the unit that gets instantiated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import wasmtime

from epick.runtime.instance import PolicyInstance

if TYPE_CHECKING:
    from epick.runtime.runtime import Runtime

__all__ = ["PolicyModule"]


@dataclass(frozen=True, eq=False)
class PolicyModule:
    """A module that passed the load-time checks (exports, signatures, ABI version).

    Made by :meth:`Runtime.compile`; shareable between threads (each instance gets its
    own Store).
    """

    name: str
    sha256: str
    """Hex digest of the wasm bytes: the module's identity and cache key."""
    exports: frozenset[str]
    """Every export name of the module (ABI functions, ``memory``, anything else)."""
    size: int
    """Size of the wasm bytes."""
    runtime: Runtime = field(repr=False)
    _module: wasmtime.Module = field(repr=False)

    def instantiate(self, params: dict[str, Any] | None = None) -> PolicyInstance:
        """A new Store and instance, ``init``-ed with ``params`` (``{}`` when ``None``)."""
        return PolicyInstance(self, params)
