"""The host's own count of what it sent where, and how policies see it (issue 14)."""

from __future__ import annotations

import msgspec

from epick import abi
from epick.bench.pypolicies import PyLoad
from epick.interfaces import PoolView
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def view() -> PoolView:
    eps = tuple(abi.EndpointMetrics(address=f"e{i}:8000") for i in range(2))
    return PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=eps))


def test_picks_count_in_flight_until_completed_and_since_scrape_until_scraped():
    p = view()
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
    p, clock = view(), FakeClock()
    s = Scheduler(lambda: p, PolicySet.of(PolicyEntry("load", PyLoad())), clock=clock,
                  decision_ttl_s=10)
    a = s.schedule(abi.Request(model="m", seed=1))
    clock.now = 11
    s.schedule(abi.Request(model="m", seed=2))  # remembering a new one expires the old
    assert s.assignments.in_flight(a.endpoint) in (0, 1)
    total = sum(s.assignments.in_flight(e.address) for e in p.snapshot.endpoints)
    assert total == 1


def test_policies_receive_the_counts_parallel_to_the_candidates():
    p = view()
    s = Scheduler(lambda: p, PolicySet.of(PolicyEntry("load", PyLoad())))
    s.assignments.picked("e1:8000")
    s.assignments.picked("e1:8000")
    from epick.interfaces import Cycle

    cycle = Cycle(view=p, request=abi.Request(model="m"), assignments=s.assignments)
    decoded = msgspec.msgpack.decode(cycle.score_input((1, 0), inline_snapshot=False))
    assert decoded[2:] == [[1, 0], [2, 0], [2, 0], [], [], [], []]


def test_every_policy_hook_of_a_cycle_gets_one_encoding_of_the_pick():
    """pre_request's event is encoded once per cycle and endpoint, and says what it must."""
    from epick.interfaces import Cycle

    p = view()
    cycle = Cycle(view=p, request=abi.Request(model="m", prompt="hi"), now_ms=1234)
    first = cycle.pre_request_input("e1:8000", 1234)
    assert cycle.pre_request_input("e1:8000", 1234) is first  # the second hook: no encoding
    event = msgspec.msgpack.decode(first, type=abi.PreRequestEvent)
    assert (event.endpoint, event.timestamp_ms, event.request.prompt) == ("e1:8000", 1234, "hi")
    other = msgspec.msgpack.decode(cycle.pre_request_input("e0:8000", 99),
                                   type=abi.PreRequestEvent)
    assert (other.endpoint, other.timestamp_ms) == ("e0:8000", 99)


def test_counts_kept_for_repeated_addresses_match_a_fresh_lookup():
    """The counts of the addresses a pick asks for again are kept current by every change
    (picked, completed, scraped, forget), never stale: checked against a fresh Assignments
    fed the same changes, over random changes and asks."""
    import random

    from epick.scheduler.assignments import Assignments

    rng = random.Random(7)
    names = tuple(f"e{i}:8000" for i in range(6)) + ("gone:1",)
    view_a, view_b = names[:6], names[1:]
    kept, fresh = Assignments(), Assignments()
    for step in range(3000):
        op = rng.choice(("picked", "picked", "completed", "scraped", "forget", "ask", "ask"))
        if op == "ask":
            asked = rng.choice((view_a, view_a, view_b, list(view_a)))
            # a fresh object each time on the fresh side: never its kept rows
            assert kept.of(asked) == fresh.of(list(asked)), step
        else:
            address = rng.choice(names)
            getattr(kept, op)(address)
            getattr(fresh, op)(address)
