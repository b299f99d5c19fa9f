"""The suite catches real bugs: mutated lora-affinity builds fail, naming the table row.

Each mutant is policies/lora-affinity/main.zig with one bug put in by text replacement,
built with the project's own build driver (epick.policies_build) into a real .wasm.
"""

from __future__ import annotations

import pytest
from conformance_mutants import assert_fails_on, build_mutants

from epick.conformance import check

# name -> (mutations, the case that must fail, words its failure must contain)
MUTANTS = {
    "room-tier-0.8": (
        [("score_room: f64 = 0.75,", "score_room: f64 = 0.8,")],
        "lora/seed/running",
        "lora/seed/running: endpoint 2 (e2:8000) expected 0.75 (room: A not in R = {b}, "
        "|R∪W| = 1 < M = 4 -> 0.75), got 0.8",
    ),
    "room-less-or-equal": (
        [("if (r_or_w < e.max_lora) return cfg.score_room;",
          "if (r_or_w <= e.max_lora) return cfg.score_room;")],
        "lora/seed/room-boundary",
        "endpoint 1 (e1:8000) expected 0 (otherwise: |R∪W| = 2 = M (no room), W empty -> 0), "
        "got 0.75",
    ),
    "waiting-ignored": (
        [("var w = distinct(&.{e.waiting_adapters}, null);", "var w: u32 = 0;"),
         ("distinct(&.{ e.running_adapters, e.waiting_adapters }, st)",
          "distinct(&.{e.running_adapters}, st)")],
        "lora/seed/waiting-count",
        "endpoint 1 (e1:8000) expected 0.375 (waiting: |W| = 1, 0.5 * (1 - 1/4) = 0.375), got 0",
    ),
    "deferred-ignored": (
        [("const deferring = e.deferred > 0;", "const deferring = e.deferred < 0;")],
        "lora/seed/current-vllm/deferred-unnamed",
        "endpoint 0 (e0:8000) expected 0.25 (waiting: R = {sql,chat}, W = {?} (deferred 2), "
        "|R∪W| = 3 >= M = 2, 0.5 * (1 - 1/2) = 0.25), got 1",
    ),
    "history-never-decremented": (
        # a runtime-true guard, not `return;`: Zig refuses code it can see is unreachable
        [("fn decrement(endpoint: []const u8, adapter: []const u8) void {",
          "fn decrement(endpoint: []const u8, adapter: []const u8) void {\n"
          "    if (endpoint.len < std.math.maxInt(usize)) return;")],
        "lora/seed/history-decremented",
        "endpoint 0 (e0:8000) expected 0.75 (room (history decremented): pre r1 then post r1 "
        "leaves 0 in flight, |R∪W| = 0 < M = 1 -> 0.75), got 1",
    ),
}


@pytest.fixture(scope="module")
def mutant_wasm():
    return build_mutants({k: ("lora-affinity", m) for k, (m, _, _) in MUTANTS.items()})


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_fails_and_the_failure_names_the_row(mutant, mutant_wasm, runtime):
    _, case, words = MUTANTS[mutant]
    module = runtime.compile(mutant_wasm[mutant].read_bytes(), name=f"lora-{mutant}")
    assert_fails_on(module, case, words)


@pytest.mark.parametrize("name", ["lora-affinity", "prefix-cache", "load", "legacy-v1"])
def test_the_shipped_policy_passes_every_vector_and_property(name, shipped):
    report = check(shipped(name), {})

    assert report.passed, "\n".join(c.why for c in report.failures)
    assert {c.group for c in report.cases} == {"vector", "property"}
