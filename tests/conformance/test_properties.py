"""The properties pass on shipped policies and catch what they are about on broken ones.

The broken policies are the shipped load policy with bugs put in by text replacement,
built into real .wasm modules (see conformance_mutants.py).
"""

from __future__ import annotations

import msgspec
import pytest
from conformance_mutants import build_mutants

from epick import abi
from epick.conformance.driver import FUTURE_FIELDS, encode, encode_with_future_fields
from epick.conformance.properties import PROPERTIES, run_properties

SCORE_LINE = "o.* = (wq * queue + wkv * kv + ww * work) / (wq + wkv + ww);"

BROKEN = {
    # 1.5 for everyone; traps on 0 candidates; spins on 1,024; leaks 512 bytes a call
    "unruly": [
        (SCORE_LINE, "o.* = 1.5 + 0.0 * (wq * queue + wkv * kv + ww * work) / (wq + wkv + ww);"),
        ("if (out.len == 0) return;",
         "_ = try sdk.gpa.alloc(u8, 512);\n    if (out.len == 0) @trap();\n"
         "    if (out.len == 1024) while (true) {};"),
    ],
    # scores drift with a call counter that init does not reset
    "stateful": [
        ("var wkv: f64 = 1.0;", "var wkv: f64 = 1.0;\nvar calls: f64 = 0;"),
        ("if (out.len == 0) return;", "calls += 1;\n    if (out.len == 0) return;"),
        (SCORE_LINE, "o.* = @min(1.0, calls / 1e6 + 0.0 * (wq * queue + wkv * kv + ww * work) / (wq + wkv + ww));"),
    ],
}


@pytest.fixture(scope="module")
def broken(runtime):
    built = build_mutants({k: ("load", m) for k, m in BROKEN.items()})
    modules = {k: runtime.compile(p.read_bytes(), name=f"load-{k}") for k, p in built.items()}
    return {k: {r.name: r for r in run_properties(m, {})} for k, m in modules.items()}


@pytest.mark.parametrize("name", ["load", "lora-affinity", "prefix-cache", "legacy-v1"])
def test_every_property_holds_for_the_shipped_policy(name, shipped):
    results = run_properties(shipped(name), {})

    names = ["property/" + p.__name__.replace("_", "-") for p in PROPERTIES]
    assert [r.name for r in results][: len(names)] == names
    assert all(r.passed for r in results), "\n".join(r.why for r in results if not r.passed)


def test_an_out_of_range_score_fails_one_result_per_candidate(broken):
    r = broken["unruly"]["property/one-result-per-candidate"]

    assert r.verdict == "fail"
    assert r.why == (
        "property/one-result-per-candidate: 1 candidates, request p1: candidate 0 scored 1.5 "
        "(not a finite number in [0, 1])"
    )


def test_a_trap_on_zero_candidates_fails_candidate_counts(broken):
    r = broken["unruly"]["property/candidate-counts"]

    assert r.verdict == "fail"
    assert r.why.startswith("property/candidate-counts: 0 candidates: PolicyTrap: policy 'load-unruly'")


def test_a_call_that_never_ends_fails_the_time_budget(broken):
    r = broken["unruly"]["property/time-budget"]

    assert r.verdict == "fail"
    assert r.why.startswith("property/time-budget: with 1024 endpoints and a ")
    assert r.why.endswith(
        "-byte prompt: score ran out of fuel (its budget is 10,000,000 instructions)")


def test_a_leak_fails_memory_stable(broken):
    r = broken["unruly"]["property/memory-stable"]

    assert r.verdict == "fail"
    assert "bytes after 5000 calls" in r.why and ": grew by " in r.why


def test_leaks_and_traps_do_not_fail_unrelated_properties(broken):
    r = broken["unruly"]

    for name in ("deterministic", "ignores-future-fields", "bad-input-is-an-error",
                 "bad-params-are-refused", "reinit-resets-state"):
        assert r[f"property/{name}"].passed, r[f"property/{name}"].why


def test_drifting_scores_fail_deterministic(broken):
    r = broken["stateful"]["property/deterministic"]

    assert r.verdict == "fail"
    assert r.why == (
        "property/deterministic: the same call twice in a row gave "
        + "[" + ", ".join(["1e-06"] * 16) + "] then [" + ", ".join(["2e-06"] * 16) + "]"
    )


def test_state_that_init_keeps_fails_reinit_resets_state(broken):
    r = broken["stateful"]["property/reinit-resets-state"]

    assert r.verdict == "fail"
    assert r.why.startswith("property/reinit-resets-state: after init, probe call 0 gave ")


def test_future_fields_are_appended_to_every_array_of_a_payload():
    ev = abi.PreRequestEvent(request=abi.Request(adapter="a"), endpoint="e", timestamp_ms=3)

    decoded = msgspec.msgpack.decode(encode_with_future_fields(ev))
    plain = msgspec.msgpack.decode(encode(ev))

    extras = [list(x) if isinstance(x, tuple) else x for x in FUTURE_FIELDS]
    assert decoded[3:] == extras
    assert decoded[0][: len(plain[0])] == plain[0]
    assert decoded[0][len(plain[0]):] == extras
    assert decoded[:3][1:] == plain[1:3]


def test_a_module_with_score_and_filter_gets_the_call_properties_for_each(shipped):
    results = run_properties(shipped("legacy-v1"), {})

    filter_rows = [r.name for r in results if r.name.endswith(" [filter]")]
    assert "property/deterministic [filter]" in filter_rows
    assert "property/bad-params-are-refused [filter]" not in filter_rows
    assert "property/loads-like-the-host [filter]" not in filter_rows
    assert len(results) == len(PROPERTIES) + len(filter_rows) == 2 * len(PROPERTIES) - 2
