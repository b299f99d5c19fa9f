"""WasmPolicy: a module as a scheduler plugin — delivery, failures, recovery, breaker, stats."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import wasmtime
from hostile import (
    MODEL,
    SLOW_FAIL_EVERY_THIRD,
    SPIN_EVERY_OTHER,
    TRAP_EVERY_OTHER,
    hostile_wasm,
)
from wat_modules import snapshot, wasm, wat_source

from epick import abi
from epick.interfaces import (
    Capabilities,
    Cycle,
    FilterPlugin,
    PluginError,
    PoolView,
    PostResponsePlugin,
    PreRequestPlugin,
    ScorePlugin,
)
from epick.runtime import Limits, PolicyCallError, PolicyError, Runtime, WasmPolicy

LONG = "x" * 5000  # counter.wat's pre_request traps on inputs over 4000 bytes


def cycle(n: int = 3, *, version: int = 1, view: PoolView | None = None, prompt: str = "") -> Cycle:
    view = view or PoolView.build(snapshot(n, version=version))
    return Cycle(view=view, request=abi.Request(model="m", prompt=prompt))


def counter_state(policy: WasmPolicy) -> tuple[int, int]:
    """(pre_request count, set_snapshot count) of a counter.wat policy."""
    return struct.unpack("<ii", policy.export_state())


@pytest.fixture
def policy(runtime, fake_clock):
    """``policy(name, **subst)``: a WasmPolicy of ``wat/<name>.wat`` on the fake clock."""

    def make(name: str, *, interval: float = 1.0, **subst: object) -> WasmPolicy:
        mod = runtime.compile(wasm(name, **subst), name=name)
        return WasmPolicy(mod, {}, clock=fake_clock, now_ms=lambda: 42, checkpoint_interval_s=interval)

    return make


def test_capabilities_follow_the_modules_exports(policy):
    scorer, filt = policy("counter"), policy("keep_even")
    assert scorer.capabilities == (Capabilities.SCORE | Capabilities.SCORES_IN_RANGE
                                   | Capabilities.PRE_REQUEST | Capabilities.POST_RESPONSE
                                   | Capabilities.STATE)
    assert filt.capabilities == Capabilities.FILTER
    assert isinstance(scorer, (ScorePlugin, FilterPlugin, PreRequestPlugin, PostResponsePlugin))


def test_name_module_and_params_are_exposed(runtime):
    mod = runtime.compile(wasm("counter"), name="counter")
    plugin = WasmPolicy(mod, {"a": 1}, name="lora")
    assert (plugin.name, plugin.module, plugin.params) == ("lora", mod, {"a": 1})
    assert WasmPolicy(mod).name == "counter"


def test_score_returns_the_guests_scores(policy):
    plugin = policy("counter")
    c = cycle(4)
    plugin.pre_request(c, "10.0.0.1:8000")
    assert plugin.score(c, (0, 1, 2, 3)).tolist() == [0.001] * 4


def test_the_snapshot_is_delivered_once_per_pool_snapshot(policy):
    plugin = policy("counter")
    first = cycle(3, version=1)
    plugin.score(first, (0, 1, 2))
    plugin.score(cycle(view=first.view), (0, 2))
    assert counter_state(plugin) == (0, 1)
    plugin.score(cycle(3, version=2), (1,))
    assert counter_state(plugin) == (0, 2)


def test_a_policy_without_set_snapshot_gets_the_snapshot_inline(policy):
    plugin = policy("flaky")
    c = cycle(2)
    assert plugin.score(c, (0, 1)).tolist() == [0.25, 0.25]
    assert list(c._inputs) == [(True, (0, 1))]


def test_a_resident_policy_gets_score_inputs_without_the_snapshot(policy):
    plugin = policy("counter")
    c = cycle(2)
    plugin.score(c, (0, 1))
    assert list(c._inputs) == [(False, (0, 1))]


def test_filter_returns_the_kept_candidates_in_order(policy):
    assert policy("keep_even").filter(cycle(6), (5, 4, 3, 1, 0)) == (5, 3, 0)


def test_no_candidates_means_no_call(policy):
    plugin = policy("unreachable")
    assert plugin.score(cycle(3), ()).tolist() == []
    assert plugin.stats.calls == 0


def test_nan_is_invalid_output(policy):
    plugin = policy("constant", value="nan", extra=0)
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(3), (0, 1, 2))
    assert (err.value.plugin, err.value.stage, err.value.kind) == ("constant", "score", "invalid-output")
    assert err.value.reason == "score nan for candidate 0 is not finite"


def test_inf_is_invalid_output(policy):
    with pytest.raises(PluginError) as err:
        policy("constant", value="inf", extra=0).score(cycle(2), (0, 1))
    assert err.value.kind == "invalid-output"
    assert err.value.reason == "score inf for candidate 0 is not finite"


def test_a_wrong_count_is_invalid_output(policy):
    with pytest.raises(PluginError) as err:
        policy("constant", value="0.5", extra=-1).score(cycle(3), (0, 1, 2))
    assert err.value.kind == "invalid-output"
    assert err.value.reason == "score wrote 2 of 3 scores (first missing: candidate 2)"


@pytest.mark.parametrize("value, clamped", [("1.5", 1.0), ("-0.25", 0.0)])
def test_out_of_range_scores_are_clamped_and_counted(policy, value, clamped):
    plugin = policy("constant", value=value, extra=0)
    assert plugin.score(cycle(3), (0, 1, 2)).tolist() == [clamped] * 3
    assert plugin.stats.out_of_range == 3
    assert plugin.stats.errors == 0


def test_a_non_zero_return_is_an_error_with_the_guests_message(policy):
    with pytest.raises(PluginError) as err:
        policy("flaky").score(cycle(3), (0, 1, 2))
    assert str(err.value) == "policy 'flaky' score: error: score returned 3: odd candidate count"


def test_a_trap_is_reported_and_the_instance_re_created(policy):
    plugin = policy("unreachable")
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(1), (0,))
    assert err.value.kind == "trap"
    assert err.value.reason == "score trapped: wasm trap: wasm `unreachable` instruction executed"
    assert plugin.stats.recoveries == 1


def test_a_timeout_is_retried_once_then_reported(fake_clock):
    # Without fuel only the wall-clock backstop stops the spinning guest.
    with Runtime(Limits(), fuel=False) as rt:
        plugin = WasmPolicy(rt.compile(wasm("spin"), name="spin"), clock=fake_clock)
        with pytest.raises(PluginError) as err:
            plugin.score(cycle(1), (0,))
    assert (err.value.kind, err.value.reason) == ("timeout", "score exceeded its 50 ms budget")
    assert plugin.stats.timeout_retries == 1
    assert plugin.stats.recoveries == 2  # after the first timeout, and after the retry's
    assert plugin.stats.errors_by_kind == {"timeout": 1}


def test_running_out_of_fuel_is_reported_at_once_never_retried(fake_clock):
    # a generous backstop: the spin must end on fuel even on a busy machine
    with Runtime(Limits(budget_ms=5000.0)) as rt:
        plugin = WasmPolicy(rt.compile(wasm("spin"), name="spin"), clock=fake_clock)
        with pytest.raises(PluginError) as err:
            plugin.score(cycle(1), (0,))
    assert (err.value.kind, err.value.reason) == (
        "out-of-fuel", "score ran out of fuel (its budget is 10,000,000 instructions)")
    assert (plugin.stats.timeout_retries, plugin.stats.recoveries) == (0, 1)


def test_after_a_trap_the_last_good_state_is_restored(policy, fake_clock):
    plugin = policy("counter", interval=1.0)
    c = cycle(2)
    plugin.pre_request(c, "a")  # first hook: checkpoint (count 1)
    fake_clock.advance(0.5)
    plugin.pre_request(c, "a")  # too soon for another checkpoint
    fake_clock.advance(0.6)
    plugin.pre_request(c, "a")  # checkpoint (count 3)
    plugin.pre_request(c, "a")  # count 4, not checkpointed
    with pytest.raises(PluginError) as err:
        plugin.pre_request(cycle(2, prompt=LONG), "a")
    assert (err.value.stage, err.value.kind) == ("pre_request", "trap")
    assert plugin.score(c, (0, 1)).tolist() == [0.003, 0.003]
    assert plugin.stats.recoveries == 1


def test_after_recovery_the_snapshot_is_delivered_again(policy):
    plugin = policy("counter", interval=0.0)
    c = cycle(2)
    plugin.score(c, (0, 1))
    plugin.pre_request(c, "a")  # checkpoint: count 1, 1 snapshot
    with pytest.raises(PluginError):
        plugin.pre_request(cycle(2, prompt=LONG), "a")
    plugin.score(c, (0, 1))  # same view, but the new instance has not seen it
    assert counter_state(plugin) == (1, 2)


def test_with_checkpoints_off_the_hooks_only_checkpoint_saves_state(runtime, fake_clock):
    """The service keeps exports off the request path and checkpoints between picks."""
    mod = runtime.compile(wasm("counter"), name="counter")
    plugin = WasmPolicy(mod, {}, clock=fake_clock, checkpoint_interval_s=0.0,
                        checkpoint_on_hooks=False)
    c = cycle(2)
    plugin.pre_request(c, "a")
    plugin.pre_request(c, "a")  # count 2, no checkpoint taken by the hooks
    plugin.checkpoint()  # the owner's checkpoint: count 2
    plugin.pre_request(c, "a")  # count 3, not saved
    with pytest.raises(PluginError):
        plugin.pre_request(cycle(2, prompt=LONG), "a")
    assert plugin.score(c, (0, 1)).tolist() == [0.002, 0.002]


def test_without_a_checkpoint_recovery_starts_fresh(policy):
    plugin = policy("counter")
    with pytest.raises(PluginError):
        plugin.pre_request(cycle(2, prompt=LONG), "a")
    assert counter_state(plugin) == (0, 0)


def test_the_breaker_opens_after_consecutive_failures(policy):
    plugin = policy("flaky")  # Limits.breaker_failures = 5
    for _ in range(5):
        with pytest.raises(PluginError) as err:
            plugin.score(cycle(3), (0, 1, 2))
        assert err.value.kind == "error"
    assert plugin.breaker_state == "open"
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(2), (0, 1))  # would succeed, but is not even tried
    assert err.value.kind == "circuit-open"
    assert err.value.reason == "5 consecutive failures; next trial in 10.0 s"
    assert plugin.stats.errors_by_kind == {"error": 5, "circuit-open": 1}


def test_a_success_resets_the_failure_count(policy):
    plugin = policy("flaky")
    for _ in range(4):
        with pytest.raises(PluginError):
            plugin.score(cycle(3), (0, 1, 2))
    plugin.score(cycle(2), (0, 1))
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(3), (0, 1, 2))
    assert err.value.kind == "error"
    assert plugin.breaker_state == "closed"


def test_after_the_cooldown_one_successful_trial_closes_the_breaker(policy, fake_clock):
    plugin = policy("flaky")
    for _ in range(5):
        with pytest.raises(PluginError):
            plugin.score(cycle(3), (0, 1, 2))
    fake_clock.advance(9.9)
    with pytest.raises(PluginError, match="circuit-open"):
        plugin.score(cycle(2), (0, 1))
    fake_clock.advance(0.1)
    assert plugin.score(cycle(2), (0, 1)).tolist() == [0.25, 0.25]
    assert plugin.breaker_state == "closed"


def test_a_failed_trial_reopens_the_breaker_for_another_cooldown(policy, fake_clock):
    plugin = policy("flaky")
    for _ in range(5):
        with pytest.raises(PluginError):
            plugin.score(cycle(3), (0, 1, 2))
    fake_clock.advance(10.0)
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(3), (0, 1, 2))  # the half-open trial, which fails
    assert err.value.kind == "error"
    assert plugin.breaker_state == "open"
    fake_clock.advance(5.0)
    with pytest.raises(PluginError, match="circuit-open"):
        plugin.score(cycle(2), (0, 1))


def test_a_half_open_trial_that_never_reports_allows_another_after_a_cooldown(fake_clock):
    from epick.runtime.breaker import CircuitBreaker

    breaker = CircuitBreaker(1, 10.0, fake_clock)
    breaker.failure()
    fake_clock.advance(10.0)
    assert breaker.allow() and breaker.state == "half-open"
    assert not breaker.allow()  # the trial is out
    fake_clock.advance(10.0)
    assert breaker.allow()  # its outcome never came back


def test_each_stage_has_its_own_breaker(policy):
    """A pre_request that traps every time opens its breaker although every score in
    between succeeds; score and post_response go on."""
    plugin = policy("counter")
    c = cycle(1)
    for _ in range(5):
        with pytest.raises(PluginError):
            plugin.pre_request(cycle(1, prompt=LONG), "a")
        plugin.score(c, (0,))
    with pytest.raises(PluginError) as err:
        plugin.pre_request(c, "a")  # would succeed, but is not even tried
    assert (err.value.stage, err.value.kind) == ("pre_request", "circuit-open")
    assert err.value.reason == "5 consecutive failures; next trial in 10.0 s"
    plugin.post_response(abi.PostResponseEvent(request_id="r"))
    assert plugin.score(c, (0,)).tolist() == [0.0]
    assert plugin.breaker_states == {"score": "closed", "pre_request": "open",
                                     "post_response": "closed", "checkpoint": "closed"}
    assert (plugin.breaker_state, plugin.breaker_opens) == ("open", 1)


def test_a_policy_failing_every_other_call_opens_its_breaker_by_error_rate(policy):
    plugin = policy("flaky")  # fails on odd candidate counts; window 20, rate 0.5
    outcomes = []
    for k in range(40):
        try:
            plugin.score(cycle(3), (0, 1, 2) if k % 2 else (0, 1))
            outcomes.append("ok")
        except PluginError as exc:
            outcomes.append(exc.kind)
    # never 2 failures in a row, yet the 10th failure in 20 calls opens the breaker
    assert outcomes[:20] == ["ok", "error"] * 10
    assert set(outcomes[20:]) == {"circuit-open"}
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(2), (0, 1))
    assert err.value.reason == "10 of the last 20 calls failed; next trial in 10.0 s"


def test_stats_count_calls_and_latency(policy):
    plugin = policy("counter")
    c = cycle(2)
    for _ in range(10):
        plugin.score(c, (0, 1))
    plugin.pre_request(c, "a")
    plugin.post_response(abi.PostResponseEvent(request_id="r"))
    stats = plugin.stats
    assert (stats.calls, stats.errors, stats.errors_by_kind) == (12, 0, {})
    assert 0 < stats.p50_us <= stats.p99_us


def test_pre_request_sends_the_request_endpoint_and_time(runtime):
    """The event reaches the guest byte for byte (checked through the input buffer)."""
    mod = runtime.compile(wasm("counter"), name="counter")
    plugin = WasmPolicy(mod, now_ms=lambda: 1234)
    c = cycle(1)
    plugin.pre_request(c, "10.0.0.0:8000")
    expected = abi.encoder.encode(
        abi.PreRequestEvent(request=c.request, endpoint="10.0.0.0:8000", timestamp_ms=1234)
    )
    inst = plugin.supervisor.instance
    assert bytes(inst._in_mv[: len(expected)]) == expected


def test_state_passes_through_for_hot_swap(policy):
    old, new = policy("counter"), policy("counter")
    old.pre_request(cycle(1), "a")
    new.import_state(old.export_state())
    assert counter_state(new) == (1, 0)


def test_imported_state_is_what_a_crash_restores(policy):
    old, new = policy("counter"), policy("counter")
    old.pre_request(cycle(1), "a")
    old.pre_request(cycle(1), "a")
    new.import_state(old.export_state())
    with pytest.raises(PluginError):
        new.pre_request(cycle(1, prompt=LONG), "a")
    assert counter_state(new) == (2, 0)


def test_a_policy_without_state_exports_none_and_refuses_imports(policy):
    plugin = policy("flaky")
    assert plugin.export_state() is None
    with pytest.raises(PolicyError) as err:
        plugin.import_state(b"")
    assert str(err.value) == "policy 'flaky': does not export 'import_state'"


def test_describe_passes_through(policy):
    assert policy("counter").describe() == abi.Describe(name="counter")


def test_set_snapshot_failure_is_reported_at_its_stage_and_retried_next_call(policy):
    plugin = policy("picky")
    for _ in range(2):
        with pytest.raises(PluginError) as err:
            plugin.score(cycle(1), (0,))
        assert str(err.value) == (
            "policy 'picky' set_snapshot: error: set_snapshot returned 1: snapshot refused"
        )


def test_scores_are_a_fresh_array_each_call(policy):
    plugin = policy("counter")
    c = cycle(2)
    a = plugin.score(c, (0, 1))
    a[:] = 7.0
    assert isinstance(a, np.ndarray)
    assert plugin.score(c, (0, 1)).tolist() == [0.0, 0.0]


def test_a_closed_policy_refuses_calls(policy):
    plugin = policy("counter")
    plugin.close()
    with pytest.raises(RuntimeError) as err:
        plugin.score(cycle(1), (0,))
    assert str(err.value) == "policy 'counter': WasmPolicy is closed"


def test_slow_checkpoints_are_spaced_out_to_a_small_share_of_the_time(load, fake_clock):
    """A checkpoint blocks a request: the gap grows with what the last one cost."""
    from epick.runtime.checkpoints import CHECKPOINT_SHARE

    plugin = WasmPolicy(load("counter"), {}, clock=fake_clock)
    plugin.checkpoints.changed()
    inst = plugin.supervisor.instance
    real_export = inst.export_state

    def slow_export():  # the cost is measured with perf_counter, so really take 10 ms
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.01:
            pass
        return real_export()

    inst.export_state = slow_export
    plugin.checkpoint()
    assert plugin.checkpoints.gap_s >= 0.01 / CHECKPOINT_SHARE  # >= 5 s for a 10 ms export


@pytest.fixture
def background(runtime, fake_clock):
    """``background(name)``: a WasmPolicy that re-creates its instance off the call path."""

    def make(name: str, source: str | None = None) -> WasmPolicy:
        data = wasmtime.wat2wasm(source) if source else wasm(name)
        return WasmPolicy(runtime.compile(data, name=name), {}, clock=fake_clock,
                          background_recovery=True, checkpoint_interval_s=0.0)

    return make


def test_with_background_recovery_calls_skip_the_policy_until_its_instance_is_rebuilt(
        runtime, background):
    gate = threading.Event()
    runtime.submit(gate.wait, 30)  # hold the rebuild thread: no spare, the rebuild queues
    plugin = background("counter")
    c = cycle(2)
    plugin.pre_request(c, "a")
    plugin.checkpoint()  # last good state: count 1
    try:
        with pytest.raises(PluginError) as err:
            plugin.pre_request(cycle(2, prompt=LONG), "a")
        assert err.value.kind == "trap"
        for _ in range(3):  # never blocks, never re-creates inline
            with pytest.raises(PluginError) as err:
                plugin.score(c, (0, 1))
            assert (err.value.kind, err.value.reason) == ("recovering",
                                                          "instance is being re-created")
        assert plugin.recovering and plugin.stats.recoveries == 0
    finally:
        gate.set()
    assert plugin.wait_recovered(timeout=30)
    assert plugin.score(c, (0, 1)).tolist() == [0.001, 0.001]  # the good state came back
    assert plugin.stats.recoveries == 1
    # skipped calls are not the guest's failures: the score breaker stayed closed
    assert plugin.breaker_states["score"] == "closed"
    assert plugin.stats.errors_by_kind == {"trap": 1, "recovering": 3}


def test_a_rebuild_that_fails_benches_the_policy_until_it_is_tried_again(
        runtime, fake_clock, background):
    gate = threading.Event()
    runtime.submit(gate.wait, 30)  # no spare yet when it first traps
    plugin = background("unreachable")
    good = plugin.params
    plugin.params = {1: "not a str key"}  # init refuses: the rebuild cannot succeed
    with pytest.raises(PluginError, match="trap"):
        plugin.score(cycle(1), (0,))
    assert plugin.breaker_states == {"score": "open"}  # rebuilding: its calls are skipped
    gate.set()
    assert not plugin.wait_recovered(timeout=30)
    assert (plugin.breaker_state, plugin.breaker_opens) == ("open", 1)
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(1), (0,))
    assert err.value.kind == "circuit-open"
    assert err.value.reason.startswith("instance could not be re-created (params must be")
    assert err.value.reason.endswith("next trial in 10.0 s")
    plugin.params = good
    fake_clock.advance(10.0)
    with pytest.raises(PluginError, match="recovering"):
        plugin.score(cycle(1), (0,))  # starts the next rebuild; the trial is not spent
    assert plugin.wait_recovered(timeout=30)
    assert plugin.stats.recoveries == 1
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(1), (0,))  # the trial reaches the (still trapping) guest
    assert err.value.kind == "trap"


def test_a_closed_policy_closes_an_instance_that_was_still_being_rebuilt(runtime, background):
    gate = threading.Event()
    runtime.submit(gate.wait, 30)
    plugin = background("unreachable")
    with pytest.raises(PluginError, match="trap"):
        plugin.score(cycle(1), (0,))
    pending = plugin.supervisor._rebuild
    plugin.close()
    gate.set()
    # cancelled before it ran, or closed by the done-callback once built
    assert pending.cancelled() or pending.result()[0]._store is None


def test_failing_checkpoints_back_off_and_have_their_own_breaker(runtime, fake_clock):
    source = wat_source("counter").replace(
        '(func (export "export_state") (result i32)',
        '(func (export "export_state") (result i32) unreachable', 1)
    mod = runtime.compile(wasmtime.wat2wasm(source), name="bad-export")
    plugin = WasmPolicy(mod, {}, clock=fake_clock, checkpoint_interval_s=1.0,
                        checkpoint_on_hooks=False)
    c = cycle(1)
    attempts = []
    for second in range(40):
        plugin.pre_request(c, "a")  # marks the state dirty, never fails
        before = plugin.stats.checkpoint_failures
        plugin.checkpoint()
        if plugin.stats.checkpoint_failures > before:
            attempts.append(second)
        fake_clock.advance(1.0)
    # 1 s apart at first, then doubling; the 5th failure opens the checkpoint breaker
    # (10 s cooldown), which holds the next one off past the gap of 32 s
    assert attempts == [0, 2, 6, 14, 30]
    assert plugin.breaker_states["checkpoint"] == "open"
    assert plugin.breaker_states["pre_request"] == "closed"


def test_a_warm_spare_goes_live_at_once_with_the_last_good_state(background):
    plugin = background("counter")
    c = cycle(2)
    plugin.pre_request(c, "a")
    plugin.checkpoint()  # last good state: count 1 (8 bytes: imported into the spare)
    assert plugin.supervisor._spare.result(timeout=30)  # the spare is built in the background
    with pytest.raises(PluginError, match="trap"):
        plugin.pre_request(cycle(2, prompt=LONG), "a")
    assert not plugin.recovering  # no call skipped
    assert plugin.score(c, (0, 1)).tolist() == [0.001, 0.001]
    assert plugin.stats.recoveries == 1 and "recovering" not in plugin.stats.errors_by_kind


def _live_or_why(plugin: WasmPolicy) -> str:
    try:
        plugin.describe()  # a control call: never traps here, says why when recovering
        return "live"
    except PolicyError as exc:
        return exc.detail


def hostile_cycle(n: int = 1) -> Cycle:
    """A cycle whose model triggers hostile.wat's score_bad."""
    return Cycle(view=PoolView.build(snapshot(n)), request=abi.Request(model=MODEL))


