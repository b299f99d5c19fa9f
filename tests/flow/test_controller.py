"""Flow control's core in virtual time: room, order, fairness, starvation, TTL, capacity."""

from __future__ import annotations

import pytest

from epick import abi
from epick.config import FlowControlConfig
from epick.flow import FlowController, QueueFull, SaturationDetector
from epick.flow.rules import RoundRobin, WeightedRoundRobin
from epick.interfaces import EndpointInfo, PoolView
from epick.scheduler.assignments import Assignments


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def view(*waiting: int, fresh: bool = True, kv: float = 0.0) -> PoolView:
    eps = tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000", waiting=w, kv_usage=kv)
                for i, w in enumerate(waiting))
    return PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=eps),
                          [EndpointInfo(fresh=fresh)] * len(eps))


class Harness:
    """A controller whose dispatches 'pick' endpoint 0 (raising its unseen count)."""

    def __init__(self, cfg: FlowControlConfig, v: PoolView) -> None:
        self.view = v
        self.ledger = Assignments()
        self.clock = Clock()
        self.order: list[object] = []
        self.refused: list[tuple[object, str]] = []
        self.fc = FlowController(cfg, view=lambda: self.view, counts=self.ledger,
                                 on_dispatch=self._dispatch,
                                 on_refuse=lambda t, o: self.refused.append((t.payload, o)),
                                 clock=self.clock, metrics=False)

    def _dispatch(self, ticket) -> None:
        self.order.append(ticket.payload)
        self.ledger.picked(self.view.addresses[0])

    def scrape(self) -> None:
        """The engine's queue drains and its scrape resets the unseen count."""
        for a in self.view.addresses:
            self.ledger.scraped(a)


CFG = FlowControlConfig(enabled=True, queue_threshold=2, starvation_limit=0)


def test_detector_counts_unseen_picks_and_stale_metrics():
    d = SaturationDetector(queue_threshold=3, kv_threshold=0.8)
    led = Assignments()
    v = view(1, 2)
    assert d.room(v, led) == 2
    led.picked(v.addresses[0])
    led.picked(v.addresses[0])  # 1 waiting + 2 unseen = 3: saturated
    assert d.room(v, led) == 1
    assert d.room(view(0, 0, fresh=False), led) == 0
    assert d.room(view(0, kv=0.8), led) == 0
    assert d.saturation(view(0, 0, fresh=False), led) == 1.0


def test_unsaturated_goes_straight_through_and_a_burst_cannot_overshoot():
    h = Harness(CFG, view(0))
    # Room for two (threshold 2): the first two go now, the burst behind them waits.
    for i in range(5):
        t = h.fc.submit(flow="", priority=0, payload=i)
        if t is None:
            h._dispatch(type("T", (), {"payload": i})())
    assert h.order == [0, 1]
    assert h.fc.waiting == 3
    h.scrape()  # the queue drained between scrapes
    assert h.fc.pump() == 2
    assert h.order == [0, 1, 2, 3]


def test_priority_first_then_fifo():
    h = Harness(CFG, view(5))  # saturated
    for p, name in [(-1, "s1"), (0, "n1"), (1, "c1"), (-1, "s2"), (1, "c2")]:
        assert h.fc.submit(flow="", priority=p, payload=name) is not None
    h.view = view(0, 0, 0, 0)
    h.view = PoolView.build(h.view.snapshot, [EndpointInfo()] * 4)
    h.ledger = h.fc._counts = Assignments()
    h.fc._counts = h.ledger
    # endpoint 0 saturates after 2 dispatches; give room for all five with 4 endpoints:
    h._dispatch = lambda t: (h.order.append(t.payload),
                             h.ledger.picked(h.view.addresses[len(h.order) % 4]))
    h.fc.on_dispatch = h._dispatch
    h.fc.pump()
    assert h.order == ["c1", "c2", "n1", "s1", "s2"]


def test_starvation_guard_serves_a_passed_over_band():
    cfg = FlowControlConfig(enabled=True, queue_threshold=1, starvation_limit=2)
    h = Harness(cfg, view(5))
    h.fc.submit(flow="", priority=-1, payload="low")
    for i in range(6):
        h.fc.submit(flow="", priority=1, payload=f"hi{i}")
    for _ in range(7):
        h.view = view(0)
        h.scrape()
        h.fc.pump()
    # Passed over twice, the low band goes third.
    assert h.order[:4] == ["hi0", "hi1", "low", "hi2"]


def test_strict_priority_without_the_guard():
    h = Harness(CFG, view(5))
    h.fc.submit(flow="", priority=-1, payload="low")
    for i in range(4):
        h.fc.submit(flow="", priority=1, payload=f"hi{i}")
    h.view = view(0)
    for _ in range(5):
        h.scrape()
        h.fc.pump()
    assert h.order[-1] == "low"


def test_round_robin_across_flows_then_fifo_within():
    h = Harness(CFG, view(5))
    for i in range(4):
        h.fc.submit(flow="noisy", priority=0, payload=f"n{i}")
    h.fc.submit(flow="quiet", priority=0, payload="q0")
    h.view = view(0, 0, 0)
    h._dispatch = lambda t: (h.order.append(t.payload),
                             h.ledger.picked(h.view.addresses[len(h.order) % 3]))
    h.fc.on_dispatch = h._dispatch
    h.fc.pump()
    assert h.order[:3] == ["n0", "q0", "n1"]


