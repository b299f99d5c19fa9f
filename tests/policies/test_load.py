"""load: queue, KV-cache and work scores and their weighted combination (docs/design.md, "Load")."""

from __future__ import annotations

import numpy as np
import pytest
from policy_payloads import PolicyLoadError, ep, score_input, snap


def scores(inst, endpoints, **request):
    return inst.score(score_input(snap(endpoints), **request), len(endpoints))


def test_queue_scores_span_min_to_max(policy):
    inst = policy("load", kv_weight=0, work_weight=0)
    got = scores(inst, [ep("a", waiting=10), ep("b", waiting=5), ep("c", waiting=0)])
    np.testing.assert_allclose(got, [0.0, 0.5, 1.0])


def test_kv_scores_are_one_minus_usage(policy):
    inst = policy("load", queue_weight=0, work_weight=0)
    got = scores(inst, [ep("a", kv_usage=0.8), ep("b", kv_usage=0.5), ep("c", kv_usage=0.0)])
    np.testing.assert_allclose(got, [0.2, 0.5, 1.0])


def test_equal_queues_score_one_everywhere(policy):
    inst = policy("load", kv_weight=0, work_weight=0)
    got = scores(inst, [ep("a", waiting=7), ep("b", waiting=7), ep("c", waiting=7)])
    np.testing.assert_allclose(got, [1.0, 1.0, 1.0])


def test_kv_usage_outside_zero_one_is_clamped(policy):
    inst = policy("load", queue_weight=0, work_weight=0)
    got = scores(inst, [ep("a", kv_usage=1.7), ep("b", kv_usage=-0.3)])
    np.testing.assert_allclose(got, [0.0, 1.0])


def test_queue_and_kv_weigh_equally_by_default(policy):
    inst = policy("load", work_weight=0)
    got = scores(inst, [ep("a", waiting=10, kv_usage=0.8), ep("b", waiting=5, kv_usage=0.5), ep("c", waiting=0)])
    np.testing.assert_allclose(got, [0.1, 0.5, 1.0])


def test_weights_are_normalised(policy):
    inst = policy("load", queue_weight=3, kv_weight=1, work_weight=0)
    got = scores(inst, [ep("a", waiting=10, kv_usage=0.0), ep("b", waiting=0, kv_usage=1.0)])
    np.testing.assert_allclose(got, [0.25, 0.75])


def test_queue_range_is_over_the_candidates_only(policy):
    inst = policy("load", kv_weight=0, work_weight=0)
    pool = snap([ep("a", waiting=100), ep("b", waiting=4), ep("c", waiting=2)])
    got = inst.score(score_input(pool, candidates=[2, 1]), 2)
    np.testing.assert_allclose(got, [1.0, 0.0])


def test_resident_snapshot_scores_like_an_inline_one(policy):
    inst = policy("load")
    pool = snap([ep("a", waiting=3, kv_usage=0.1), ep("b", waiting=9, kv_usage=0.6)], version=4)
    inline = inst.score(score_input(pool), 2)
    inst.set_snapshot(__import__("epick").abi.encoder.encode(pool))
    resident = inst.score(score_input(None, candidates=[0, 1]), 2)
    np.testing.assert_array_equal(inline, resident)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"queue_weight": -1}, "param 'queue_weight': -1 must be a finite number >= 0"),
        ({"queue_weight": 0, "kv_weight": 0, "work_weight": 0}, "params 'queue_weight', 'kv_weight' and 'work_weight' are all 0; at least one must be > 0"),
        ({"work_scale": 0}, "param 'work_scale': 0 must be a finite number > 0"),
        ({"recent_requests": -1}, "param 'recent_requests': -1 must be a finite number >= 0"),
        ({"recent_ms": 0}, "param 'recent_ms': 0 must be a finite number > 0"),
        ({"kv_weight": "high"}, "param 'kv_weight': expected a number, got a string"),
    ],
    ids=["negative", "all-zero", "zero-scale", "negative-recent", "zero-recent-ms", "ill-typed"],
)
def test_bad_weights_are_refused_naming_the_param(policy, params, message):
    with pytest.raises(PolicyLoadError) as info:
        policy("load", **params)
    assert info.value.message == message


def test_describe_reports_kind_and_default_weights(policy):
    d = policy("load").describe()
    assert (d.name, d.kind, d.params) == ("load", "load", {
        "queue_weight": 1.0, "kv_weight": 1.0, "work_weight": 2.0, "work_scale": 8.0,
        "recent_requests": 8.0, "recent_ms": 45.0})


def test_queues_at_the_int64_limits_still_score_in_range(policy):
    inst = policy("load", kv_weight=0, work_weight=0)
    got = scores(inst, [ep("a", waiting=-(2**63)), ep("b", waiting=2**63 - 1)])
    np.testing.assert_allclose(got, [1.0, 0.0])


def test_work_tells_an_idle_replica_from_a_busy_one_when_queues_are_empty(policy):
    # the starved replica: queue 0 and KV ~0 everywhere, running differs
    inst = policy("load")
    got = scores(inst, [ep("a"), ep("b", running=3, kv_usage=0.01)])
    assert got[0] == 1.0 and got[1] < 0.9


def test_picks_the_scrape_has_not_seen_count_as_work(policy):
    inst = policy("load", queue_weight=0, kv_weight=0, work_scale=4)
    pool = snap([ep("a"), ep("b")])
    got = inst.score(score_input(pool, picked_since_scrape=[3, 0]), 2)
    np.testing.assert_allclose(got, [4 / 7, 1.0])
    got = inst.score(score_input(pool, in_flight=[0, 5]), 2)
    np.testing.assert_allclose(got, [1.0, 4 / 9])


def test_assignments_of_the_wrong_length_are_an_error(policy):
    inst = policy("load")
    with pytest.raises(Exception) as info:
        inst.score(score_input(snap([ep("a"), ep("b")]), in_flight=[1]), 2)
    assert "in_flight has 1 values for 2 candidates" in str(info.value)
