"""Per-policy call statistics: counters plus latency percentiles over a recent window."""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["PolicyStats"]


class PolicyStats:
    """What one ``WasmPolicy`` has done.

    ``calls`` counts every score/filter/hook call made on the plugin (rejections by an
    open breaker included); ``errors`` those that raised ``PluginError``, split by kind
    in ``errors_by_kind``. ``out_of_range`` counts individual scores outside [0, 1] that
    were clamped. ``recoveries`` counts instance re-creations after a trap or timeout;
    ``timeout_retries`` the timed-out calls retried once on a re-created instance (a
    preempted thread can overrun a wall-clock budget; see ``WasmPolicy``);
    ``checkpoint_failures`` the ``export_state`` checkpoints that failed.
    ``checkpoints`` counts last-good-state captures (a recovery goes back to the latest).
    ``failing_ms`` is the wall-clock time spent in calls that failed (what the
    supervisor's time budget judges).
    ``p50_us``/``p99_us`` are over the last ``window`` calls that reached the guest
    (host-side work included); 0.0 before the first.
    """

    __slots__ = (
        "calls", "errors", "errors_by_kind", "out_of_range", "recoveries", "timeout_retries",
        "checkpoint_failures", "checkpoints", "_latency_ns", "_failing_ns",
    )

    def __init__(self, window: int = 1024) -> None:
        self.calls = 0
        self.errors = 0
        self.errors_by_kind: dict[str, int] = {}
        self.out_of_range = 0
        self.recoveries = 0
        self.timeout_retries = 0
        self.checkpoint_failures = 0
        self.checkpoints = 0
        self._latency_ns: deque[int] = deque(maxlen=window)
        self._failing_ns = 0

    def succeeded(self, elapsed_ns: int) -> None:
        self.calls += 1
        self._latency_ns.append(elapsed_ns)

    def failed(self, kind: str, elapsed_ns: int | None = None) -> None:
        self.calls += 1
        self.errors += 1
        self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1
        if elapsed_ns is not None:
            self._latency_ns.append(elapsed_ns)
            self._failing_ns += elapsed_ns

    @property
    def failing_ms(self) -> float:
        return self._failing_ns / 1e6

    def _percentile_us(self, q: float) -> float:
        if not self._latency_ns:
            return 0.0
        return float(np.percentile(np.fromiter(self._latency_ns, dtype=np.int64), q)) / 1000

    @property
    def p50_us(self) -> float:
        return self._percentile_us(50)

    @property
    def p99_us(self) -> float:
        return self._percentile_us(99)

    def __repr__(self) -> str:
        return (
            f"PolicyStats(calls={self.calls}, errors={self.errors}, "
            f"errors_by_kind={self.errors_by_kind}, out_of_range={self.out_of_range}, "
            f"recoveries={self.recoveries}, timeout_retries={self.timeout_retries}, p50_us={self.p50_us:.1f}, p99_us={self.p99_us:.1f})"
        )
