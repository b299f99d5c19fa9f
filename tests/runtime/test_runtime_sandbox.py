"""The sandbox: a guest that spins, traps, or eats memory fails its call, not the host."""

from __future__ import annotations

import threading
import time

import pytest
import wasmtime
from wat_modules import score_input, wasm, wat_source

from epick.runtime import (
    Limits,
    PolicyCallError,
    PolicyLoadError,
    PolicyOutOfFuel,
    PolicyTimeout,
    PolicyTrap,
    Runtime,
)


@pytest.fixture
def tight() -> Runtime:
    """The default limits (5 M instructions, 50 ms backstop)."""
    with Runtime(Limits()) as rt:
        yield rt


def test_a_guest_that_never_returns_runs_out_of_fuel(tight):
    inst = tight.compile(wasm("spin"), name="spin").instantiate()
    started = time.monotonic()
    with pytest.raises(PolicyOutOfFuel) as err:
        inst.score(score_input(1), 1)
    # A liveness bound, not a latency goal: a stuck thread never returns.
    assert time.monotonic() - started < 5.0
    assert str(err.value) == (
        "policy 'spin': score ran out of fuel (its budget is 10,000,000 instructions)"
    )
    assert (err.value.export, err.value.fuel) == ("score", 10_000_000)


def test_running_out_of_fuel_does_not_depend_on_a_busy_thread():
    """Fuel is an instruction count: the verdict is the same however often the thread
    is preempted (here: 20 calls while another thread competes for the core)."""
    with Runtime(Limits(budget_ms=2000.0)) as rt:
        inst = rt.compile(wasm("spin"), name="spin").instantiate()
        stop = threading.Event()
        burner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
        burner.start()
        try:
            kinds = set()
            for _ in range(20):
                with pytest.raises((PolicyOutOfFuel, PolicyTimeout)) as err:
                    inst.score(score_input(1), 1)
                kinds.add(type(err.value))
        finally:
            stop.set()
            burner.join()
    assert kinds == {PolicyOutOfFuel}


def test_bulk_memory_operations_cost_fuel_per_byte(tight):
    # memory.fill of 4 MiB per round: wasmtime charges its length in fuel.
    inst = tight.compile(wasm("bulk_spin"), name="filler").instantiate()
    with pytest.raises(PolicyOutOfFuel):
        inst.score(score_input(1), 1)


@pytest.fixture
def unfuelled() -> Runtime:
    """Default limits on an engine without fuel: only the wall-clock backstop is left."""
    with Runtime(Limits(), fuel=False) as rt:
        yield rt


def test_what_fuel_does_not_stop_the_wall_clock_backstop_does(unfuelled):
    inst = unfuelled.compile(wasm("spin"), name="spin").instantiate()
    started = time.monotonic()
    with pytest.raises(PolicyTimeout) as err:
        inst.score(score_input(1), 1)
    assert time.monotonic() - started < 5.0
    assert str(err.value) == "policy 'spin': score exceeded its 50 ms budget"
    assert (err.value.export, err.value.budget_ms) == ("score", 50.0)


def test_a_spinning_guest_does_not_stop_other_python_threads(unfuelled):
    """The call releases the GIL: another thread keeps running while the guest spins
    (and the epoch ticker thread can interrupt it)."""
    inst = unfuelled.compile(wasm("spin"), name="spin").instantiate()
    ticks = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0)

    other = threading.Thread(target=count)
    other.start()
    try:
        for _ in range(20):
            with pytest.raises(PolicyTimeout):
                inst.score(score_input(1), 1)
    finally:
        stop.set()
        other.join()
    assert ticks


def test_the_instance_still_answers_after_running_out_of_fuel(tight):
    mod = tight.compile(wasm("spin"), name="spin")
    inst = mod.instantiate()
    with pytest.raises(PolicyOutOfFuel):
        inst.score(score_input(1), 1)
    # The Store stays usable (WasmPolicy re-creates anyway, since guest state is suspect).
    assert inst.describe().name == "spin"


def test_unreachable_is_a_trap_naming_the_reason(runtime):
    inst = runtime.compile(wasm("unreachable"), name="boom").instantiate()
    with pytest.raises(PolicyTrap) as err:
        inst.score(score_input(1), 1)
    assert str(err.value) == (
        "policy 'boom': score trapped: wasm trap: wasm `unreachable` instruction executed"
    )
    assert err.value.trap_code == "UNREACHABLE"


