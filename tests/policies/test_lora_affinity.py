"""lora-affinity: the seed table row by row, request history, reconcile, the upstream
profile, state hand-over (docs/scoring.md, "lora-affinity")."""

from __future__ import annotations

import numpy as np
import pytest
from policy_payloads import PolicyCallError, PolicyLoadError, ep, post, pre, score_input, snap

from epick import abi


def one(inst, endpoint, adapter="A", **request) -> float:
    return float(inst.score(score_input(snap([endpoint]), adapter=adapter, **request), 1)[0])


def resident(inst, endpoints, *, timestamp_ms=0, version=1):
    inst.set_snapshot(abi.encoder.encode(snap(endpoints, version=version, timestamp_ms=timestamp_ms)))


def score_resident(inst, n, adapter="A"):
    return inst.score(score_input(None, candidates=range(n), adapter=adapter), n)


# -- the seed table, row by row ---------------------------------------------------------

SEED_ROWS = [
    # (running, waiting, max_lora, expected)
    pytest.param(["A"], [], 3, 1.0, id="A-running-nothing-waiting"),
    pytest.param(["A", "B", "C"], [], 3, 1.0, id="A-running-slots-full-nothing-waiting"),
    pytest.param(["A"], ["B"], 3, 0.75, id="A-running-but-W-not-empty-room"),
    pytest.param(["B"], ["C"], 3, 0.75, id="union-is-M-minus-1"),
    pytest.param([], [], 1, 0.75, id="empty-endpoint-with-a-slot"),
    pytest.param(["B", "C", "D"], [], 3, 0.0, id="union-is-M-W-empty"),
    pytest.param(["B", "C"], ["D"], 3, 0.5 * (1 - 1 / 3), id="W-1-of-M-3"),
    pytest.param(["A", "C"], ["D"], 3, 0.5 * (1 - 1 / 3), id="A-running-W-1-no-room"),
    pytest.param(["B"], ["C", "D"], 3, 0.5 * (1 - 2 / 3), id="W-2-of-M-3"),
    pytest.param([], ["C", "D", "E"], 3, 0.0, id="W-equals-M"),
    pytest.param([], ["C", "D", "E", "F"], 3, 0.0, id="W-beyond-M"),
    pytest.param([], [], 0, 0.0, id="M-0-nothing-loaded"),
    pytest.param([], ["C"], 0, 0.0, id="M-0-with-waiting"),
    pytest.param(["B", "B"], ["B"], 2, 0.75, id="duplicates-count-once"),
]


@pytest.mark.parametrize(("running", "waiting", "max_lora", "expected"), SEED_ROWS)
def test_seed_table_row(policy, running, waiting, max_lora, expected):
    inst = policy("lora-affinity")
    e = ep("e", running_adapters=tuple(running), waiting_adapters=tuple(waiting), max_lora=max_lora)
    assert one(inst, e) == pytest.approx(expected)


def test_base_model_requests_score_one_everywhere(policy):
    inst = policy("lora-affinity")
    pool = snap([ep("full", waiting_adapters=("X", "Y", "Z"), max_lora=3), ep("none", max_lora=0)])
    np.testing.assert_array_equal(inst.score(score_input(pool, adapter=""), 2), [1.0, 1.0])


def test_tier_values_are_params(policy):
    inst = policy("lora-affinity", score_running=0.9, score_room=0.6, score_waiting_max=0.4, score_other=0.1)
    pool = snap([
        ep("run", running_adapters=("A",), max_lora=1),
        ep("room", max_lora=1),
        ep("wait", running_adapters=("B",), waiting_adapters=("C",), max_lora=2),
        ep("other", running_adapters=("B",), max_lora=1),
    ])
    np.testing.assert_allclose(inst.score(score_input(pool, adapter="A"), 4), [0.9, 0.6, 0.4 * 0.5, 0.1])


# -- request history --------------------------------------------------------------------

def test_history_only_adapter_counts_as_running(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1), ep("e2", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    np.testing.assert_array_equal(score_resident(inst, 2), [1.0, 0.75])


def test_history_adapters_fill_slots_for_other_adapters(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="B"))
    assert score_resident(inst, 1, adapter="A")[0] == 0.0


