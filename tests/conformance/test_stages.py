"""conformance/stages.py: picks, state, statistics and the host stage, judged without WASM
(a stand-in driver; the host stage with fixed-score policies through the real scheduler)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from epick import abi
from epick.conformance import stages
from epick.conformance.schema import Case, Pick, State

SNAP = abi.Snapshot(version=1, timestamp_ms=5_000, endpoints=tuple(
    abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in range(3)))


class Instance:
    def __init__(self, state: object | None) -> None:
        self.exports = {} if state is None else {"export_state": None}
        self._state = state

    def export_state(self) -> bytes:
        return msgspec.msgpack.encode(self._state)


class FakeDriver:
    """What stages asks of a Driver: fixed scores per endpoint, an optional keep-mask."""

    def __init__(self, scores=(0.1, 0.9, 0.5), keep=None, state=None) -> None:
        self.scores = np.asarray(scores, dtype=float)
        self.keep = keep
        self.can_filter = keep is not None
        self.can_score = scores is not None
        self.hooks: list[abi.PreRequestEvent] = []
        self.instance = Instance(state)

    def filter(self, snap, request, cands):
        return [self.keep[c] for c in cands]

    def score(self, snap, request, cands):
        return self.scores[list(cands)]

    def pre_request(self, event):
        self.hooks.append(event)


def test_pick_takes_the_best_score_among_the_candidates():
    chosen, totals = stages.pick(FakeDriver(), SNAP, abi.Request(), (0, 1, 2), "max")
    assert chosen == 1 and list(totals) == [0.1, 0.9, 0.5]
    assert stages.pick(FakeDriver(), SNAP, abi.Request(), (0, 2), "max")[0] == 2


def test_pick_clips_scores_to_the_unit_range_as_the_host_does():
    chosen, totals = stages.pick(FakeDriver(scores=(-3.0, 7.0, 0.5)), SNAP, abi.Request(),
                                 (0, 1, 2), "max")
    assert chosen == 1 and list(totals) == [0.0, 1.0, 0.5]


def test_a_filter_only_policy_picks_among_what_it_keeps():
    d = FakeDriver(scores=None, keep=(False, False, True))
    chosen, totals = stages.pick(d, SNAP, abi.Request(), (0, 1, 2), "max")
    assert chosen == 2 and list(totals) == [1.0]


def test_a_filter_that_keeps_nothing_sheds_a_standard_request_but_never_a_critical_one():
    d = FakeDriver(keep=(False, False, False))
    assert stages.pick(d, SNAP, abi.Request(), (0, 1, 2), "max")[0] is None
    critical = abi.Request(criticality=abi.Criticality.CRITICAL)
    assert stages.pick(d, SNAP, critical, (0, 1, 2), "max")[0] == 1


def test_check_pick_passes_and_runs_pre_request_on_the_pick_at_the_snapshot_time():
    d = FakeDriver()
    assert stages.check_pick(d, SNAP, Pick(expect="10.0.0.1:8000"), "steps[0]") == []
    [hook] = d.hooks
    assert hook.endpoint == "10.0.0.1:8000" and hook.timestamp_ms == 5_000


def test_check_pick_names_the_expected_and_the_actual_pick_with_the_scores():
    d = FakeDriver()
    [diff] = stages.check_pick(d, SNAP, Pick(expect="10.0.0.2:8000", why="least busy"),
                               "steps[1]")
    assert diff == ("steps[1]: expected 10.0.0.2:8000 to be picked (least busy), got "
                    "10.0.0.1:8000 (scores [0.1, 0.9, 0.5])")


def test_check_pick_reports_a_shed_only_when_a_pick_was_expected():
    d = FakeDriver(keep=(False, False, False))
    assert stages.check_pick(d, SNAP, Pick(expect="10.0.0.0:8000"), "s") == [
        "s: every candidate was filtered out (shed)"]
    assert stages.check_pick(d, SNAP, Pick(), "s") == [] and d.hooks == []


def test_check_state_walks_the_exported_state_and_compares():
    d = FakeDriver(state={"lru": [["a", 1], ["b", 2]], "n": 2})
    assert stages.check_state(d, State(path=("n",), equals=2), "w") == []
    assert stages.check_state(d, State(path=("lru",), length=2), "w") == []
    assert stages.check_state(d, State(path=("lru", 1, 0), equals="b"), "w") == []


def test_check_state_says_where_the_walk_stopped_and_what_differs():
    d = FakeDriver(state={"lru": [["a", 1]], "n": 1})
    assert stages.check_state(d, State(path=("lru", 3), equals=1), "w") == [
        "w: state['lru'] has no [3] (it is [['a', 1]])"]
    assert stages.check_state(d, State(path=("n",), equals=2, why="two picks"), "w") == [
        "w: expected state['n'] = 2 (two picks), got 1"]
    assert stages.check_state(d, State(path=("n",), length=1), "w") == [
        "w: expected state['n'] to have 1 elements, got no length: 1"]


def test_check_state_of_a_policy_without_export_state_says_so():
    assert stages.check_state(FakeDriver(), State(path=(), equals={}), "w") == [
        "w: the policy does not export export_state (no observable state)"]


def case(**fields) -> Case:
    snap = {"endpoints": [{"address": f"10.0.0.{i}:8000"} for i in range(3)]}
    return msgspec.convert({"name": "c", "snapshot": snap, **fields}, type=Case)


def test_check_stats_counts_each_candidates_share_of_the_seeds():
    c = case(stats={"seeds": 50, "frequencies": [0.0, 1.0, 0.0]})
    diffs, shares = stages.check_stats(FakeDriver(), SNAP, c)
    assert diffs == [] and list(shares) == [0.0, 1.0, 0.0]


def test_check_stats_names_the_endpoint_its_share_and_the_expectation():
    c = case(stats={"seeds": 20, "frequencies": [0.5, 0.5, 0.0], "tolerance": 0.05,
                    "why": "a tie"})
    diffs, _ = stages.check_stats(FakeDriver(), SNAP, c)
    assert diffs == [
        "endpoint 0 (10.0.0.0:8000) picked 0.0% of 20 seeds, expected 50.0% ± 5.0% (a tie)",
        "endpoint 1 (10.0.0.1:8000) picked 100.0% of 20 seeds, expected 50.0% ± 5.0% (a tie)"]


def fixed(name, **spec):
    return {"name": name, **spec}


def test_the_host_stage_weighs_fixed_policies_through_the_real_scheduler():
    c = case(host={"policies": [fixed("a", scores=[1.0, 0.0, 0.5], weight=1.0),
                                fixed("b", scores=[0.0, 1.0, 0.6], weight=2.0)],
                   "fallbacks": 1,
                   "expect": {"pick": "10.0.0.1:8000", "fallbacks": ["10.0.0.2:8000"],
                              "totals": [1.0, 2.0, 1.7]}})
    diffs, decided = stages.check_host(c, SNAP, None, None, None, {})
    assert diffs == [], diffs
    assert decided == "10.0.0.1:8000 then ['10.0.0.2:8000']"


def test_the_host_stage_reports_a_wrong_pick_totals_and_filtering():
    c = case(host={"policies": [fixed("f", keep=[True, False, True]),
                                fixed("s", scores=[0.2, 0.9, 0.4])],
                   "expect": {"pick": "10.0.0.0:8000", "totals": [0.2, 0.9, 0.4],
                              "filtered": {"10.0.0.2:8000": "f"}, "why": "w"}})
    diffs, decided = stages.check_host(c, SNAP, None, None, None, {})
    assert decided.startswith("10.0.0.2:8000 then")
    assert diffs[0] == "expected 10.0.0.0:8000 to be picked (w), got 10.0.0.2:8000"
    assert any(d.startswith("10.0.0.1:8000: expected total 0.9") for d in diffs)
    assert "10.0.0.1:8000: expected to survive, got removed by 'f'" in diffs
    assert "10.0.0.2:8000: expected to be removed by 'f', got kept" in diffs


def test_the_host_stage_knows_an_unavailable_pool_from_a_pick():
    everything_stale = {"stale": [f"10.0.0.{i}:8000" for i in range(3)],
                        "policies": [fixed("s", scores=[0.1, 0.2, 0.3])]}
    ok = case(host={**everything_stale, "expect": {"outcome": "unavailable"}})
    diffs, decided = stages.check_host(ok, SNAP, None, None, None, {})
    assert diffs == [] and decided.startswith("unavailable: ")
    wrong = case(host={**everything_stale, "expect": {"pick": "10.0.0.0:8000"}})
    [diff], _ = stages.check_host(wrong, SNAP, None, None, None, {})
    assert diff.startswith("expected a pick of 10.0.0.0:8000, got unavailable: ")


def test_the_host_stage_pins_models_per_endpoint():
    c = case(request={"model": "m2"},
             host={"serves": {"10.0.0.0:8000": {"models": ["m1"]},
                              "10.0.0.1:8000": {"models": ["m1"]}},
                   "policies": [fixed("s", scores=[0.9, 0.9, 0.1])],
                   "expect": {"pick": "10.0.0.2:8000"}})
    assert stages.check_host(c, SNAP, None, None, None, {})[0] == []


def test_the_host_stage_statistics_count_every_seed():
    c = case(stats={"seeds": 30, "frequencies": [0.0, 0.0, 1.0]},
             host={"policies": [fixed("s", scores=[0.1, 0.2, 0.3])]})
    diffs, shares = stages.check_host(c, SNAP, None, None, None, {})
    assert diffs == [] and shares == "[0.0%, 0.0%, 100.0%]"


def test_a_self_host_policy_without_a_module_under_test_is_refused():
    c = case(host={"policies": [{"name": "me", "module": "self"}],
                   "expect": {"pick": "10.0.0.0:8000"}})
    with pytest.raises(ValueError, match="host policy 'me' is `self`, but no module"):
        stages.check_host(c, SNAP, None, None, None, {})
