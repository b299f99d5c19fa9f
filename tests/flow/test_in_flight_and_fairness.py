"""The in-flight cap and its reserve (the detector), and ``precedence = "fairness"``
(tenants take turns before bands, below the protected bands)."""

from __future__ import annotations

import random

import pytest

from epick import abi
from epick.config import FlowControlConfig
from epick.flow import FlowController, QueueFull, SaturationDetector
from epick.flow.controller import SHARE_WINDOW
from epick.interfaces import ACROSS_BANDS, EndpointInfo, PoolView
from epick.scheduler.assignments import Assignments


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def view(n: int = 1, waiting: int = 0) -> PoolView:
    eps = tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000", waiting=waiting)
                for i in range(n))
    return PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=eps),
                          [EndpointInfo(fresh=True)] * n)


class Harness:
    """Dispatches go to the first endpoint inside the controller's room and count as in
    flight there until :meth:`complete`; scrapes are immediate (no queue threshold in
    the way unless a test wants one)."""

    def __init__(self, cfg: FlowControlConfig, v: PoolView) -> None:
        self.view = v
        self.ledger = Assignments()
        self.order: list[object] = []
        self.where: list[str] = []
        self.fc = FlowController(cfg, view=lambda: self.view, counts=self.ledger,
                                 on_dispatch=lambda t: self.send(t.payload),
                                 clock=Clock(), metrics=False)

    def send(self, payload) -> None:
        room = self.fc.room
        address = room[0] if room else self.view.addresses[0]
        self.order.append(payload)
        self.where.append(address)
        self.ledger.picked(address)
        self.ledger.scraped(address)  # the queue threshold is not what these tests test

    def submit(self, payload, *, flow: str = "", priority: int = 0) -> None:
        if self.fc.submit(flow=flow, priority=priority, payload=payload) is None:
            self.send(payload)

    def complete(self, address: str | None = None) -> None:
        self.ledger.completed(address or self.view.addresses[0])
        self.fc.pump()


# -- the detector ----------------------------------------------------------------------


def test_max_in_flight_caps_what_epick_has_sent_and_not_seen_complete():
    v = view(2)
    led = Assignments()
    d = SaturationDetector(queue_threshold=100, max_in_flight=2)
    a, b = v.addresses
    for _ in range(2):
        led.picked(a)
        led.scraped(a)  # the scrape forgets the picks, the in-flight count does not
    assert d.with_room(v, led) == (b,)
    led.completed(a)
    assert d.with_room(v, led) == (a, b)
    # 0 = no cap (the default): the same counts leave both with room.
    led.picked(a)
    assert SaturationDetector(queue_threshold=100).with_room(v, led) == (a, b)


def test_max_in_flight_per_endpoint_overrides_the_default():
    v = view(2)
    led = Assignments()
    a, b = v.addresses
    for addr in (a, b):
        for _ in range(3):
            led.picked(addr)
    d = SaturationDetector(queue_threshold=100, max_in_flight=3, per_endpoint={a: 4})
    assert d.with_room(v, led) == (a,)
    d = SaturationDetector(queue_threshold=100, max_in_flight=3, per_endpoint={b: 0})
    assert d.with_room(v, led) == (b,)  # 0: no cap for that one


def test_the_reserve_keeps_the_pools_last_free_slots_for_urgent_requests():
    v = view(2)
    led = Assignments()
    a, b = v.addresses
    d = SaturationDetector(queue_threshold=100, max_in_flight=4, reserved=2)
    for _ in range(3):
        led.picked(a)
    assert d.rooms(v, led) == ((a, b), (a, b))  # 1 + 4 free: more than the reserve
    for _ in range(3):
        led.picked(b)
    assert d.rooms(v, led) == ((a, b), ())  # 1 + 1 free: only the reserve is left
    led.picked(a)
    assert d.rooms(v, led) == ((b,), ())
    # An endpoint without a cap has unlimited free slots: the reserve never binds.
    d = SaturationDetector(queue_threshold=100, max_in_flight=4, reserved=2,
                           per_endpoint={b: 0})
    assert d.rooms(v, led) == ((b,), (b,))
    assert SaturationDetector(queue_threshold=100, max_in_flight=4).rooms(v, led) == (
        (b,), (b,))


