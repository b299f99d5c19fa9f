"""The scheduler runner with plain-Python plugins: filters, weights, picker, hooks, errors."""

from __future__ import annotations

import numpy as np
import pytest

from epick import abi
from epick.abi import Criticality
from epick.bench.pypolicies import PyLoad, PyLoraAffinity, PyPrefixCache
from epick.interfaces import Capabilities, EndpointInfo, PluginError, PoolView
from epick.scheduler.filters import AdmissionFilter
from epick.scheduler.pickers import MaxScorePicker, WeightedRandomPicker
from epick.scheduler.policyset import DuplicatePolicyError, PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler, Shed, Unavailable


def view(*endpoints: abi.EndpointMetrics, info=None, version: int = 1) -> PoolView:
    return PoolView.build(abi.Snapshot(version=version, timestamp_ms=1000,
                                           endpoints=tuple(endpoints)), info)


def ep(i: int, **kw) -> abi.EndpointMetrics:
    return abi.EndpointMetrics(address=f"10.0.0.{i}:8000", **kw)


def req(**kw) -> abi.Request:
    kw.setdefault("model", "m")
    kw.setdefault("seed", 7)
    return abi.Request(**kw)


def sched(p: PoolView, *entries: PolicyEntry, **kw) -> Scheduler:
    return Scheduler(lambda: p, PolicySet.of(*entries), **kw)


class Boom:
    """A scorer that always fails, like a trapping WASM module."""

    name = "boom"
    capabilities = Capabilities.SCORE

    def score(self, cycle, candidates):
        raise PluginError("boom", "score", "trap", "unreachable executed")


class Recorder:
    def __init__(self):
        self.errors, self.shadows, self.stage_times = [], [], []

    def stages(self, *seconds):
        self.stage_times.append(seconds)

    def policy_error(self, error):
        self.errors.append((error.plugin, error.kind))

    def policy_latency(self, policy, seconds):
        pass

    def shadow(self, policy, agree, delta):
        self.shadows.append((policy, agree, delta))

    def completion(self, status, prompt_tokens, completion_tokens, ttft_s):
        pass


def test_queue_10_5_0_picks_the_idle_endpoint_and_orders_fallbacks():
    p = view(ep(1, waiting=10), ep(2, waiting=5), ep(3, waiting=0))
    d = sched(p, PolicyEntry("load", PyLoad())).schedule(req())
    assert d.endpoint == "10.0.0.3:8000"
    assert d.fallbacks == ["10.0.0.2:8000", "10.0.0.1:8000"]


def test_adapter_running_on_one_endpoint_wins_with_lora_affinity():
    p = view(ep(1, max_lora=1, running_adapters=("x",)),
             ep(2, max_lora=1, running_adapters=("sql",)),
             ep(3, max_lora=1, running_adapters=("y",)))
    s = sched(p, PolicyEntry("lora", PyLoraAffinity()), PolicyEntry("load", PyLoad()))
    assert s.schedule(req(adapter="sql")).endpoint == "10.0.0.2:8000"


def test_stale_endpoints_are_not_candidates():
    p = view(ep(1), ep(2), info=[EndpointInfo(fresh=False), EndpointInfo(fresh=True)])
    d = sched(p, PolicyEntry("load", PyLoad())).schedule(req())
    assert d.endpoint == "10.0.0.2:8000" and d.fallbacks == []


def test_no_fresh_endpoint_is_unavailable_and_says_why():
    p = view(ep(1), info=[EndpointInfo(fresh=False)])
    with pytest.raises(Unavailable, match=r"no endpoint has fresh metrics \(all stale\)"):
        sched(p).schedule(req())


def test_model_not_served_anywhere_is_unavailable():
    p = view(ep(1), info=[EndpointInfo(models=frozenset({"other"}))])
    with pytest.raises(Unavailable, match="no fresh endpoint serves model 'm'"):
        sched(p).schedule(req())


def test_pinned_adapters_restrict_candidates():
    p = view(ep(1), ep(2), info=[EndpointInfo(adapters=frozenset({"a"})), EndpointInfo()])
    d = sched(p).schedule(req(adapter="b"))
    assert d.endpoint == "10.0.0.2:8000" and d.fallbacks == []


