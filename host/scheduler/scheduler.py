"""The scheduler: runs one cycle per request through the extension points, one named
method per stage (as the llm-d router's scheduler profile does):

    _filter      host filters (fresh, awake, serves-model, subset, admission), then
                 filter policies: a failing one is skipped (fail open)
    _score       total = Σ weight × clamp(score, 0, 1); a failing scorer is skipped
    _pick        the picker: primary + fallbacks
    _shadow      shadow scorers, compared with the pick; they never change it
    _pre_request live and shadow policies record the pick

``complete()`` later runs ``_post_response``. Every plugin call goes through
``_guarded`` (a :class:`PluginError` is counted, logged at most once per 10 s per
policy, stage and kind, and the pick goes on without that policy); every stage of a
successful pick is timed into ``Recorder.stages``. Decisions wait for their completion
report in a :class:`~epick.scheduler.memory.DecisionMemory`. Everything here runs on the thread
that owns the scheduler (the service's event-loop thread): no locks, and a policy set
swap is one attribute assignment.

Collaborators are given, never swapped: the view source, the assignment counts, the KV
counts and the pool's scrape status to the constructor; a caller with its own (a replay
of the decision log) gives ``policies``, ``assignments`` and ``kv`` to one
:meth:`Scheduler.schedule` call.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import msgspec
import numpy as np

from epick import abi
from epick.abi import Criticality
from epick.interfaces import Cycle, KvCounts, Picker, PluginError, PoolView
from epick.ratelog import RateLimitedLog
from epick.scheduler import explain as explain_view
from epick.scheduler.assignments import Assignments, Ledger
from epick.scheduler.explain import CandidateScore
from epick.scheduler.filters import AdmissionFilter, AwakeFilter, FreshFilter, ServesModelFilter
from epick.scheduler.memory import DecisionMemory
from epick.scheduler.pickers import MaxScorePicker
from epick.scheduler.policyset import PolicySet

__all__ = [
    "Scheduler",
    "Decision",
    "CandidateScore",
    "SchedulingError",
    "Shed",
    "Unavailable",
    "Recorder",
]

log = logging.getLogger("epick.scheduler")


class SchedulingError(Exception):
    """No endpoint was picked. ``outcome`` is the metric label."""

    outcome = "error"


class Shed(SchedulingError):
    """A SHEDDABLE (or policy-filtered) request was refused to protect the pool."""

    outcome = "shed"


class Unavailable(SchedulingError):
    """No fresh, ready endpoint can serve the request."""

    outcome = "unavailable"


class Recorder(Protocol):
    """Where the scheduler reports what happened (Prometheus in the service)."""

    def policy_error(self, error: PluginError) -> None: ...
    def policy_latency(self, policy: str, seconds: float) -> None: ...
    def shadow(self, policy: str, agree: bool, delta: float) -> None: ...
    def stages(self, filter_s: float, score_s: float, pick_s: float, hooks_s: float) -> None:
        """One successful cycle's time per stage (hooks include the shadows)."""
    def completion(self, status: int, prompt_tokens: int | None,
                   completion_tokens: int | None, ttft_s: float | None) -> None:
        """A known decision completed, with what the gateway measured (None = unknown)."""


class DecisionSink(Protocol):
    """Records decisions and completions (``epick.decisions.DecisionLog``); must not block."""

    def decision(self, decision: Decision, cycle: Cycle, policies: PolicySet,
                 candidates: tuple[int, ...], scores: dict[str, np.ndarray],
                 shadow_scores: dict[str, np.ndarray], picked: list[int]) -> None: ...
    def completion(self, decision_id: str, event: abi.PostResponseEvent, endpoint: str,
                   prompt_tokens: int | None, completion_tokens: int | None,
                   ttft_s: float | None) -> None: ...


class _NullRecorder:
    def policy_error(self, error: PluginError) -> None:
        pass

    def policy_latency(self, policy: str, seconds: float) -> None:
        pass

    def shadow(self, policy: str, agree: bool, delta: float) -> None:
        pass

    def stages(self, filter_s: float, score_s: float, pick_s: float, hooks_s: float) -> None:
        pass

    def completion(self, status, prompt_tokens, completion_tokens, ttft_s) -> None:
        pass


