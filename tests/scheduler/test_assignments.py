"""The host's own count of what it sent where, and how policies see it (issue 14)."""

from __future__ import annotations

import msgspec

from epick import abi
from epick.bench.pypolicies import PyLoad
from epick.interfaces import PoolSnapshot
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool() -> PoolSnapshot:
    eps = tuple(abi.EndpointMetrics(address=f"e{i}:8000") for i in range(2))
    return PoolSnapshot.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=eps))


def test_picks_count_in_flight_until_completed_and_since_scrape_until_scraped():
    p = pool()
    s = Scheduler(lambda: p, PolicySet.of(PolicyEntry("load", PyLoad())))
    a = s.schedule(abi.Request(model="m", seed=1))
    assert s.assignments.in_flight(a.endpoint) == 1
    assert s.assignments.picked_since_scrape(a.endpoint) == 1
    # the idle endpoint now wins: the just-picked one stops looking idle at once
    b = s.schedule(abi.Request(model="m", seed=1))
    assert b.endpoint != a.endpoint
    s.assignments.scraped(a.endpoint)
    assert s.assignments.picked_since_scrape(a.endpoint) == 0
    assert s.assignments.in_flight(a.endpoint) == 1
    assert s.complete(decision_id=a.decision_id)
    assert s.assignments.in_flight(a.endpoint) == 0
    assert not s.complete(decision_id=a.decision_id)  # a second report changes nothing
    assert s.assignments.in_flight(a.endpoint) == 0


def test_an_expired_unreported_decision_stops_counting():
    p, clock = pool(), FakeClock()
    s = Scheduler(lambda: p, PolicySet.of(PolicyEntry("load", PyLoad())), clock=clock,
                  decision_ttl_s=10)
    a = s.schedule(abi.Request(model="m", seed=1))
    clock.now = 11
    s.schedule(abi.Request(model="m", seed=2))  # remembering a new one expires the old
    assert s.assignments.in_flight(a.endpoint) in (0, 1)
    total = sum(s.assignments.in_flight(e.address) for e in p.snapshot.endpoints)
    assert total == 1


def test_policies_receive_the_counts_parallel_to_the_candidates():
    p = pool()
    s = Scheduler(lambda: p, PolicySet.of(PolicyEntry("load", PyLoad())))
    s.assignments.picked("e1:8000")
    s.assignments.picked("e1:8000")
    from epick.interfaces import Cycle

    cycle = Cycle(pool=p, request=abi.Request(model="m"), assignments=s.assignments)
    decoded = msgspec.msgpack.decode(cycle.score_input((1, 0), inline_snapshot=False))
    assert decoded[2:] == [[1, 0], [2, 0], [2, 0], [], [], []]