def test_sheddable_request_is_shed_when_every_endpoint_is_over_thresholds():
    p = view(ep(1, waiting=6), ep(2, kv_usage=0.81))
    with pytest.raises(Shed, match=r"queue <= 5, kv <= 0.8"):
        sched(p, admission=AdmissionFilter(5, 0.8)).schedule(
            req(criticality=Criticality.SHEDDABLE))


def test_sheddable_request_goes_to_an_endpoint_under_the_thresholds():
    p = view(ep(1, waiting=6), ep(2, waiting=5, kv_usage=0.8))
    d = sched(p).schedule(req(criticality=Criticality.SHEDDABLE))
    assert d.endpoint == "10.0.0.2:8000"


def test_standard_request_is_never_shed_by_admission():
    p = view(ep(1, waiting=600, kv_usage=1.0))
    assert sched(p).schedule(req()).endpoint == "10.0.0.1:8000"


def test_failing_scorer_is_skipped_counted_and_the_pick_still_succeeds():
    rec = Recorder()
    p = view(ep(1, waiting=3), ep(2, waiting=0))
    s = sched(p, PolicyEntry("boom", Boom()), PolicyEntry("load", PyLoad()), recorder=rec)
    d = s.schedule(req())
    assert d.endpoint == "10.0.0.2:8000"
    assert rec.errors == [("boom", "trap")]
    assert d.skipped == ["boom: trap: unreachable executed"]
    (times,) = rec.stage_times  # filter, score, pick, hooks: once per successful pick
    assert len(times) == 4 and all(t >= 0 for t in times)


def test_weights_combine_scores():
    # lora prefers endpoint 1 (adapter running); load prefers endpoint 2 (empty queue;
    # one running, so the work-conserving rule has no idle replica to step in for).
    p = view(ep(1, waiting=10, max_lora=1, running_adapters=("a",)),
             ep(2, waiting=0, running=1, max_lora=1, running_adapters=("b",)))
    lora = lambda w: PolicyEntry("lora", PyLoraAffinity(), weight=w)  # noqa: E731
    load = PolicyEntry("load", PyLoad(), weight=1.0)
    assert sched(p, lora(3.0), load).schedule(req(adapter="a")).endpoint == "10.0.0.1:8000"
    assert sched(p, lora(0.1), load).schedule(req(adapter="a")).endpoint == "10.0.0.2:8000"


def test_ties_are_broken_by_the_seed_reproducibly_and_uniformly():
    p = view(*(ep(i) for i in range(4)))
    # recent picks off: with them each pick makes its endpoint busier, and nothing ties
    s = sched(p, PolicyEntry("load", PyLoad(recent_requests=0.0)))
    first = [s.schedule(req(seed=k)).endpoint for k in range(200)]
    again = [s.schedule(req(seed=k)).endpoint for k in range(200)]
    assert first == again
    counts = {a: first.count(a) for a in set(first)}
    assert len(counts) == 4 and min(counts.values()) > 25


def test_prefix_history_steers_the_same_prompt_back_to_the_same_endpoint():
    p = view(*(ep(i) for i in range(4)))
    s = sched(p, PolicyEntry("prefix", PyPrefixCache()), PolicyEntry("load", PyLoad()))
    prompt = "You are a helpful assistant. " * 20
    first = s.schedule(req(prompt=prompt, seed=1))
    s.complete(decision_id=first.decision_id)
    for k in range(2, 30):
        d = s.schedule(req(prompt=prompt, seed=k))
        assert d.endpoint == first.endpoint
        s.complete(decision_id=d.decision_id)


def test_prefix_affinity_yields_when_its_replica_is_far_busier_than_the_rest():
    # affinity bounded by load: requests that never complete pile up on the home replica
    # until it is more than max_imbalance (8) busier than an idle one; then load decides
    p = view(*(ep(i) for i in range(4)))
    s = sched(p, PolicyEntry("prefix", PyPrefixCache()), PolicyEntry("load", PyLoad()))
    prompt = "You are a helpful assistant. " * 20
    picks = [s.schedule(req(prompt=prompt, seed=k)).endpoint for k in range(1, 30)]
    home = picks[0]
    assert picks[:9] == [home] * 9
    assert len(set(picks)) > 1


