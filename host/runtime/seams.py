"""What an instance needs from the layers above it, as Protocols.

The runtime's layers import one way: ``runtime`` (compiles) -> ``module`` (a compiled
module) -> ``instance`` (one Store). An instance still reads its module's and its
runtime's settings; naming them through these Protocols instead of importing
:class:`~epick.runtime.module.PolicyModule` and :class:`~epick.runtime.runtime.Runtime`
keeps the arrows pointing down, even for type checkers
(``tests/runtime/test_runtime_imports.py`` guards it).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol

import wasmtime

from epick.runtime.limits import Limits

__all__ = ["Compiled", "Sandbox", "Ticker"]


class Ticker(Protocol):
    @property
    def running(self) -> bool: ...


class Sandbox(Protocol):
    """What instances need from the runtime that compiled their module: its limits,
    Stores with every cap set, the epoch ticker, the rebuild thread."""

    limits: Limits
    ticker: Ticker

    def new_store(self, *, backstop_ms: float) -> wasmtime.Store: ...

    def ticks_for(self, budget_ms: float) -> int: ...

    def fuel_for(self, fuel: int) -> int: ...

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future: ...

    def _check_open(self) -> None: ...


class Compiled(Protocol):
    """What an instance is made from (a :class:`~epick.runtime.module.PolicyModule`)."""

    name: str
    sha256: str
    exports: frozenset[str]
    has_start: bool
    vetting: bool
    runtime: Sandbox
    _module: wasmtime.Module
