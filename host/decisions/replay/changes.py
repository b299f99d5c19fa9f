"""What a replay is asked to change, and the error it gives when it cannot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Changes", "ReplayError"]


class ReplayError(ValueError):
    """The replay cannot run as asked (a module is missing, a change names no policy...)."""


@dataclass
class Changes:
    """What to change in the recorded policy set (all keyed by policy name)."""

    modules: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    """name -> (wasm bytes, where they came from): replace or add that policy's module."""
    weights: dict[str, float] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> params merged over the recorded ones."""

    @property
    def empty(self) -> bool:
        return not (self.modules or self.weights or self.params)
