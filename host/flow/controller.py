"""The queues in front of the scheduler: one per (priority band, fairness id).

A request arrives with a band (higher first; negative = sheddable), a fairness id, a
size and optionally a TTFT objective and a deadline. :meth:`FlowController.submit`:

- nothing waits and the pool has room (:class:`~epick.flow.detector.SaturationDetector`):
  ``None`` -- the caller schedules it now, inside :attr:`FlowController.room` (the
  endpoints with room, ``None``: all), nothing was queued (the unsaturated path);
- the band is full (``max_requests`` / ``max_bytes``): :class:`QueueFull`;
- else a :class:`Ticket`, queued. It leaves exactly once, through ``on_dispatch(ticket)``
  (room came: the callback schedules it, synchronously and inside :attr:`room`, so the
  pick lands where there is room and is counted in ``picked_since_scrape`` before the
  next request is let through) or
  ``on_refuse(ticket, outcome)`` (``expired``: its TTL or deadline passed;
  ``unavailable``: it expired while no endpoint had fresh metrics), or
  :meth:`FlowController.cancel` (the caller went away).

Dispatch order (:meth:`FlowController.pump`, while there is room): the highest non-empty
band, unless a lower one has been passed over ``starvation_limit`` dispatches in a row
(then that one: the highest such); within the band the :class:`FairnessPolicy` picks the
flow; within the flow the :class:`OrderingPolicy`'s smallest key goes.

Time comes from ``clock`` (seconds; ``time.monotonic`` by default): a simulator in virtual
time passes its own and calls :meth:`pump` itself; the service's driver
(``epick.api.decide.Decider.run``) pumps every ``poll_ms`` while anything waits. Touched
only from one thread (the event loop).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from epick import telemetry
from epick.config import FlowControlConfig
from epick.flow.detector import Counts, SaturationDetector
from epick.flow.rules import make_fairness, make_ordering
from epick.interfaces import PoolView

__all__ = ["FlowController", "Ticket", "QueueFull"]


class QueueFull(Exception):
    """The band cannot hold one more request (``limit``: ``max_requests`` or
    ``max_bytes``)."""

    def __init__(self, priority: int, limit: str, value: int) -> None:
        super().__init__(f"flow control: priority band {priority} is full "
                         f"([flow_control] {limit} = {value})")
        self.priority = priority
        self.limit = limit


@dataclass(slots=True, eq=False)
class Ticket:
    """One waiting request (an :class:`epick.interfaces.FlowItem`)."""

    flow: str
    priority: int
    seq: int
    enqueued: float
    slo_deadline: float | None
    expires: float
    size: int
    payload: object = None
    """Whatever the caller needs to finish it (the Decider's pick)."""
    key: tuple = ()
    done: bool = False
    outcome: str = ""
    """How it left: ``dispatched``, ``expired``, ``unavailable``, ``cancelled``."""
    left: float = 0.0
    """When it left (clock seconds)."""
    labels: tuple[str, str] = ("", "")

    @property
    def wait_s(self) -> float:
        return self.left - self.enqueued


@dataclass(slots=True)
class _Flow:
    heap: list = field(default_factory=list)  # (key, ticket); dead tickets skipped
    live: int = 0


@dataclass(slots=True)
class _Band:
    flows: dict[str, _Flow] = field(default_factory=dict)  # non-empty, first-queued order
    count: int = 0
    bytes: int = 0
    skipped: int = 0


def _noop(*_args) -> None:
    pass


class FlowController:
    def __init__(self, config: FlowControlConfig, *, view: Callable[[], PoolView],
                 counts: Counts, on_dispatch: Callable[[Ticket], None] = _noop,
                 on_refuse: Callable[[Ticket, str], None] = _noop,
                 clock: Callable[[], float] = time.monotonic, metrics: bool = True) -> None:
        self._view = view
        self._counts = counts
        self.on_dispatch = on_dispatch
        self.on_refuse = on_refuse
        self.clock = clock
        self.metrics = metrics
        self._bands: dict[int, _Band] = {}
        self._expiry: list = []  # (expires, seq, ticket)
        self._seq = itertools.count()
        self._count = 0
        self._labelled: set[str] = set()
        self._direct: dict[int, object] = {}  # priority -> its bound "direct" counter
        #: After :meth:`has_room`: the addresses with room when some endpoint has none
        #: (a pick let through now must stay inside them), else ``None``.
        self.room: tuple[str, ...] | None = None
        self.configure(config)

    def configure(self, config: FlowControlConfig) -> None:
        """Apply a (reloaded) ``[flow_control]``: thresholds, capacities and rules. A new
        ordering applies to requests that arrive from now on."""
        old = getattr(self, "config", None)
        self.config = config
        self.detector = SaturationDetector(config.queue_threshold, config.kv_threshold)
        if old is None or old.ordering != config.ordering:
            self.ordering = make_ordering(config.ordering)
        if (old is None or old.fairness != config.fairness
                or old.fairness_weights != config.fairness_weights):
            self.fairness = make_fairness(config.fairness, config.fairness_weights)

    # -- state -------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._count

    def waiting_in(self, priority: int) -> int:
        band = self._bands.get(priority)
        return band.count if band is not None else 0

    def has_room(self) -> bool:
        """Whether some endpoint has room; sets :attr:`room` (which ones)."""
        view = self._view()
        if not view.info:
            self.room = None
            return True  # nothing to wait for: the scheduler answers unavailable
        room = self.detector.with_room(view, self._counts)
        if self.metrics:
            telemetry.FLOW_POOL_SATURATION.set(1.0 - len(room) / len(view.info))
        # Dispatch only to endpoints with room: the scheduler's favourite may be full.
        self.room = room if len(room) < len(view.info) else None
        return bool(room)

    # -- arrivals ----------------------------------------------------------------------

    def submit(self, *, flow: str, priority: int, size: int = 0,
               slo_ttft_ms: int | None = None, deadline: float | None = None,
               payload: object = None) -> Ticket | None:
        """Queue one request, or ``None`` when it may go now (see the module doc); raises
        :class:`QueueFull`. ``deadline``: the caller's own, on this clock."""
        if not self._count and self.has_room():
            if self.metrics:
                child = self._direct.get(priority)
                if child is None:
                    child = self._direct[priority] = telemetry.FLOW_DISPATCHES.labels(
                        str(priority), "direct")
                child.inc()
            return None
        cfg = self.config
        band = self._bands.get(priority)
        count, size_now = (band.count, band.bytes) if band is not None else (0, 0)
        if count + 1 > cfg.max_requests:
            self._full(priority, "max_requests", cfg.max_requests)
        if size_now + size > cfg.max_bytes:
            self._full(priority, "max_bytes", cfg.max_bytes)
        now = self.clock()
        expires = now + cfg.ttl_ms / 1000
        if deadline is not None and deadline < expires:
            expires = deadline
        ticket = Ticket(flow=flow, priority=priority, seq=next(self._seq), enqueued=now,
                        slo_deadline=None if slo_ttft_ms is None else now + slo_ttft_ms / 1000,
                        expires=expires, size=size, payload=payload)
        ticket.key = self.ordering.key(ticket)
        if band is None:
            band = self._bands[priority] = _Band()
        f = band.flows.get(flow)
        if f is None:
            f = band.flows[flow] = _Flow()
        heapq.heappush(f.heap, (ticket.key, ticket.seq, ticket))
        f.live += 1
        band.count += 1
        band.bytes += size
        self._count += 1
        heapq.heappush(self._expiry, (expires, ticket.seq, ticket))
        if self.metrics:
            ticket.labels = (str(priority), self._label(flow))
            telemetry.FLOW_QUEUE_REQUESTS.labels(*ticket.labels).inc()
            telemetry.FLOW_QUEUE_BYTES.labels(*ticket.labels).inc(size)
        # Someone may have waited for this arrival's room (or a lower band's turn).
        self.pump()
        return ticket

    def _full(self, priority: int, limit: str, value: int):
        if self.metrics:
            telemetry.FLOW_QUEUE_WAIT.labels("full").observe(0.0)
        raise QueueFull(priority, limit, value)

    def _label(self, flow: str) -> str:
        if flow in self._labelled:
            return flow
        if len(self._labelled) < self.config.metrics_max_flows:
            self._labelled.add(flow)
            return flow
        return "other"

    # -- leaving -----------------------------------------------------------------------

    def _remove(self, ticket: Ticket, outcome: str, now: float) -> None:
        ticket.done, ticket.outcome, ticket.left = True, outcome, now
        band = self._bands[ticket.priority]
        f = band.flows[ticket.flow]
        f.live -= 1
        if not f.live:
            del band.flows[ticket.flow]
            self.fairness.forget(ticket.priority, ticket.flow)
        band.count -= 1
        band.bytes -= ticket.size
        if not band.count:
            del self._bands[ticket.priority]
        self._count -= 1
        if self.metrics:
            telemetry.FLOW_QUEUE_REQUESTS.labels(*ticket.labels).dec()
            telemetry.FLOW_QUEUE_BYTES.labels(*ticket.labels).dec(ticket.size)
            telemetry.FLOW_QUEUE_WAIT.labels(outcome).observe(max(0.0, ticket.wait_s))
            if outcome == "dispatched":
                telemetry.FLOW_DISPATCHES.labels(ticket.labels[0], "queued").inc()

    def cancel(self, ticket: Ticket) -> bool:
        """The caller went away: drop it (False if it had already left)."""
        if ticket.done:
            return False
        self._remove(ticket, "cancelled", self.clock())
        return True

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, _, ticket = heapq.heappop(expiry)
            if ticket.done:
                continue
            view = self._view()
            outcome = "expired" if view.fresh else "unavailable"
            self._remove(ticket, outcome, now)
            self.on_refuse(ticket, outcome)
        if not self._count:
            expiry.clear()  # only dead entries remain

    def _next(self) -> Ticket:
        """The next ticket to dispatch (the queue is not empty)."""
        bands = sorted(self._bands, reverse=True)
        chosen = bands[0]
        limit = self.config.starvation_limit
        if limit and len(bands) > 1:
            for b in bands[1:]:
                if self._bands[b].skipped >= limit:
                    chosen = b
                    break
            for b in bands:
                band = self._bands[b]
                band.skipped = 0 if b == chosen else band.skipped + 1
        band = self._bands[chosen]
        flows = list(band.flows)
        flow = band.flows[flows[0] if len(flows) == 1
                          else self.fairness.choose(chosen, flows)]
        while True:
            _, _, ticket = heapq.heappop(flow.heap)
            if not ticket.done:
                return ticket

    def pump(self) -> int:
        """Expire what is overdue, then dispatch while there is room; the number
        dispatched."""
        if not self._count:
            return 0
        now = self.clock()
        self._expire(now)
        n = 0
        while self._count and self.has_room():
            ticket = self._next()
            self._remove(ticket, "dispatched", now)
            n += 1
            self.on_dispatch(ticket)
        return n

    def drain(self) -> int:
        """Dispatch everything waiting, room or not (flow control was turned off)."""
        now = self.clock()
        self._expire(now)
        n = 0
        while self._count:
            ticket = self._next()
            self._remove(ticket, "dispatched", now)
            n += 1
            self.on_dispatch(ticket)
        return n

    def next_expiry(self) -> float | None:
        while self._expiry and self._expiry[0][2].done:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None
