"""The extension points and the types they share: the leaf every layer builds on.

``epick.interfaces`` declares what a scheduling cycle is made of — the snapshot a pool
publishes (:class:`PoolView`, :class:`EndpointInfo`), the per-request
:class:`Cycle`, the plugin protocols (filter, score, pre-request, post-response), the
:class:`Picker`, the :class:`Capabilities` a plugin declares (checked once, at install,
by :func:`check_plugin`), the one error a plugin raises (:class:`PluginError`) and the
one family every policy failure belongs to (:class:`PolicyFailure`, with a
:class:`FailureKind`, and :data:`STATUS`, the one table of what each kind answers). The
scheduler runs them, the runtime implements them (``WasmPolicy``), the pool builds the
snapshot, the API and the decision log read it.

Nothing here imports any of those: only :mod:`epick.abi` (the policy payloads). The
rule, with the others, is written in docs/design.md ("Layers") and enforced by the
import-linter contracts that `make lint` runs.

Modules: ``view`` (PoolView, EndpointInfo), ``cycle`` (Cycle, AssignmentView, KvCounts),
``plugins`` (the protocols, Capabilities, PluginError, Picker), ``errors``
(PolicyFailure, FailureKind, STATUS), ``flow`` (flow control's ordering and fairness
rules: FlowItem, OrderingPolicy, FairnessPolicy, ACROSS_BANDS).
"""

from epick.interfaces.cycle import AssignmentView, Cycle, KvCounts
from epick.interfaces.errors import STATUS, FailureKind, PolicyFailure, Status, status_of
from epick.interfaces.flow import ACROSS_BANDS, FairnessPolicy, FlowItem, OrderingPolicy
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
    "ACROSS_BANDS",
    "PoolView",
    "EndpointInfo",
    "Cycle",
    "AssignmentView",
    "KvCounts",
    "PluginError",
    "PolicyFailure",
    "FailureKind",
    "Status",
    "STATUS",
    "status_of",
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
    "FlowItem",
    "OrderingPolicy",
    "FairnessPolicy",
]
