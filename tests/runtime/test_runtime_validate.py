"""validate(): the smoke run a module must pass before it goes live."""

from __future__ import annotations

import pytest
import wasmtime
from wat_modules import wasm, wat_source

from epick.config import BUILTIN_POLICY_DIR
from epick.runtime import Limits, PolicyLoadError, Runtime, validate
from epick.runtime.validate import FUEL_HEADROOM, synthetic_snapshot

DIST = BUILTIN_POLICY_DIR


@pytest.mark.parametrize("name", ["counter", "keep_even"])
def test_well_behaved_modules_pass(load, name):
    fuel = validate(load(name), {})
    # the smoke run called the request-path exports and metered each one
    assert fuel and all(used > 0 for used in fuel.values()), fuel


def test_nan_scores_fail_validation(load):
    with pytest.raises(PolicyLoadError) as err:
        validate(load("constant", value="nan", extra=0))
    assert str(err.value) == (
        "policy 'constant': validation failed: score (1 endpoints, no adapters, inline "
        "snapshot, 1 candidates): score nan for candidate 0; scores must be finite and in [0, 1]"
    )


def test_out_of_range_scores_fail_validation_rather_than_being_clamped(load):
    with pytest.raises(PolicyLoadError, match=r"score 1\.5 for candidate 0; scores must be finite and in \[0, 1\]$"):
        validate(load("constant", value="1.5", extra=0))


def test_a_wrong_count_fails_validation(load):
    with pytest.raises(PolicyLoadError) as err:
        validate(load("constant", value="0.5", extra=1))
    assert str(err.value) == (
        "policy 'constant': validation failed: score (0 endpoints, no adapters, inline "
        "snapshot, 0 candidates): score wrote more than the 0 scores asked for"
    )


def test_an_error_return_fails_validation_with_the_guests_message(load):
    with pytest.raises(PolicyLoadError) as err:
        validate(load("flaky"))
    assert str(err.value) == (
        "policy 'flaky': validation failed: score (1 endpoints, no adapters, inline "
        "snapshot, 1 candidates): score returned 3: odd candidate count"
    )
    assert err.value.export == "score"


def test_a_trap_fails_validation(load):
    with pytest.raises(PolicyLoadError, match=r"score trapped: wasm trap: wasm `unreachable` instruction executed$"):
        validate(load("unreachable"))


def test_a_module_over_budget_fails_validation():
    with Runtime(Limits()) as rt:
        with pytest.raises(PolicyLoadError) as err:
            validate(rt.compile(wasm("spin"), name="spin"))
    assert str(err.value).endswith(
        "score ran out of fuel (its budget is 10,000,000 instructions)"
    )


def test_init_refusing_the_params_fails_validation(load):
    with pytest.raises(PolicyLoadError) as err:
        validate(load("init_error"), {"foo": 1})
    assert err.value.message == "unknown param 'foo'"


def test_a_resident_snapshot_refusal_fails_validation(load):
    with pytest.raises(PolicyLoadError) as err:
        validate(load("picky"))
    assert str(err.value) == (
        "policy 'picky': validation failed: set_snapshot (0 endpoints, no adapters, resident "
        "snapshot): set_snapshot returned 1: snapshot refused"
    )


def test_a_hook_that_traps_fails_validation(runtime):
    # counter.wat's pre_request traps on inputs over 4000 bytes; make that over 0.
    source = wat_source("counter").replace("(i32.const 4000)", "(i32.const 0)")
    with pytest.raises(PolicyLoadError) as err:
        validate(runtime.compile(wasmtime.wat2wasm(source), name="counter"))
    assert str(err.value) == (
        "policy 'counter': validation failed: pre_request: pre_request trapped: "
        "wasm trap: wasm `unreachable` instruction executed"
    )


def test_synthetic_snapshots_are_deterministic_and_varied():
    a, b = synthetic_snapshot(64, adapters=True), synthetic_snapshot(64, adapters=True)
    assert a == b
    assert len({e.waiting for e in a.endpoints}) > 5
    assert any(e.waiting_adapters for e in a.endpoints)
    assert not any(e.running_adapters for e in synthetic_snapshot(8, adapters=False).endpoints)


@pytest.mark.parametrize("path", sorted(DIST.glob("*.wasm")), ids=lambda p: p.stem)
def test_the_built_policies_pass_validation(runtime, path):
    mod = runtime.compile(path.read_bytes(), name=path.stem)
    fuel = validate(mod, {})
    assert {"score", "filter"} & set(fuel) and all(used > 0 for used in fuel.values()), fuel
    budget = runtime.limits.fuel
    assert max(fuel.values()) * FUEL_HEADROOM <= budget  # the headroom validate demands
