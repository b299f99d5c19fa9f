"""A consecutive-failure circuit breaker with a half-open trial, on an injectable clock."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """``closed`` -> (``failures`` consecutive failures) -> ``open`` for ``cooldown_s`` ->
    ``half-open``: one trial call; its success closes the breaker, its failure re-opens
    it for another ``cooldown_s``.

    Single-threaded by design (it guards one Store). ``clock`` returns seconds
    (monotonic); tests pass a fake one.
    """

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"

    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1:
            raise ValueError(f"CircuitBreaker failures must be >= 1, got {failures!r}")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = self.CLOSED
        self.consecutive = 0
        self.opened_at = 0.0

    def allow(self) -> bool:
        """May a call go ahead now? Moves ``open`` to ``half-open`` once cooled down."""
        if self.state == self.CLOSED:
            return True
        # In half-open a trial is out; should its outcome never be reported (the caller
        # died mid-call), another trial is allowed one cooldown later.
        if self.clock() - self.opened_at >= self.cooldown_s:
            self.state = self.HALF_OPEN
            self.opened_at = self.clock()
            return True
        return False

    def success(self) -> None:
        self.consecutive = 0
        self.state = self.CLOSED

    def failure(self) -> None:
        self.consecutive += 1
        if self.state == self.HALF_OPEN or self.consecutive >= self.failures:
            self.state = self.OPEN
            self.opened_at = self.clock()

    @property
    def retry_in_s(self) -> float:
        """Seconds until the breaker lets a (next) trial through (0 when closed)."""
        if self.state == self.CLOSED:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown_s - self.clock())
