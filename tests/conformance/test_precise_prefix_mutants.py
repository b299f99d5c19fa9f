"""The precise-prefix vectors catch real bugs: mutated builds fail, naming the case.

Each mutant is policies/precise-prefix/main.zig with one bug put in by text replacement,
built with epick.policies_build (as test_mutants.py does for lora-affinity)."""

from __future__ import annotations

import pytest
from conformance_mutants import assert_fails_on, build_mutants

from epick.conformance import check

# name -> (mutations, the case that must fail, words its failure must contain)
MUTANTS = {
    "counts-ignored": (
        [("if (ctx.prefixMatched(i)) |m| {", "if (ctx.prefixMatched(i + ctx.candidates.len)) |m| {")],
        "precise/full-half-none",
        "endpoint 0 (e0:8000) expected 1 (events: 4 of 4 -> 1), got 0",
    ),
    "denominator-off-by-one": (
        [("@as(f64, @floatFromInt(blocks))", "@as(f64, @floatFromInt(blocks + 1))")],
        "precise/full-half-none",
        "endpoint 0 (e0:8000) expected 1 (events: 4 of 4 -> 1), got 0.8",
    ),
    "no-fallback": (
        [("o.* = if (h.len == 0) 0 else", "o.* = if (h.len != 12345678) 0 else")],
        "precise/fallback-where-no-stream",
        "endpoint 0 (e0:8000) expected 0.5 (fallback (M = -1): estimate aaaa of aaaa|bbbb -> 1/2), got 0",
    ),
    "recent-picks-ignored": (
        [("if (h.len > 0 and recent_ttl_ms > 0) {", "if (h.len > 0 and recent_ttl_ms < 0) {")],
        "precise/a-recent-pick-counts-before-its-events",
        "endpoint 0 (e0:8000) expected 0.666667 (recent: aaaa|bbbb picked 500 ms ago, 2 of 3 "
        "estimate blocks -> max(0/6, 2/3)), got 0",
    ),
    "recent-picks-never-expire": (
        [("@max(ctx.snapshot.timestamp_ms -| recent_ttl_ms, clearedAt(ctx, i))",
          "@max(ctx.snapshot.timestamp_ms -| 1000 * recent_ttl_ms, clearedAt(ctx, i))")],
        "precise/events-overrule-the-estimate",
        "endpoint 0 (e0:8000) expected 0 (events: 0 of 2 (the pick is 10 s old, the estimate's "
        "2/2 is not used) -> 0), got 1",
    ),
    "no-cold-spread": (
        [("o.* = if (busy) 0 else cold_spread;", "o.* = if (busy) 0 else 0;")],
        "precise/cold-spread",
        "endpoint 1 (e1:8000) expected 0.25 (cold: e1's was 600 ms ago -> cold_spread), got 0",
    ),
    "cold-picks-not-marked": (
        [("if (cold) gop.value_ptr.*.cold_ms = ev.timestamp_ms;", "")],
        "precise/cold-spread",
        "endpoint 0 (e0:8000) expected 0 (cold: e0 got a cold request 300 ms ago (< 500) -> 0), "
        "got 0.25",
    ),
    "cold-spread-when-warm": (
        [("if (cold_spread_ms == 0 or warm or", "if (cold_spread_ms == 0 or")],
        "precise/warm-is-not-spread",
        "endpoint 0 (e0:8000) expected 0 (events: 0 of 2), got 0.25",
    ),
    "recent-picks-survive-a-clear": (
        [("@max(ctx.snapshot.timestamp_ms -| recent_ttl_ms, clearedAt(ctx, i))",
          "ctx.snapshot.timestamp_ms -| recent_ttl_ms")],
        "precise/a-clear-voids-earlier-picks",
        "endpoint 0 (e0:8000) expected 0 (picked at 9500, its engine emptied its cache at "
        "9600: the pick is void; events 0 of 2), got 1",
    ),
    "cold-busy-survives-a-clear": (
        [("r.cold_ms >= @max(since, clearedAt(ctx, i))", "r.cold_ms >= since")],
        "precise/a-clear-ends-a-cold-prefill",
        "endpoint 0 (e0:8000) expected 0.25 (its cold request at 9700 was aborted by the "
        "clear at 9800 -> cold_spread), got 0",
    ),
    "unbounded-by-load": (
        [("if (max_imbalance >= 0 and ctx.work(i) - min_work > max_imbalance) {",
          "if (max_imbalance >= 0 and ctx.work(i) - min_work > 2 * max_imbalance) {")],
        "precise/load-bound",
        "endpoint 0 (e0:8000) expected 0 (work 10 exceeds the least (0) by more than "
        "max_imbalance 8 -> 0), got 1",
    ),
}


@pytest.fixture(scope="module")
def mutant_wasm():
    return build_mutants({k: ("precise-prefix", m) for k, (m, _, _) in MUTANTS.items()})


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_fails_and_the_failure_names_the_case(mutant, mutant_wasm, runtime):
    _, case, words = MUTANTS[mutant]
    module = runtime.compile(mutant_wasm[mutant].read_bytes(), name=f"precise-{mutant}")
    assert_fails_on(module, case, words)


def test_the_shipped_policy_passes_every_vector_and_property(shipped):
    report = check(shipped("precise-prefix"), {})

    assert report.passed, "\n".join(c.why for c in report.failures)
    assert {c.group for c in report.cases} == {"vector", "property"}
