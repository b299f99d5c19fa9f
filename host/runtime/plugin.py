"""WasmPolicy: a policy module as a scheduler plugin (epick.interfaces).

One WasmPolicy owns one :class:`PolicyInstance` and turns the framework's calls into ABI
calls:

- **Snapshot delivery.** If the module exports ``set_snapshot``, ``cycle.view.encoded``
  is delivered once per pool snapshot (a new :class:`PoolView` object) before the
  first score/filter on it, and ``ScoreInput.snapshot`` is nil; otherwise every call
  carries the snapshot inline (``cycle.score_input(..., inline_snapshot=True)``).
- **Failures** become ``PluginError(plugin, stage, kind, reason)``, ``kind``
  one of ``error`` (non-zero return), ``trap``, ``timeout`` (the wall-clock backstop),
  ``out-of-fuel``, ``invalid-output`` (NaN, inf, wrong count, bad keep byte),
  ``circuit-open`` and ``recovering`` (the instance is being re-created). Scores
  outside [0, 1] are clamped, not errors, and counted in ``stats.out_of_range``.
- **Recovery.** After a trap, timeout or running out of fuel the guest's state is
  suspect: the instance is re-created (fresh ``init`` with the same params), given the
  last good state (``import_state``), and the snapshot is re-delivered before the next
  call. With ``background_recovery=True`` (the service) instances are built on the
  runtime's rebuild thread, never inside a pick: a warm spare (fresh, ``init``-ed) is
  kept ready and goes live at once, given the last good state when that is small
  (:data:`SPARE_STATE_BYTES`); otherwise the new instance is built with its state on
  that thread, and until it is ready every call fails fast with ``recovering`` and the
  scheduler goes on without the policy. An instance
  that dies again within a cooldown of its last rebuild is rebuilt after a doubling
  gap (:data:`REBUILD_MIN_GAP_S` up to the cooldown); a rebuild that fails is tried
  again one breaker cooldown later. Without it, the instance is
  re-created at once, inline.
  Last good state is captured with ``export_state`` after a successful hook, at most
  once per ``checkpoint_interval_s`` (default 1 s, on ``clock``) and only if a hook
  changed something since the last capture. Checkpoints run on the request path, so
  the gap also stretches to keep them under :data:`CHECKPOINT_SHARE` of the time (a
  full prefix cache exports 15 MiB in ~20 ms: then one every ~10 s). With
  ``checkpoint_on_hooks=False`` the owner calls :meth:`WasmPolicy.checkpoint` itself
  (the service does, from a background task, so no request waits for an export). So a crash loses at most about one
  interval of history (LoRA in-flight counts, prefix hashes) — which the policies'
  periodic reconcile repairs anyway.
- **Timeouts are retried once, inline recovery only.** The backstop is wall-clock
  time, so a thread preempted mid-call can overrun it without the guest being slow; a
  timed-out call is re-run once on the re-created instance (``stats.timeout_retries``).
  With background recovery there is no instance to retry on yet: the call fails and the
  policy sits out until its new instance is ready. Running out of fuel is
  deterministic and never retried.
- **Circuit breakers, one per stage** (``score``, ``filter``, ``pre_request``,
  ``post_response``): after ``Limits.breaker_failures`` consecutive failures of that
  stage, or ``Limits.breaker_error_rate`` of its last ``Limits.breaker_window`` calls,
  its calls fail fast with ``circuit-open`` for ``Limits.breaker_cooldown_s``; then one
  trial call decides (half-open). A pre_request hook that always traps no longer rides
  on the good scores' successes. Checkpoints have a breaker of their own, and back off
  (doubling, up to :data:`CHECKPOINT_MAX_GAP_S`) while they fail.
- **Stats** in :attr:`WasmPolicy.stats` (:class:`PolicyStats`).

Threading: like its instance, a WasmPolicy is used by one thread at a time (the
scheduler's). ``export_state``/``import_state``/``describe`` are control-plane calls and
raise :class:`PolicyError` subclasses, not ``PluginError``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from itertools import compress
from typing import Any

import numpy as np

from epick import abi
from epick.interfaces import Capabilities, Cycle, PluginError
from epick.ratelog import RateLimitedLog
from epick.runtime.breaker import CircuitBreaker
from epick.runtime.errors import (
    PolicyError,
    PolicyOutOfFuel,
    PolicyOutputError,
    PolicyTimeout,
    PolicyTrap,
)
from epick.runtime.instance import PolicyInstance
from epick.runtime.module import PolicyModule
from epick.runtime.stats import PolicyStats

__all__ = ["WasmPolicy", "error_kind", "capabilities_of"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

#: Most of the time export_state checkpoints may take (they block a request).
CHECKPOINT_SHARE = 0.002
#: Longest gap between checkpoint attempts while they keep failing.
CHECKPOINT_MAX_GAP_S = 60.0
#: First gap between two rebuilds of an instance that died again soon after the last.
REBUILD_MIN_GAP_S = 0.05
#: Largest last good state imported into the warm spare inside the failing call (a
#: bigger one is imported on the rebuild thread while the policy sits out).
SPARE_STATE_BYTES = 64 << 10
#: The stages with a breaker each (set_snapshot failures count for the call it preceded).
STAGES = ("score", "filter", "pre_request", "post_response")
_SUSPECT = (PolicyTrap, PolicyTimeout, PolicyOutOfFuel)

_encode = abi.encoder.encode
_perf_ns = time.perf_counter_ns
_EMPTY = np.empty(0, dtype=np.float64)


def error_kind(exc: PolicyError) -> str:
    """The ``PluginError.kind`` for a runtime error."""
    if isinstance(exc, PolicyTimeout):
        return "timeout"
    if isinstance(exc, PolicyOutOfFuel):
        return "out-of-fuel"
    if isinstance(exc, PolicyTrap):
        return "trap"
    if isinstance(exc, PolicyOutputError):
        return "invalid-output"
    return "error"


def capabilities_of(exports) -> Capabilities:
    """A module's plugin capabilities, from the names it exports."""
    caps = Capabilities.NONE
    for export, cap in (("filter", Capabilities.FILTER), ("score", Capabilities.SCORE),
                        ("pre_request", Capabilities.PRE_REQUEST),
                        ("post_response", Capabilities.POST_RESPONSE)):
        if export in exports:
            caps |= cap
    if "export_state" in exports and "import_state" in exports:
        caps |= Capabilities.STATE
    if "score" in exports:
        caps |= Capabilities.SCORES_IN_RANGE
    return caps


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class WasmPolicy:
    """A checked policy module running as a scheduler plugin; see the module docstring.

    ``mod`` is instantiated and ``init``-ed with ``params`` here (PolicyLoadError if that
    fails). ``name`` defaults to the module's. ``clock`` (monotonic seconds) drives the
    breakers and checkpoints; ``now_ms`` (Unix ms) stamps ``PreRequestEvent``s;
    ``background_recovery`` re-creates failed instances on the runtime's rebuild
    thread instead of inside the failing call.
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
        background_recovery: bool = False,
    ) -> None:
        self.module = mod
        self.params: dict[str, Any] = dict(params or {})
        self.name = name or mod.name
        self._inst: PolicyInstance | None = mod.instantiate(self.params)
        exports = mod.exports
        #: What it implements, from its exports: declared once, checked at install.
        #: score() returns finite values clamped to [0, 1], so the scheduler need not
        #: clamp again (SCORES_IN_RANGE).
        self.capabilities = capabilities_of(exports)
        self.has_state = Capabilities.STATE in self.capabilities
        self._resident = "set_snapshot" in exports
        limits = mod.runtime.limits

        def breaker() -> CircuitBreaker:
            return CircuitBreaker(limits.breaker_failures, limits.breaker_cooldown_s, clock,
                                  error_rate=limits.breaker_error_rate,
                                  window=limits.breaker_window)

        self._breakers = {stage: breaker() for stage in STAGES}
        self._checkpoint_breaker = breaker()
        self._cooldown_s = limits.breaker_cooldown_s
        self._background = background_recovery
        self._rebuild: concurrent.futures.Future | None = None
        self._spare: concurrent.futures.Future | None = None  # a warm, fresh instance
        self._rebuild_at = 0.0  # earliest clock() for the next rebuild attempt
        self._rebuild_gap = 0.0  # back-off between rebuilds of an instance that keeps dying
        self._last_rebuild = float("-inf")
        self._clock = clock
        self._now_ms = now_ms
        self._checkpoint_interval_s = checkpoint_interval_s
        self._checkpoint_gap_s = checkpoint_interval_s
        self._checkpoint_on_hooks = checkpoint_on_hooks
        self._last_checkpoint = float("-inf")
        self._dirty = False
        self._good_state: bytes | None = None
        self._view: object = None  # the PoolView the instance holds (resident mode)
        self._recovery_error = ""
        self._closed = False
        self.stats = PolicyStats(stats_window)
        self._want_spare()

    def __repr__(self) -> str:
        return f"<WasmPolicy {self.name!r} module={self.module.name!r} breaker={self.breaker_state}>"

    @property
    def breaker_state(self) -> str:
        """``closed`` when every stage's breaker is; else ``open`` if any is open, else
        ``half-open``."""
        states = {b.state for b in self._breakers.values()}
        if states == {"closed"}:
            return "closed"
        return "open" if "open" in states else "half-open"

    @property
    def breaker_states(self) -> dict[str, str]:
        """Each stage's breaker (only the stages the module exports), plus checkpoints."""
        exported = self.module.exports
        out = {s: b.state for s, b in self._breakers.items() if s in exported}
        if self.has_state:
            out["checkpoint"] = self._checkpoint_breaker.state
        return out

    @property
    def breaker_opens(self) -> int:
        """How often any of this policy's breakers opened."""
        return sum(b.opens for b in self._breakers.values()) + self._checkpoint_breaker.opens

    @property
    def recovering(self) -> bool:
        """The instance is being re-created (calls fail with ``recovering``)."""
        return self._inst is None and not self._closed

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
        except _Recovering as exc:
            raise self._skipped("score", exc) from None
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
        self._succeeded("score", t0)
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
        except _Recovering as exc:
            raise self._skipped("filter", exc) from None
        self._succeeded("filter", t0)
        return tuple(compress(candidates, keep.tolist()))

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        """Tell the policy ``endpoint`` was picked for ``cycle.request`` (stamped with the
        cycle's ``now_ms``, else ``now_ms()``)."""
        self._hook("pre_request",
                   cycle.pre_request_input(endpoint, cycle.now_ms or self._now_ms()))

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
        """Release the instance now (and one still being rebuilt, once it is); the
        plugin is unusable after (``RuntimeError``). Idempotent."""
        self._closed = True
        if self._inst is not None:
            self._inst.close()
        self._inst = None
        self._good_state = None
        for attr in ("_rebuild", "_spare"):
            pending = getattr(self, attr)
            setattr(self, attr, None)
            if pending is not None and not pending.cancel():
                pending.add_done_callback(_close_result)

    @property
    def spare_ready(self) -> bool:
        """A warm spare instance is built and waiting (background recovery only)."""
        spare = self._spare
        return spare is not None and spare.done() and not spare.cancelled() \
            and spare.exception() is None

    def _want_spare(self) -> None:
        """Build a fresh spare instance on the rebuild thread, if none is on its way."""
        if self._background and not self._closed and self._spare is None:
            try:
                self._spare = self.module.runtime.submit(_build, self.module,
                                                         dict(self.params), None)
            except RuntimeError:  # closed runtime: recovery reports it
                self._spare = None

    def _take_spare(self) -> bool:
        """Go live on the warm spare at once, if it is ready and the last good state is
        small enough to import here (LoRA history: yes; a full prefix LRU: no, that
        import runs on the rebuild thread instead)."""
        spare, state = self._spare, self._good_state
        if spare is not None and spare.done() and (spare.cancelled() or spare.exception()):
            self._spare = None  # it could not be built: the rebuild will say why
            return False
        if not self.spare_ready or (state is not None and len(state) > SPARE_STATE_BYTES):
            return False
        inst = self._spare.result()[0]
        self._spare = None
        if state is not None:
            try:
                inst.import_state(state)
            except PolicyError as exc:
                # The ABI says a failed import leaves the policy freshly initialised.
                _rlog.warning(("restore", self.name),
                              "policy %r: last good state not restored: %s", self.name, exc)
        self._inst = inst
        self._recovery_error = ""
        self.stats.recoveries += 1
        self._want_spare()
        return True

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait for a background rebuild to finish (tests, tools); True if live now."""
        pending = self._rebuild
        if pending is not None:
            concurrent.futures.wait([pending], timeout=timeout)
        try:
            self._live()
        except (PolicyError, _Recovering):
            return False
        return True

    # -- internals ----------------------------------------------------------------------

    def _control(self, call: Callable[[PolicyInstance], Any]) -> Any:
        """A control-plane call: PolicyError propagates, but a trap still re-creates."""
        try:
            inst = self._live()
        except _Recovering as exc:
            raise PolicyError(self.name, None, str(exc)) from None
        try:
            return call(inst)
        except _SUSPECT:
            self._recover()
            raise

    def _live(self) -> PolicyInstance:
        inst = self._inst
        if inst is None:
            if self._closed:
                raise RuntimeError(f"policy {self.name!r}: WasmPolicy is closed")
            if self._background:
                return self._adopt()
            self._recover()
            inst = self._inst
            if inst is None:
                raise PolicyError(
                    self.name, None, f"instance could not be re-created: {self._recovery_error}"
                )
        return inst

    def _adopt(self) -> PolicyInstance:
        """The rebuilt instance if it is ready; else start/await a rebuild (``_Recovering``)."""
        pending = self._rebuild
        if pending is None:
            if self._clock() < self._rebuild_at:
                wait = self._rebuild_at - self._clock()
                if self._recovery_error:
                    raise _Recovering(f"instance could not be re-created "
                                      f"({self._recovery_error}); next try in {wait:.1f} s")
                raise _Recovering(f"instance keeps failing; re-created again in {wait:.2f} s")
            self._start_rebuild()
            raise _Recovering("instance is being re-created")
        if not pending.done():
            raise _Recovering("instance is being re-created")
        self._rebuild = None
        try:
            inst, restored = pending.result()
        except PolicyError as exc:
            self._recovery_error = exc.detail
            self._rebuild_at = self._clock() + self._cooldown_s
            _rlog.error(("rebuild", self.name), "policy %r: cannot re-create the instance: %s",
                        self.name, exc)
            raise _Recovering(f"instance could not be re-created: {exc.detail}") from None
        except Exception as exc:  # the runtime closed under it, or a host bug: never a pick's
            self._recovery_error = str(exc)
            self._rebuild_at = self._clock() + self._cooldown_s
            _rlog.error(("rebuild", self.name), "policy %r: cannot re-create the instance: %r",
                        self.name, exc)
            raise _Recovering(f"instance could not be re-created: {exc}") from None
        if restored is not None:
            _rlog.warning(("restore", self.name), "policy %r: last good state not restored: %s",
                          self.name, restored)
        self._inst = inst
        self._recovery_error = ""
        self.stats.recoveries += 1
        self._want_spare()
        return inst

    def _schedule_rebuild(self) -> None:
        """Rebuild now, or — for an instance that died again within a cooldown of its
        last rebuild — after a gap that doubles (50 ms up to the breaker cooldown), so a
        module that crashes every few calls cannot keep a core busy re-creating it."""
        now = self._clock()
        if now - self._last_rebuild >= self._cooldown_s:
            self._rebuild_gap = 0.0
        else:
            self._rebuild_gap = min(self._cooldown_s, max(REBUILD_MIN_GAP_S, 2 * self._rebuild_gap))
        if self._rebuild_gap:
            self._rebuild_at = now + self._rebuild_gap
        elif self._take_spare():
            self._last_rebuild = now
        else:
            self._start_rebuild()

    def _start_rebuild(self) -> None:
        self._last_rebuild = self._clock()
        try:
            self._rebuild = self.module.runtime.submit(
                _build, self.module, dict(self.params), self._good_state)
        except RuntimeError as exc:  # closed runtime
            self._recovery_error = str(exc)
            self._rebuild_at = self._clock() + self._cooldown_s

    def _score_input(self, inst: PolicyInstance, cycle: Cycle, candidates: tuple[int, ...]) -> bytes:
        if not self._resident:
            return cycle.score_input(candidates, inline_snapshot=True)
        view = cycle.view
        if view is not self._view:
            inst.set_snapshot(view.encoded)
            self._view = view
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
        except _Recovering as exc:
            raise self._skipped(stage, exc) from None
        self._succeeded(stage, t0)
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
        if self._background:  # no instance to retry on before the rebuild is done
            raise self._failed(stage, first, t0) from first
        self.stats.timeout_retries += 1
        self._recover()
        try:
            return once(*args)
        except PolicyError as exc:
            raise self._failed(stage, exc, t0) from exc

    def _admit(self, stage: str) -> None:
        breaker = self._breakers[stage]
        if breaker.state != "closed" and not breaker.allow():
            self.stats.failed("circuit-open")
            raise PluginError(
                self.name, stage, "circuit-open",
                f"{breaker.reason}; next trial in {breaker.retry_in_s:.1f} s",
            )

    def _succeeded(self, stage: str, t0: int) -> None:
        self.stats.succeeded(_perf_ns() - t0)
        self._breakers[stage].success()

    def _skipped(self, stage: str, exc: _Recovering) -> PluginError:
        """A call while the instance is rebuilt: not the guest's failure (no breaker)."""
        self.stats.failed("recovering")
        return PluginError(self.name, stage, "recovering", str(exc))

    def _failed(self, stage: str, exc: PolicyError, t0: int) -> PluginError:
        breaker = self._breakers[stage]
        if exc.export == "set_snapshot":  # delivering the snapshot before score/filter
            stage = "set_snapshot"
        kind = error_kind(exc)
        self.stats.failed(kind, _perf_ns() - t0)
        breaker.failure()
        if isinstance(exc, _SUSPECT):
            self._recover()
        return PluginError(self.name, stage, kind, exc.detail)

    def _recover(self) -> None:
        """Replace the instance with a fresh one holding the last good state (at once,
        or on the rebuild thread with ``background_recovery``)."""
        old, self._inst, self._view = self._inst, None, None
        if old is not None:
            old.close()
        if self._closed:
            return
        if self._background:
            if self._rebuild is None:
                self._schedule_rebuild()
            return
        try:
            inst = self.module.instantiate(self.params)
        except PolicyError as exc:
            self._recovery_error = exc.detail
            _rlog.error(("rebuild", self.name), "policy %r: cannot re-create the instance: %s",
                        self.name, exc)
            return
        if self._good_state is not None:
            try:
                inst.import_state(self._good_state)
            except PolicyError as exc:
                # The ABI says a failed import leaves the policy freshly initialised.
                _rlog.warning(("restore", self.name),
                              "policy %r: last good state not restored: %s", self.name, exc)
        self._inst = inst
        self.stats.recoveries += 1
        _rlog.warning(("recovered", self.name), "policy %r: instance re-created after a failure",
                      self.name)

    def _maybe_checkpoint(self) -> None:
        if not self.has_state or not self._dirty:
            return
        now = self._clock()
        if now - self._last_checkpoint < self._checkpoint_gap_s:
            return
        breaker = self._checkpoint_breaker
        if not breaker.allow():
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
            self.stats.checkpoint_failures += 1
            breaker.failure()
            # Back off: a failing export must not cost its budget every second.
            self._last_checkpoint = now
            self._checkpoint_gap_s = min(CHECKPOINT_MAX_GAP_S, 2 * self._checkpoint_gap_s)
            _rlog.warning(("export_state", self.name), "policy %r: export_state failed: %s",
                          self.name, exc)
            if isinstance(exc, _SUSPECT):
                self._recover()
            return
        breaker.success()
        # A checkpoint runs on the request path: keep it to <= CHECKPOINT_SHARE of the
        # time (a full prefix cache exports 15 MiB in ~20 ms -> one every ~10 s).
        cost = time.perf_counter() - t0
        self._checkpoint_gap_s = max(self._checkpoint_interval_s, cost / CHECKPOINT_SHARE)
        self._last_checkpoint = now
        self._dirty = False
        self.stats.checkpoints += 1


class _Recovering(Exception):
    """The instance is being re-created off the pick path; the call is skipped."""


def _build(mod: PolicyModule, params: dict[str, Any], state: bytes | None
           ) -> tuple[PolicyInstance, str | None]:
    """On the rebuild thread: a fresh instance given ``state``; (instance, why the state
    was not restored or None). Raises PolicyError when the instance cannot be made."""
    inst = mod.instantiate(params)
    if state is None:
        return inst, None
    try:
        inst.import_state(state)
    except PolicyError as exc:
        # The ABI says a failed import leaves the policy freshly initialised.
        return inst, str(exc)
    return inst, None


def _close_result(future: concurrent.futures.Future) -> None:
    """Close an instance that finished building after its WasmPolicy was closed."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()
