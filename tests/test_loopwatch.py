"""LoopWatch: the event loop's lag measured, and a stall named by what ran."""

from __future__ import annotations

import logging
import time

import anyio

from epick import telemetry
from epick.loopwatch import LoopWatch


def hold_the_loop_until(watch: LoopWatch) -> None:
    """Block the loop's thread (a blocking call in a coroutine, the bug being caught)
    until the watchdog has seen it; at most 10 s."""
    deadline = time.monotonic() + 10
    while not watch.sampled.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_blocking_coroutine_is_named_in_a_warning_and_its_lag_recorded(caplog):
    caplog.set_level(logging.WARNING, logger="epick.loop")
    lags: list[float] = []
    stalls: list[float] = []
    watch = LoopWatch(warn_s=0.05, interval_s=0.01, observe=lags.append,
                      on_stall=lambda lag, _seen: stalls.append(lag))

    async def blocking_checkpoint() -> None:
        hold_the_loop_until(watch)

    async def main() -> None:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(watch.run)
                tg.start_soon(blocking_checkpoint, name="the-culprit")
                while not stalls:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
    assert watch.sampled.is_set()
    warning = next(r.getMessage() for r in caplog.records if "event loop held" in r.getMessage())
    assert "over [server] loop_stall_warn_ms = 50" in warning
    assert "running task 'the-culprit':" in warning
    assert "/asyncio/" not in warning and "/anyio/" not in warning  # plumbing left out
    assert "in blocking_checkpoint" in warning and "hold_the_loop_until(watch)" in warning
    assert "time.sleep(0.01)" in warning  # the innermost frame: what held it
    assert len(stalls) == 1 and stalls[0] > 0.05
    assert max(lags) == stalls[0]  # the metric saw the stall


def test_without_a_stall_nothing_is_logged_and_the_lag_is_still_measured(caplog):
    caplog.set_level(logging.WARNING, logger="epick.loop")
    lags: list[float] = []
    watch = LoopWatch(warn_s=5.0, interval_s=0.01, observe=lags.append)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(watch.run)
            while len(lags) < 5:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
    assert len(lags) >= 5 and all(lag >= 0 for lag in lags)
    assert "event loop held" not in caplog.text and not watch.sampled.is_set()


def test_warn_zero_measures_only_and_starts_no_thread():
    import threading

    lags: list[float] = []
    watch = LoopWatch(warn_s=0.0, interval_s=0.01, observe=lags.append)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(watch.run)
            names = {t.name for t in threading.enumerate()}
            while len(lags) < 2:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert "epick-loop-watchdog" not in names

    anyio.run(main, backend="asyncio")
    assert len(lags) >= 2


def test_the_service_metric_is_the_lag_histogram():
    before = telemetry.REGISTRY.get_sample_value("epick_event_loop_lag_seconds_count") or 0
    telemetry.EVENT_LOOP_LAG.observe(0.3)
    assert telemetry.REGISTRY.get_sample_value("epick_event_loop_lag_seconds_count") == before + 1
    assert telemetry.REGISTRY.get_sample_value("epick_event_loop_lag_seconds_bucket",
                                               {"le": "0.25"}) is not None
