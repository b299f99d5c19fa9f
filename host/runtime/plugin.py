"""WasmPolicy: a policy module as a scheduler plugin (epick.interfaces) — the adapter.

One job: turn the framework's calls into ABI calls and judge what comes back. It
implements the plugin protocols (score, filter, pre_request, post_response), encodes
their inputs, delivers snapshots and checks outputs; whether a call may reach the
instance, and which instance that is, is its :class:`~epick.runtime.supervisor.Supervisor`'s
business (breakers, recovery, spares), and the last good state its
:class:`~epick.runtime.checkpoints.Checkpoints`'.

- **Snapshot delivery.** If the module exports ``set_snapshot``, ``cycle.view.encoded``
  is delivered once per pool view (a new :class:`PoolView` object) and instance
  before the first score/filter on it, and ``ScoreInput.snapshot`` is nil; otherwise
  every call carries the snapshot inline (``cycle.score_input(..., inline_snapshot=True)``).
- **Failures** become ``PluginError(plugin, stage, kind, reason)``, ``kind``
  one of ``error`` (non-zero return), ``trap``, ``timeout`` (the wall-clock backstop),
  ``out-of-fuel``, ``invalid-output`` (NaN, inf, wrong count, bad keep byte),
  ``circuit-open`` and ``recovering`` (the instance is being re-created). Scores
  outside [0, 1] are clamped, not errors, and counted in ``stats.out_of_range``.
- **Timeouts are retried once, inline recovery only.** The backstop is wall-clock
  time, so a thread preempted mid-call can overrun it without the guest being slow; a
  timed-out call is re-run once on the re-created instance (``stats.timeout_retries``).
  With background recovery there is no instance to retry on yet: the call fails and the
  policy sits out until its new instance is ready. Running out of fuel is
  deterministic and never retried.
- **Checkpoints** are taken after a successful hook (``checkpoint_on_hooks``) or when
  the owner calls :meth:`WasmPolicy.checkpoint` (the service does, from a background
  task, so no request waits for an export).
- **Stats** in :attr:`WasmPolicy.stats` (:class:`PolicyStats`).

Threading: like its instance, a WasmPolicy is used by one thread at a time (the
scheduler's). ``export_state``/``import_state``/``describe`` are control-plane calls and
raise :class:`PolicyError` subclasses, not ``PluginError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import compress
from typing import Any

import numpy as np

from epick import abi
from epick.interfaces import Capabilities, Cycle, PluginError
from epick.runtime import frame as _frames
from epick.runtime import scoreall as _scoreall
from epick.runtime.checkpoints import Checkpoints
from epick.runtime.errors import PolicyError, PolicyOutputError, PolicyTimeout
from epick.runtime.instance import PolicyInstance
from epick.runtime.module import PolicyModule
from epick.runtime.stats import PolicyStats
from epick.runtime.supervisor import Recovering, Supervisor, _rlog, error_kind, new_breaker

__all__ = ["WasmPolicy", "error_kind", "capabilities_of", "pre_request_all"]

_encode = abi.encoder.encode
_perf_ns = time.perf_counter_ns
_EMPTY = np.empty(0, dtype=np.float64)


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
    thread instead of inside the failing call. ``checkpoint_interval_s`` is the least
    gap between two captures of the last good state.
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
        self.name = name or mod.name
        exports = mod.exports
        #: What it implements, from its exports: declared once, checked at install.
        #: score() returns finite values clamped to [0, 1], so the scheduler need not
        #: clamp again (SCORES_IN_RANGE).
        self.capabilities = capabilities_of(exports)
        self.has_state = Capabilities.STATE in self.capabilities
        self._resident = "set_snapshot" in exports
        #: ABI v2: score frames, and pre_request carried by the next score/filter call.
        self._v2 = getattr(mod, "abi_version", 1) >= 2
        self._carries = self._v2 and "pre_request" in exports and (
            "score" in exports or "filter" in exports)
        self._now_ms = now_ms
        self._checkpoint_on_hooks = checkpoint_on_hooks
        self.stats = PolicyStats(stats_window)
        self.checkpoints = Checkpoints(
            enabled=self.has_state, clock=clock, interval_s=checkpoint_interval_s,
            breaker=new_breaker(mod.runtime.limits, clock), stats=self.stats)
        self.supervisor = Supervisor(
            mod, dict(params or {}), name=self.name, clock=clock, stats=self.stats,
            checkpoints=self.checkpoints, background=background_recovery)
        # The instance and PoolView last delivered with set_snapshot (resident mode).
        self._fed_inst: object = None
        self._fed_view: object = None
        # Read on every score: a closed breaker needs no admit() call.
        self._score_breaker = self.supervisor.breaker("score")
        self._hook_breakers = {stage: self.supervisor.breaker(stage)
                               for stage in ("pre_request", "post_response")}
        self._pre_breaker = self._hook_breakers["pre_request"]
        #: The scheduler's one call for all of a pick's scorers when every one has it
        #: (epick.interfaces.plugins, "score_group"): the native loop. Not for a subclass
        #: that overrides score: the loop would bypass it.
        self.score_group = (_scoreall.score_all if type(self).score is WasmPolicy.score
                            else None)
        #: The same for the pre_request hooks of a pick (epick.interfaces.plugins,
        #: "pre_request_group"): :func:`pre_request_all`. Not for a subclass that
        #: overrides pre_request.
        self.pre_request_group = (pre_request_all
                                  if type(self).pre_request is WasmPolicy.pre_request
                                  else None)

    def __repr__(self) -> str:
        return f"<WasmPolicy {self.name!r} module={self.module.name!r} breaker={self.breaker_state}>"

    @property
    def params(self) -> dict[str, Any]:
        """The params every (re-created) instance is ``init``-ed with."""
        return self.supervisor.params

    @params.setter
    def params(self, value: dict[str, Any]) -> None:
        self.supervisor.params = value

    @property
    def breaker_state(self) -> str:
        """The policy's one state: ``closed``, ``open`` or ``half-open`` (the supervisor's)."""
        return self.supervisor.state

    @property
    def breaker_states(self) -> dict[str, str]:
        """Each stage's state (only the stages the module exports), plus checkpoints."""
        out = self.supervisor.states
        if self.has_state:
            out["checkpoint"] = self.checkpoints.breaker.state
        return out

    @property
    def breaker_opens(self) -> int:
        """How often any of this policy's breakers opened."""
        return self.supervisor.opens + self.checkpoints.breaker.opens

    @property
    def recovering(self) -> bool:
        """The instance is being re-created (calls fail with ``recovering``)."""
        return self.supervisor.recovering

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: the instance is released, calls raise RuntimeError."""
        return self.supervisor.closed

    @property
    def spare_ready(self) -> bool:
        """A warm spare instance is built and waiting (background recovery only)."""
        return self.supervisor.spare_ready

    # -- framework extension points -----------------------------------------------------

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        """One score per candidate, finite, clamped to [0, 1] (``PluginError`` on failure)."""
        n = len(candidates)
        if n == 0:
            return _EMPTY.copy()
        sup = self.supervisor
        breaker = self._score_breaker
        if breaker.state != "closed":
            sup.admit("score")
        t0 = _perf_ns()
        # The lean path, inlined (_score_once is the same, for the retry): every call of
        # every pick runs it, and each Python call layer costs about as much as a check.
        try:
            inst = sup.live()
            if self._resident:
                view = cycle.view
                if view is not self._fed_view or inst is not self._fed_inst:
                    self._feed(inst, view)
            if self._v2:
                scores, in_range = inst.score_frame(
                    _frames.frame_for(cycle, candidates, inline_snapshot=not self._resident), n)
                if inst.deferred_failure is not None:
                    self._deferred_failed(inst, t0)
            else:
                blob = cycle.score_input(candidates, inline_snapshot=not self._resident)
                scores, in_range = inst.score_checked(blob, n)
        except PolicyTimeout as exc:
            scores, in_range = self._retry("score", exc, t0, self._score_once, cycle, candidates, n)
        except PolicyError as exc:
            raise sup.failed("score", exc, t0) from exc
        except Recovering as exc:
            raise sup.skipped("score", exc) from None
        if not in_range:
            self._judge(scores, t0)
        self.stats.succeeded(_perf_ns() - t0)
        breaker.success()
        return scores

    def _judge(self, scores: np.ndarray, t0: int) -> None:
        """Scores not all in [0, 1]: a non-finite one fails the call, the rest are
        clamped in place (and counted)."""
        finite = np.isfinite(scores)
        if not finite.all():
            bad = int(np.argmin(finite))
            exc = PolicyOutputError(
                self.name, "score", f"score {float(scores[bad])!r} for candidate {bad} is not finite"
            )
            raise self.supervisor.failed("score", exc, t0) from None
        self.stats.out_of_range += int(np.count_nonzero((scores < 0.0) | (scores > 1.0)))
        np.clip(scores, 0.0, 1.0, out=scores)

    def native_finish(self, inst: PolicyInstance, code: int, aux: int, event: bytes | None,
                      size: int, n: int, t0: int, cycle: Cycle,
                      candidates: tuple[int, ...]) -> np.ndarray:
        """Finish a score call :func:`epick.runtime.scoreall.score_all` made that did not
        come back clean, as :meth:`score` does after its call (the same exceptions,
        retry, breaker outcome, stats and clamping); ``PluginError`` on failure."""
        sup = self.supervisor
        try:
            scores, in_range = inst.native_score_finish(code, aux, event, size, n)
            if inst.deferred_failure is not None:
                self._deferred_failed(inst, t0)
        except PolicyTimeout as exc:
            scores, in_range = self._retry("score", exc, t0, self._score_once, cycle, candidates, n)
        except PolicyError as exc:
            raise sup.failed("score", exc, t0) from exc
        if not in_range:
            self._judge(scores, t0)
        self.stats.succeeded(_perf_ns() - t0)
        self._score_breaker.success()
        return scores

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """The kept subset of ``candidates``, in order (``PluginError`` on failure)."""
        n = len(candidates)
        if n == 0:
            return ()
        sup = self.supervisor
        sup.admit("filter")
        t0 = _perf_ns()
        try:
            keep = self._filter_once(cycle, candidates, n)
        except PolicyTimeout as exc:
            keep = self._retry("filter", exc, t0, self._filter_once, cycle, candidates, n)
        except PolicyError as exc:
            raise sup.failed("filter", exc, t0) from exc
        except Recovering as exc:
            raise sup.skipped("filter", exc) from None
        sup.succeeded("filter", t0)
        return tuple(compress(candidates, keep.tolist()))

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        """Tell the policy ``endpoint`` was picked for ``cycle.request`` (stamped with the
        cycle's ``now_ms``, else ``now_ms()``)."""
        blob = cycle.pre_request_input(endpoint, cycle.now_ms or self._now_ms())
        # _hook's lean path, inlined for the hook every pick runs (one call layer less).
        breaker = self._pre_breaker
        if breaker.state != "closed":
            self._hook("pre_request", blob)
            return
        sup = self.supervisor
        t0 = _perf_ns()
        try:
            inst = sup.live()
            if self._carries:
                # ABI v2: the event rides on the next score/filter call (or is flushed by
                # its own call before anything else reaches the instance); a failure is
                # reported then. No guest call here, so nothing to time; the state counts
                # as changed for the checkpoints, as before.
                inst.defer_pre_request(blob)
                breaker.success()
                if inst.deferred_failure is not None:  # an older event, flushed
                    self._deferred_failed(inst, t0)
                self.checkpoints.changed()
                if self._checkpoint_on_hooks:
                    self._maybe_checkpoint()
                return
            inst.pre_request(blob)
        except PolicyTimeout as exc:
            self._retry("pre_request", exc, t0, self._hook_once, "pre_request", blob)
        except PolicyError as exc:
            raise sup.failed("pre_request", exc, t0) from exc
        except Recovering as exc:
            raise sup.skipped("pre_request", exc) from None
        self.stats.succeeded(_perf_ns() - t0)
        breaker.success()
        self.checkpoints.changed()
        if self._checkpoint_on_hooks:
            self._maybe_checkpoint()

    def post_response(self, event: abi.PostResponseEvent) -> None:
        """Tell the policy a request finished."""
        self._hook("post_response", _encode(event))

    # -- control plane (hot swap, admin) ------------------------------------------------

    def describe(self) -> abi.Describe:
        return self.supervisor.control(lambda inst: inst.describe())

    def export_state(self) -> bytes | None:
        """The policy's state, or ``None`` if the module has no ``export_state``."""
        if not self.has_state:
            return None
        return self.supervisor.control(lambda inst: inst.export_state())

    def import_state(self, blob: bytes) -> None:
        """Load state from ``export_state`` (this or another version of the policy).

        It also becomes the state restored after a crash.
        """
        if not self.has_state:
            raise PolicyError(self.name, "import_state", "does not export 'import_state'")
        self.supervisor.control(lambda inst: inst.import_state(blob))
        self.checkpoints.adopt(blob)

    def checkpoint(self, *, force: bool = False) -> None:
        """Capture the last good state now if it is due (interval passed, state changed).

        For owners that pass ``checkpoint_on_hooks=False`` to keep the export off the
        request path: the service calls this from a background task once a second.
        ``force`` captures now, due or not (a replay mirroring a live checkpoint).
        """
        if force:
            self.checkpoints.force()
        self._maybe_checkpoint()

    def recover(self) -> None:
        """Re-create the instance from the last good state now, as a trap does (a replay
        mirroring a live recovery)."""
        self.supervisor.recover()

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait for a background rebuild to finish (tests, tools); True if live now."""
        return self.supervisor.wait_recovered(timeout)

    def close(self) -> None:
        """Release the instance now (and one still being rebuilt, once it is); the
        plugin is unusable after (``RuntimeError``). Idempotent."""
        self.supervisor.close()
        self.checkpoints.clear()

    # -- internals ----------------------------------------------------------------------

    def _feed(self, inst: PolicyInstance, view: Any) -> None:
        """Deliver ``view``'s snapshot to ``inst`` (resident mode: a new view or instance)."""
        inst.set_snapshot(view.encoded)
        self._fed_inst, self._fed_view = inst, view

    def _score_input(self, inst: PolicyInstance, cycle: Cycle, candidates: tuple[int, ...]) -> bytes:
        """The msgpack ScoreInput (version 1) or the score frame (version 2) for ``inst``,
        its snapshot delivered first when resident."""
        if self._resident:
            view = cycle.view
            if view is not self._fed_view or inst is not self._fed_inst:  # a new snapshot, or instance
                self._feed(inst, view)
        if self._v2:
            return _frames.frame_for(cycle, candidates, inline_snapshot=not self._resident)
        return cycle.score_input(candidates, inline_snapshot=not self._resident)

    def _score_once(self, cycle: Cycle, candidates: tuple[int, ...], n: int) -> tuple[np.ndarray, bool]:
        inst = self.supervisor.live()
        blob = self._score_input(inst, cycle, candidates)
        if not self._v2:
            return inst.score_checked(blob, n)
        got = inst.score_frame(blob, n)
        if inst.deferred_failure is not None:
            self._deferred_failed(inst, _perf_ns())
        return got

    def _filter_once(self, cycle: Cycle, candidates: tuple[int, ...], n: int) -> np.ndarray:
        inst = self.supervisor.live()
        blob = self._score_input(inst, cycle, candidates)
        if not self._v2:
            return inst.filter(blob, n)
        keep = inst.filter_frame(blob, n)
        if inst.deferred_failure is not None:
            self._deferred_failed(inst, _perf_ns())
        return keep

    def _deferred_failed(self, inst: PolicyInstance, t0: int) -> None:
        """Report a carried (or flushed) pre_request event's failure as that stage's: its
        breaker and stats count it and it is logged; the call it rode on stands."""
        exc = inst.take_deferred_failure()
        if exc is None:
            return
        err = self.supervisor.failed("pre_request", exc, t0)
        _rlog.warning((self.name, "pre_request", err.kind), "%s", err)

    def _hook_once(self, stage: str, blob: bytes) -> None:
        inst = self.supervisor.live()
        if stage == "pre_request":
            if self._carries:
                inst.defer_pre_request(blob)
            else:
                inst.pre_request(blob)
        else:
            inst.post_response(blob)
            if inst.deferred_failure is not None:  # the pending event, flushed first
                self._deferred_failed(inst, _perf_ns())

    def _hook(self, stage: str, blob: bytes) -> None:
        sup = self.supervisor
        breaker = self._hook_breakers[stage]
        if breaker.state != "closed":
            sup.admit(stage)
        t0 = _perf_ns()
        try:
            self._hook_once(stage, blob)
        except PolicyTimeout as exc:
            self._retry(stage, exc, t0, self._hook_once, stage, blob)
        except PolicyError as exc:
            raise sup.failed(stage, exc, t0) from exc
        except Recovering as exc:
            raise sup.skipped(stage, exc) from None
        self.stats.succeeded(_perf_ns() - t0)
        breaker.success()
        self.checkpoints.changed()
        if self._checkpoint_on_hooks:
            self._maybe_checkpoint()

    def _retry(self, stage: str, first: PolicyTimeout, t0: int, once: Callable[..., Any], *args: Any) -> Any:
        """Re-run a timed-out call once on a re-created instance (see module docstring)."""
        sup = self.supervisor
        if sup.background:  # no instance to retry on before the rebuild is done
            raise sup.failed(stage, first, t0) from first
        self.stats.timeout_retries += 1
        sup.recover()
        try:
            return once(*args)
        except PolicyError as exc:
            raise sup.failed(stage, exc, t0) from exc

    def _maybe_checkpoint(self) -> None:
        try:
            self.checkpoints.capture(self.supervisor.instance)
        except PolicyError as exc:
            self.supervisor.checkpoint_failed(exc)


#: Per tuple of pre_request entries (by id, checked by identity): what each hook reads.
_pre_plans: dict[int, tuple] = {}


def pre_request_all(cycle: Cycle, entries: tuple, endpoint: str,
                    failed: Callable[..., None], *args: Any) -> None:
    """Every entry's :meth:`WasmPolicy.pre_request` for one pick, in order (the
    scheduler's one call when all its pre_request policies are WasmPolicies): the same
    effects, without one Python call stack per policy.

    A policy whose event is deferred as usual (ABI v2 carrying pre_request, the stage's
    breaker closed without failures, a live instance with no event or failure waiting,
    the cycle stamped with ``now_ms``) is handled here: its event is left for the next
    score call, the breaker counts a success, its checkpoints see a change, and a capture
    that is due runs as :meth:`WasmPolicy.pre_request` runs it. Any other policy's own
    :meth:`~WasmPolicy.pre_request` runs, in its place in the order; a
    :class:`PluginError` it raises goes to ``failed(exc, *args)``.
    """
    plan = _pre_plans.get(id(entries))
    if plan is None or plan[0] is not entries:
        if len(_pre_plans) >= 8:
            _pre_plans.clear()
        plan = _pre_plans[id(entries)] = (entries, tuple(
            (e.plugin, e.plugin._carries, e.plugin._pre_breaker, e.plugin.supervisor,
             e.plugin.checkpoints, e.plugin._checkpoint_on_hooks) for e in entries))
    now = cycle.now_ms
    blob = cycle.pre_request_input(endpoint, now) if now else None
    for p, carries, breaker, sup, cps, on_hooks in plan[1]:
        inst = sup._inst
        if (blob is None or not carries or inst is None or breaker.state != "closed"
                or breaker.consecutive or inst._pending is not None
                or inst.deferred_failure is not None or inst._pre_request is None):
            try:
                p.pre_request(cycle, endpoint)
            except PluginError as exc:
                failed(exc, *args)
            continue
        # WasmPolicy.pre_request's deferred path, through the same public calls: what the
        # group saves is the blob encoded once and one call stack per policy.
        inst.defer_pre_request(blob)
        breaker.success()
        cps.changed()
        if on_hooks:
            p._maybe_checkpoint()