def test_post_response_ends_the_history(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    inst.post_response(post("e1", request_id="r1", adapter="A"))
    assert score_resident(inst, 1)[0] == 0.75


def test_repeated_post_response_removes_one_request_only(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    inst.pre_request(pre("e1", request_id="r2", adapter="A"))
    inst.post_response(post("e1", request_id="r1", adapter="A"))
    inst.post_response(post("e1", request_id="r1", adapter="A"))
    assert score_resident(inst, 1)[0] == 1.0
    inst.post_response(post("e1", request_id="r2", adapter="A"))
    assert score_resident(inst, 1)[0] == 0.75


def test_post_response_without_pre_request_is_tolerated(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1)])
    inst.post_response(post("e1", request_id="never-seen", adapter="A"))
    inst.post_response(post("e1", request_id="", adapter="A"))
    inst.post_response(post("elsewhere", request_id="", adapter="Z"))
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    assert score_resident(inst, 1)[0] == 1.0


def test_anonymous_requests_are_counted_by_adapter_and_endpoint(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1)])
    inst.pre_request(pre("e1", request_id="", adapter="A"))
    inst.pre_request(pre("e1", request_id="", adapter="A"))
    inst.post_response(post("e1", request_id="", adapter="A"))
    assert score_resident(inst, 1)[0] == 1.0
    inst.post_response(post("e1", request_id="", adapter="A"))
    inst.post_response(post("e1", request_id="", adapter="A"))  # never below zero
    assert score_resident(inst, 1)[0] == 0.75
    inst.pre_request(pre("e1", request_id="", adapter="A"))
    assert score_resident(inst, 1)[0] == 1.0


