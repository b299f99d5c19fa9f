"""RateLimitedLog: a line repeated on every pick is written once per interval per key."""

from __future__ import annotations

import logging

from fakes import FakeClock

from epick.ratelog import RateLimitedLog


def test_a_repeated_line_is_written_once_per_interval_with_the_count_held_back(caplog):
    clock = FakeClock()
    rlog = RateLimitedLog(logging.getLogger("t"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t"):
        written = [rlog.warning("k", "policy %r failed", "p") for _ in range(1000)]
        rlog.warning("other", "another key logs at once")
        clock.advance(10.0)
        rlog.warning("k", "policy %r failed", "p")
    assert written.count(True) == 1
    assert caplog.messages == [
        "policy 'p' failed",
        "another key logs at once",
        "policy 'p' failed (999 similar lines suppressed)",
    ]
