"""The WASM policy runtime: compile, check, instantiate and call epick policy modules.

::

    rt = Runtime(Limits())                 # one Engine (fuel + epoch) + one ticker thread
    mod = rt.compile(wasm, name="lora")    # checked against policies/ABI.md
    validate(mod, params)                  # smoke-run (judged on fuel) before it goes live
    rt.keep(mod)                           # accepted: cache its compiled code
    plugin = WasmPolicy(mod, params)       # a scheduler plugin (epick.interfaces)
    ...
    rt.close()

Layers: :class:`Runtime` (Engine, ticker, artifact cache) -> :class:`PolicyModule`
(compiled + checked) -> :class:`PolicyInstance` (one Store: raw ABI calls, fast ctypes
path, raises :class:`PolicyError` subclasses) -> :class:`WasmPolicy` (the plugin adapter:
snapshot delivery, output checks, stats; raises ``epick.interfaces.PluginError``), which
runs its instance through a :class:`~epick.runtime.supervisor.Supervisor` (breakers,
recovery, spares) and keeps its last good state in
:class:`~epick.runtime.checkpoints.Checkpoints`. A pick whose scorers are all
WasmPolicies runs their ``score`` calls in one C call (:mod:`epick.runtime.scoreall`,
``make native``; without the library, one by one in Python, with the same results).

Threading rule: a wasmtime Store — so a PolicyInstance, and a WasmPolicy — is used by
one thread at a time. The service runs every pick on its event-loop thread; a second
thread calling into an instance mid-call gets a ``RuntimeError`` (never a corrupted
Store). Engine, Runtime.compile and PolicyModule are thread-safe.
"""

from epick.runtime.errors import (
    PolicyCallError,
    PolicyError,
    PolicyLoadError,
    PolicyOutOfFuel,
    PolicyOutputError,
    PolicyTimeout,
    PolicyTrap,
)
from epick.runtime.instance import PolicyInstance
from epick.runtime.limits import Limits
from epick.runtime.module import PolicyModule
from epick.runtime.plugin import WasmPolicy
from epick.runtime.runtime import Runtime
from epick.runtime.validate import validate

__all__ = [
    "Limits",
    "Runtime",
    "PolicyModule",
    "PolicyInstance",
    "WasmPolicy",
    "validate",
    "PolicyError",
    "PolicyLoadError",
    "PolicyCallError",
    "PolicyTrap",
    "PolicyTimeout",
    "PolicyOutOfFuel",
    "PolicyOutputError",
]
