"""Checkpoints: one policy's last good state, and when to capture it.

One job: keep the state a re-created instance is given back. It is captured with
``export_state`` after a hook changed something, at most once per ``interval_s`` (on
``clock``); captures run on whoever calls them (a request, or the service's background
task), so the gap also stretches to keep them under :data:`CHECKPOINT_SHARE` of the time
(a full prefix cache exports 15 MiB in ~20 ms: then one every ~10 s). Failing captures
back off (doubling, up to :data:`CHECKPOINT_MAX_GAP_S`) and have a breaker of their own;
the older good state stays. State imported through the control plane becomes the good
state at once. A crash so loses at most about one interval of history (LoRA in-flight
counts, prefix hashes), which the policies' periodic reconcile repairs anyway.

The instance is passed in: who owns it (the supervisor) is not this module's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from epick.runtime.breaker import CircuitBreaker
from epick.runtime.errors import PolicyError
from epick.runtime.instance import PolicyInstance
from epick.runtime.stats import PolicyStats

__all__ = ["Checkpoints", "CHECKPOINT_SHARE", "CHECKPOINT_MAX_GAP_S"]

#: Most of the time export_state checkpoints may take (they block whoever runs them).
CHECKPOINT_SHARE = 0.002
#: Longest gap between checkpoint attempts while they keep failing.
CHECKPOINT_MAX_GAP_S = 60.0


class Checkpoints:
    """The last good state of one policy (``good_state``; ``None`` before the first).

    ``enabled`` is False for a module without ``export_state``/``import_state``: then
    nothing is ever captured. ``breaker`` guards the exports; ``stats`` counts
    ``checkpoints`` and ``checkpoint_failures``.
    """

    def __init__(self, *, enabled: bool, clock: Callable[[], float], interval_s: float,
                 breaker: CircuitBreaker, stats: PolicyStats) -> None:
        self.enabled = enabled
        self.breaker = breaker
        self.interval_s = interval_s
        self.gap_s = interval_s
        """The current gap between captures (stretched by slow or failing exports)."""
        self.good_state: bytes | None = None
        self._clock = clock
        self._stats = stats
        self._last = float("-inf")
        self._dirty = False

    def changed(self) -> None:
        """A hook succeeded: the guest's state moved on since the last capture."""
        self._dirty = True

    def due(self) -> bool:
        """Something changed and the gap since the last capture passed."""
        return (self.enabled and self._dirty
                and self._clock() - self._last >= self.gap_s)

    def force(self) -> None:
        """Make the next :meth:`capture` run, due or not (a replay mirroring a live one)."""
        self._dirty = True
        self._last = float("-inf")

    def capture(self, inst: PolicyInstance | None) -> None:
        """Export ``inst``'s state if a capture is :meth:`due` and the breaker allows.

        Raises the export's :class:`PolicyError` after recording it (breaker, back-off,
        ``checkpoint_failures``); the older good state stays.
        """
        if inst is None or not self.due() or not self.breaker.allow():
            return
        now = self._clock()
        t0 = time.perf_counter()
        try:
            state = inst.export_state()
        except PolicyError:
            self._stats.checkpoint_failures += 1
            self.breaker.failure()
            # Back off: a failing export must not cost its budget every second.
            self._last = now
            self.gap_s = min(CHECKPOINT_MAX_GAP_S, 2 * self.gap_s)
            raise
        self.breaker.success()
        self.good_state = state
        # Keep captures to <= CHECKPOINT_SHARE of the time (a full prefix cache exports
        # 15 MiB in ~20 ms -> one every ~10 s).
        cost = time.perf_counter() - t0
        self.gap_s = max(self.interval_s, cost / CHECKPOINT_SHARE)
        self._last = now
        self._dirty = False
        self._stats.checkpoints += 1

    def adopt(self, blob: bytes) -> None:
        """State imported through the control plane: it is the good state now."""
        self.good_state = bytes(blob)
        self._last = self._clock()
        self._dirty = False

    def clear(self) -> None:
        self.good_state = None