def test_completion_runs_post_response_once_and_unknown_ids_are_acknowledged():
    lora = PyLoraAffinity()
    p = view(ep(1, max_lora=2))
    s = sched(p, PolicyEntry("lora", lora))
    d = s.schedule(req(adapter="a", request_id="r1"))
    assert lora.history == {("a", "10.0.0.1:8000"): 1}
    assert s.complete(decision_id=d.decision_id) is True
    assert lora.history == {("a", "10.0.0.1:8000"): 0}
    assert s.complete(decision_id=d.decision_id) is False
    assert s.complete(decision_id="nope") is False
    assert s.pending_decisions == 0


def test_completion_by_request_id():
    p = view(ep(1))
    s = sched(p)
    s.schedule(req(request_id="abc"))
    assert s.complete(request_id="abc") is True
    assert s.complete(request_id="abc") is False


def test_forgotten_decisions_do_not_leak():
    now = [0.0]
    p = view(ep(1))
    s = sched(p, decision_ttl_s=10, max_decisions=5, clock=lambda: now[0])
    for k in range(20):
        s.schedule(req(request_id=f"r{k}"))
    assert s.pending_decisions <= 5
    now[0] = 100.0
    s.schedule(req(request_id="late"))
    assert s.pending_decisions == 1
    assert s.complete(request_id="r0") is False


def test_explain_lists_every_endpoint_with_scores_filter_and_rank():
    p = view(ep(1, waiting=10), ep(2, waiting=0), ep(3),
             info=[EndpointInfo(), EndpointInfo(), EndpointInfo(fresh=False)])
    d = sched(p, PolicyEntry("load", PyLoad(), weight=2.0)).schedule(req(), explain=True)
    rows = {c.endpoint: c for c in d.explanation}
    assert rows["10.0.0.3:8000"].filtered_by == "fresh" and rows["10.0.0.3:8000"].rank == -1
    assert rows["10.0.0.2:8000"].rank == 0 and rows["10.0.0.1:8000"].rank == 1
    assert rows["10.0.0.2:8000"].scores == {"load": 1.0}
    assert rows["10.0.0.2:8000"].total == pytest.approx(2.0)
    # (queue 0 + kv 1 + 2 * work 8 / (8 + 10)) / 4
    assert rows["10.0.0.1:8000"].scores["load"] == pytest.approx((1 + 2 * 8 / 18) / 4)


def test_shadow_policy_scores_without_changing_the_pick():
    rec = Recorder()
    p = view(ep(1, waiting=0, max_lora=1, running_adapters=("b",)),
             ep(2, waiting=9, max_lora=1, running_adapters=("a",)))
    s = sched(p, PolicyEntry("load", PyLoad()),
              PolicyEntry("lora", PyLoraAffinity(), shadow=True), recorder=rec)
    d = s.schedule(req(adapter="a"), explain=True)
    assert d.endpoint == "10.0.0.1:8000"
    assert rec.shadows == [("lora", False, 1.0)]
    rows = {c.endpoint: c for c in d.explanation}
    assert rows["10.0.0.2:8000"].shadow_scores == {"lora": 1.0}
    assert "lora" not in rows["10.0.0.2:8000"].scores


def test_policy_set_refuses_duplicate_names():
    with pytest.raises(DuplicatePolicyError, match="a policy named 'load' already exists"):
        PolicySet.of(PolicyEntry("load", PyLoad()), PolicyEntry("load", PyLoad()))


def test_swapping_the_policy_set_changes_behaviour_for_the_next_pick():
    p = view(ep(1, waiting=0, max_lora=1, running_adapters=("b",)),
             ep(2, waiting=9, max_lora=1, running_adapters=("a",)))
    s = sched(p, PolicyEntry("load", PyLoad()))
    assert s.schedule(req(adapter="a")).endpoint == "10.0.0.1:8000"
    s.policies = s.policies.put(PolicyEntry("lora", PyLoraAffinity(), weight=5))
    assert s.schedule(req(adapter="a")).endpoint == "10.0.0.2:8000"


