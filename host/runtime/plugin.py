"""WasmPolicy: a policy module as a scheduler plugin (epick.scheduler.framework).

One WasmPolicy owns one :class:`PolicyInstance` and turns the framework's calls into ABI
calls:

- **Snapshot delivery.** If the module exports ``set_snapshot``, ``cycle.pool.encoded``
  is delivered once per pool snapshot (a new :class:`PoolSnapshot` object) before the
  first score/filter on it, and ``ScoreInput.snapshot`` is nil; otherwise every call
  carries the snapshot inline (``cycle.score_input(..., inline_snapshot=True)``).
- **Failures** become ``framework.PluginError(plugin, stage, kind, reason)``, ``kind``
  one of ``error`` (non-zero return), ``trap``, ``timeout``, ``invalid-output`` (NaN,
  inf, wrong count, bad keep byte) and ``circuit-open``. Scores outside [0, 1] are
  clamped, not errors, and counted in ``stats.out_of_range``.
- **Recovery.** After a trap or timeout the guest's state is suspect: the instance is
  re-created at once (fresh ``init`` with the same params), given the last good state
  (``import_state``), and the snapshot is re-delivered before the next call.
  Last good state is captured with ``export_state`` after a successful hook, at most
  once per ``checkpoint_interval_s`` (default 1 s, on ``clock``) and only if a hook
  changed something since the last capture. Checkpoints run on the request path, so
  the gap also stretches to keep them under :data:`CHECKPOINT_SHARE` of the time (a
  full prefix cache exports 15 MiB in ~20 ms: then one every ~10 s). With
  ``checkpoint_on_hooks=False`` the owner calls :meth:`WasmPolicy.checkpoint` itself
  (the service does, from a background task, so no request waits for an export). So a crash loses at most about one
  interval of history (LoRA in-flight counts, prefix hashes) — which the policies'
  periodic reconcile repairs anyway.
- **Timeouts are retried once.** The budget is wall-clock time, so a thread preempted
  mid-call (a loaded machine) can overrun it without the guest being slow. A timed-out
  call is therefore re-run once on the re-created instance; only a second timeout is
  reported (``stats.timeout_retries`` counts the retries). A guest that really spins
  costs two budgets per call until the breaker opens.
- **Circuit breaker.** After ``Limits.breaker_failures`` consecutive failures (any kind
  except ``circuit-open``) every call fails fast with ``circuit-open`` for
  ``Limits.breaker_cooldown_s``; then one trial call decides (half-open).
- **Stats** in :attr:`WasmPolicy.stats` (:class:`PolicyStats`).

Threading: like its instance, a WasmPolicy is used by one thread at a time (the
scheduler's). ``export_state``/``import_state``/``describe`` are control-plane calls and
raise :class:`PolicyError` subclasses, not ``PluginError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import compress
from typing import Any

import numpy as np

from epick import abi
from epick.runtime.breaker import CircuitBreaker
from epick.runtime.errors import (
    PolicyError,
    PolicyOutputError,
    PolicyTimeout,
    PolicyTrap,
)
from epick.runtime.instance import PolicyInstance
from epick.runtime.module import PolicyModule
from epick.runtime.stats import PolicyStats
from epick.scheduler.framework import Cycle, PluginError

__all__ = ["WasmPolicy", "error_kind"]

log = logging.getLogger(__name__)

#: Most of the time export_state checkpoints may take (they block a request).
CHECKPOINT_SHARE = 0.002

_encode = abi.encoder.encode
_perf_ns = time.perf_counter_ns
_EMPTY = np.empty(0, dtype=np.float64)


def error_kind(exc: PolicyError) -> str:
    """The ``PluginError.kind`` for a runtime error."""
    if isinstance(exc, PolicyTimeout):
        return "timeout"
    if isinstance(exc, PolicyTrap):
        return "trap"
    if isinstance(exc, PolicyOutputError):
        return "invalid-output"
    return "error"


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class WasmPolicy:
    """A checked policy module running as a scheduler plugin; see the module docstring.

    ``mod`` is instantiated and ``init``-ed with ``params`` here (PolicyLoadError if that
    fails). ``name`` defaults to the module's. ``clock`` (monotonic seconds) drives the
    breaker and checkpoints; ``now_ms`` (Unix ms) stamps ``PreRequestEvent``s.
    """

    def __init__(
        self,
        mod: PolicyModule,
        params: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        now_ms: Callable[[], int] = _wall_ms,
        checkpoint_interval_s: float = 1.0,
        checkpoint_on_hooks: bool = True,
        stats_window: int = 1024,
    ) -> None:
        self.module = mod
        self.params: dict[str, Any] = dict(params or {})
        self.name = name or mod.name
        self._inst: PolicyInstance | None = mod.instantiate(self.params)
        exports = mod.exports
        self.is_filter = "filter" in exports
        self.is_scorer = "score" in exports
        self.has_pre_request = "pre_request" in exports
        self.has_post_response = "post_response" in exports
        self.has_state = "export_state" in exports and "import_state" in exports
        self._resident = "set_snapshot" in exports
        limits = mod.runtime.limits
        self._breaker = CircuitBreaker(limits.breaker_failures, limits.breaker_cooldown_s, clock)
        self._clock = clock
        self._now_ms = now_ms
        self._checkpoint_interval_s = checkpoint_interval_s
        #: score() already returns finite values clamped to [0, 1]: the scheduler
        #: need not clamp again.
        self.clamps_scores = True
        self._checkpoint_gap_s = checkpoint_interval_s
        self._checkpoint_on_hooks = checkpoint_on_hooks
        self._last_checkpoint = float("-inf")
        self._dirty = False
        self._good_state: bytes | None = None
        self._pool: object = None  # the PoolSnapshot the instance holds (resident mode)
        self._recovery_error = ""
        self._closed = False
        self.stats = PolicyStats(stats_window)

    def __repr__(self) -> str:
        return f"<WasmPolicy {self.name!r} module={self.module.name!r} breaker={self._breaker.state}>"

    @property
    def breaker_state(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        return self._breaker.state

    # -- framework extension points -----------------------------------------------------

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        """One score per candidate, finite, clamped to [0, 1] (``PluginError`` on failure)."""
        n = len(candidates)
        if n == 0:
            return _EMPTY.copy()
        self._admit("score")
        t0 = _perf_ns()
        try:
            scores, in_range = self._score_once(cycle, candidates, n)
        except PolicyTimeout as exc:
            scores, in_range = self._retry("score", exc, t0, self._score_once, cycle, candidates, n)
        except PolicyError as exc:
            raise self._failed("score", exc, t0) from exc
        if not in_range:
            finite = np.isfinite(scores)
            if not finite.all():
                bad = int(np.argmin(finite))
                exc = PolicyOutputError(
                    self.name, "score", f"score {float(scores[bad])!r} for candidate {bad} is not finite"
                )
                raise self._failed("score", exc, t0) from None
            self.stats.out_of_range += int(np.count_nonzero((scores < 0.0) | (scores > 1.0)))
            np.clip(scores, 0.0, 1.0, out=scores)
        self._succeeded(t0)
        return scores

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """The kept subset of ``candidates``, in order (``PluginError`` on failure)."""
        n = len(candidates)
        if n == 0:
            return ()
        self._admit("filter")
        t0 = _perf_ns()
        try:
            keep = self._filter_once(cycle, candidates, n)
        except PolicyTimeout as exc:
            keep = self._retry("filter", exc, t0, self._filter_once, cycle, candidates, n)
        except PolicyError as exc:
            raise self._failed("filter", exc, t0) from exc
        self._succeeded(t0)
        return tuple(compress(candidates, keep.tolist()))

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        """Tell the policy ``endpoint`` was picked for ``cycle.request`` (stamped with the
        cycle's ``now_ms``, else ``now_ms()``)."""
        event = abi.PreRequestEvent(request=cycle.request, endpoint=endpoint,
                                    timestamp_ms=cycle.now_ms or self._now_ms())
        self._hook("pre_request", _encode(event))

    def post_response(self, event: abi.PostResponseEvent) -> None:
        """Tell the policy a request finished."""
        self._hook("post_response", _encode(event))

    # -- control plane (hot swap, admin) ------------------------------------------------

    def describe(self) -> abi.Describe:
        return self._control(lambda inst: inst.describe())

    def export_state(self) -> bytes | None:
        """The policy's state, or ``None`` if the module has no ``export_state``."""
        if not self.has_state:
            return None
        return self._control(lambda inst: inst.export_state())

    def import_state(self, blob: bytes) -> None:
        """Load state from ``export_state`` (this or another version of the policy).

        It also becomes the state restored after a crash.
        """
        if not self.has_state:
            raise PolicyError(self.name, "import_state", "does not export 'import_state'")
        self._control(lambda inst: inst.import_state(blob))
        self._good_state = bytes(blob)
        self._last_checkpoint = self._clock()
        self._dirty = False

    def close(self) -> None:
        """Release the instance now; the plugin is unusable after (``RuntimeError``)."""
        self._closed = True
        if self._inst is not None:
            self._inst.close()
        self._inst = None

    # -- internals ----------------------------------------------------------------------

    def _control(self, call: Callable[[PolicyInstance], Any]) -> Any:
        """A control-plane call: PolicyError propagates, but a trap still re-creates."""
        try:
            return call(self._live())
        except (PolicyTrap, PolicyTimeout):
            self._recover()
            raise

    def _live(self) -> PolicyInstance:
        inst = self._inst
        if inst is None:
            if self._closed:
                raise RuntimeError(f"policy {self.name!r}: WasmPolicy is closed")
            self._recover()
            inst = self._inst
            if inst is None:
                raise PolicyError(
                    self.name, None, f"instance could not be re-created: {self._recovery_error}"
                )
        return inst

    def _score_input(self, inst: PolicyInstance, cycle: Cycle, candidates: tuple[int, ...]) -> bytes:
        if not self._resident:
            return cycle.score_input(candidates, inline_snapshot=True)
        pool = cycle.pool
        if pool is not self._pool:
            inst.set_snapshot(pool.encoded)
            self._pool = pool
        return cycle.score_input(candidates, inline_snapshot=False)

    def _score_once(self, cycle: Cycle, candidates: tuple[int, ...], n: int) -> tuple[np.ndarray, bool]:
        inst = self._live()
        return inst.score_checked(self._score_input(inst, cycle, candidates), n)

    def _filter_once(self, cycle: Cycle, candidates: tuple[int, ...], n: int) -> np.ndarray:
        inst = self._live()
        return inst.filter(self._score_input(inst, cycle, candidates), n)

    def _hook_once(self, stage: str, blob: bytes) -> None:
        inst = self._live()
        if stage == "pre_request":
            inst.pre_request(blob)
        else:
            inst.post_response(blob)

    def _hook(self, stage: str, blob: bytes) -> None:
        self._admit(stage)
        t0 = _perf_ns()
        try:
            self._hook_once(stage, blob)
        except PolicyTimeout as exc:
            self._retry(stage, exc, t0, self._hook_once, stage, blob)
        except PolicyError as exc:
            raise self._failed(stage, exc, t0) from exc
        self._succeeded(t0)
        self._dirty = True
        if self._checkpoint_on_hooks:
            self._maybe_checkpoint()

    def checkpoint(self, *, force: bool = False) -> None:
        """Capture the last good state now if it is due (interval passed, state changed).

        For owners that pass ``checkpoint_on_hooks=False`` to keep the export off the
        request path: the service calls this from a background task once a second.
        ``force`` captures now, due or not (a replay mirroring a live checkpoint).
        """
        if force:
            self._dirty = True
            self._last_checkpoint = float("-inf")
        self._maybe_checkpoint()

    def recover(self) -> None:
        """Re-create the instance from the last good state now, as a trap does (a replay
        mirroring a live recovery)."""
        self._recover()

    def _retry(self, stage: str, first: PolicyTimeout, t0: int, once: Callable[..., Any], *args: Any) -> Any:
        """Re-run a timed-out call once on a re-created instance (see module docstring)."""
        self.stats.timeout_retries += 1
        self._recover()
        try:
            return once(*args)
        except PolicyError as exc:
            raise self._failed(stage, exc, t0) from exc

    def _admit(self, stage: str) -> None:
        breaker = self._breaker
        if breaker.state != "closed" and not breaker.allow():
            self.stats.failed("circuit-open")
            raise PluginError(
                self.name, stage, "circuit-open",
                f"{self._breaker.consecutive} consecutive failures; "
                f"next trial in {self._breaker.retry_in_s:.1f} s",
            )

    def _succeeded(self, t0: int) -> None:
        self.stats.succeeded(_perf_ns() - t0)
        breaker = self._breaker
        if breaker.consecutive or breaker.state != "closed":
            breaker.success()

    def _failed(self, stage: str, exc: PolicyError, t0: int) -> PluginError:
        if exc.export == "set_snapshot":  # delivering the snapshot before score/filter
            stage = "set_snapshot"
        kind = error_kind(exc)
        self.stats.failed(kind, _perf_ns() - t0)
        self._breaker.failure()
        if kind in ("trap", "timeout"):
            self._recover()
        return PluginError(self.name, stage, kind, exc.detail)

    def _recover(self) -> None:
        """Replace the instance with a fresh one holding the last good state."""
        old, self._inst, self._pool = self._inst, None, None
        if old is not None:
            old.close()
        try:
            inst = self.module.instantiate(self.params)
        except PolicyError as exc:
            self._recovery_error = exc.detail
            log.error("policy %r: cannot re-create the instance: %s", self.name, exc)
            return
        if self._good_state is not None:
            try:
                inst.import_state(self._good_state)
            except PolicyError as exc:
                # The ABI says a failed import leaves the policy freshly initialised.
                log.warning("policy %r: last good state not restored: %s", self.name, exc)
        self._inst = inst
        self.stats.recoveries += 1
        log.warning("policy %r: instance re-created after a failure", self.name)

    def _maybe_checkpoint(self) -> None:
        if not self.has_state or not self._dirty:
            return
        now = self._clock()
        if now - self._last_checkpoint < self._checkpoint_gap_s:
            return
        inst = self._inst
        if inst is None:
            return
        t0 = time.perf_counter()
        try:
            self._good_state = inst.export_state()
        except PolicyError as exc:
            # The hook itself succeeded; keep the older good state and count the failure.
            kind = error_kind(exc)
            self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1
            self.stats.errors += 1
            log.warning("policy %r: export_state failed: %s", self.name, exc)
            if kind in ("trap", "timeout"):
                self._recover()
            return
        # A checkpoint runs on the request path: keep it to <= CHECKPOINT_SHARE of the
        # time (a full prefix cache exports 15 MiB in ~20 ms -> one every ~10 s).
        cost = time.perf_counter() - t0
        self._checkpoint_gap_s = max(self._checkpoint_interval_s, cost / CHECKPOINT_SHARE)
        self._last_checkpoint = now
        self._dirty = False
        self.stats.checkpoints += 1
