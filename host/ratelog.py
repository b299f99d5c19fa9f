"""Rate-limited logging: a line that would repeat on every pick is written at most once
per ``interval_s`` per key, with a count of the lines it held back.

A failing policy fails on every pick (~150/s): one WARNING each would bury the log
(13 k lines while one breaker was open). ``RateLimitedLog(log).warning(key, msg, *args)``
writes the first line of a key at once, then at most one per interval, suffixed
``(N similar lines suppressed)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]

#: Distinct keys remembered; past that the oldest are forgotten (their next line logs).
MAX_KEYS = 1024


class RateLimitedLog:
    """Wraps a :class:`logging.Logger`; not thread-safe (one per event loop)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[object, list] = {}  # key -> [last written at, suppressed]

    def log(self, level: int, key: object, msg: str, *args: object) -> bool:
        """Log unless ``key`` logged within the interval; True if a line was written."""
        now = self.clock()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        suppressed = seen[1] if seen is not None else 0
        if seen is None and len(self._last) >= MAX_KEYS:
            self._last.pop(next(iter(self._last)))
        self._last[key] = [now, 0]
        if suppressed:
            msg = f"{msg} ({suppressed} similar lines suppressed)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: object, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: object, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, key, msg, *args)
