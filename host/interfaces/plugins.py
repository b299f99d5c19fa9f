"""The scheduler's extension points — every plugin implements one or more of these.

One scheduling cycle, for one request (seed 001; the kube-scheduler framework):

    filter  (hard: drop candidates)   host filters first, then filter policies, in order
    score   (soft: one score per candidate in [0, 1])   every live scorer, weighted sum
    pick    (max total, seeded random tie-break; or weighted random)   primary + fallbacks
    pre_request   (after the pick: policies record it — LoRA history, prefix LRU)
    ...later, when the gateway reports completion...
    post_response

Plugins know nothing of each other; they share only the read-only :class:`Cycle`.
Each declares once, in ``capabilities`` (:class:`Capabilities`), which of these it
implements; :func:`check_plugin` holds it to that when it is installed (a
``PolicyEntry`` is made), so the runner never probes a plugin for methods.
A plugin that fails raises :class:`PluginError`; the runner decides the consequence
(a failed scorer is skipped for that request, a failed filter is skipped too — failing
open — and both are counted).

Threading: a cycle runs start to finish on the thread that owns the scheduler (the
service's event-loop thread). WASM Stores are single-threaded, so plugins may assume it.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import numpy as np

from epick import abi
from epick.interfaces.cycle import Cycle
from epick.interfaces.errors import FailureKind, PolicyFailure

__all__ = [
    "Capabilities",
    "EXTENSION_POINTS",
    "Plugin",
    "check_plugin",
    "PluginSpecError",
    "PluginError",
    "FilterPlugin",
    "ScorePlugin",
    "PreRequestPlugin",
    "PostResponsePlugin",
    "Picker",
]


class Capabilities(enum.Flag):
    """What a plugin implements, declared by the plugin (``plugin.capabilities``)."""

    NONE = 0
    FILTER = enum.auto()
    """``filter(cycle, candidates)`` (:class:`FilterPlugin`)."""
    SCORE = enum.auto()
    """``score(cycle, candidates)`` (:class:`ScorePlugin`)."""
    PRE_REQUEST = enum.auto()
    """``pre_request(cycle, endpoint)`` (:class:`PreRequestPlugin`)."""
    POST_RESPONSE = enum.auto()
    """``post_response(event)`` (:class:`PostResponsePlugin`)."""
    STATE = enum.auto()
    """``export_state() -> bytes`` and ``import_state(bytes)``: state is handed over when
    a new version replaces it."""
    SCORES_IN_RANGE = enum.auto()
    """``score`` already returns finite values in [0, 1] (the runtime clamps), so the
    runner skips its own clip."""


#: The capabilities that put a plugin into a stage; a plugin needs at least one.
EXTENSION_POINTS = (Capabilities.FILTER | Capabilities.SCORE | Capabilities.PRE_REQUEST
                    | Capabilities.POST_RESPONSE)

_METHODS = {
    Capabilities.FILTER: ("filter",),
    Capabilities.SCORE: ("score",),
    Capabilities.PRE_REQUEST: ("pre_request",),
    Capabilities.POST_RESPONSE: ("post_response",),
    Capabilities.STATE: ("export_state", "import_state"),
    Capabilities.SCORES_IN_RANGE: ("score",),
}


@runtime_checkable
class Plugin(Protocol):
    """What every plugin has: a name and its declared capabilities."""

    name: str
    capabilities: Capabilities


class PluginSpecError(PolicyFailure, TypeError):
    """A plugin is not what it declares (refused at install). ``plugin`` names it."""

    kind = FailureKind.SPEC

    def __init__(self, plugin: str, reason: str) -> None:
        super().__init__(f"plugin {plugin!r}: {reason}", policy=plugin)
        self.plugin = plugin
        self.reason = reason


def check_plugin(name: str, plugin: object) -> Capabilities:
    """The capabilities ``plugin`` declares, once it is held to them; raise
    :class:`PluginSpecError` naming ``name`` if it declares none, declares no extension
    point, or lacks a method one of its capabilities needs."""
    caps = getattr(plugin, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise PluginSpecError(name, f"{type(plugin).__name__} declares no `capabilities` "
                              f"(an epick.interfaces.Capabilities), got {caps!r}")
    if not caps & EXTENSION_POINTS:
        raise PluginSpecError(name, f"implements no extension point (capabilities "
                              f"{caps!r}; expected at least one of filter, score, "
                              "pre_request, post_response)")
    for cap, methods in _METHODS.items():
        if cap in caps:
            for method in methods:
                if not callable(getattr(plugin, method, None)):
                    raise PluginSpecError(name, f"declares {cap.name} but has no "
                                          f"{method}() method")
    return caps


class PluginError(PolicyFailure):
    """A plugin failed for this call: it trapped, timed out, errored or misbehaved.

    ``plugin`` names who failed, ``stage`` where (``score``, ``filter``, ``pre_request``…),
    ``kind`` what happened (a :class:`FailureKind`: ``error``, ``trap``, ``timeout``,
    ``invalid-output``, ``circuit-open``…; a plain string naming one is taken too) — the
    label used by metrics.
    """

    def __init__(self, plugin: str, stage: str, kind: FailureKind | str, reason: str) -> None:
        kind = FailureKind(kind)
        super().__init__(f"policy {plugin!r} {stage}: {kind}: {reason}", kind=kind,
                         policy=plugin)
        self.plugin = plugin
        self.stage = stage
        self.reason = reason


@runtime_checkable
class FilterPlugin(Protocol):
    """Hard requirement: keep only candidates that may serve the request."""

    name: str

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """Return the kept subset of ``candidates`` (indices into the snapshot), in order.

        Raise :class:`PluginError` on failure; the runner then keeps the input (fail open).
        An empty result means nothing can serve the request.
        """
        ...


@runtime_checkable
class ScorePlugin(Protocol):
    """Soft preference: one score per candidate."""

    name: str

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        """Return a float64 array, one score per candidate in order, each finite in [0, 1].

        Raise :class:`PluginError` on failure; the runner then skips this plugin for this
        request. Must not mutate state that changes later scores: recording a decision is
        ``pre_request``'s job.
        """
        ...

    # Optional: ``score_group``, a function ``(cycle, entries, candidates, keep)`` shared
    # by a plugin type. When every live scorer of a policy set has the same one, the
    # scheduler calls it once per pick for all of them (in order) instead of each
    # ``score``. It returns ``(totals, results, ns)`` — per entry its scores or its
    # PluginError (``results`` may be None when all succeeded and ``keep`` is false), and
    # its call's ns (None if it failed); ``totals`` Σ weight × scores or None (the
    # scheduler sums) — or None to have the scheduler call each ``score`` (nothing was
    # called then).
    # WasmPolicy's runs every scorer in one native call (epick.runtime.scoreall).


@runtime_checkable
class PreRequestPlugin(Protocol):
    """Runs once per successful pick, after it."""

    name: str

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        """Record that ``endpoint`` (an address) was picked for ``cycle.request``."""
        ...

    # Optional: ``pre_request_group``, a function ``(cycle, entries, endpoint, failed,
    # *args)`` shared by a plugin type. When every pre_request entry of a policy set has
    # the same one, the scheduler calls it once per pick instead of each ``pre_request``:
    # it runs every entry's hook in order and hands each PluginError to
    # ``failed(exc, *args)``. WasmPolicy's: epick.runtime.plugin.pre_request_all.


@runtime_checkable
class PostResponsePlugin(Protocol):
    """Runs when the gateway reports completion."""

    name: str

    def post_response(self, event: abi.PostResponseEvent) -> None:
        """Idempotent; tolerates an event with no matching ``pre_request``."""
        ...


class Picker(Protocol):
    """Turns the weighted totals into the answer: primary first, then fallbacks
    (``epick.scheduler.pickers`` has the two the config names)."""

    name: str

    def pick(self, totals: np.ndarray, count: int, seed: int | None) -> list[int]:
        """Return up to ``count`` positions into ``totals``, best first."""
        ...