# -- the controller: cap and reserve ---------------------------------------------------


def test_a_full_endpoint_holds_requests_in_epick_until_a_completion():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=2,
                            starvation_limit=0)
    h = Harness(cfg, view(1))
    h.submit("s1")
    h.submit("s2")
    h.submit("n1", priority=-1)
    h.submit("c1", priority=1)
    assert h.order == ["s1", "s2"] and h.fc.waiting == 2
    h.complete()
    assert h.order == ["s1", "s2", "c1"]  # the completion's slot goes to the head
    h.complete()
    assert h.order[-1] == "n1"


def test_reserved_slots_go_to_critical_only_while_requests_wait():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=3,
                            reserved_in_flight=1)
    h = Harness(cfg, view(1))
    for i in range(5):
        h.submit(f"s{i}")
    # Nothing waited for the first three: not saturated, the reserve does not apply.
    assert h.order == ["s0", "s1", "s2"] and h.fc.waiting == 2
    h.complete()  # 1 free slot: the reserve; the standard backlog stays in epick
    assert h.order == ["s0", "s1", "s2"]
    h.submit("c0", priority=1)  # urgent: takes it
    assert h.order[-1] == "c0"
    h.complete()
    assert h.order[-1] == "c0"
    h.complete()  # 2 free: one for the backlog, one kept
    assert h.order[-1] == "s3" and h.fc.waiting == 1
    # protected_priority moves the line: 0 makes STANDARD urgent too.
    h2 = Harness(FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=3,
                                   reserved_in_flight=1, protected_priority=0), view(1))
    for i in range(4):
        h2.submit(f"s{i}")
    h2.complete()
    assert h2.order == ["s0", "s1", "s2", "s3"]


# -- precedence = "fairness" -----------------------------------------------------------

FAIR = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1,
                         precedence="fairness", starvation_limit=0)


def fill(h: Harness) -> None:
    h.submit("busy", flow="x")  # takes the one slot: everything after waits


def test_by_priority_a_tenants_sheddable_waits_behind_anothers_standard():
    h = Harness(FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1,
                                  starvation_limit=0), view(1))
    fill(h)
    for i in range(3):
        h.submit(f"noisy{i}", flow="noisy")
    h.submit("quiet-shed", flow="quiet", priority=-1)
    for _ in range(4):
        h.complete()
    assert h.order[1:] == ["noisy0", "noisy1", "noisy2", "quiet-shed"]


def test_by_fairness_tenants_take_turns_across_bands_and_critical_still_goes_first():
    h = Harness(FAIR, view(1))
    fill(h)
    for i in range(3):
        h.submit(f"noisy{i}", flow="noisy")
    h.submit("quiet-shed", flow="quiet", priority=-1)
    h.submit("quiet-std", flow="quiet")
    h.submit("noisy-crit", flow="noisy", priority=1)
    for _ in range(6):
        h.complete()
    # CRITICAL (protected) first; then the tenants alternate, each its own highest band.
    assert h.order[1:] == ["noisy-crit", "noisy0", "quiet-std", "noisy1", "quiet-shed",
                           "noisy2"]


def test_by_fairness_the_starvation_guard_works_inside_a_flow():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1,
                            precedence="fairness", starvation_limit=2)
    h = Harness(cfg, view(1))
    fill(h)
    h.submit("low", flow="t", priority=-1)
    for i in range(4):
        h.submit(f"std{i}", flow="t")
    for _ in range(5):
        h.complete()
    assert h.order[1:] == ["std0", "std1", "low", "std2", "std3"]