def _score_outcome(plugin: WasmPolicy, c: Cycle) -> str:
    try:
        plugin.score(c, tuple(range(len(c.view.snapshot.endpoints))))
    except PluginError as exc:
        return exc.kind
    return "ok"


def test_an_instance_that_keeps_dying_is_benched_for_a_doubling_gap(
        runtime, fake_clock, background):
    """Issue 32's module: each fresh instance traps on its 2nd call. Once it dies again
    soon after its re-creation the breaker opens and says so; it is not a 'recovering'
    story beside a 'closed' breaker."""
    plugin = background("trap-every-other", wat_source("hostile", score_bad=TRAP_EVERY_OTHER,
                                                       pre_bad="(nop)", init_loops=0))
    plugin.supervisor._spare.result(timeout=30)
    c = hostile_cycle()
    assert [_score_outcome(plugin, c) for _ in range(2)] == ["ok", "trap"]
    assert plugin.breaker_state == "closed"  # the warm spare went live at once
    assert [_score_outcome(plugin, c) for _ in range(2)] == ["ok", "trap"]
    assert (plugin.breaker_state, plugin.breaker_opens) == ("open", 1)
    assert plugin.breaker_states == {"score": "open", "pre_request": "open"}
    with pytest.raises(PluginError) as err:
        plugin.score(c, (0,))
    assert err.value.kind == "circuit-open"
    assert err.value.reason.startswith("instance keeps failing (died 0.00 s after it was "
                                       "re-created); next trial in")
    fake_clock.advance(0.06)  # the first gap is 50 ms
    assert _score_outcome(plugin, c) == "recovering"  # the rebuild starts now
    assert plugin.wait_recovered(timeout=30)
    assert plugin.breaker_states["score"] == "half-open"
    assert _score_outcome(plugin, c) == "ok"  # the trial
    assert plugin.breaker_states["score"] == "closed"
    fake_clock.advance(0.5)
    assert _score_outcome(plugin, c) == "trap"  # died again within the cooldown
    assert plugin.supervisor.states["score"] == "open"
    assert plugin.breaker_opens == 2
    assert plugin.supervisor.retry_in_s == pytest.approx(0.1)  # the gap doubled
    fake_clock.advance(0.2)
    assert _live_or_why(plugin) == "instance is being re-created"  # control calls rebuild too
    assert plugin.wait_recovered(timeout=30)
    assert plugin.breaker_states == {"score": "half-open", "pre_request": "half-open"}
    plugin.pre_request(c, "a")  # pre_request's own trial
    assert plugin.breaker_states["pre_request"] == "closed"


