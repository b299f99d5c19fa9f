"""CircuitBreaker: its transitions, the error-rate window, trips, and trials."""

from __future__ import annotations

import pytest

from epick.runtime.breaker import CircuitBreaker


def breaker(clock, *, failures=3, cooldown=10.0, error_rate=None, window=1) -> CircuitBreaker:
    return CircuitBreaker(failures, cooldown, clock, error_rate=error_rate, window=window)


@pytest.mark.parametrize("kwargs, message", [
    ({"failures": 0}, "CircuitBreaker failures must be >= 1, got 0"),
    ({"error_rate": 0.0, "window": 5}, "CircuitBreaker needs 0 < error_rate <= 1 and "
                                        "window >= 1, got 0.0 and 5"),
    ({"error_rate": 0.5, "window": 0}, "CircuitBreaker needs 0 < error_rate <= 1 and "
                                        "window >= 1, got 0.5 and 0"),
])
def test_bad_settings_are_refused_naming_them(fake_clock, kwargs, message):
    with pytest.raises(ValueError) as err:
        breaker(fake_clock, **kwargs)
    assert str(err.value) == message


def test_it_opens_after_the_consecutive_failures_and_counts_the_opening(fake_clock):
    b = breaker(fake_clock)
    b.failure()
    b.failure()
    assert (b.state, b.allow()) == ("closed", True)
    b.failure()
    assert (b.state, b.opens, b.reason) == ("open", 1, "3 consecutive failures")
    assert not b.allow() and b.retry_in_s == 10.0


def test_without_an_error_rate_only_consecutive_failures_open_it(fake_clock):
    b = CircuitBreaker(3, 10.0, fake_clock)  # no error_rate: no window judgement
    for _ in range(10):
        b.failure()
        b.success()
    assert b.state == "closed"


def test_a_success_in_between_restarts_the_count(fake_clock):
    b = breaker(fake_clock)
    for _ in range(5):
        b.failure()
        b.failure()
        b.success()
    assert b.state == "closed" and b.opens == 0


def test_the_error_rate_is_judged_only_over_a_full_window(fake_clock):
    b = breaker(fake_clock, failures=100, error_rate=0.5, window=4)
    b.failure()
    b.success()
    b.failure()  # 2 of 3: the window is not full yet
    assert b.state == "closed"
    b.success()  # 2 of 4: half of a full window
    assert b.state == "closed"  # judged at a failure
    b.failure()  # the last 4: success, failure, success, failure
    assert (b.state, b.reason) == ("open", "2 of the last 4 calls failed")


def test_failures_older_than_the_window_drop_out(fake_clock):
    b = breaker(fake_clock, failures=100, error_rate=0.5, window=4)
    b.failure()
    for _ in range(3):
        b.success()
    b.failure()  # the first failure left the window: 1 of the last 4
    assert b.state == "closed"


def test_after_the_cooldown_one_trial_decides(fake_clock):
    b = breaker(fake_clock, failures=1)
    b.failure()
    fake_clock.advance(9.9)
    assert not b.ready and not b.allow() and b.state == "open"
    fake_clock.advance(0.1)
    assert b.ready and b.state == "open"  # ready changes nothing
    assert b.allow() and b.state == "half-open"
    assert not b.allow()  # one trial at a time
    b.failure()
    assert (b.state, b.reason, b.opens) == ("open", "the half-open trial failed", 1)
    fake_clock.advance(10.0)
    assert b.allow()
    b.success()
    assert (b.state, b.retry_in_s) == ("closed", 0.0)


def test_a_closed_breaker_starts_a_fresh_window(fake_clock):
    b = breaker(fake_clock, failures=100, error_rate=0.5, window=4)
    for _ in range(2):
        b.success()
        b.failure()
    assert b.state == "open"
    fake_clock.advance(10.0)
    assert b.allow()
    b.success()
    b.failure()  # the failures before the opening no longer count
    assert b.state == "closed"


def test_a_trip_opens_for_the_time_it_names_and_keeps_a_longer_opening(fake_clock):
    b = breaker(fake_clock)
    assert b.trip("instance keeps failing", 0.05)
    assert (b.state, b.reason, b.opens) == ("open", "instance keeps failing", 1)
    assert b.retry_in_s == pytest.approx(0.05)
    assert not b.trip("a longer one", 2.0)  # already open: not a new opening
    assert b.retry_in_s == pytest.approx(2.0)
    b.trip("a shorter one", 0.1)
    assert (b.reason, b.retry_in_s) == ("a longer one", pytest.approx(2.0))
    fake_clock.advance(2.0)
    assert b.allow() and b.state == "half-open"
    b.failure()  # a failed trial re-opens for the breaker's own cooldown
    assert b.retry_in_s == pytest.approx(10.0)


def test_a_released_trial_lets_the_next_call_be_the_trial(fake_clock):
    b = breaker(fake_clock, failures=1)
    b.failure()
    fake_clock.advance(10.0)
    assert b.allow()
    b.release()  # the call was skipped before it reached what the breaker guards
    assert b.allow() and b.state == "half-open"
    b.success()
    assert b.state == "closed"
    b.release()  # closed: nothing to give back
    assert b.state == "closed"
