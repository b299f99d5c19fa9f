"""The supervisor: whether a policy's calls may reach its instance, and a live instance.

One job: the policy's health, told one way everywhere (the error a call gets,
ListPolicies, metrics): every way a policy is kept out of picks is a stage breaker that
is open, so ``state`` says ``open`` exactly when its calls do not reach the guest. It
owns the instance and

- **judges outcomes** with one circuit breaker per stage (``score``, ``filter``,
  ``pre_request``, ``post_response``): after ``Limits.breaker_failures`` consecutive
  failures of that stage, or ``Limits.breaker_error_rate`` of its last
  ``Limits.breaker_window`` calls, its calls fail fast with ``circuit-open`` for
  ``Limits.breaker_cooldown_s``; then one trial call decides (half-open). A pre_request
  hook that always traps no longer rides on the good scores' successes. The windows span
  instance re-creations: a module that fails every 2nd call is judged on all of them.
- **benches** a policy — opens every stage's breaker — when its failing calls took more
  than ``Limits.breaker_burn_ms`` of wall-clock time within one second (a failing call
  may burn all its fuel or its backstop, and holds a pick meanwhile), when its instance
  keeps dying, and when its instance cannot be re-created. After the bench each stage
  gets one trial call: a success closes it, a failure opens it for another cooldown.
- **recovers** after a trap, timeout or running out of fuel (the guest's state is
  suspect): the instance is re-created (fresh ``init`` with the same params), given the
  last good state (:class:`~epick.runtime.checkpoints.Checkpoints`). With
  ``background=True`` (the service) instances are built on the runtime's rebuild
  thread, never inside a pick: a warm spare (fresh, ``init``-ed) is kept ready and goes
  live at once, given the last good state when that is small (:data:`SPARE_STATE_BYTES`);
  otherwise the new instance is built with its state on that thread, and until it is
  ready every call fails fast with ``recovering`` (and the stages read ``open``). An
  instance that dies again within a cooldown of its last rebuild is benched for a
  doubling gap (:data:`REBUILD_MIN_GAP_S` up to the cooldown) and rebuilt after it; a
  rebuild that fails benches the policy for a cooldown, then is tried again. Without
  it, the instance is re-created at once, inline.

Counts go to the shared :class:`~epick.runtime.stats.PolicyStats`. Single-threaded,
like the instance it guards.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from epick.interfaces import PluginError
from epick.ratelog import RateLimitedLog
from epick.runtime.breaker import CircuitBreaker
from epick.runtime.checkpoints import Checkpoints
from epick.runtime.errors import (
    PolicyError,
    PolicyOutOfFuel,
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
#: The time burned in failing calls is judged over this many seconds.
BURN_WINDOW_S = 1.0
#: The stages with a breaker each (set_snapshot failures count for the call it preceded).
STAGES = ("score", "filter", "pre_request", "post_response")
#: Failures after which the guest's state is suspect: the instance is re-created.
SUSPECT = (PolicyTrap, PolicyTimeout, PolicyOutOfFuel)

_perf_ns = time.perf_counter_ns


def error_kind(exc: PolicyError) -> str:
    """The ``PluginError.kind`` for a runtime error: its own (each class names one)."""
    return exc.kind.value


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
        self._burn_budget_ns = int(limits.breaker_burn_ms * 1e6)
        self._burned: deque[tuple[float, int]] = deque()  # (clock(), ns) of recent failures
        self._burned_ns = 0
        self._bench_extra_opens = 0
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
        """The policy's one state: ``closed`` when every stage's calls reach the guest;
        else ``open`` if any stage's calls are held off (its breaker is open, or the
        instance is being re-created), else ``half-open`` (a trial is next)."""
        states = set(self.states.values())
        if states == {"closed"}:
            return "closed"
        return "open" if "open" in states else "half-open"

    @property
    def states(self) -> dict[str, str]:
        """Each exported stage's state as its calls meet it: its breaker's, but ``open``
        while the instance is being re-created (its calls are skipped), and
        ``half-open`` once an open breaker cooled down (its next call is the trial)."""
        rebuilding = self.recovering
        out = {}
        for s in self._stages:
            breaker = self._breakers[s]
            state = breaker.state
            if rebuilding and state == "closed":
                state = "open"
            elif state == "open" and breaker.ready:  # cooled down: the next call is a trial
                state = "half-open"
            out[s] = state
        return out

    @property
    def retry_in_s(self) -> float:
        """Seconds until the first held-off stage lets a trial through (0: none held)."""
        waits = [self._breakers[s].retry_in_s for s in self._stages
                 if self._breakers[s].state != "closed"]
        return min(waits, default=0.0)

    @property
    def reason(self) -> str:
        """Why the policy is not ``closed`` (empty when it is)."""
        for s in self._stages:
            breaker = self._breakers[s]
            if breaker.state != "closed":
                return f"{s}: {breaker.reason}"
        if self.recovering:
            return "instance is being re-created"
        return ""

    @property
    def opens(self) -> int:
        """How often the policy's calls were held off: a stage breaker opened, or the
        policy was benched (all of them at once: one opening)."""
        return sum(b.opens for b in self._breakers.values()) - self._bench_extra_opens

    @property
    def spare_ready(self) -> bool:
        """A warm spare instance is built and waiting (background recovery only)."""
        spare = self._spare
        return spare is not None and spare.done() and not spare.cancelled() \
            and spare.exception() is None

    # -- the request path ---------------------------------------------------------------

    def breaker(self, stage: str) -> CircuitBreaker:
        """``stage``'s breaker (the same object for the supervisor's lifetime): a caller on
        the request path may skip :meth:`admit` while its state is ``closed``, and record
        a success as :meth:`succeeded` does."""
        return self._breakers[stage]

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
        breaker.failure()
        if isinstance(exc, SUSPECT):
            self.recover()
        cost = _perf_ns() - t0  # an inline re-creation held the pick too
        self.stats.failed(kind, cost)
        self._burn(cost)
        return PluginError(self.name, stage, kind, exc.detail)

    def skipped(self, stage: str, exc: Recovering) -> PluginError:
        """A call while the instance is rebuilt: not the guest's failure (no breaker
        outcome; a half-open stage's trial goes to the next call)."""
        self._breakers[stage].release()
        self.stats.failed("recovering")
        return PluginError(self.name, stage, "recovering", str(exc))

    def _burn(self, cost_ns: int) -> None:
        """Count a failing call's time; bench the policy once the last second's failing
        calls took more than the budget."""
        now = self._clock()
        burned = self._burned
        burned.append((now, cost_ns))
        self._burned_ns += cost_ns
        while burned[0][0] <= now - BURN_WINDOW_S:
            self._burned_ns -= burned.popleft()[1]
        if self._burned_ns > self._burn_budget_ns:
            spent, n = self._burned_ns / 1e6, len(burned)
            burned.clear()
            self._burned_ns = 0
            self.bench(f"{n} failing call{'s' if n > 1 else ''} took {spent:.0f} ms within "
                       f"{BURN_WINDOW_S:g} s, over the {self._burn_budget_ns / 1e6:g} ms budget",
                       self._cooldown_s)

    def bench(self, reason: str, seconds: float) -> None:
        """Hold every stage's calls off for ``seconds`` (then one trial each)."""
        opened = sum(self._breakers[s].trip(reason, seconds) for s in self._stages)
        self._bench_extra_opens += max(0, opened - 1)  # one bench is one opening
        _rlog.warning(("bench", self.name), "policy %r benched for %.2f s: %s",
                      self.name, seconds, reason)

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
        self.bench(f"instance could not be re-created ({detail})", self._cooldown_s)

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
            self.bench(f"instance keeps failing (died {now - self._last_rebuild:.2f} s after "
                       f"it was re-created)", self._rebuild_gap)
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
            self._rebuild_failed(str(exc))


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
