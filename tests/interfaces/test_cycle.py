"""interfaces/cycle.py: one cycle's shared state; N policies cost one encoding."""

from __future__ import annotations

import msgspec

from epick import abi
from epick.interfaces import Cycle, PoolView

REQ = abi.Request(request_id="r1", model="m", prompt="hello")


def pool_view(n: int = 3) -> PoolView:
    return PoolView.build(abi.Snapshot(version=4, endpoints=tuple(
        abi.EndpointMetrics(address=f"10.0.0.{i}:8000", running=i) for i in range(n))))


class Assigned:
    """An AssignmentView that counts its calls: in flight = 10 + the address's last digit."""

    def __init__(self, empty: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.empty = empty

    def of(self, addresses):
        self.calls.append(list(addresses))
        return (tuple(10 + int(a.split(":")[0][-1]) for a in addresses),
                tuple(1 for _ in addresses))

    def __bool__(self) -> bool:
        return not self.empty


class Kv:
    def __init__(self) -> None:
        self.calls = 0

    def counts(self, request, endpoints, candidates):
        self.calls += 1
        return tuple(4 for _ in candidates), tuple(c for c in candidates)

    def cleared(self, endpoints, candidates):
        return tuple(1000 + c for c in candidates)


def decode(blob: bytes) -> abi.ScoreInput:
    return msgspec.msgpack.decode(blob, type=abi.ScoreInput)


def test_score_input_carries_the_request_candidates_and_inline_snapshot():
    p = pool_view()
    got = decode(Cycle(view=p, request=REQ).score_input((0, 2), inline_snapshot=True))
    assert got.request == REQ and got.candidates == (0, 2) and got.snapshot == p.snapshot
    assert got.in_flight == () and got.prefix_blocks == () and got.prefix_cleared_ms == ()


def test_a_resident_snapshot_policy_gets_no_snapshot_in_its_input():
    got = decode(Cycle(view=pool_view(), request=REQ).score_input((0,), inline_snapshot=False))
    assert got.snapshot is None and got.candidates == (0,)


def test_score_input_is_encoded_once_per_candidates_and_mode():
    c = Cycle(view=pool_view(), request=REQ, assignments=Assigned(), kv=Kv())
    first = c.score_input((0, 1), inline_snapshot=False)
    assert c.score_input((0, 1), inline_snapshot=False) is first
    assert c.score_input((0, 1), inline_snapshot=True) is not first
    assert c.score_input((1,), inline_snapshot=False) is not first
    assert c.kv.calls == 2  # one per candidate tuple, shared by both modes


def test_assignments_are_read_once_per_candidates_and_frozen_for_the_cycle():
    view = Assigned()
    c = Cycle(view=pool_view(), request=REQ, assignments=view)
    assert c.assigned((0, 1, 2)) == ((10, 11, 12), (1, 1, 1))
    assert c.assigned((0, 1, 2)) == ((10, 11, 12), (1, 1, 1))
    assert c.assigned((2,)) == ((12,), (1,))
    assert view.calls == [["10.0.0.0:8000", "10.0.0.1:8000", "10.0.0.2:8000"],
                          ["10.0.0.2:8000"]]
    got = decode(c.score_input((2,), inline_snapshot=False))
    assert got.in_flight == (12,) and got.picked_since_scrape == (1,)


def test_no_or_empty_assignments_give_empty_counts_without_asking():
    assert Cycle(view=pool_view(), request=REQ).assigned((0,)) == ((), ())
    empty = Assigned(empty=True)
    assert Cycle(view=pool_view(), request=REQ, assignments=empty).assigned((0,)) == ((), ())
    assert empty.calls == []


def test_kv_counts_and_clears_fill_the_prefix_fields_when_kv_events_are_on():
    got = decode(Cycle(view=pool_view(), request=REQ, kv=Kv()).score_input(
        (0, 2), inline_snapshot=False))
    assert got.prefix_blocks == (4, 4) and got.prefix_matched == (0, 2)
    assert got.prefix_cleared_ms == (1000, 1002)


def test_kv_off_leaves_the_prefix_fields_empty():
    c = Cycle(view=pool_view(), request=REQ)
    assert c.kv_counts((0, 1)) == ((), ()) and c.kv_cleared((0, 1)) == ()


def test_pre_request_input_is_encoded_once_per_endpoint_and_time():
    c = Cycle(view=pool_view(), request=REQ)
    blob = c.pre_request_input("10.0.0.1:8000", 55)
    assert c.pre_request_input("10.0.0.1:8000", 55) is blob
    ev = msgspec.msgpack.decode(blob, type=abi.PreRequestEvent)
    assert (ev.request, ev.endpoint, ev.timestamp_ms) == (REQ, "10.0.0.1:8000", 55)
    other = msgspec.msgpack.decode(c.pre_request_input("10.0.0.2:8000", 55),
                                   type=abi.PreRequestEvent)
    assert other.endpoint == "10.0.0.2:8000"
