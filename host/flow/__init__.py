"""Flow control: hold, order and shed requests while the pool is saturated.

``detector`` (is there room: scraped queue/KV plus what epick sent since each scrape,
what it has in flight, and the reserve for urgent requests),
``rules`` (the ordering and fairness plugins and their registries), ``controller`` (the
queues per (priority band, fairness id), dispatch, TTL, capacity; a clock seam so a
simulator in virtual time can drive it). docs/flow-control.md has the semantics.
"""

from epick.flow.controller import FlowController, QueueFull, Ticket
from epick.flow.detector import SaturationDetector
from epick.flow.rules import FAIRNESS, ORDERINGS, make_fairness, make_ordering

__all__ = ["FlowController", "QueueFull", "Ticket", "SaturationDetector", "FAIRNESS",
           "ORDERINGS", "make_fairness", "make_ordering"]
