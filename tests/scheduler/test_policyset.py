"""PolicySet and PolicyEntry: capabilities checked at install, stage views, swaps."""

from __future__ import annotations

import numpy as np
import pytest

from epick import abi
from epick.interfaces import Capabilities, Cycle, PluginSpecError, PoolView
from epick.scheduler.policyset import (
    DuplicatePolicyError,
    PolicyEntry,
    PolicySet,
    UnknownPolicyError,
)
from epick.scheduler.scheduler import Scheduler

C = Capabilities


class Plugin:
    """A plugin with every method; ``capabilities`` says which it claims."""

    def __init__(self, capabilities=C.SCORE, score: float = 0.5) -> None:
        self.capabilities = capabilities
        self._score = score

    def score(self, cycle, candidates):
        return np.full(len(candidates), self._score)

    def filter(self, cycle, candidates):
        return candidates

    def pre_request(self, cycle, endpoint):
        pass

    def post_response(self, event):
        pass

    def export_state(self):
        return b""

    def import_state(self, state):
        pass


class Bare:
    """Methods, but no declaration: not probed, refused."""

    def score(self, cycle, candidates):
        return np.zeros(len(candidates))


class OnlyFilter:
    capabilities = C.FILTER | C.SCORE

    def filter(self, cycle, candidates):
        return candidates


def test_a_plugin_that_declares_nothing_is_refused_with_its_name():
    with pytest.raises(PluginSpecError, match=r"plugin 'bare': Bare declares no "
                       r"`capabilities` \(an epick.interfaces.Capabilities\), got None"):
        PolicyEntry("bare", Bare())


def test_a_plugin_that_implements_no_extension_point_is_refused():
    with pytest.raises(PluginSpecError, match=r"plugin 'idle': implements no extension "
                       r"point .* expected at least one of filter, score"):
        PolicyEntry("idle", Plugin(C.STATE))
    with pytest.raises(PluginSpecError, match="plugin 'none'"):
        PolicyEntry("none", Plugin(C.NONE))


def test_a_declared_capability_without_its_method_is_refused():
    with pytest.raises(PluginSpecError, match=r"plugin 'f': declares SCORE but has no "
                       r"score\(\) method") as err:
        PolicyEntry("f", OnlyFilter())
    assert err.value.plugin == "f"


def test_capabilities_are_read_once_at_install():
    plugin = Plugin(C.SCORE)
    entry = PolicyEntry("p", plugin)
    plugin.capabilities = C.FILTER  # a later change does not move it between stages
    assert entry.capabilities == C.SCORE
    assert PolicySet.of(entry).scorers == (entry,) and PolicySet.of(entry).filters == ()


def test_the_stage_views_follow_capabilities_and_shadow():
    f = PolicyEntry("f", Plugin(C.FILTER))
    s = PolicyEntry("s", Plugin(C.SCORE | C.PRE_REQUEST))
    post = PolicyEntry("post", Plugin(C.POST_RESPONSE))
    shadow = PolicyEntry("shadow", Plugin(C.SCORE | C.FILTER | C.PRE_REQUEST), shadow=True)
    ps = PolicySet.of(f, s, post, shadow)
    assert ps.filters == (f,)
    assert ps.scorers == (s,)
    assert ps.shadows == (shadow,)  # a shadow filter never filters
    assert ps.pre_request == (s, shadow)  # shadows record the pick too
    assert ps.post_response == (post,)
    assert [e.name for e in ps.entries] == ["f", "s", "post", "shadow"]


def test_duplicate_names_are_refused():
    with pytest.raises(DuplicatePolicyError, match="a policy named 'a' already exists"):
        PolicySet.of(PolicyEntry("a", Plugin()), PolicyEntry("a", Plugin()))


def test_put_replaces_in_place_and_appends_new_names():
    a, b = PolicyEntry("a", Plugin()), PolicyEntry("b", Plugin())
    ps = PolicySet.of(a, b)
    a2 = PolicyEntry("a", Plugin(C.FILTER))
    swapped = ps.put(a2)
    assert swapped.entries == (a2, b) and swapped.filters == (a2,) and swapped.scorers == (b,)
    assert ps.entries == (a, b)  # the old set is unchanged: a swap is a new value
    c = PolicyEntry("c", Plugin())
    assert ps.put(c).entries == (a, b, c)


def test_remove_and_weight_name_unknown_policies():
    ps = PolicySet.of(PolicyEntry("a", Plugin()))
    with pytest.raises(UnknownPolicyError) as err:
        ps.remove("zz")
    assert str(err.value) == "no policy named 'zz'"
    with pytest.raises(UnknownPolicyError):
        ps.with_weight("zz", 2.0)
    assert len(ps.remove("a")) == 0 and "a" not in ps.remove("a")
    weighted = ps.with_weight("a", 3.0)
    assert weighted.get("a").weight == 3.0 and weighted.get("a").capabilities == C.SCORE


def _view() -> PoolView:
    eps = tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in range(2))
    return PoolView.build(abi.Snapshot(version=1, timestamp_ms=0, endpoints=eps))


@pytest.mark.parametrize(("caps", "total"), [
    (C.SCORE, 1.0),  # out of range: the runner clamps
    (C.SCORE | C.SCORES_IN_RANGE, 2.0),  # declared in range: the runner trusts it
], ids=["clamped-by-runner", "declared-in-range"])
def test_the_runner_clamps_only_scores_not_declared_in_range(caps, total):
    p = _view()
    s = Scheduler(lambda: p, PolicySet.of(PolicyEntry("x", Plugin(caps, score=2.0))))
    d = s.schedule(abi.Request(model="m", seed=1), explain=True)
    assert [row.total for row in d.explanation] == [total, total]


def test_a_cycle_is_what_plugins_share():
    # the interfaces' Cycle carries the request to every plugin of one pick
    p = _view()
    seen = []

    class Spy(Plugin):
        def score(self, cycle: Cycle, candidates):
            seen.append((cycle.request.model, candidates))
            return super().score(cycle, candidates)

    Scheduler(lambda: p, PolicySet.of(PolicyEntry("spy", Spy()))).schedule(
        abi.Request(model="m", seed=1))
    assert seen == [("m", (0, 1))]
