"""PolicyStats: counts, kinds, the latency window and its percentiles."""

from __future__ import annotations

import pytest

from epick.runtime.stats import PolicyStats


def test_before_any_call_everything_is_zero():
    s = PolicyStats()
    assert (s.calls, s.errors, s.errors_by_kind, s.p50_us, s.p99_us, s.failing_ms) == (
        0, 0, {}, 0.0, 0.0, 0.0)


def test_calls_and_errors_are_counted_by_kind():
    s = PolicyStats()
    s.succeeded(1_000)
    s.failed("trap", 2_000)
    s.failed("trap", 3_000)
    s.failed("circuit-open")  # never reached the guest: no latency
    assert (s.calls, s.errors) == (4, 3)
    assert s.errors_by_kind == {"trap": 2, "circuit-open": 1}
    assert s.failing_ms == pytest.approx(0.005)
    assert s.p50_us == pytest.approx(2.0)


def test_percentiles_are_over_the_last_window_calls():
    s = PolicyStats(window=100)
    for _ in range(100):
        s.succeeded(1_000_000)  # 1 ms: all pushed out below
    for us in range(1, 101):
        s.succeeded(us * 1_000)
    assert s.p50_us == pytest.approx(50.5)
    assert s.p99_us == pytest.approx(99.01)


def test_one_slow_call_in_a_hundred_is_the_p99_not_the_p50():
    s = PolicyStats()
    for _ in range(99):
        s.succeeded(10_000)
    s.succeeded(50_000_000)
    assert s.p50_us == pytest.approx(10.0)
    assert s.p99_us > 10.0


def test_repr_names_the_counts():
    s = PolicyStats()
    s.failed("error", 1_000)
    assert repr(s).startswith("PolicyStats(calls=1, errors=1, errors_by_kind={'error': 1}")