def test_by_fairness_the_guard_serves_the_group_behind_a_critical_stream():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1,
                            precedence="fairness", starvation_limit=2)
    h = Harness(cfg, view(1))
    fill(h)
    h.submit("std", flow="a")
    for i in range(4):
        h.submit(f"crit{i}", flow="b", priority=1)
    for _ in range(5):
        h.complete()
    assert h.order[1:] == ["crit0", "crit1", "std", "crit2", "crit3"]


def test_a_below_share_tenant_takes_the_reserved_slot_an_over_share_one_cannot():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=3,
                            reserved_in_flight=1, precedence="fairness")
    for precedence, expected in (("fairness", ["n0", "n1", "n2", "q0"]),
                                 ("priority", ["n0", "n1", "n2"])):
        h = Harness(msgspec_replace(cfg, precedence=precedence), view(1))
        for i in range(4):
            h.submit(f"n{i}", flow="noisy")
        h.complete()  # only the reserve is free: noisy (every dispatch so far) waits
        assert h.order == ["n0", "n1", "n2"]
        h.submit("q0", flow="quiet")  # no dispatch yet: below its share
        assert h.order == expected, precedence


def test_a_lone_tenant_is_never_below_its_share():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=2,
                            reserved_in_flight=1, precedence="fairness")
    h = Harness(cfg, view(1))
    for i in range(3):
        h.submit(f"a{i}")
    h.complete()
    assert h.order == ["a0", "a1"]


def test_share_window_forgets_old_dispatches():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, precedence="fairness")
    h = Harness(cfg, view(1))
    for i in range(SHARE_WINDOW):
        h.submit(i, flow="a")
    h.submit("b", flow="b")
    assert h.fc._under_share("b") and not h.fc._under_share("a")
    for i in range(SHARE_WINDOW):
        h.submit(i, flow="b")
    assert h.fc._recent_n == {"b": SHARE_WINDOW}
    assert h.fc._under_share("a")


def test_a_reload_to_fairness_keeps_what_waits_and_orders_it_by_flow():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1,
                            starvation_limit=0)
    h = Harness(cfg, view(1))
    fill(h)
    for i in range(2):
        h.submit(f"noisy{i}", flow="noisy")
    h.submit("quiet-shed", flow="quiet", priority=-1)
    h.fc.configure(msgspec_replace(cfg, precedence="fairness"))
    for _ in range(3):
        h.complete()
    assert h.order[1:] == ["noisy0", "quiet-shed", "noisy1"]
    h.fc.configure(cfg)  # and back: nothing is lost
    assert h.fc.waiting == 0


def test_fairness_policy_is_asked_about_the_group_with_across_bands():
    h = Harness(FAIR, view(1))
    seen = []
    choose = h.fc.fairness.choose
    h.fc.fairness.choose = lambda band, flows: (seen.append((band, list(flows))),
                                                choose(band, flows))[1]
    fill(h)
    h.submit("a", flow="a", priority=0)
    h.submit("b", flow="b", priority=-1)
    h.complete()
    assert seen == [(ACROSS_BANDS, ["a", "b"])]


