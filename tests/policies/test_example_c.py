"""example-c: a policy written in C on policies/sdk/epick.h, built with `zig cc`."""

from __future__ import annotations

import numpy as np
import pytest
from policy_payloads import PolicyLoadError, ep, score_input, snap


def test_fewer_running_requests_score_higher(policy):
    inst = policy("example-c", max_running=10)
    pool = snap([ep("a", running=0), ep("b", running=5), ep("c", running=10), ep("d", running=50)])
    np.testing.assert_allclose(inst.score(score_input(pool), 4), [1.0, 0.5, 0.0, 0.0])


def test_the_default_scale_is_256_running_requests(policy):
    inst = policy("example-c")
    pool = snap([ep("a", running=64)])
    np.testing.assert_allclose(inst.score(score_input(pool, candidates=[0]), 1), [0.75])


def test_it_needs_the_snapshot_inline(policy):
    inst = policy("example-c")
    assert not inst.has("set_snapshot")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_running": 0}, "param 'max_running': must be > 0"),
        ({"max_running": 2.5}, "param 'max_running': expected an int"),
        ({"max_running": "x"}, "param 'max_running': expected an int"),
    ],
    ids=["zero", "float", "string"],
)
def test_bad_params_are_refused(policy, params, message):
    with pytest.raises(PolicyLoadError) as info:
        policy("example-c", **params)
    assert info.value.message == message


def test_describe_reports_its_params(policy):
    d = policy("example-c").describe()
    assert (d.name, d.kind, d.params) == ("example-c", "custom", {"max_running": 256})