@pytest.mark.parametrize("picker", [MaxScorePicker(), WeightedRandomPicker()],
                         ids=["max", "weighted-random"])
def test_pickers_return_distinct_positions_best_first(picker):
    totals = np.array([0.1, 0.9, 0.5, 0.0])
    order = picker.pick(totals, 4, 3)
    assert sorted(order) == [0, 1, 2, 3]
    assert order[-1] == 3  # total 0 is last for both
    if isinstance(picker, MaxScorePicker):
        assert order == [1, 2, 0, 3]


def test_weighted_random_follows_the_totals():
    totals = np.array([3.0, 1.0])
    firsts = [WeightedRandomPicker().pick(totals, 1, s)[0] for s in range(2000)]
    assert 0.68 < firsts.count(0) / 2000 < 0.82


class FailsAt:
    """A plugin of every stage that raises PluginError at ``stage`` only."""

    def __init__(self, stage: str, name: str = "flaky") -> None:
        self.name, self.stage = name, stage
        self.capabilities = (Capabilities.FILTER | Capabilities.SCORE
                             | Capabilities.PRE_REQUEST | Capabilities.POST_RESPONSE)

    def _maybe_fail(self, stage):
        if stage == self.stage:
            raise PluginError(self.name, stage, "trap", "unreachable executed")

    def filter(self, cycle, candidates):
        self._maybe_fail("filter")
        return candidates

    def score(self, cycle, candidates):
        self._maybe_fail("score")
        return np.full(len(candidates), 0.5)

    def pre_request(self, cycle, endpoint):
        self._maybe_fail("pre_request")

    def post_response(self, event):
        self._maybe_fail("post_response")


@pytest.mark.parametrize(("stage", "shadow", "listed"), [
    ("filter", False, True),
    ("score", False, True),
    ("pre_request", False, True),
    ("score", True, False),  # a shadow's failure never shows in the live answer
    ("pre_request", True, True),  # shadows record the pick like live policies
    ("post_response", False, False),  # after the answer: counted only
], ids=["filter", "score", "pre_request", "shadow-score", "shadow-pre_request",
        "post_response"])
def test_every_stage_guards_a_failing_plugin_the_same_way(stage, shadow, listed):
    rec = Recorder()
    p = view(ep(1), ep(2))
    s = sched(p, PolicyEntry("flaky", FailsAt(stage), shadow=shadow),
              PolicyEntry("load", PyLoad()), recorder=rec)
    d = s.schedule(req(request_id="r"))
    assert d.endpoint in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert s.complete(decision_id=d.decision_id) is True
    assert rec.errors == [("flaky", "trap")]
    assert d.skipped == (["flaky: trap: unreachable executed"] if listed else [])
    assert len(rec.stage_times) == 1 and all(t >= 0 for t in rec.stage_times[0])


def test_completion_hooks_name_the_picked_endpoint_and_the_log_what_the_gateway_said():
    class Sink:
        def __init__(self):
            self.completions = []

        def decision(self, *args):
            pass

        def completion(self, decision_id, event, endpoint, *rest):
            self.completions.append((event.endpoint, endpoint))

    lora = PyLoraAffinity()
    p = view(ep(1, max_lora=2), ep(2, max_lora=2), ep(3, max_lora=2))
    s = sched(p, PolicyEntry("lora", lora))
    s.decision_log = sink = Sink()
    d = s.schedule(req(adapter="a"))  # no request id: history is keyed by endpoint
    assert lora.history == {("a", d.endpoint): 1}
    # the gateway failed over to a fallback and says so
    assert s.complete(decision_id=d.decision_id, endpoint=d.fallbacks[0]) is True
    assert lora.history == {("a", d.endpoint): 0}  # the pick's history came down
    assert s.assignments.in_flight(d.endpoint) == 0
    assert sink.completions == [(d.endpoint, d.fallbacks[0])]


