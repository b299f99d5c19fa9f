"""DecisionMemory: bounded in count and age, taken once, found by request id."""

from __future__ import annotations

from epick.scheduler.memory import DecisionMemory


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_decision_is_taken_once_by_its_id_or_its_request_id():
    m = DecisionMemory()
    a = m.remember("req-a", "m", "lora", "10.0.0.1:8000")
    b = m.remember("", "m", "", "10.0.0.2:8000")
    assert a != b and len(m) == 2
    got = m.take(request_id="req-a")
    assert got is not None and got[0] == a and got[1].endpoint == "10.0.0.1:8000"
    assert got[1].adapter == "lora" and got[1].model == "m"
    assert m.take(decision_id=a) is None  # a second report is unknown
    assert m.take(request_id="req-a") is None
    assert m.take(decision_id=b)[1].endpoint == "10.0.0.2:8000"
    assert m.take() is None and len(m) == 0


def test_the_decision_id_wins_over_the_request_id():
    m = DecisionMemory()
    a = m.remember("r1", "m", "", "x:1")
    b = m.remember("r2", "m", "", "y:1")
    assert m.take(decision_id=b, request_id="r1")[0] == b
    assert m.take(request_id="r1")[0] == a


def test_expired_and_surplus_decisions_are_dropped_and_reported():
    clock, expired = Clock(), []
    m = DecisionMemory(ttl_s=10, max_decisions=3, clock=clock, on_expire=expired.append)
    ids = [m.remember(f"r{i}", "m", "", f"e{i}:1") for i in range(3)]
    m.remember("r3", "m", "", "e3:1")  # over the count: the oldest goes
    assert expired == ["e0:1"] and len(m) == 3 and m.take(ids[0]) is None
    assert m.take(request_id="r0") is None  # its request id went with it
    clock.now = 11.0
    m.remember("r4", "m", "", "e4:1")  # every older one has expired
    assert expired == ["e0:1", "e1:1", "e2:1", "e3:1"] and len(m) == 1


def test_a_reused_request_id_finds_the_newest_decision():
    m = DecisionMemory()
    m.remember("r", "m", "", "old:1")
    new = m.remember("r", "m", "", "new:1")
    assert m.take(request_id="r")[0] == new