@pytest.mark.parametrize("precedence", ["priority", "fairness"])
def test_every_request_leaves_exactly_once_with_cap_reserve_and_either_precedence(
        precedence):
    rng = random.Random(27)
    cfg = FlowControlConfig(enabled=True, queue_threshold=3, ttl_ms=500, max_requests=20,
                            starvation_limit=3, max_in_flight=3, reserved_in_flight=1,
                            precedence=precedence, fairness="weighted",
                            fairness_weights={"a": 3.0})
    h = Harness(cfg, view(2))
    left: dict[int, list[str]] = {}
    inflight: list[str] = []

    def send(payload) -> None:
        room = h.fc.room
        address = room[0] if room else h.view.addresses[0]
        left.setdefault(payload, []).append("dispatched")
        h.ledger.picked(address)
        inflight.append(address)

    h.fc.on_dispatch = lambda t: send(t.payload)
    h.fc.on_refuse = lambda t, o: left.setdefault(t.payload, []).append(o)
    tickets, direct, full = {}, set(), set()
    for n in range(3000):
        op = rng.random()
        if op < 0.45:
            try:
                t = h.fc.submit(flow=rng.choice("abc"), priority=rng.randint(-1, 1),
                                payload=n)
            except QueueFull:
                full.add(n)
                continue
            if t is None:
                direct.add(n)
                room = h.fc.room
                address = room[0] if room else h.view.addresses[0]
                h.ledger.picked(address)
                inflight.append(address)
            else:
                tickets[n] = t
        elif op < 0.6:
            h.fc.clock.t += rng.random() * 0.2
            h.fc.pump()
        elif op < 0.8 and inflight:
            h.ledger.completed(inflight.pop(rng.randrange(len(inflight))))
            h.fc.pump()
        elif op < 0.9:
            for a in h.view.addresses:
                h.ledger.scraped(a)
            h.fc.pump()
        elif op < 0.95 and rng.random() < 0.2:
            h.fc.configure(msgspec_replace(cfg, precedence=rng.choice(
                ["priority", "fairness"])))
        elif tickets:
            n = rng.choice(list(tickets))
            if h.fc.cancel(tickets[n]):
                left.setdefault(n, []).append("cancelled")
        # Never more in flight on an endpoint than the cap.
        assert all(h.ledger.in_flight(a) <= 3 for a in h.view.addresses)
    h.fc.drain()
    assert h.fc.waiting == 0
    for n in tickets:
        assert len(left.get(n, [])) == 1, (n, left.get(n))
    assert not (set(left) & (direct | full))


def msgspec_replace(cfg, **kw):
    import msgspec

    return msgspec.structs.replace(cfg, **kw)


def test_a_reload_applies_a_new_cap_and_reserve_to_what_waits():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1)
    h = Harness(cfg, view(1))
    h.submit("a")
    h.submit("b")
    h.submit("c")
    assert h.order == ["a"]
    h.fc.configure(msgspec_replace(cfg, max_in_flight=3, reserved_in_flight=1))
    h.fc.pump()
    assert h.order == ["a", "b"]  # 2 in flight: 1 free, the reserve; c waits
    h.submit("crit", priority=1)
    assert h.order == ["a", "b", "crit"]


def test_least_busy_placement_narrows_an_urgent_requests_room():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=4,
                            urgent_placement="least-busy")
    h = Harness(cfg, view(3))
    a, b, c = h.view.addresses
    for address, picks, scraped in ((a, 2, False), (b, 3, True), (c, 1, True)):
        for _ in range(picks):
            h.ledger.picked(address)
        if scraped:
            h.ledger.scraped(address)
    # a: 2 picks since its scrape; b: 0, 3 in flight; c: 0, 1 in flight.
    assert h.fc.submit(flow="", priority=1, payload="crit") is None
    assert h.fc.room == (c,)
    assert h.fc.submit(flow="", priority=0, payload="std") is None
    assert h.fc.room is None  # not urgent: anywhere with room, as the scheduler likes
    # The default placement leaves an urgent request's room alone.
    h2 = Harness(msgspec_replace(cfg, urgent_placement="scheduler"), view(3))
    h2.ledger.picked(a)
    assert h2.fc.submit(flow="", priority=1, payload="crit") is None
    assert h2.fc.room is None


def test_least_busy_placement_applies_to_a_queued_urgent_request():
    cfg = FlowControlConfig(enabled=True, queue_threshold=100, max_in_flight=1,
                            urgent_placement="least-busy")
    h = Harness(cfg, view(2))
    a, b = h.view.addresses
    h.submit("s0")
    h.submit("s1")  # both endpoints full now (one each)
    assert sorted(h.where) == [a, b]
    h.submit("crit", priority=1)
    h.ledger.picked(a)  # a: 1 pick since its scrape (the Harness scrapes on send)
    h.ledger.completed(a)
    h.ledger.completed(a)
    h.ledger.completed(b)  # both have room; a had a pick since its scrape, b none
    h.fc.pump()
    assert h.order[-1] == "crit" and h.where[-1] == b