def test_weighted_fairness_shares():
    w = WeightedRoundRobin({"a": 3.0})
    picks = [w.choose(0, ["a", "b"]) for _ in range(8)]
    assert picks.count("a") == 6 and picks.count("b") == 2
    rr = RoundRobin()
    assert [rr.choose(0, ["a", "b", "c"]) for _ in range(4)] == ["a", "b", "c", "a"]


def test_edf_orders_by_the_ttft_objective():
    h = Harness(FlowControlConfig(enabled=True, queue_threshold=1, ttl_ms=10_000), view(5))
    h.fc.submit(flow="", priority=0, payload="plain")          # deadline = its TTL, 10 s
    h.fc.submit(flow="", priority=0, payload="slo-2s", slo_ttft_ms=2000)
    h.fc.submit(flow="", priority=0, payload="slo-1s", slo_ttft_ms=1000)
    for _ in range(3):
        h.view = view(0)
        h.scrape()
        h.fc.pump()
    assert h.order == ["slo-1s", "slo-2s", "plain"]
    fcfs = Harness(FlowControlConfig(enabled=True, queue_threshold=1, ordering="fcfs"),
                   view(5))
    fcfs.fc.submit(flow="", priority=0, payload="a")
    fcfs.fc.submit(flow="", priority=0, payload="b", slo_ttft_ms=1)
    fcfs.view = view(0)
    fcfs.fc.pump()
    assert fcfs.order == ["a"]


def test_ttl_and_the_callers_deadline_expire_with_a_reason():
    h = Harness(FlowControlConfig(enabled=True, ttl_ms=1000), view(9))
    h.fc.submit(flow="", priority=0, payload="ttl")
    h.fc.submit(flow="", priority=0, payload="deadline", deadline=h.clock.t + 0.2)
    h.clock.t += 0.3
    h.fc.pump()
    assert h.refused == [("deadline", "expired")]
    h.view = view(0, fresh=False)  # nothing fresh when it expires: unavailable
    h.clock.t += 1
    h.fc.pump()
    assert h.refused[-1] == ("ttl", "unavailable")
    assert h.fc.waiting == 0 and h.order == []


def test_band_capacity_refuses_the_newcomer():
    h = Harness(FlowControlConfig(enabled=True, max_requests=2, max_bytes=100), view(9))
    h.fc.submit(flow="", priority=0, payload=1, size=10)
    h.fc.submit(flow="", priority=0, payload=2, size=10)
    with pytest.raises(QueueFull, match="max_requests"):
        h.fc.submit(flow="", priority=0, payload=3)
    h.fc.submit(flow="", priority=1, payload=4, size=95)  # another band: its own room
    with pytest.raises(QueueFull, match="max_bytes"):
        h.fc.submit(flow="", priority=1, payload=5, size=6)


def test_cancel_and_drain():
    h = Harness(CFG, view(9))
    a = h.fc.submit(flow="", priority=0, payload="a")
    h.fc.submit(flow="x", priority=0, payload="b")
    assert h.fc.cancel(a) and not h.fc.cancel(a)
    assert h.fc.drain() == 1
    assert h.order == ["b"] and h.fc.waiting == 0


def test_every_request_leaves_exactly_once_whatever_happens():
    import random

    rng = random.Random(26)
    cfg = FlowControlConfig(enabled=True, queue_threshold=2, ttl_ms=500, max_requests=20,
                            starvation_limit=3, fairness="weighted",
                            fairness_weights={"a": 3.0})
    h = Harness(cfg, view(9))
    left: dict[int, list[str]] = {}
    h.fc.on_dispatch = lambda t: (left.setdefault(t.payload, []).append("dispatched"),
                                  h.ledger.picked(h.view.addresses[0]))
    h.fc.on_refuse = lambda t, o: left.setdefault(t.payload, []).append(o)
    tickets, direct, full = {}, set(), set()
    for n in range(3000):
        op = rng.random()
        if op < 0.5:
            try:
                t = h.fc.submit(flow=rng.choice("abc"), priority=rng.randint(-1, 1),
                                size=rng.randint(0, 10), payload=n,
                                slo_ttft_ms=rng.choice([None, 100, 1000]))
            except QueueFull:
                full.add(n)
                continue
            if t is None:
                direct.add(n)
            else:
                tickets[n] = t
        elif op < 0.7:
            h.clock.t += rng.random() * 0.2
            h.fc.pump()
        elif op < 0.8:
            h.view = view(rng.choice([0, 1, 9]), fresh=rng.random() < 0.9)
            h.scrape()
            h.fc.pump()
        elif op < 0.9 and tickets:
            n = rng.choice(list(tickets))
            if h.fc.cancel(tickets[n]):
                left.setdefault(n, []).append("cancelled")
    h.fc.drain()
    assert h.fc.waiting == 0
    for n in tickets:
        assert len(left.get(n, [])) == 1, (n, left.get(n))
    assert not (set(left) & (direct | full))
    outcomes = {o for v in left.values() for o in v}
    assert {"dispatched", "expired", "cancelled"} <= outcomes