def test_the_error_rate_is_judged_across_re_created_instances(runtime, fake_clock):
    """Inline recovery: every 2nd call traps and re-creates the instance; never 2 in a
    row, yet the 10th trap in 20 calls opens the breaker (the window is the policy's,
    not the instance's)."""
    mod = runtime.compile(hostile_wasm(score_bad=TRAP_EVERY_OTHER), name="every-other")
    plugin = WasmPolicy(mod, {}, clock=fake_clock)
    c = hostile_cycle()
    outcomes = [_score_outcome(plugin, c) for _ in range(22)]
    assert outcomes[:20] == ["ok", "trap"] * 10
    assert outcomes[20:] == ["circuit-open"] * 2
    assert plugin.stats.recoveries == 10
    assert plugin.breaker_state == "open"
    assert plugin.supervisor.reason == "score: 10 of the last 20 calls failed"


def test_failing_calls_that_burn_their_fuel_bench_the_policy_within_the_budget(fake_clock):
    """Every 2nd call spins until its 10 M fuel is gone (milliseconds each): neither 5 in
    a row nor 50% of 20 yet, but the time they burn passes the budget within a second
    (the fake clock stands still) and the policy is benched at that call."""
    budget_ms = 10.0
    with Runtime(Limits(budget_ms=5000.0, breaker_burn_ms=budget_ms)) as rt:
        plugin = WasmPolicy(rt.compile(hostile_wasm(score_bad=SPIN_EVERY_OTHER), name="burn"),
                            {}, clock=fake_clock)
        c = hostile_cycle()
        costs, outcome = [], "ok"
        while outcome != "circuit-open":
            before = plugin.stats.failing_ms
            outcome = _score_outcome(plugin, c)
            assert outcome in ("ok", "out-of-fuel", "circuit-open")
            if outcome == "out-of-fuel":
                costs.append(plugin.stats.failing_ms - before)
        assert 1 <= len(costs) < 10  # before the error rate could have judged
        assert sum(costs[:-1]) <= budget_ms < sum(costs)  # benched at the first call over
        assert plugin.breaker_state == "open"
        assert plugin.breaker_states == {"score": "open", "pre_request": "open"}
        reason = plugin.supervisor.reason
        assert reason.startswith("score: ") and reason.endswith("over the 10 ms budget")
        # benched: a well-behaved request is not even tried until the cooldown is over
        assert _score_outcome(plugin, cycle(1)) == "circuit-open"