def test_a_guest_growing_memory_without_bound_hits_the_cap_and_traps():
    with Runtime(Limits(budget_ms=500.0, memory_bytes=4 << 20)) as rt:
        inst = rt.compile(wasm("grow"), name="hog").instantiate()
        with pytest.raises(PolicyTrap) as err:
            inst.score(score_input(1), 1)
    assert err.value.trap_code == "MEMORY_OUT_OF_BOUNDS"
    assert str(err.value).startswith("policy 'hog': score trapped: wasm trap: out of bounds memory access")
    assert str(err.value).endswith("(memory at 3.125 MiB of its 4 MiB cap)")


def test_an_allocation_past_the_cap_is_an_out_of_memory_error():
    with Runtime(Limits(memory_bytes=1 << 20)) as rt:
        inst = rt.compile(wasm("counter"), name="counter").instantiate()
        blob = b"\x93\xc0\x90\x90" + b"\0" * (2 << 20)
        with pytest.raises(PolicyCallError) as err:
            inst.score(blob, 0)
    # the host asks for 7 bytes more, to align the buffer to 8
    assert str(err.value) == (
        f"policy 'counter': alloc returned 0: out of memory (asked for {len(blob) + 7} bytes)"
    )


def test_a_second_thread_cannot_enter_an_instance_mid_call():
    with Runtime(Limits(budget_ms=1000.0, fuel=10_000_000_000)) as rt:
        inst = rt.compile(wasm("spin"), name="spin").instantiate()
        inside = threading.Event()
        outcome: list[BaseException] = []

        def spin() -> None:
            inside.set()
            try:
                inst.score(score_input(1), 1)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        worker = threading.Thread(target=spin)
        worker.start()
        inside.wait()
        time.sleep(0.2)  # let the worker get into the guest (it spins for 1 s)
        with pytest.raises(RuntimeError) as err:
            inst.score(score_input(1), 1)
        worker.join()
    assert str(err.value) == (
        "policy 'spin': instance is in use by another thread; a PolicyInstance "
        "(its wasmtime Store) must be used by one thread at a time"
    )
    assert isinstance(outcome[0], PolicyTimeout)


def test_an_instance_may_be_handed_to_another_thread_between_calls(load):
    inst = load("counter").instantiate()
    inst.pre_request(b"x")
    results = []
    worker = threading.Thread(target=lambda: results.append(inst.score(score_input(2), 2).tolist()))
    worker.start()
    worker.join()
    assert results == [[0.001, 0.001]]


def test_closing_the_runtime_stops_its_ticker_thread():
    before = {t for t in threading.enumerate() if t.name == "epick-epoch-ticker"}
    rt = Runtime()
    (ticker,) = {t for t in threading.enumerate() if t.name == "epick-epoch-ticker"} - before
    rt.close()
    assert not ticker.is_alive()


def test_an_init_that_never_returns_is_a_load_error(tight):
    source = wat_source("spin").replace(
        '(func (export "init") (param i32 i32) (result i32) (i32.const 0))',
        '(func (export "init") (param i32 i32) (result i32) (loop $l (br $l)) (i32.const 0))',
    )
    mod = tight.compile(wasmtime.wat2wasm(source), name="stuck")
    with pytest.raises(PolicyLoadError) as err:
        mod.instantiate()
    # init is a control-plane call: 100 budgets of fuel (500 M) and of backstop (5 s);
    # which comes first depends on the machine's speed.
    assert str(err.value) in (
        "policy 'stuck': init ran out of fuel (its budget is 1,000,000,000 instructions)",
        "policy 'stuck': init exceeded its 5000 ms budget",
    )
    assert err.value.export == "init"


def test_a_guest_functions_budget_changed_after_it_is_made_is_what_its_next_call_gets(tight):
    """GuestFunc keeps its fuel and deadline as ready-made ctypes arguments: setting
    ``fuel`` or ``ticks`` must reach the next call, not the values it was made with."""
    inst = tight.compile(wasm("spin"), name="spin").instantiate()
    func = inst._score
    func.fuel = 1_000
    with pytest.raises(PolicyOutOfFuel) as err:
        inst.score(score_input(1), 1)
    assert err.value.fuel == 1_000 and func.fuel == 1_000
    assert func.fuel_used() == 1_000
    func.fuel, func.ticks = 10**15, 0  # fuel for hours; the deadline is now
    started = time.monotonic()
    with pytest.raises(PolicyTimeout):
        inst.score(score_input(1), 1)
    assert time.monotonic() - started < 5.0 and func.ticks == 0