class Decision(msgspec.Struct):
    """One pick's answer. (A struct, not a dataclass: made once per pick, and a
    dataclass's ``__init__`` is a Python call, several times the cost.)"""

    decision_id: str
    endpoint: str
    fallbacks: list[str]
    snapshot_version: int
    explanation: list[CandidateScore] | None = None
    skipped: list[str] = msgspec.field(default_factory=list)
    """``policy: reason`` for each policy that failed on this request."""


class Scheduler:
    """Picks endpoints for requests; owns the live :class:`PolicySet`.

    Parameters
    ----------
    view:
        Returns the current :class:`PoolView` (an attribute read, not a rebuild).
    policies:
        The initial policy set; replace ``scheduler.policies`` to swap atomically.
    assignments:
        What the host has sent where (:class:`Assignments`, the default: a new one); the
        pool's good scrapes reset it, so the service builds it and gives it to both.
    kv:
        Per-candidate KV block counts from the engines' events (``epick.kv.KvRouting``);
        ``None`` = KV events off.
    pool_status:
        The pool's per-endpoint scrape status (``Pool.status``): lets an explanation
        show endpoints that are not in the view, and why (only ``explain`` reads it).
    fallbacks:
        How many endpoints to return after the primary.
    """

    def __init__(
        self,
        view: Callable[[], PoolView],
        policies: PolicySet = PolicySet(),
        *,
        assignments: Ledger | None = None,
        kv: KvCounts | None = None,
        pool_status: Callable[[], Sequence] | None = None,
        fallbacks: int = 2,
        admission: AdmissionFilter = AdmissionFilter(),
        picker: Picker | None = None,
        work_conserving: bool = True,
        recorder: Recorder | None = None,
        decision_ttl_s: float = 600.0,
        max_decisions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._view = view
        self.policies = policies
        self.fallbacks = fallbacks
        self.host_filters = (FreshFilter(), AwakeFilter(), ServesModelFilter())
        self.admission = admission
        self.picker = picker or MaxScorePicker()
        self.work_conserving = work_conserving
        self.recorder = recorder or _NullRecorder()
        self._wall_clock = wall_clock
        self.assignments: Ledger = assignments if assignments is not None else Assignments()
        self.memory = DecisionMemory(ttl_s=decision_ttl_s, max_decisions=max_decisions,
                                     clock=clock, on_expire=self.assignments.completed)
        self.pool_status = pool_status
        self.kv = kv
        # A failing policy fails on every pick: one line per (policy, stage, kind) per 10 s.
        self._rlog = RateLimitedLog(log)
        #: Where decisions and completions are recorded (``epick.decisions.DecisionLog``);
        #: ``None`` = not recorded. Its methods only enqueue: they never block a pick.
        self.decision_log: DecisionSink | None = None
        # [picks scored, picks agreeing] per shadow plugin: a new plugin (a new load of
        # the policy) starts from zero, a dropped one is forgotten with it.
        self._shadow_tally: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The endpoints with nothing running or waiting, for the last snapshot's endpoints
        # (held, so the identity check cannot meet a recycled id).
        self._idle_of: object = None
        self._idle_set: frozenset[int] = frozenset()
        # The host filters' answers for the last view, per (model, adapter) (_host_kept).
        self._kept_view: object = None
        self._kept: dict[tuple[str, str], tuple[int, ...]] = {}

    @property
    def decision_ttl_s(self) -> float:
        return self.memory.ttl_s

    @property
    def pending_decisions(self) -> int:
        return len(self.memory)

    def shadow_agreement(self, plugin: object) -> float:
        """The share of picks on which shadow ``plugin`` would have picked the live
        endpoint (0.0 before it has scored one)."""
        calls, agree = self._shadow_tally.get(plugin, (0, 0))
        return agree / calls if calls else 0.0

    # -- the cycle -----------------------------------------------------------------

    def schedule(self, request: abi.Request, *, explain: bool = False,
                 subset: Collection[str] | None = None, pin: str = "",
                 policies: PolicySet | None = None, assignments: Ledger | None = None,
                 kv: KvCounts | None = None) -> Decision:
        """Pick an endpoint for ``request``; raise :class:`Shed` or :class:`Unavailable`.

        ``request.seed`` drives every random choice (the API layer fills a random one
        when the gateway sent none), so the same request on the same snapshot and
        policy state gives the same answer.

        ``subset`` (a data plane's hint: ``host:port`` or bare ``host`` entries) keeps
        only those endpoints; none of them eligible is :class:`Unavailable`. ``pin``
        forces one endpoint (``host:port``): it must be fresh and serve the model, or the
        pick is :class:`Unavailable` — never silently replaced; admission and policy
        filters do not apply to it, and it has no fallbacks.

        ``policies``, ``assignments`` and ``kv`` replace the scheduler's own for this pick
        only (``None``: its own); a replay gives what the log recorded.
        """
        perf = time.perf_counter
        t_start = perf()
        view = self._view()
        if policies is None:
            policies = self.policies  # one read: a concurrent swap cannot split this pick
        if assignments is None:
            assignments = self.assignments
        cycle = Cycle(view=view, request=request, assignments=assignments,
                      now_ms=int(self._wall_clock() * 1000),
                      kv=kv if kv is not None else self.kv)
        sink = self.decision_log
        endpoints = view.snapshot.endpoints
        why: dict[int, str] | None = {} if explain else None
        skipped: list[str] = []

        candidates = self._filter(cycle, policies, why, skipped, subset=subset, pin=pin)
        t_filtered = perf()
        totals, per_policy = self._score(cycle, policies, candidates, skipped,
                                         keep=explain or sink is not None)
        t_scored = perf()
        # The picker called straight (Scheduler._pick is the same call, kept for callers).
        order = self.picker.pick(totals, 1 + self.fallbacks, request.seed)
        if self.work_conserving and not pin and endpoints[candidates[order[0]]].waiting:
            if endpoints is not self._idle_of:
                self._idle(endpoints)
            if self._idle_set:  # else no endpoint is idle: the rule has nothing to do
                order = _conserve_work(endpoints, self._idle_set, assignments, candidates,
                                       totals, order)
        endpoint = endpoints[candidates[order[0]]].address
        fallbacks = [endpoints[candidates[o]].address for o in order[1:]]
        t_picked = perf()
        # Shadows score before the hooks record this pick, so they judge the same state
        # the live policies did.
        shadow_scores = (self._shadow(cycle, policies, candidates, order[0])
                         if policies.shadows else {})
        self._pre_request(cycle, policies, endpoint, skipped)
        self.recorder.stages(t_filtered - t_start, t_scored - t_filtered,
                             t_picked - t_scored, perf() - t_picked)

        decision_id = self.memory.remember(request.request_id, request.model,
                                           request.adapter, endpoint)
        assignments.picked(endpoint)
        decision = Decision(decision_id, endpoint, fallbacks, view.snapshot.version,
                            None, skipped)
        if sink is not None:
            sink.decision(decision, cycle, policies, candidates, per_policy, shadow_scores,
                          [candidates[o] for o in order])
        if explain:
            decision.explanation = self._explain(cycle, assignments, candidates, totals,
                                                 per_policy, order, why or {}, shadow_scores)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision %s request=%s model=%s adapter=%s -> %s fallbacks=%s snapshot=%d",
                decision.decision_id, request.request_id, request.model, request.adapter,
                endpoint, decision.fallbacks, view.version,
            )
        return decision

    def current_view(self) -> PoolView:
        """The pool's view a pick made now would read (for readers beside the picks, such
        as the weights hub)."""
        return self._view()

    def weigh(self, request: abi.Request) -> tuple[PoolView, tuple[int, ...], np.ndarray,
                                                   dict[int, str]]:
        """The filters and weighted scores :meth:`schedule` would compute for ``request``,
        without picking: ``(view, candidates, totals, why)`` (``why``: index -> the filter
        that removed it). For the weights stream (``epick.api.weights``).

        Side-effect free: no pick, no pre_request hooks or shadows, no decision
        remembered or logged, no in-flight count, no stage or policy-latency telemetry
        (a failing policy is still counted and skipped, as on a pick). Raises
        :class:`Shed` / :class:`Unavailable` as :meth:`schedule` would.
        """
        view = self._view()
        policies = self.policies
        cycle = Cycle(view=view, request=request, assignments=self.assignments,
                      now_ms=int(self._wall_clock() * 1000), kv=self.kv)
        why: dict[int, str] = {}
        skipped: list[str] = []
        candidates = self._filter(cycle, policies, why, skipped, subset=None, pin="")
        totals, _ = self._score(cycle, policies, candidates, skipped, keep=False,
                                timed=False)
        return view, candidates, totals, why

    def _idle(self, endpoints: Sequence[abi.EndpointMetrics]) -> frozenset[int]:
        """Indices of ``endpoints`` with nothing running and nothing waiting (computed
        once per snapshot: the work-conserving rule reads it on every pick whose primary
        has requests waiting)."""
        if endpoints is not self._idle_of:
            self._idle_set = frozenset(i for i, m in enumerate(endpoints)
                                       if not m.waiting and not m.running)
            self._idle_of = endpoints
        return self._idle_set

    def _host_kept(self, cycle: Cycle) -> tuple[int, ...]:
        """What the host filters keep of every endpoint. Fresh, awake and serves-model read
        only the snapshot and the request's (model, adapter), so their answer is kept per
        view and pair (at most :data:`_MAX_HOST_KEPT` pairs a view): a pick runs them once
        per new snapshot and pair, then finds the answer."""
        view = cycle.view
        if view is not self._kept_view:
            self._kept_view = view
            self._kept = {}
        request = cycle.request
        key = (request.model, request.adapter)
        kept = self._kept.get(key)
        if kept is None:
            kept = tuple(range(len(view.snapshot.endpoints)))
            for f in self.host_filters:
                kept = f.filter(cycle, kept)
            if len(self._kept) < _MAX_HOST_KEPT:
                self._kept[key] = kept
        return kept

    # -- the stages, in order ------------------------------------------------------------

    def _filter(self, cycle: Cycle, policies: PolicySet, why: dict[int, str] | None,
                skipped: list[str], *, subset: Collection[str] | None,
                pin: str) -> tuple[int, ...]:
        """Host filters, the subset hint, admission, then filter policies: the candidates.

        Raises :class:`Unavailable` when no endpoint can serve the request and
        :class:`Shed` when admission or a policy leaves none for a request that may be
        shed. A pinned endpoint passes the host filters only.
        """
        view, request = cycle.view, cycle.request
        if pin:
            return self._pinned(view, cycle, pin)
        if why is None:
            candidates = self._host_kept(cycle)
        else:
            candidates = tuple(range(len(view.snapshot.endpoints)))
            for f in self.host_filters:
                candidates = _apply(f.name, f.filter(cycle, candidates), candidates, why)
        if subset is not None:
            candidates = self._in_subset(view, candidates, subset, request, why)
        if not candidates:
            status = self.pool_status() if self.pool_status is not None else None
            raise Unavailable(explain_view.unavailable_reason(view, request)
                              + explain_view.scrape_errors(status))
        kept = self.admission.filter(cycle, candidates)
        candidates = kept if why is None else _apply(self.admission.name, kept, candidates,
                                                     why)
        if not candidates:
            raise Shed(
                "SHEDDABLE request shed: every endpoint is over the admission thresholds "
                f"(queue <= {self.admission.queue_threshold}, "
                f"kv <= {self.admission.kv_threshold})"
            )
        for entry in policies.filters:
            kept = self._guarded(entry, "filter", skipped, entry.plugin.filter, cycle,
                                 candidates)
            if kept is _FAILED:
                continue
            if not kept:
                if request.criticality == Criticality.CRITICAL:
                    continue  # critical requests are never shed by a policy
                raise Shed(f"policy {entry.name!r} filtered out every endpoint")
            candidates = _apply(entry.name, kept, candidates, why)
        return candidates

    def _score(self, cycle: Cycle, policies: PolicySet, candidates: tuple[int, ...],
               skipped: list[str], *, keep: bool,
               timed: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The weighted totals, and each scorer's scores when ``keep`` (explain, log);
        ``timed``: record each scorer's latency (picks only, not :meth:`weigh`)."""
        totals = None
        owned = False
        per_policy: dict[str, np.ndarray] = {}
        perf = time.perf_counter
        latency = self.recorder.policy_latency
        group = policies.score_group
        if group is not None:
            got = group(cycle, policies.scorers, candidates, keep)
            if got is not None:
                return self._score_grouped(policies.scorers, candidates, skipped, got,
                                           keep=keep, timed=timed)
        for entry in policies.scorers:
            t0 = perf()
            try:
                scores = entry.plugin.score(cycle, candidates)
            except PluginError as exc:
                self._plugin_failed(exc, skipped)
                continue
            if timed:
                latency(entry.name, perf() - t0)
            if not entry.scores_in_range:
                scores = np.clip(scores, 0.0, 1.0)
            totals, owned = _add_weighted(totals, owned, scores, entry.weight)
            if keep:
                per_policy[entry.name] = scores
        if totals is None:
            totals = np.zeros(len(candidates))
        elif not owned:  # one scorer of weight 1: its own array, which per_policy may hold
            totals = totals.copy()
        return totals, per_policy

    def _score_grouped(self, scorers, candidates, skipped, got, *, keep: bool,
                       timed: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """:meth:`_score` from a ``score_group`` answer: ``(totals, results, ns)``, per
        scorer its scores or its :class:`PluginError`; ``totals`` ``None`` when this loop
        sums (the same sums, in the same order, as the per-policy loop)."""
        totals, results, ns = got
        latency = self.recorder.policy_latency
        if results is None:  # all clean, summed, and nobody keeps the scores
            if timed:
                for entry, took in zip(scorers, ns):
                    latency(entry.name, took * 1e-9)
            return totals, {}
        per_policy: dict[str, np.ndarray] = {}
        summed = totals is None
        owned = False
        for entry, scores, took in zip(scorers, results, ns):
            if took is None:
                self._plugin_failed(scores, skipped)
                continue
            if timed:
                latency(entry.name, took * 1e-9)
            if keep:
                per_policy[entry.name] = scores
            if summed:
                totals, owned = _add_weighted(totals, owned, scores, entry.weight)
        if totals is None:
            totals = np.zeros(len(candidates))
        elif summed and not owned:
            totals = totals.copy()
        return totals, per_policy

    def _pick(self, request: abi.Request, totals: np.ndarray) -> list[int]:
        """Positions into the candidates: the primary, then the fallbacks."""
        return self.picker.pick(totals, 1 + self.fallbacks, request.seed)

    def _shadow(self, cycle: Cycle, policies: PolicySet, candidates: tuple[int, ...],
                live_pos: int) -> dict[str, np.ndarray]:
        """Each shadow scorer's scores, and whether it would have picked the same."""
        out: dict[str, np.ndarray] = {}
        for entry in policies.shadows:
            scores = self._guarded(entry, "score", None, entry.plugin.score, cycle,
                                   candidates)
            if scores is _FAILED:
                continue
            scores = np.clip(scores, 0.0, 1.0)
            best = int(np.argmax(scores))
            agree = bool(scores[live_pos] >= scores[best])
            tally = self._shadow_tally.setdefault(entry.plugin, [0, 0])
            tally[0] += 1
            tally[1] += agree
            self.recorder.shadow(entry.name, agree, float(scores[best] - scores[live_pos]))
            out[entry.name] = scores
        return out

    def _pre_request(self, cycle: Cycle, policies: PolicySet, endpoint: str,
                     skipped: list[str]) -> None:
        group = policies.pre_request_group
        if group is not None:
            group(cycle, policies.pre_request, endpoint, self._plugin_failed, skipped)
            return
        for entry in policies.pre_request:
            try:
                entry.plugin.pre_request(cycle, endpoint)
            except PluginError as exc:
                self._plugin_failed(exc, skipped)

    def _post_response(self, policies: PolicySet, event: abi.PostResponseEvent) -> None:
        for entry in policies.post_response:
            self._guarded(entry, "post_response", None, entry.plugin.post_response, event)

    def _guarded(self, entry, stage: str, skipped: list[str] | None, call, *args):
        """``call(*args)``, or :data:`_FAILED` when the plugin raised :class:`PluginError`
        (counted, logged rate-limited, and listed in ``skipped`` for live policies)."""
        try:
            return call(*args)
        except PluginError as exc:
            self._plugin_failed(exc, skipped)
            return _FAILED

    def _plugin_failed(self, exc: PluginError, skipped: list[str] | None) -> None:
        """What :meth:`_guarded` does with a failure (the score and hook loops call it
        inline: one Python call less per policy and pick)."""
        if skipped is not None:
            skipped.append(f"{exc.plugin}: {exc.kind}: {exc.reason}")
        self.recorder.policy_error(exc)
        self._rlog.warning((exc.plugin, exc.stage, exc.kind), "%s", exc)

    # -- helpers of the filter stage ----------------------------------------------------

    def _pinned(self, view: PoolView, cycle: Cycle, pin: str) -> tuple[int, ...]:
        index = next((i for i, e in enumerate(view.snapshot.endpoints) if e.address == pin),
                     None)
        if index is None:
            raise Unavailable(f"pinned endpoint {pin!r} is not in the pool (or has never "
                              "reported metrics)")
        if not view.info[index].fresh:
            raise Unavailable(f"pinned endpoint {pin!r} is not fresh (its metrics are stale)")
        for f in self.host_filters:
            if not f.filter(cycle, (index,)):
                raise Unavailable(f"pinned endpoint {pin!r} is refused by the {f.name!r} "
                                  "filter")
        return (index,)

    @staticmethod
    def _in_subset(view, candidates, subset, request, why) -> tuple[int, ...]:
        wanted = set(subset)
        eps = view.snapshot.endpoints
        kept = tuple(i for i in candidates
                     if eps[i].address in wanted or eps[i].address.rpartition(":")[0] in wanted)
        if why is not None:
            for i in set(candidates) - set(kept):
                why[i] = "subset-hint"
        if not kept:
            listed = ", ".join(sorted(wanted)[:8]) + (", ..." if len(wanted) > 8 else "")
            what = f"model {request.model!r}" + (
                f" with adapter {request.adapter!r}" if request.adapter else "")
            raise Unavailable(f"no endpoint in the subset hint [{listed}] is fresh and "
                              f"serves {what}")
        return kept

    def _explain(self, cycle, assignments, candidates, totals, per_policy, order, why,
                 shadow_scores) -> list[CandidateScore]:
        endpoints = cycle.view.snapshot.endpoints
        rows = explain_view.explain(endpoints, candidates, totals, per_policy, order, why,
                                    shadow_scores)
        # as the policies saw them: before this pick was counted
        in_flight, since = cycle.assigned(candidates)
        blocks, matched = cycle.kv_counts(candidates) if cycle.kv is not None else ((), ())
        seen = {endpoints[c].address: k for k, c in enumerate(candidates)}
        for row in rows:
            k = seen.get(row.endpoint)
            if k is None:
                row.in_flight = assignments.in_flight(row.endpoint)
                row.picked_since_scrape = assignments.picked_since_scrape(row.endpoint)
            else:
                row.in_flight = in_flight[k] if in_flight else 0
                row.picked_since_scrape = since[k] if since else 0
                if blocks:
                    row.prefix_blocks, row.prefix_matched = blocks[k], matched[k]
        if self.pool_status is not None:
            explain_view.add_scrape_reasons(rows, self.pool_status())
        return rows

    # -- completions -----------------------------------------------------------------

    def complete(
        self,
        *,
        decision_id: str = "",
        request_id: str = "",
        endpoint: str = "",
        status: int = abi.CompletionStatus.OK,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        ttft_s: float | None = None,
    ) -> bool:
        """Run the post_response hooks for a finished request; False if the id is unknown.

        Idempotent: a second report for the same decision is unknown and does nothing.
        What the gateway reports goes where it is true: token counts and TTFT to the
        recorder and the decision log, the endpoint that served (a fallback, if it failed
        over; empty when it did not say) to the decision log. The hooks' event and the
        in-flight count name the endpoint that was picked: the one whose history
        (pre_request) and count the pick raised, so a fail-over cannot leave them raised.
        """
        found = self.memory.take(decision_id, request_id)
        if found is None:
            return False
        decision_id, rec = found
        self.assignments.completed(rec.endpoint)
        event = abi.PostResponseEvent(
            request_id=rec.request_id,
            adapter=rec.adapter,
            endpoint=rec.endpoint,
            status=int(status),
            timestamp_ms=int(self._wall_clock() * 1000),
            model=rec.model,
            ttft_ms=ttft_s * 1000.0 if ttft_s is not None and ttft_s >= 0 else -1.0,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else -1,
            completion_tokens=completion_tokens if completion_tokens is not None else -1,
        )
        self._post_response(self.policies, event)
        self.recorder.completion(int(status), prompt_tokens, completion_tokens, ttft_s)
        if self.decision_log is not None:
            self.decision_log.completion(decision_id, event, endpoint, prompt_tokens,
                                      completion_tokens, ttft_s)
        return True


#: (model, adapter) pairs whose host-filter answer a view keeps (requests name what they
#: like; memory must not grow with them).
_MAX_HOST_KEPT = 1024

#: What :meth:`Scheduler._guarded` returns for a plugin call that failed.
_FAILED = object()


def _apply(name: str, kept: tuple[int, ...], candidates: tuple[int, ...],
           why: dict[int, str] | None) -> tuple[int, ...]:
    """``kept``, noting in ``why`` (explain only) which filter dropped the others."""
    if why is not None and len(kept) != len(candidates):
        kept_set = set(kept)
        for i in candidates:
            if i not in kept_set:
                why[i] = name
    return kept


def _conserve_work(endpoints, idle: frozenset[int], assignments: Ledger,
                   candidates: tuple[int, ...], totals: np.ndarray,
                   order: list[int]) -> list[int]:
    """The host's work-conserving rule: never send a request to a replica that has
    requests waiting while an eligible one is idle (nothing running, nothing waiting,
    nothing epick sent it in flight or since its last scrape). Then the best-scored idle
    candidate goes first and the rest keep their order.

    Affinity may concentrate work at light load, but not leave capacity idle while
    requests queue (issue 30: on 50 ms scrapes, affinity kept one replica's queue while
    the other sat empty). The usual case costs one read: the primary has nothing waiting
    (the caller checks that); the next one a set test: no endpoint is idle in this
    snapshot (``idle``: the indices with nothing running or waiting).
    """
    first = endpoints[candidates[order[0]]]
    if first.waiting == 0 or not idle:
        return order
    best = -1
    for pos in range(len(candidates)):
        if candidates[pos] not in idle:
            continue
        address = endpoints[candidates[pos]].address
        if assignments.in_flight(address) or assignments.picked_since_scrape(address):
            continue
        if best < 0 or totals[pos] > totals[best]:
            best = pos
    if best < 0:
        return order
    return [best, *(o for o in order if o != best)][:len(order)]


def _add_weighted(totals: np.ndarray | None, owned: bool, scores: np.ndarray,
                  weight: float) -> tuple[np.ndarray, bool]:
    """``totals + weight × scores`` and whether ``totals`` is now an array of its own.
    Summed in the scorers' order, the same floats as zeros + w1·s1 + w2·s2 + …, with fewer
    numpy calls: a weight of 1 needs none, and the first scores are not copied (the second
    sum makes the array ``totals`` owns)."""
    if totals is None:
        return (scores, False) if weight == 1.0 else (weight * scores, True)
    if not owned:
        return totals + (scores if weight == 1.0 else weight * scores), True
    if weight == 1.0:
        totals += scores
    else:
        totals += weight * scores
    return totals, True
