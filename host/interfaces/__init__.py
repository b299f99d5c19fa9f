"""The extension points and the types they share: the leaf every layer builds on.

``epick.interfaces`` declares what a scheduling cycle is made of — the snapshot a pool
publishes (:class:`PoolView`, :class:`EndpointInfo`), the per-request
:class:`Cycle`, the plugin protocols (filter, score, pre-request, post-response), the
:class:`Picker`, the :class:`Capabilities` a plugin declares (checked once, at install,
by :func:`check_plugin`) and the one error a plugin raises (:class:`PluginError`). The
scheduler runs them, the runtime implements them (``WasmPolicy``), the pool builds the
snapshot, the API and the decision log read it.

Nothing here imports any of those: only :mod:`epick.abi` (the policy payloads). The
rule, with the others, is written in docs/design.md ("Layers") and enforced by the
import-linter contracts that `make lint` runs.

Modules: ``snapshot`` (PoolView, EndpointInfo), ``cycle`` (Cycle, AssignmentView, KvCounts),
``plugins`` (the protocols, Capabilities, PluginError, Picker).
"""

from epick.interfaces.cycle import AssignmentView, Cycle, KvCounts
from epick.interfaces.plugins import (
    EXTENSION_POINTS,
    Capabilities,
    FilterPlugin,
    Picker,
    Plugin,
    PluginError,
    PluginSpecError,
    PostResponsePlugin,
    PreRequestPlugin,
    ScorePlugin,
    check_plugin,
)
from epick.interfaces.view import EndpointInfo, PoolView

__all__ = [
    "PoolView",
    "EndpointInfo",
    "Cycle",
    "AssignmentView",
    "KvCounts",
    "PluginError",
    "Capabilities",
    "EXTENSION_POINTS",
    "Plugin",
    "check_plugin",
    "PluginSpecError",
    "FilterPlugin",
    "ScorePlugin",
    "PreRequestPlugin",
    "PostResponsePlugin",
    "Picker",
]