def test_a_benched_policy_recovers_when_it_behaves_again(fake_clock):
    with Runtime(Limits(budget_ms=5000.0, breaker_burn_ms=1.0)) as rt:
        plugin = WasmPolicy(rt.compile(hostile_wasm(score_bad=SPIN_EVERY_OTHER), name="burn"),
                            {}, clock=fake_clock)
        c = hostile_cycle()
        assert [_score_outcome(plugin, c) for _ in range(3)] == ["ok", "out-of-fuel",
                                                                 "circuit-open"]
        fake_clock.advance(10.0)
        # the half-open trial: a request that does not trigger the spin succeeds
        assert _score_outcome(plugin, cycle(1)) == "ok"
        assert plugin.breaker_states["score"] == "closed"
        assert [_score_outcome(plugin, cycle(1)) for _ in range(3)] == ["ok"] * 3
        plugin.pre_request(cycle(1), "a")  # its own trial, which succeeds
        assert plugin.breaker_state == "closed" and plugin.supervisor.reason == ""
        assert plugin.breaker_opens == 1


def test_a_failed_trial_after_a_bench_benches_it_again(fake_clock):
    with Runtime(Limits(budget_ms=5000.0, breaker_burn_ms=1.0)) as rt:
        plugin = WasmPolicy(rt.compile(hostile_wasm(score_bad=SPIN_EVERY_OTHER), name="burn"),
                            {}, clock=fake_clock)
        c = hostile_cycle()
        assert [_score_outcome(plugin, c) for _ in range(2)] == ["ok", "out-of-fuel"]
        fake_clock.advance(10.0)
        assert _score_outcome(plugin, c) == "ok"  # fresh instance: its 1st call is fine
        assert _score_outcome(plugin, c) == "out-of-fuel"  # closed again, then over budget
        assert _score_outcome(plugin, cycle(1)) == "circuit-open"
        assert plugin.breaker_opens == 2


