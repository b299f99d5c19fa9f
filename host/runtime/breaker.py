"""A circuit breaker that opens on consecutive failures or on an error rate, with a
half-open trial, on an injectable clock."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """``closed`` -> ``open`` for ``cooldown_s`` -> ``half-open``: one trial call; its
    success closes the breaker, its failure re-opens it for another ``cooldown_s``.

    It opens after ``failures`` consecutive failures, or (when ``error_rate`` is given)
    once at least ``error_rate`` of the last ``window`` outcomes were failures (a policy
    failing every 2nd call never fails twice in a row), or when its owner trips it (:meth:`trip`: for a reason the
    breaker cannot see, time burned or an instance that keeps dying) for a time of its
    choosing. ``opens`` counts how often it opened.

    Successes are cheap to record (:meth:`success` is an increment while closed), since
    every policy call records one. Single-threaded by design (it guards one Store).
    ``clock`` returns seconds (monotonic); tests pass a fake one.
    """

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        error_rate: float | None = None,
        window: int = 1,
    ) -> None:
        if failures < 1:
            raise ValueError(f"CircuitBreaker failures must be >= 1, got {failures!r}")
        if error_rate is not None and (not 0 < error_rate <= 1 or window < 1):
            raise ValueError(
                f"CircuitBreaker needs 0 < error_rate <= 1 and window >= 1, "
                f"got {error_rate!r} and {window!r}"
            )
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.window = window
        # Without an error rate only consecutive failures open it (the window then
        # never fills up to a judgement).
        self._rate_failures = (max(1, int(error_rate * window + 0.5 - 1e-9))
                               if error_rate is not None else window + 1)
        self.state = self.CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        self._open_for = cooldown_s  # how long this opening lasts
        self.opens = 0
        self.reason = ""
        """Why it last opened (for the ``circuit-open`` message)."""
        self._outcomes = 0  # outcomes recorded since the breaker last closed
        self._failed_at: deque[int] = deque()  # outcome numbers of recent failures

    @property
    def ready(self) -> bool:
        """Would :meth:`allow` let a call through now? (It changes nothing.)"""
        return self.state == self.CLOSED or self.clock() - self.opened_at >= self._open_for

    def allow(self) -> bool:
        """May a call go ahead now? Moves ``open`` to ``half-open`` once cooled down."""
        if self.state == self.CLOSED:
            return True
        # In half-open a trial is out; should its outcome never be reported (the caller
        # died mid-call), another trial is allowed one cooldown later.
        if self.clock() - self.opened_at >= self._open_for:
            self.state = self.HALF_OPEN
            self.opened_at = self.clock()
            self._open_for = self.cooldown_s
            return True
        return False

    def release(self) -> None:
        """The call :meth:`allow` let through never reached what the breaker guards (it
        was skipped): a half-open breaker lets the next call be the trial instead."""
        if self.state == self.HALF_OPEN:
            self.opened_at = self.clock() - self._open_for

    def trip(self, reason: str, cooldown_s: float) -> bool:
        """Open now for ``cooldown_s`` (an opening that lasts longer is kept); True if
        it was closed."""
        now = self.clock()
        was_closed = self.state == self.CLOSED
        if self.state == self.OPEN and self.opened_at + self._open_for >= now + cooldown_s:
            return False
        self._open(reason, cooldown_s)
        return was_closed

    def success(self) -> None:
        self._outcomes += 1
        if self.consecutive or self.state != self.CLOSED:
            self.consecutive = 0
            if self.state != self.CLOSED:
                self._reset()
            self.state = self.CLOSED

    def failure(self) -> None:
        self._outcomes += 1
        self.consecutive += 1
        failed = self._failed_at
        failed.append(self._outcomes)
        while failed[0] <= self._outcomes - self.window:
            failed.popleft()
        if self.state == self.HALF_OPEN:
            self._open("the half-open trial failed")
        elif self.consecutive >= self.failures:
            self._open(f"{self.consecutive} consecutive failures")
        elif self._outcomes >= self.window and len(failed) >= self._rate_failures:
            self._open(f"{len(failed)} of the last {self.window} calls failed")

    def _open(self, reason: str, cooldown_s: float | None = None) -> None:
        if self.state == self.CLOSED:
            self.opens += 1
        self.state = self.OPEN
        self.opened_at = self.clock()
        self._open_for = self.cooldown_s if cooldown_s is None else cooldown_s
        self.reason = reason

    def _reset(self) -> None:
        self._outcomes = 0
        self._failed_at.clear()

    @property
    def retry_in_s(self) -> float:
        """Seconds until the breaker lets a (next) trial through (0 when closed)."""
        if self.state == self.CLOSED:
            return 0.0
        return max(0.0, self.opened_at + self._open_for - self.clock())