def test_use_history_false_ignores_picks(policy):
    inst = policy("lora-affinity", use_history=False)
    resident(inst, [ep("e1", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    assert score_resident(inst, 1)[0] == 0.75


# -- reconcile --------------------------------------------------------------------------

def test_history_is_reconciled_away_after_the_interval(policy):
    inst = policy("lora-affinity")
    pool = [ep("e1", max_lora=1)]
    resident(inst, pool, timestamp_ms=0)  # first reconcile at t=0
    inst.pre_request(pre("e1", 100, request_id="r1", adapter="A"))  # completion never reported
    resident(inst, pool, timestamp_ms=900, version=2)  # not due yet
    assert score_resident(inst, 1)[0] == 1.0
    resident(inst, pool, timestamp_ms=1000, version=3)  # due, but the pick is only 900 ms old
    assert score_resident(inst, 1)[0] == 1.0
    resident(inst, pool, timestamp_ms=2000, version=4)  # due, and the pick is 1900 ms old
    assert score_resident(inst, 1)[0] == 0.75


def test_history_backed_by_scraped_waiting_survives_reconcile(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=2)], timestamp_ms=0)
    inst.pre_request(pre("e1", 0, request_id="r1", adapter="A"))
    # Due at t=5000 and the pick is old, but the endpoint reports A waiting: kept.
    resident(inst, [ep("e1", waiting_adapters=("A",), max_lora=2)], timestamp_ms=5000, version=2)
    resident(inst, [ep("e1", max_lora=1)], timestamp_ms=5500, version=3)  # not due again yet
    assert score_resident(inst, 1)[0] == 1.0


def test_endpoints_that_leave_the_snapshot_are_forgotten(policy):
    inst = policy("lora-affinity", reconcile_interval_ms=1_000_000)
    resident(inst, [ep("e1", max_lora=1), ep("e2", max_lora=1)], version=1)
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    resident(inst, [ep("e2", max_lora=1)], version=2)
    resident(inst, [ep("e1", max_lora=1), ep("e2", max_lora=1)], version=3)
    np.testing.assert_array_equal(score_resident(inst, 2), [0.75, 0.75])


def test_a_repicked_request_id_moves_its_history(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1), ep("e2", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    inst.pre_request(pre("e2", request_id="r1", adapter="A"))
    np.testing.assert_array_equal(score_resident(inst, 2), [0.75, 1.0])


# -- the upstream profile ---------------------------------------------------------------

UPSTREAM_ROWS = [
    pytest.param(["A"], ["B", "C", "D"], 2, "A", 1.0, id="A-running-whatever-waits"),
    pytest.param(["B"], [], 2, "A", 0.8, id="sum-below-M"),
    pytest.param(["B"], ["B"], 2, "A", 0.0, id="sum-not-union"),
    pytest.param(["B"], ["A"], 2, "A", 0.6, id="A-waiting-no-room"),
    pytest.param(["B", "C"], [], 2, "A", 0.0, id="no-room-not-waiting"),
    pytest.param([], [], 0, "A", 0.0, id="M-0"),
    pytest.param(["B"], [], 1, "", 0.0, id="base-model-no-room"),
    pytest.param([], [], 1, "", 0.8, id="base-model-with-room"),
]


@pytest.mark.parametrize(("running", "waiting", "max_lora", "adapter", "expected"), UPSTREAM_ROWS)
def test_upstream_profile_row(policy, running, waiting, max_lora, adapter, expected):
    inst = policy("lora-affinity", profile="upstream")
    e = ep("e", running_adapters=tuple(running), waiting_adapters=tuple(waiting), max_lora=max_lora)
    assert one(inst, e, adapter=adapter) == pytest.approx(expected)


def test_upstream_profile_keeps_no_history(policy):
    inst = policy("lora-affinity", profile="upstream")
    resident(inst, [ep("e1", running_adapters=("B",), max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    assert score_resident(inst, 1)[0] == 0.0


# -- params, describe, state ------------------------------------------------------------

@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"profile": "go"}, "param 'profile': 'go' is not one of 'seed', 'upstream'"),
        ({"score_room": 1.5}, "param 'score_room': 1.5 is not in [0, 1]"),
        ({"profile": "upstream", "score_room": 0.7},
         "param 'score_room' applies to profile 'seed' only (profile 'upstream' has fixed tiers 1.0/0.8/0.6/0)"),
        ({"reconcile_interval_ms": -1}, "param 'reconcile_interval_ms': -1 must be >= 0"),
        ({"use_history": 1}, "param 'use_history': expected a bool, got an int"),
        ({"max_lora": 4}, "unknown param 'max_lora' (known: profile, score_running, score_room, "
         "score_waiting_max, score_other, use_history, reconcile_interval_ms, request_ttl_ms, "
         "max_imbalance)"),
    ],
    ids=["unknown-profile", "tier-out-of-range", "tier-with-upstream", "negative-interval", "ill-typed", "unknown"],
)
def test_bad_params_are_refused_naming_the_param(policy, params, message):
    with pytest.raises(PolicyLoadError) as info:
        policy("lora-affinity", **params)
    assert info.value.message == message


def test_describe_reports_every_default(policy):
    d = policy("lora-affinity").describe()
    assert d.kind == "lora-affinity"
    assert d.params == {
        "profile": "seed", "score_running": 1.0, "score_room": 0.75, "score_waiting_max": 0.5,
        "score_other": 0.0, "use_history": True, "reconcile_interval_ms": 1000, "request_ttl_ms": 600000,
        "max_imbalance": 16,
    }


def test_exported_history_carries_over_to_a_new_instance(policy):
    old = policy("lora-affinity")
    resident(old, [ep("e1", max_lora=1), ep("e2", max_lora=1)])
    old.pre_request(pre("e1", request_id="r1", adapter="A"))
    state = old.export_state()
    new = policy("lora-affinity")
    new.import_state(state)
    resident(new, [ep("e1", max_lora=1), ep("e2", max_lora=1)])
    np.testing.assert_array_equal(score_resident(new, 2), [1.0, 0.75])
    new.post_response(post("e1", request_id="r1", adapter="A"))  # the record came along too
    np.testing.assert_array_equal(score_resident(new, 2), [0.75, 0.75])


def test_truncated_state_is_refused_naming_what_was_cut(policy):
    inst = policy("lora-affinity")
    with pytest.raises(PolicyCallError) as info:
        inst.import_state(b"\x94\x01")
    assert info.value.message == "length 4 of lora-affinity state exceeds the 1 bytes left"


def test_garbage_state_is_refused_and_leaves_a_fresh_policy(policy):
    inst = policy("lora-affinity")
    resident(inst, [ep("e1", max_lora=1)])
    inst.pre_request(pre("e1", request_id="r1", adapter="A"))
    with pytest.raises(PolicyCallError) as info:
        inst.import_state(b"\x94\x02\xc0\x90\x90")
    assert info.value.message == "lora-affinity state format 2 is not 1"
    resident(inst, [ep("e1", max_lora=1)], version=2)
    assert score_resident(inst, 1)[0] == 0.75
