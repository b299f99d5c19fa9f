"""A compiled, checked policy module: the unit that gets instantiated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import wasmtime

from epick.runtime.instance import PolicyInstance
from epick.runtime.seams import Sandbox

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
    runtime: Sandbox = field(repr=False)
    """The :class:`~epick.runtime.Runtime` that compiled it."""
    _module: wasmtime.Module = field(repr=False)
    has_start: bool = False
    """The module has a start function (it runs at every instantiation)."""
    vetting: bool = False
    """Instances are judged on fuel alone: every call's wall-clock backstop is
    ``VETTING_BACKSTOP_FACTOR`` budgets (see :meth:`for_vetting`)."""
    _cached: bool = field(default=False, repr=False)
    abi_version: int = 1
    """What its ``epick_abi_version`` returned (one of :data:`epick.abi.ABI_VERSIONS`):
    version 2 instances take flat score frames and carry ``pre_request`` events with the
    next ``score``/``filter`` (policies/ABI.md)."""

    def instantiate(self, params: dict[str, Any] | None = None) -> PolicyInstance:
        """A new Store and instance, ``init``-ed with ``params`` (``{}`` when ``None``)."""
        return PolicyInstance(self, params)

    def for_vetting(self) -> PolicyModule:
        """This module, with instances whose verdicts depend on fuel, not the clock: the
        smoke run and the conformance gate use it, so a busy machine cannot fail them."""
        return dataclasses.replace(self, vetting=True)
