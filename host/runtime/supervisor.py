"""The supervisor: whether a policy's calls may reach its instance, and a live instance.

One job: the policy's health, told one way everywhere (the error a call gets,
ListPolicies, metrics). It owns the instance and

- **judges outcomes** with one circuit breaker per stage (``score``, ``filter``,
  ``pre_request``, ``post_response``): after ``Limits.breaker_failures`` consecutive
  failures of that stage, or ``Limits.breaker_error_rate`` of its last
  ``Limits.breaker_window`` calls, its calls fail fast with ``circuit-open`` for
  ``Limits.breaker_cooldown_s``; then one trial call decides (half-open). A pre_request
  hook that always traps no longer rides on the good scores' successes.
- **recovers** after a trap, timeout or running out of fuel (the guest's state is
  suspect): the instance is re-created (fresh ``init`` with the same params), given the
  last good state (:class:`~epick.runtime.checkpoints.Checkpoints`). With
  ``background=True`` (the service) instances are built on the runtime's rebuild
  thread, never inside a pick: a warm spare (fresh, ``init``-ed) is kept ready and goes
  live at once, given the last good state when that is small (:data:`SPARE_STATE_BYTES`);
  otherwise the new instance is built with its state on that thread, and until it is
  ready every call fails fast with ``recovering``. An instance that dies again within a
  cooldown of its last rebuild is rebuilt after a doubling gap (:data:`REBUILD_MIN_GAP_S`
  up to the cooldown); a rebuild that fails is tried again one cooldown later. Without
  it, the instance is re-created at once, inline.

Counts go to the shared :class:`~epick.runtime.stats.PolicyStats`. Single-threaded,
like the instance it guards.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from epick.interfaces import PluginError
from epick.ratelog import RateLimitedLog
from epick.runtime.breaker import CircuitBreaker
from epick.runtime.checkpoints import Checkpoints
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

__all__ = ["Supervisor", "Recovering", "error_kind", "STAGES", "SUSPECT",
           "REBUILD_MIN_GAP_S", "SPARE_STATE_BYTES"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

#: First gap between two rebuilds of an instance that died again soon after the last.
REBUILD_MIN_GAP_S = 0.05
#: Largest last good state imported into the warm spare inside the failing call (a
#: bigger one is imported on the rebuild thread while the policy sits out).
SPARE_STATE_BYTES = 64 << 10
#: The stages with a breaker each (set_snapshot failures count for the call it preceded).
STAGES = ("score", "filter", "pre_request", "post_response")
#: Failures after which the guest's state is suspect: the instance is re-created.
SUSPECT = (PolicyTrap, PolicyTimeout, PolicyOutOfFuel)

_perf_ns = time.perf_counter_ns


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


class Recovering(Exception):
    """The instance is being re-created off the pick path; the call is skipped."""


class Supervisor:
    """Keeps a live instance of ``module`` (``init``-ed with ``params``) for the policy
    ``name``, and decides which calls reach it; see the module docstring."""

    def __init__(self, module: PolicyModule, params: dict[str, Any], *, name: str,
                 clock: Callable[[], float], stats: PolicyStats, checkpoints: Checkpoints,
                 background: bool) -> None:
        self.module = module
        self.params = params
        self.name = name
        self.stats = stats
        self.checkpoints = checkpoints
        self.background = background
        limits = module.runtime.limits
        self._inst: PolicyInstance | None = module.instantiate(params)
        self._breakers = {stage: new_breaker(limits, clock) for stage in STAGES}
        self._stages = tuple(s for s in STAGES if s in module.exports)
        self._cooldown_s = limits.breaker_cooldown_s
        self._clock = clock
        self._rebuild: concurrent.futures.Future | None = None
        self._spare: concurrent.futures.Future | None = None  # a warm, fresh instance
        self._rebuild_at = 0.0  # earliest clock() for the next rebuild attempt
        self._rebuild_gap = 0.0  # back-off between rebuilds of an instance that keeps dying
        self._last_rebuild = float("-inf")
        self._recovery_error = ""
        self.closed = False
        self._want_spare()

    # -- what it tells ------------------------------------------------------------------

    @property
    def instance(self) -> PolicyInstance | None:
        """The live instance; ``None`` while it is being re-created (or once closed)."""
        return self._inst

    @property
    def recovering(self) -> bool:
        """The instance is being re-created (calls fail with ``recovering``)."""
        return self._inst is None and not self.closed

    @property
    def state(self) -> str:
        """``closed`` when every stage's breaker is; else ``open`` if any is open, else
        ``half-open``."""
        states = {b.state for b in self._breakers.values()}
        if states == {"closed"}:
            return "closed"
        return "open" if "open" in states else "half-open"

    @property
    def states(self) -> dict[str, str]:
        """Each stage's breaker (only the stages the module exports)."""
        return {s: self._breakers[s].state for s in self._stages}

    @property
    def opens(self) -> int:
        """How often any of the stage breakers opened."""
        return sum(b.opens for b in self._breakers.values())

    @property
    def spare_ready(self) -> bool:
        """A warm spare instance is built and waiting (background recovery only)."""
        spare = self._spare
        return spare is not None and spare.done() and not spare.cancelled() \
            and spare.exception() is None

    # -- the request path ---------------------------------------------------------------

    def admit(self, stage: str) -> None:
        """Raise ``PluginError(circuit-open)`` if ``stage``'s breaker holds calls off."""
        breaker = self._breakers[stage]
        if breaker.state != "closed" and not breaker.allow():
            self.stats.failed("circuit-open")
            raise PluginError(
                self.name, stage, "circuit-open",
                f"{breaker.reason}; next trial in {breaker.retry_in_s:.1f} s",
            )

    def succeeded(self, stage: str, t0: int) -> None:
        """A call that started at ``t0`` (perf_counter_ns) succeeded."""
        self.stats.succeeded(_perf_ns() - t0)
        self._breakers[stage].success()

    def failed(self, stage: str, exc: PolicyError, t0: int) -> PluginError:
        """A call that started at ``t0`` failed with ``exc``: count it, re-create a
        suspect instance, and return the ``PluginError`` to raise."""
        breaker = self._breakers[stage]
        if exc.export == "set_snapshot":  # delivering the snapshot before score/filter
            stage = "set_snapshot"
        kind = error_kind(exc)
        self.stats.failed(kind, _perf_ns() - t0)
        breaker.failure()
        if isinstance(exc, SUSPECT):
            self.recover()
        return PluginError(self.name, stage, kind, exc.detail)

    def skipped(self, stage: str, exc: Recovering) -> PluginError:
        """A call while the instance is rebuilt: not the guest's failure (no breaker)."""
        self.stats.failed("recovering")
        return PluginError(self.name, stage, "recovering", str(exc))

    def checkpoint_failed(self, exc: PolicyError) -> None:
        """A checkpoint's export failed (the hook itself had succeeded)."""
        kind = error_kind(exc)
        self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1
        self.stats.errors += 1
        _rlog.warning(("export_state", self.name), "policy %r: export_state failed: %s",
                      self.name, exc)
        if isinstance(exc, SUSPECT):
            self.recover()

    def live(self) -> PolicyInstance:
        """The live instance: re-created inline if need be, or (background) the rebuilt
        one once ready, else :class:`Recovering`."""
        inst = self._inst
        if inst is None:
            if self.closed:
                raise RuntimeError(f"policy {self.name!r}: WasmPolicy is closed")
            if self.background:
                return self._adopt()
            self.recover()
            inst = self._inst
            if inst is None:
                raise PolicyError(
                    self.name, None, f"instance could not be re-created: {self._recovery_error}"
                )
        return inst

    def control(self, call: Callable[[PolicyInstance], Any]) -> Any:
        """A control-plane call: PolicyError propagates, but a trap still re-creates."""
        try:
            inst = self.live()
        except Recovering as exc:
            raise PolicyError(self.name, None, str(exc)) from None
        try:
            return call(inst)
        except SUSPECT:
            self.recover()
            raise

    # -- recovery -----------------------------------------------------------------------

    def recover(self) -> None:
        """Replace the instance with a fresh one holding the last good state (at once,
        or on the rebuild thread with ``background``)."""
        old, self._inst = self._inst, None
        if old is not None:
            old.close()
        if self.closed:
            return
        if self.background:
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
        self._restore(inst)
        self._inst = inst
        self.stats.recoveries += 1
        _rlog.warning(("recovered", self.name), "policy %r: instance re-created after a failure",
                      self.name)

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait for a background rebuild to finish (tests, tools); True if live now."""
        pending = self._rebuild
        if pending is not None:
            concurrent.futures.wait([pending], timeout=timeout)
        try:
            self.live()
        except (PolicyError, Recovering):
            return False
        return True

    def close(self) -> None:
        """Release the instance now (and one still being built, once it is). Idempotent."""
        self.closed = True
        if self._inst is not None:
            self._inst.close()
        self._inst = None
        for attr in ("_rebuild", "_spare"):
            pending = getattr(self, attr)
            setattr(self, attr, None)
            if pending is not None and not pending.cancel():
                pending.add_done_callback(_close_result)

    def _restore(self, inst: PolicyInstance) -> None:
        state = self.checkpoints.good_state
        if state is None:
            return
        try:
            inst.import_state(state)
        except PolicyError as exc:
            # The ABI says a failed import leaves the policy freshly initialised.
            _rlog.warning(("restore", self.name),
                          "policy %r: last good state not restored: %s", self.name, exc)

    def _want_spare(self) -> None:
        """Build a fresh spare instance on the rebuild thread, if none is on its way."""
        if self.background and not self.closed and self._spare is None:
            try:
                self._spare = self.module.runtime.submit(_build, self.module,
                                                         dict(self.params), None)
            except RuntimeError:  # closed runtime: recovery reports it
                self._spare = None

    def _take_spare(self) -> bool:
        """Go live on the warm spare at once, if it is ready and the last good state is
        small enough to import here (LoRA history: yes; a full prefix LRU: no, that
        import runs on the rebuild thread instead)."""
        spare, state = self._spare, self.checkpoints.good_state
        if spare is not None and spare.done() and (spare.cancelled() or spare.exception()):
            self._spare = None  # it could not be built: the rebuild will say why
            return False
        if not self.spare_ready or (state is not None and len(state) > SPARE_STATE_BYTES):
            return False
        inst = self._spare.result()[0]
        self._spare = None
        self._restore(inst)
        self._went_live(inst)
        return True

    def _went_live(self, inst: PolicyInstance) -> None:
        self._inst = inst
        self._recovery_error = ""
        self.stats.recoveries += 1
        self._want_spare()

    def _adopt(self) -> PolicyInstance:
        """The rebuilt instance if it is ready; else start/await a rebuild (``Recovering``)."""
        pending = self._rebuild
        if pending is None:
            if self._clock() < self._rebuild_at:
                wait = self._rebuild_at - self._clock()
                if self._recovery_error:
                    raise Recovering(f"instance could not be re-created "
                                     f"({self._recovery_error}); next try in {wait:.1f} s")
                raise Recovering(f"instance keeps failing; re-created again in {wait:.2f} s")
            self._start_rebuild()
            raise Recovering("instance is being re-created")
        if not pending.done():
            raise Recovering("instance is being re-created")
        self._rebuild = None
        try:
            inst, restored = pending.result()
        except Exception as exc:  # PolicyError; or the runtime closed under it, a host bug
            detail = exc.detail if isinstance(exc, PolicyError) else str(exc)
            self._rebuild_failed(detail)
            raise Recovering(f"instance could not be re-created: {detail}") from None
        if restored is not None:
            _rlog.warning(("restore", self.name), "policy %r: last good state not restored: %s",
                          self.name, restored)
        self._went_live(inst)
        return inst

    def _rebuild_failed(self, detail: str) -> None:
        self._recovery_error = detail
        self._rebuild_at = self._clock() + self._cooldown_s
        _rlog.error(("rebuild", self.name), "policy %r: cannot re-create the instance: %s",
                    self.name, detail)

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
                _build, self.module, dict(self.params), self.checkpoints.good_state)
        except RuntimeError as exc:  # closed runtime
            self._recovery_error = str(exc)
            self._rebuild_at = self._clock() + self._cooldown_s


def new_breaker(limits, clock: Callable[[], float]) -> CircuitBreaker:
    """A breaker on ``limits``' settings (stages and checkpoints alike)."""
    return CircuitBreaker(limits.breaker_failures, limits.breaker_cooldown_s, clock,
                          error_rate=limits.breaker_error_rate, window=limits.breaker_window)


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
    """Close an instance that finished building after its owner was closed."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()
