"""EpochTicker: it interrupts a spinning guest, and its thread has one owner and stops
with it (close, garbage collection), never twice started."""

from __future__ import annotations

import gc
import threading

import pytest
import wasmtime

from epick.runtime.ticker import EpochTicker

SPIN = '(module (func (export "spin") (loop $l (br $l))))'


def engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    config.epoch_interruption = True
    config.consume_fuel = True  # a backstop, so a broken ticker fails instead of hanging
    return wasmtime.Engine(config)


def ticker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "epick-epoch-ticker"]


def test_the_ticks_interrupt_a_spinning_guest():
    eng = engine()
    ticker = EpochTicker(eng, 0.001)
    ticker.start()
    try:
        store = wasmtime.Store(eng)
        store.set_fuel(10**11)  # far more than any tick deadline needs
        store.set_epoch_deadline(3)
        spin = wasmtime.Instance(store, wasmtime.Module(eng, SPIN), []).exports(store)["spin"]
        with pytest.raises(wasmtime.Trap) as err:
            spin(store)
        assert err.value.trap_code is wasmtime.TrapCode.INTERRUPT
    finally:
        ticker.close()


def test_a_period_must_be_positive():
    with pytest.raises(ValueError, match="EpochTicker period_s must be > 0, got 0"):
        EpochTicker(engine(), 0)


def test_start_runs_one_thread_and_close_stops_and_joins_it():
    before = len(ticker_threads())
    ticker = EpochTicker(engine(), 0.05)
    assert not ticker.running
    ticker.start()
    assert ticker.running and len(ticker_threads()) == before + 1
    with pytest.raises(RuntimeError, match="EpochTicker already started"):
        ticker.start()
    ticker.close()
    assert not ticker.running and len(ticker_threads()) == before
    ticker.close()  # idempotent


def test_a_forgotten_ticker_stops_when_it_is_collected():
    ticker = EpochTicker(engine(), 0.05)
    ticker.start()
    thread = ticker._thread
    del ticker
    gc.collect()
    thread.join(timeout=30)  # liveness only: the gate opens at once on collection
    assert not thread.is_alive()