def test_slow_failures_under_the_error_rate_are_benched_by_the_time_they_burn(fake_clock):
    """1 call in 3 fails after ~7 M instructions, returning an error (the instance lives
    on): never twice in a row, a third of the calls — only the time budget catches it."""
    budget_ms = 10.0
    with Runtime(Limits(budget_ms=5000.0, breaker_burn_ms=budget_ms)) as rt:
        mod = rt.compile(hostile_wasm(score_bad=SLOW_FAIL_EVERY_THIRD), name="slow")
        plugin = WasmPolicy(mod, {}, clock=fake_clock)
        c = hostile_cycle()
        costs, outcomes = [], []
        while not outcomes or outcomes[-1] != "circuit-open":
            before = plugin.stats.failing_ms
            outcomes.append(_score_outcome(plugin, c))
            if outcomes[-1] == "error":
                costs.append(plugin.stats.failing_ms - before)
        assert outcomes[:-1] == ["ok", "ok", "error"] * len(costs)
        assert sum(costs[:-1]) <= budget_ms < sum(costs)
        assert plugin.stats.recoveries == 0 and plugin.breaker_state == "open"


def _failing_call_of(plugin: WasmPolicy, ms: float) -> None:
    """Report a failed score call that took ``ms`` (a synthetic cost: deterministic)."""
    exc = PolicyCallError(plugin.name, "score", 3, "slow")
    plugin.supervisor.failed("score", exc, time.perf_counter_ns() - int(ms * 1e6))


def test_the_time_budget_is_judged_over_the_last_second(policy, fake_clock):
    plugin = policy("flaky")  # Limits.breaker_burn_ms = 100
    for _ in range(4):  # 4 x 60 ms, but 1 s apart: never 100 ms within a second
        _failing_call_of(plugin, 60.0)
        plugin.score(cycle(2), (0, 1))  # a success between: no consecutive failures
        fake_clock.advance(1.0)
    assert plugin.breaker_state == "closed"
    _failing_call_of(plugin, 60.0)
    fake_clock.advance(0.5)
    _failing_call_of(plugin, 60.0)  # 120 ms within 0.5 s
    assert plugin.breaker_state == "open" and plugin.breaker_opens == 1
    assert plugin.supervisor.reason == ("score: 2 failing calls took 120 ms within 1 s, "
                                        "over the 100 ms budget")
    assert plugin.stats.failing_ms >= 360.0
