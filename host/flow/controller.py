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

With ``precedence = "fairness"`` the bands below ``protected_priority`` form one group,
ranked below the protected bands (with the same starvation guard between them): when the
group's turn comes the :class:`FairnessPolicy` picks the flow among every flow waiting in
it (band :data:`~epick.interfaces.flow.ACROSS_BANDS`), then that flow's highest band goes
(the starvation guard again, per flow), then the ordering's smallest key. A tenant's
lower bands then compete with other tenants by fairness, not behind their higher bands.

Urgent requests -- bands at or above ``protected_priority``, and with ``precedence =
"fairness"`` a flow below its fair share of the last :data:`SHARE_WINDOW` dispatches --
may also take the pool's ``reserved_in_flight`` last free slots while requests wait; when
only those are free, only an urgent request is dispatched from the queue. A request that
arrives while nothing waits takes any slot (the pool is not saturated: the reserve is
there to keep the backlog from taking every slot, and costs nothing unsaturated).

Time comes from ``clock`` (seconds; ``time.monotonic`` by default): a simulator in virtual
time passes its own and calls :meth:`pump` itself; the service's driver
(``epick.api.decide.Decider.run``) pumps every ``poll_ms`` while anything waits. Touched
only from one thread (the event loop).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from epick import telemetry
from epick.config import FlowControlConfig
from epick.flow.detector import Counts, SaturationDetector
from epick.flow.rules import make_fairness, make_ordering
from epick.interfaces import ACROSS_BANDS, PoolView

__all__ = ["FlowController", "Ticket", "QueueFull", "SHARE_WINDOW"]

