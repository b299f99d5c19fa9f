"""Flow control's extension points: how requests waiting in one band are ordered.

Flow control (``epick.flow``, docs/flow-control.md) holds requests while the pool is
saturated, in one queue per (priority band, fairness id). Two rules decide which waiting
request is dispatched next, and both are plugins behind these protocols:

- :class:`FairnessPolicy`: which flow (fairness id) of a band goes next;
- :class:`OrderingPolicy`: which request of a flow goes next (its sort key).

The band is chosen by the controller itself (highest priority first, with a bounded
starvation guard), or, with ``[flow_control] precedence = "fairness"``, below
``protected_priority`` the flow is chosen first (:class:`FairnessPolicy` called with the
band :data:`ACROSS_BANDS` and every flow waiting in those bands) and then that flow's own
highest band. Plugins see only :class:`FlowItem` facts, never the request's body.
They run on the thread that owns the controller (the event loop), one call at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["FlowItem", "OrderingPolicy", "FairnessPolicy", "ACROSS_BANDS"]

ACROSS_BANDS = -(1 << 62)
"""The ``band`` a :class:`FairnessPolicy` is asked about when flows take turns across
every band below ``protected_priority`` (``precedence = "fairness"``); no real band."""


class FlowItem(Protocol):
    """What an ordering or fairness rule may read of one waiting request."""

    flow: str
    """Its fairness id (``""``: the default flow)."""
    priority: int
    """Its band: higher first; negative = sheddable."""
    seq: int
    """Arrival order across the whole controller (unique, increasing)."""
    enqueued: float
    """When it arrived, on the controller's clock (seconds)."""
    slo_deadline: float | None
    """``enqueued + slo_ttft_ms`` when the request carries a TTFT objective, else None."""
    expires: float
    """When it stops waiting (its TTL or the caller's deadline, the earlier)."""
    size: int
    """Bytes it holds (the prompt), counted against the band's ``max_bytes``."""


@runtime_checkable
class OrderingPolicy(Protocol):
    """Orders the requests of one flow: the smallest key is dispatched first."""

    name: str

    def key(self, item: FlowItem) -> tuple:
        """A sort key, fixed for the item's life (it is computed once, at arrival)."""
        ...


@runtime_checkable
class FairnessPolicy(Protocol):
    """Chooses which flow of a band is served next."""

    name: str

    def choose(self, band: int, flows: Sequence[str]) -> str:
        """One of ``flows`` (the band's non-empty flows, in the order they first
        queued; never empty; for :data:`ACROSS_BANDS`, the flows waiting in any band
        below ``protected_priority``). Called once per dispatch from that band, so a stateful
        rule (round-robin) may advance on each call."""
        ...

    def forget(self, band: int, flow: str) -> None:
        """``flow`` emptied in ``band``: drop any state kept for it."""
        ...
