"""The scheduler's collaborators are given, never swapped: assignments, KV counts and
the pool's status to the constructor; policies, assignments and KV counts to one call
(a replay of the decision log gives what the log recorded)."""

from __future__ import annotations

import numpy as np

from epick import abi
from epick.interfaces import Capabilities, PoolView
from epick.pool import EndpointStatus
from epick.scheduler.assignments import Assignments
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler

VIEW = PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=tuple(
    abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in (1, 2))))
FIRST, SECOND = "10.0.0.1:8000", "10.0.0.2:8000"


class Prefers:
    """A scorer that gives 1.0 to one endpoint and 0.0 to the rest."""

    capabilities = Capabilities.SCORE

    def __init__(self, address: str) -> None:
        self.name, self.address = "prefers", address

    def score(self, cycle, candidates):
        eps = cycle.view.snapshot.endpoints
        return np.array([1.0 if eps[i].address == self.address else 0.0 for i in candidates])


def prefers(address: str) -> PolicySet:
    return PolicySet.of(PolicyEntry("prefers", Prefers(address)))


class Counts:
    """A ledger with fixed counts that records what it was told."""

    def __init__(self, in_flight: dict[str, int]) -> None:
        self.counts, self.picks, self.completions = in_flight, [], []

    def of(self, addresses):
        return tuple(self.counts.get(a, 0) for a in addresses), (0,) * len(addresses)

    def picked(self, address):
        self.picks.append(address)

    def completed(self, address):
        self.completions.append(address)

    def in_flight(self, address):
        return self.counts.get(address, 0)

    def picked_since_scrape(self, address):
        return 0

    def __bool__(self):
        return True


class Kv:
    def counts(self, request, endpoints, candidates):
        return (4,) * len(candidates), tuple(3 if endpoints[i].address == SECOND else 0
                                              for i in candidates)

    def cleared(self, endpoints, candidates):
        return (0,) * len(candidates)


def test_picks_and_completions_go_to_the_assignments_the_scheduler_was_given():
    given = Assignments()
    s = Scheduler(lambda: VIEW, prefers(FIRST), assignments=given)
    d = s.schedule(abi.Request(model="m", seed=1))
    assert s.assignments is given and given.in_flight(FIRST) == 1
    assert s.complete(decision_id=d.decision_id)
    assert given.in_flight(FIRST) == 0


def test_kv_counts_and_pool_status_given_at_construction_reach_the_explanation():
    never = EndpointStatus(address="10.0.0.9:8000", url="http://10.0.0.9:8000/metrics",
                           engine="vllm", fresh=False, last_success_age_ms=None,
                           last_error="refused", failures=3)
    s = Scheduler(lambda: VIEW, prefers(FIRST), kv=Kv(), pool_status=lambda: [never])
    rows = {r.endpoint: r for r in s.schedule(abi.Request(model="m", seed=1),
                                              explain=True).explanation}
    assert (rows[SECOND].prefix_blocks, rows[SECOND].prefix_matched) == (4, 3)
    assert rows[never.address].filtered_by == "no-metrics"
    assert rows[never.address].reason.endswith("last error: refused")


def test_a_call_with_its_own_collaborators_leaves_the_schedulers_own_untouched():
    own = Assignments()
    s = Scheduler(lambda: VIEW, prefers(FIRST), assignments=own)
    ledger = Counts({SECOND: 5})
    d = s.schedule(abi.Request(model="m", seed=1), explain=True, policies=prefers(SECOND),
                   assignments=ledger, kv=Kv())
    assert d.endpoint == SECOND  # the call's policies, not the scheduler's
    rows = {r.endpoint: r for r in d.explanation}
    assert rows[SECOND].in_flight == 5 and rows[SECOND].prefix_matched == 3
    assert ledger.picks == [SECOND] and not own  # the pick counted in the call's ledger
    assert s.policies.get("prefers").plugin.address == FIRST
    assert s.kv is None
    # The next call without them uses the scheduler's own again.
    d = s.schedule(abi.Request(model="m", seed=1), explain=True)
    assert d.endpoint == FIRST and own.in_flight(FIRST) == 1
    assert {r.endpoint: r.prefix_blocks for r in d.explanation} == {FIRST: None, SECOND: None}