def test_shadow_agreement_is_tallied_per_plugin_and_a_new_load_starts_fresh():
    p = view(ep(1), ep(2, waiting=9))
    lora = PyLoraAffinity()  # scores both 0.8-ish: agrees with load's pick
    s = sched(p, PolicyEntry("load", PyLoad()), PolicyEntry("lora", lora, shadow=True))
    assert s.shadow_agreement(lora) == 0.0  # nothing scored yet
    for seed in range(10):
        s.schedule(req(seed=seed))
    assert s.shadow_agreement(lora) == 1.0
    fresh = PyLoraAffinity()
    s.policies = s.policies.put(PolicyEntry("lora", fresh, shadow=True))
    assert s.shadow_agreement(fresh) == 0.0 and s.shadow_agreement(lora) == 1.0


class Favour:
    """Scores one address 1 and the rest 0: affinity strong enough to beat any load."""

    capabilities = Capabilities.SCORE

    def __init__(self, address: str) -> None:
        self.name, self.address = "favour", address

    def score(self, cycle, candidates):
        endpoints = cycle.view.snapshot.endpoints
        return np.array([1.0 if endpoints[i].address == self.address else 0.0
                         for i in candidates])


def test_work_conserving_sends_past_a_queue_to_an_idle_replica():
    """Issue 30: affinity may concentrate work, not leave a replica idle while another
    queues. The best-scored idle replica goes first; the rest keep their order."""
    p = view(ep(1, waiting=3, running=4), ep(2, running=2), ep(3), ep(4))
    s = sched(p, PolicyEntry("favour", Favour("10.0.0.1:8000")))
    d = s.schedule(req())
    assert d.endpoint in ("10.0.0.3:8000", "10.0.0.4:8000")
    assert d.fallbacks[0] == "10.0.0.1:8000"  # the favourite is still next
    assert len(d.fallbacks) == 2


def test_work_conserving_counts_what_epick_sent_since_the_scrape_as_work():
    p = view(ep(1, waiting=3), ep(2))
    s = sched(p, PolicyEntry("favour", Favour("10.0.0.1:8000")))
    s.assignments.picked("10.0.0.2:8000")  # not idle: epick just sent it one
    assert s.schedule(req()).endpoint == "10.0.0.1:8000"


def test_work_conserving_leaves_affinity_alone_when_nothing_waits_or_nothing_is_idle():
    favour = PolicyEntry("favour", Favour("10.0.0.1:8000"))
    assert sched(view(ep(1, running=5), ep(2)), favour).schedule(req()).endpoint == \
        "10.0.0.1:8000"  # nothing waits: affinity may concentrate
    assert sched(view(ep(1, waiting=2), ep(2, running=1)), favour).schedule(
        req()).endpoint == "10.0.0.1:8000"  # nobody idle


def test_work_conserving_off_keeps_the_scored_order():
    p = view(ep(1, waiting=3), ep(2))
    s = sched(p, PolicyEntry("favour", Favour("10.0.0.1:8000")), work_conserving=False)
    assert s.schedule(req()).endpoint == "10.0.0.1:8000"


def test_work_conserving_reads_each_new_snapshots_idle_replicas():
    """The idle replicas are found once per snapshot: a new snapshot (a scrape) where one
    became idle, or stopped being idle, changes the pick at once."""
    views = [view(ep(1, waiting=2), ep(2, running=1), ep(3, running=1), version=1)]
    favour = PolicyEntry("favour", Favour("10.0.0.1:8000"))
    s = Scheduler(lambda: views[-1], PolicySet.of(favour))
    assert s.schedule(req()).endpoint == "10.0.0.1:8000"  # nobody idle
    views.append(view(ep(1, waiting=2), ep(2, running=1), ep(3), version=2))
    assert s.schedule(req()).endpoint == "10.0.0.3:8000"  # 3 went idle
    views.append(view(ep(1, waiting=2), ep(2), ep(3, running=1), version=3))
    assert s.schedule(req()).endpoint == "10.0.0.2:8000"  # 2 did, and 3 is busy again
    views.append(view(ep(1, waiting=2), ep(2, running=1), ep(3, waiting=1), version=4))
    assert s.schedule(req()).endpoint == "10.0.0.1:8000"