SHARE_WINDOW = 128
"""``precedence = "fairness"``: a flow's share of dispatch is counted over this many of
the latest dispatches (straight through or queued)."""


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
        # precedence = "fairness": flow -> its tickets waiting below protected_priority
        # (first-queued order), the group's starvation count, and per (flow, band) ones.
        self._group: dict[str, int] = {}
        self._group_skipped = 0
        self._flow_skipped: dict[tuple[str, int], int] = {}
        self._by_flow = False
        self._protected = 1
        self._recent: deque[str] = deque(maxlen=SHARE_WINDOW)  # flows of the last dispatches
        self._recent_n: dict[str, int] = {}
        #: After :meth:`has_room`: the addresses with room when some endpoint has none
        #: (a pick let through now must stay inside them), else ``None``.
        self.room: tuple[str, ...] | None = None
        self.configure(config)

    def configure(self, config: FlowControlConfig) -> None:
        """Apply a (reloaded) ``[flow_control]``: thresholds, capacities and rules. A new
        ordering applies to requests that arrive from now on."""
        old = getattr(self, "config", None)
        self.config = config
        self.detector = SaturationDetector(config.queue_threshold, config.kv_threshold,
                                           config.max_in_flight,
                                           config.max_in_flight_endpoints,
                                           config.reserved_in_flight)
        if old is None or old.ordering != config.ordering:
            self.ordering = make_ordering(config.ordering)
        regroup = (old is None or old.precedence != config.precedence
                   or old.protected_priority != config.protected_priority)
        if (regroup or old.fairness != config.fairness
                or old.fairness_weights != config.fairness_weights):
            self.fairness = make_fairness(config.fairness, config.fairness_weights)
        self._protected = config.protected_priority
        self._least_busy = config.urgent_placement == "least-busy"
        if regroup:
            self._by_flow = config.precedence == "fairness"
            self._recent.clear()
            self._recent_n.clear()
            self._group.clear()
            self._group_skipped = 0
            self._flow_skipped.clear()
            if self._by_flow:  # who waits below the protected bands, in arrival order
                live = sorted((t for _, _, t in self._expiry if not t.done),
                              key=lambda t: t.seq)
                for t in live:
                    if t.priority < self._protected:
                        self._group[t.flow] = self._group.get(t.flow, 0) + 1

    # -- state -------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._count

    def waiting_in(self, priority: int) -> int:
        band = self._bands.get(priority)
        return band.count if band is not None else 0

    def has_room(self, urgent: bool = True) -> bool:
        """Whether some endpoint has room (``urgent``: counting its reserved slots); sets
        :attr:`room` (which ones)."""
        room, open_, total = self._rooms()
        return self._set_room(room if urgent else open_, total)

    def _rooms(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        """``(room, open, endpoints)``: with room for an urgent request, for any."""
        view = self._view()
        total = len(view.info)
        if not total:
            return (), (), 0
        room, open_ = self.detector.rooms(view, self._counts)
        if self.metrics:
            telemetry.FLOW_POOL_SATURATION.set(1.0 - len(room) / total)
        return room, open_, total

    def _set_room(self, room: tuple[str, ...], total: int) -> bool:
        if not total:
            self.room = None
            return True  # nothing to wait for: the scheduler answers unavailable
        # Dispatch only to endpoints with room: the scheduler's favourite may be full.
        self.room = room if len(room) < total else None
        return bool(room)

    def _place_urgent(self) -> None:
        """``urgent_placement = "least-busy"``: narrow :attr:`room` to the endpoints with
        the fewest picks since their scrape, then the fewest in flight."""
        room = self.room if self.room is not None else self._view().addresses
        if len(room) < 2:
            return
        c = self._counts
        keys = {a: (c.picked_since_scrape(a), c.in_flight(a)) for a in room}
        best = min(keys.values())
        self.room = tuple(a for a in room if keys[a] == best)

    def _urgent(self, priority: int, flow: str) -> bool:
        """May it take reserved slots: a protected band, or (``precedence =
        "fairness"``) a flow below its fair share of the recent dispatches."""
        return priority >= self._protected or (self._by_flow and self._under_share(flow))

    def _under_share(self, flow: str) -> bool:
        """Its share of the last dispatches is below its weight's share among the flows
        in them (itself included). A lone flow never is."""
        recent = self._recent_n
        if not recent or (len(recent) == 1 and flow in recent):
            return False
        weights = self.config.fairness_weights
        w = weights.get(flow, 1.0)
        total_w = w + sum(weights.get(f, 1.0) for f in recent if f != flow)
        return recent.get(flow, 0) / len(self._recent) < w / total_w

    def _dispatched(self, flow: str) -> None:
        if not self._by_flow:
            return
        recent, n = self._recent, self._recent_n
        if len(recent) == recent.maxlen:
            old = recent[0]
            left = n[old] - 1
            if left:
                n[old] = left
            else:
                del n[old]
        recent.append(flow)
        n[flow] = n.get(flow, 0) + 1

    # -- arrivals ----------------------------------------------------------------------

    def submit(self, *, flow: str, priority: int, size: int = 0,
               slo_ttft_ms: int | None = None, deadline: float | None = None,
               payload: object = None) -> Ticket | None:
        """Queue one request, or ``None`` when it may go now (see the module doc); raises
        :class:`QueueFull`. ``deadline``: the caller's own, on this clock."""
        # Nothing waits: not saturated, the reserve does not apply (it keeps slots from
        # the backlog, so that an urgent request does not wait behind it).
        if not self._count and self.has_room():
            if self._least_busy and self._urgent(priority, flow):
                self._place_urgent()
            self._dispatched(flow)
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
        if self._by_flow and priority < self._protected:
            self._group[flow] = self._group.get(flow, 0) + 1
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
            self._flow_skipped.pop((ticket.flow, ticket.priority), None)
        if self._by_flow and ticket.priority < self._protected:
            left = self._group[ticket.flow] - 1
            if left:
                self._group[ticket.flow] = left
            else:
                del self._group[ticket.flow]
                self.fairness.forget(ACROSS_BANDS, ticket.flow)
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
        if self._by_flow:
            return self._next_by_flow()
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
        return self._pop_band(chosen)

    def _pop_band(self, chosen: int) -> Ticket:
        """The next ticket of band ``chosen``: fairness across its flows, then ordering."""
        band = self._bands[chosen]
        flows = list(band.flows)
        return self._pop(band.flows[flows[0] if len(flows) == 1
                                    else self.fairness.choose(chosen, flows)])

    @staticmethod
    def _pop(flow: _Flow) -> Ticket:
        while True:
            _, _, ticket = heapq.heappop(flow.heap)
            if not ticket.done:
                return ticket

    def _next_by_flow(self) -> Ticket:
        """``precedence = "fairness"``: the protected bands, then the group below them
        (one contender), with the starvation guard between them; in the group, the flow
        first, then its highest band (the guard again, per flow)."""
        limit = self.config.starvation_limit
        protected = self._protected
        top = sorted((b for b in self._bands if b >= protected), reverse=True)
        group = bool(self._group)
        chosen: int | None = top[0] if top else None  # None: the group
        if limit and len(top) + group > 1:
            for b in top[1:]:
                if self._bands[b].skipped >= limit:
                    chosen = b
                    break
            else:
                if group and top and self._group_skipped >= limit:
                    chosen = None
            for b in top:
                band = self._bands[b]
                band.skipped = 0 if b == chosen else band.skipped + 1
            if group:
                self._group_skipped = 0 if chosen is None else self._group_skipped + 1
        if chosen is not None:
            return self._pop_band(chosen)
        flows = list(self._group)
        name = flows[0] if len(flows) == 1 else self.fairness.choose(ACROSS_BANDS, flows)
        mine = sorted((b for b, band in self._bands.items()
                       if b < protected and name in band.flows), reverse=True)
        pick = mine[0]
        if limit and len(mine) > 1:
            skipped = self._flow_skipped
            for b in mine[1:]:
                if skipped.get((name, b), 0) >= limit:
                    pick = b
                    break
            for b in mine:
                skipped[(name, b)] = 0 if b == pick else skipped.get((name, b), 0) + 1
        return self._pop(self._bands[pick].flows[name])

    def pump(self) -> int:
        """Expire what is overdue, then dispatch while there is room; the number
        dispatched."""
        if not self._count:
            return 0
        now = self.clock()
        self._expire(now)
        n = 0
        while self._count:
            room, open_, total = self._rooms()
            if open_ or not total:
                ticket = self._next()
                urgent = self._urgent(ticket.priority, ticket.flow)
                self._set_room(room if urgent else open_, total)
                if urgent and self._least_busy:
                    self._place_urgent()
            elif room:  # only reserved slots are free: only an urgent request goes
                ticket = self._next_urgent()
                if ticket is None:
                    break
                self._set_room(room, total)
                if self._least_busy:
                    self._place_urgent()
            else:
                break
            self._remove(ticket, "dispatched", now)
            self._dispatched(ticket.flow)
            n += 1
            self.on_dispatch(ticket)
        return n

    def _next_urgent(self) -> Ticket | None:
        """The next urgent ticket (see :meth:`_urgent`), else ``None``: the highest
        protected band's, else a below-share flow's highest band's."""
        top = max(self._bands)
        if top >= self._protected:
            return self._pop_band(top)
        if not self._by_flow:
            return None
        under = [f for f in self._group if self._under_share(f)]
        if not under:
            return None
        name = under[0] if len(under) == 1 else self.fairness.choose(ACROSS_BANDS, under)
        pick = max(b for b, band in self._bands.items()
                   if b < self._protected and name in band.flows)
        return self._pop(self._bands[pick].flows[name])

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
