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


class _Reference:
    """The memory before picks skipped the expiry check: the oldest looked at on every
    remember (what DecisionMemory must still do, observably)."""

    def __init__(self, ttl_s, max_decisions, clock, on_expire):
        from collections import OrderedDict

        self.ttl_s, self.max, self.clock, self.on_expire = ttl_s, max_decisions, clock, on_expire
        self.pending, self.by_request = OrderedDict(), {}

    def remember(self, decision_id, request_id, endpoint):
        now = self.clock()
        while self.pending:
            oldest_id, (rid, ep, expires) = next(iter(self.pending.items()))
            if expires > now and len(self.pending) < self.max:
                break
            self.pending.popitem(last=False)
            self.on_expire(ep)
            if rid and self.by_request.get(rid) == oldest_id:
                del self.by_request[rid]
        self.pending[decision_id] = (request_id, endpoint, now + self.ttl_s)
        if request_id:
            self.by_request[request_id] = decision_id

    def take(self, decision_id="", request_id=""):
        if not decision_id and request_id:
            decision_id = self.by_request.get(request_id, "")
        rec = self.pending.pop(decision_id, None) if decision_id else None
        if rec is None:
            return None
        if rec[0] and self.by_request.get(rec[0]) == decision_id:
            del self.by_request[rec[0]]
        return decision_id


def test_expiry_is_what_looking_at_the_oldest_on_every_remember_gave():
    """Picks skip the expiry check until the oldest decision can have expired: the same
    decisions expire at the same remember as before, clock jumps back included."""
    import random

    rng = random.Random(29)
    for trial in range(100):
        clock = Clock()
        got, want = [], []
        m = DecisionMemory(ttl_s=5.0, max_decisions=rng.choice([3, 8, 1000]), clock=clock,
                           on_expire=got.append)
        ref = _Reference(5.0, m.max_decisions, clock, want.append)
        ids = []
        for step in range(400):
            r = rng.random()
            if r < 0.55:
                rid = rng.choice(["", f"r{rng.randrange(20)}"])
                endpoint = f"e{rng.randrange(4)}"
                decision_id = m.remember(rid, "m", "", endpoint)
                ref.remember(decision_id, rid, endpoint)
                ids.append(decision_id)
            elif r < 0.8 and ids:
                if rng.random() < 0.5:
                    # often the oldest: the one whose expiry the check waits for
                    oldest = next(iter(ref.pending), None)
                    pick = oldest if oldest and rng.random() < 0.5 else rng.choice(ids)
                    taken = m.take(decision_id=pick)
                    want_taken = ref.take(decision_id=taken[0]) if taken else None
                else:
                    rid = f"r{rng.randrange(20)}"
                    taken, want_taken = m.take(request_id=rid), ref.take(request_id=rid)
                assert (taken[0] if taken else None) == want_taken
            else:  # the clock moves: mostly on, now and then back (trial 0: never back)
                back = trial and rng.random() < 0.1
                clock.now += -rng.uniform(0, 8) if back else rng.uniform(0, 3)
            assert got == want, (trial, step)
            assert len(m) == len(ref.pending)
