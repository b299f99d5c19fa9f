"""Running vector cases against a real module: verdicts and the words of each failure."""

from __future__ import annotations

import pytest

from epick.conformance import check, vectors
from epick.conformance.runner import run_case

WRONG = """
kind = "load"
params = { queue_weight = 1.0, kv_weight = 0.0, work_weight = 0.0 }

[[case]]
name = "mine/wrong-score"
snapshot.endpoints = [
  { address = "e0:8000", waiting = 10 },
  { address = "e1:8000", waiting = 5 },
  { address = "e2:8000", waiting = 0 },
]
expect.scores = [0.0, 0.9, 1.0]
expect.why = ["max queue", "made up", "min queue"]

[[case]]
name = "mine/wrong-order"
snapshot.endpoints = [
  { address = "e0:8000", waiting = 10 },
  { address = "e1:8000", waiting = 5 },
  { address = "e2:8000", waiting = 0 },
]
expect.order = [0, 1, 2]
expect.why = ["long queue", "medium queue", "empty queue"]

[[case]]
name = "mine/refused-params"
params = { queue_weight = -1.0 }
snapshot.endpoints = [{ address = "e0:8000" }]
expect.scores = [1.0]

[[case]]
name = "mine/keep-mask-on-a-scorer"
snapshot.endpoints = [{ address = "e0:8000" }]
expect.keep = [true]
expect.why = "a filter expectation"

[[case]]
name = "mine/tolerance"
snapshot.endpoints = [{ address = "e0:8000", waiting = 1 }, { address = "e1:8000", waiting = 4 }]
candidates = [1, 0]
expect.scores = [0.01, 0.99]
expect.tolerance = 0.02
expect.why = "within 0.02"
"""


@pytest.fixture
def results(tmp_path, shipped):
    path = tmp_path / "mine.toml"
    path.write_text(WRONG)
    cases = [c for c in vectors.load("load", [path]) if c.name.startswith("mine/")]
    return {c.name: run_case(shipped("load"), c) for c in cases}


def test_a_wrong_score_fails_naming_the_case_endpoint_derivation_and_value(results):
    r = results["mine/wrong-score"]

    assert r.verdict == "fail"
    assert r.why == "mine/wrong-score: endpoint 1 (e1:8000) expected 0.9 (made up), got 0.5"
    assert (r.expected, r.got) == ("[0, 0.9, 1]", "[0, 0.5, 1]")


def test_a_wrong_order_fails_naming_each_inverted_pair(results):
    r = results["mine/wrong-order"]

    assert r.verdict == "fail"
    assert r.why == (
        "mine/wrong-order: endpoint 0 (e0:8000) (long queue) should score above "
        "endpoint 1 (e1:8000) (medium queue), got 0 vs 0.5; endpoint 1 (e1:8000) "
        "(medium queue) should score above endpoint 2 (e2:8000) (empty queue), got 0.5 vs 1"
    )
    assert r.expected == "order 0 > 1 > 2"


def test_params_the_policy_refuses_are_an_error_naming_the_param(results):
    r = results["mine/refused-params"]

    assert r.verdict == "error"
    assert r.why.startswith(
        "mine/refused-params: init with params {'queue_weight': -1.0, 'kv_weight': 0.0, "
        "'work_weight': 0.0}: "
        "PolicyLoadError: policy 'load': init refused its params: param 'queue_weight': -1"
    )


def test_a_keep_mask_against_a_policy_without_filter_is_an_error(results):
    r = results["mine/keep-mask-on-a-scorer"]

    assert r.verdict == "error"
    assert r.why == (
        "mine/keep-mask-on-a-scorer: filter: PolicyError: policy 'load': does not export 'filter'"
    )


def test_scores_within_the_tolerance_pass_in_candidate_order(results):
    r = results["mine/tolerance"]

    assert r.verdict == "pass", r.why
    assert r.got == "[0, 1]"


def test_check_runs_builtin_and_extra_vectors_then_the_properties(tmp_path, shipped):
    path = tmp_path / "mine.toml"
    path.write_text(WRONG)

    report = check(shipped("load"), {}, extra_vectors=[path])

    names = [c.name for c in report.cases]
    assert names[0] == "load/queue-spread"
    assert "mine/tolerance" in names
    assert names[-1] == "property/carried-events-like-their-own-calls"
    assert not report.passed
    assert {c.name for c in report.failures} == {
        "mine/wrong-score", "mine/wrong-order", "mine/refused-params", "mine/keep-mask-on-a-scorer",
    }
    assert report.summary() == f"FAIL: load (load): {len(names) - 4} passed, 2 failed, 2 errors"


def test_check_takes_the_kind_from_describe(shipped):
    report = check(shipped("load"), {}, properties=False)

    assert report.kind == "load"
    assert report.passed
    assert all(c.group == "vector" for c in report.cases)
