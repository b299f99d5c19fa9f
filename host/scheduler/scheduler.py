"""The scheduler: runs one cycle per request through the extension points.

    host filters (fresh, serves-model, admission)
      -> filter policies            a failing one is skipped (fail open)
      -> scorers: total = Σ weight × clamp(score, 0, 1); a failing one is skipped
      -> picker: primary + fallbacks
      -> shadow scorers             (compared with the pick; never change it)
      -> pre_request hooks          (live and shadow policies record the pick)

``complete()`` later runs the post_response hooks. Everything here runs on the thread
that owns the scheduler (the service's event-loop thread): no locks, and a policy set
swap is one attribute assignment.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from epick import abi
from epick.abi import Criticality
from epick.interfaces import Capabilities, Cycle, Picker, PluginError, PoolSnapshot
from epick.ratelog import RateLimitedLog
from epick.scheduler.assignments import Assignments
from epick.scheduler.filters import AdmissionFilter, AwakeFilter, FreshFilter, ServesModelFilter
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


@dataclass(slots=True)
class CandidateScore:
    """One endpoint's part in a decision (the ``explain`` view)."""

    endpoint: str
    total: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    filtered_by: str = ""
    rank: int = -1
    shadow_scores: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    picked_since_scrape: int = 0
    reason: str = ""
    """Why it is not a candidate, in words, beyond the filter's name (no metrics, stale)."""


@dataclass(slots=True)
class Decision:
    decision_id: str
    endpoint: str
    fallbacks: list[str]
    snapshot_version: int
    explanation: list[CandidateScore] | None = None
    skipped: list[str] = field(default_factory=list)
    """``policy: reason`` for each policy that failed on this request."""


@dataclass(slots=True)
class _Pending:
    request_id: str
    model: str
    adapter: str
    endpoint: str
    expires: float


class Scheduler:
    """Picks endpoints for requests; owns the live :class:`PolicySet`.

    Parameters
    ----------
    pool:
        Returns the current :class:`PoolSnapshot` (an attribute read, not a rebuild).
    policies:
        The initial policy set; replace ``scheduler.policies`` to swap atomically.
    fallbacks:
        How many endpoints to return after the primary.
    """

    def __init__(
        self,
        pool: Callable[[], PoolSnapshot],
        policies: PolicySet = PolicySet(),
        *,
        fallbacks: int = 2,
        admission: AdmissionFilter = AdmissionFilter(),
        picker: Picker | None = None,
        recorder: Recorder | None = None,
        decision_ttl_s: float = 600.0,
        max_decisions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self.policies = policies
        self.fallbacks = fallbacks
        self.host_filters = (FreshFilter(), AwakeFilter(), ServesModelFilter())
        self.admission = admission
        self.picker = picker or MaxScorePicker()
        self.recorder = recorder or _NullRecorder()
        self.decision_ttl_s = decision_ttl_s
        self.max_decisions = max_decisions
        self._clock = clock
        self._wall_clock = wall_clock
        self.assignments = Assignments()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._by_request: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._boot = os.urandom(4).hex()
        self.pool_status: Callable[[], Sequence] | None = None
        """The pool's per-endpoint scrape status (``Pool.status``): lets an explanation
        show endpoints that are not in the snapshot, and why (only ``explain`` reads it)."""
        # A failing policy fails on every pick: one line per (policy, stage, kind) per 10 s.
        self._rlog = RateLimitedLog(log)
        #: Where decisions and completions are recorded (``epick.decisions.DecisionLog``);
        #: ``None`` = not recorded. Its methods only enqueue: they never block a pick.
        self.decisions: DecisionSink | None = None

    # -- the cycle -----------------------------------------------------------------

    def schedule(self, request: abi.Request, *, explain: bool = False,
                 subset: Collection[str] | None = None, pin: str = "") -> Decision:
        """Pick an endpoint for ``request``; raise :class:`Shed` or :class:`Unavailable`.

        ``request.seed`` drives every random choice (the API layer fills a random one
        when the gateway sent none), so the same request on the same snapshot and
        policy state gives the same answer.

        ``subset`` (a data plane's hint: ``host:port`` or bare ``host`` entries) keeps
        only those endpoints; none of them eligible is :class:`Unavailable`. ``pin``
        forces one endpoint (``host:port``): it must be fresh and serve the model, or the
        pick is :class:`Unavailable` — never silently replaced; admission and policy
        filters do not apply to it, and it has no fallbacks.
        """
        perf = time.perf_counter
        t_start = perf()
        pool = self._pool()
        policies = self.policies  # one read: a concurrent swap cannot split this pick
        cycle = Cycle(pool=pool, request=request, assignments=self.assignments,
                      now_ms=int(self._wall_clock() * 1000))
        sink = self.decisions
        endpoints = pool.snapshot.endpoints
        candidates = tuple(range(len(endpoints)))
        why: dict[int, str] | None = {} if explain else None

        if pin:
            candidates = self._pinned(pool, cycle, pin)
        else:
            for f in self.host_filters:
                candidates = self._run_filter(f.name, f.filter, cycle, candidates, why)
            if subset is not None:
                candidates = self._in_subset(pool, candidates, subset, request, why)
            if not candidates:
                raise Unavailable(self._unavailable_reason(pool, request) + self._scrape_errors())
            candidates = self._run_filter(
                self.admission.name, self.admission.filter, cycle, candidates, why
            )
        if not candidates:
            raise Shed(
                "SHEDDABLE request shed: every endpoint is over the admission thresholds "
                f"(queue <= {self.admission.queue_threshold}, "
                f"kv <= {self.admission.kv_threshold})"
            )

        skipped: list[str] = []
        for entry in () if pin else policies.filters:
            try:
                kept = entry.plugin.filter(cycle, candidates)
            except PluginError as exc:
                self._policy_failed(exc, skipped)
                continue
            if not kept:
                if request.criticality == Criticality.CRITICAL:
                    continue  # critical requests are never shed by a policy
                raise Shed(f"policy {entry.name!r} filtered out every endpoint")
            if why is not None:
                kept_set = set(kept)
                for i in candidates:
                    if i not in kept_set:
                        why[i] = entry.name
            candidates = kept

        t_filtered = perf()
        totals = np.zeros(len(candidates))
        per_policy: dict[str, np.ndarray] = {}
        for entry in policies.scorers:
            t0 = perf()
            try:
                scores = entry.plugin.score(cycle, candidates)
            except PluginError as exc:
                self._policy_failed(exc, skipped)
                continue
            self.recorder.policy_latency(entry.name, perf() - t0)
            if Capabilities.SCORES_IN_RANGE not in entry.capabilities:
                scores = np.clip(scores, 0.0, 1.0)
            totals += entry.weight * scores
            if explain or sink is not None:
                per_policy[entry.name] = scores

        t_scored = perf()
        order = self.picker.pick(totals, 1 + self.fallbacks, request.seed)
        picked = [candidates[o] for o in order]
        endpoint = endpoints[picked[0]].address
        t_picked = perf()

        # Shadows score before the hooks record this pick, so they judge the same state
        # the live policies did.
        shadow_scores: dict[str, np.ndarray] = {}
        if policies.shadows:
            shadow_scores = self._run_shadows(policies, cycle, candidates, order[0])

        for entry in policies.pre_request:
            try:
                entry.plugin.pre_request(cycle, endpoint)
            except PluginError as exc:
                self._policy_failed(exc, skipped)

        self.recorder.stages(t_filtered - t_start, t_scored - t_filtered,
                             t_picked - t_scored, perf() - t_picked)
        decision = Decision(
            decision_id=self._remember(request, endpoint),
            endpoint=endpoint,
            fallbacks=[endpoints[i].address for i in picked[1:]],
            snapshot_version=pool.version,
            skipped=skipped,
        )
        if sink is not None:
            sink.decision(decision, cycle, policies, candidates, per_policy, shadow_scores,
                          picked)
        if explain:
            decision.explanation = self._explain(
                endpoints, candidates, totals, per_policy, order, why or {}, shadow_scores
            )
            # as the policies saw them: before this pick was counted
            in_flight, since = cycle.assigned(candidates)
            seen = {endpoints[c].address: k for k, c in enumerate(candidates)}
            for row in decision.explanation:
                k = seen.get(row.endpoint)
                if k is None:
                    row.in_flight = self.assignments.in_flight(row.endpoint)
                    row.picked_since_scrape = self.assignments.picked_since_scrape(row.endpoint)
                else:
                    row.in_flight = in_flight[k] if in_flight else 0
                    row.picked_since_scrape = since[k] if since else 0
            if self.pool_status is not None:
                _add_scrape_reasons(decision.explanation, self.pool_status())
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision %s request=%s model=%s adapter=%s -> %s fallbacks=%s snapshot=%d",
                decision.decision_id, request.request_id, request.model, request.adapter,
                endpoint, decision.fallbacks, pool.version,
            )
        return decision

    def _pinned(self, pool: PoolSnapshot, cycle: Cycle, pin: str) -> tuple[int, ...]:
        index = next((i for i, e in enumerate(pool.snapshot.endpoints) if e.address == pin),
                     None)
        if index is None:
            raise Unavailable(f"pinned endpoint {pin!r} is not in the pool (or has never "
                              "reported metrics)")
        if not pool.info[index].fresh:
            raise Unavailable(f"pinned endpoint {pin!r} is not fresh (its metrics are stale)")
        for f in self.host_filters:
            if not f.filter(cycle, (index,)):
                raise Unavailable(f"pinned endpoint {pin!r} is refused by the {f.name!r} "
                                  "filter")
        return (index,)

    @staticmethod
    def _in_subset(pool, candidates, subset, request, why) -> tuple[int, ...]:
        wanted = set(subset)
        eps = pool.snapshot.endpoints
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

    def _run_filter(self, name, fn, cycle, candidates, why):
        kept = fn(cycle, candidates)
        if why is not None and len(kept) != len(candidates):
            kept_set = set(kept)
            for i in candidates:
                if i not in kept_set:
                    why[i] = name
        return kept

    def _policy_failed(self, exc: PluginError, skipped: list[str]) -> None:
        skipped.append(f"{exc.plugin}: {exc.kind}: {exc.reason}")
        self.recorder.policy_error(exc)
        self._rlog.warning((exc.plugin, exc.stage, exc.kind), "%s", exc)

    def _run_shadows(self, policies, cycle, candidates, live_pos) -> dict[str, np.ndarray]:
        out = {}
        for entry in policies.shadows:
            try:
                scores = np.clip(entry.plugin.score(cycle, candidates), 0.0, 1.0)
            except PluginError as exc:
                self.recorder.policy_error(exc)
                continue
            best = int(np.argmax(scores))
            agree = bool(scores[live_pos] >= scores[best])
            self.recorder.shadow(entry.name, agree, float(scores[best] - scores[live_pos]))
            out[entry.name] = scores
        return out

    def _scrape_errors(self, limit: int = 3) -> str:
        """The pool's latest scrape errors, for an UNAVAILABLE answer: '' when none."""
        if self.pool_status is None:
            return ""
        errors = [f"{st.address}: {st.last_error}" for st in self.pool_status()
                  if st.last_error and not st.fresh]
        if not errors:
            return ""
        more = f"; and {len(errors) - limit} more" if len(errors) > limit else ""
        return f" (last scrape errors: {'; '.join(errors[:limit])}{more})"

    @staticmethod
    def _unavailable_reason(pool: PoolSnapshot, request: abi.Request) -> str:
        if not pool.snapshot.endpoints:
            return "no endpoint has reported metrics yet"
        if not any(i.fresh for i in pool.info):
            return "no endpoint has fresh metrics (all stale)"
        live = [i for i in pool.info if i.fresh and not i.sleeping]
        if not live:
            return "every endpoint with fresh metrics is asleep"
        what = f"model {request.model!r}"
        if request.adapter:
            what += f" with adapter {request.adapter!r}"
        return f"no fresh endpoint serves {what}; {_served(live)}"

    @staticmethod
    def _explain(endpoints, candidates, totals, per_policy, order, why,
                 shadow_scores) -> list[CandidateScore]:
        pos_of = {c: p for p, c in enumerate(candidates)}
        rank_of = {o: r for r, o in enumerate(order)}
        out = []
        for i, ep in enumerate(endpoints):
            row = CandidateScore(endpoint=ep.address, filtered_by=why.get(i, ""))
            p = pos_of.get(i)
            if p is not None:
                row.total = float(totals[p])
                row.scores = {name: float(s[p]) for name, s in per_policy.items()}
                row.shadow_scores = {name: float(s[p]) for name, s in shadow_scores.items()}
                row.rank = rank_of.get(p, -1)
            out.append(row)
        return out

    # -- completions -----------------------------------------------------------------

    def _remember(self, request: abi.Request, endpoint: str) -> str:
        now = self._clock()
        pending = self._pending
        while pending:
            oldest_id, oldest = next(iter(pending.items()))
            if oldest.expires > now and len(pending) < self.max_decisions:
                break
            pending.popitem(last=False)
            self.assignments.completed(oldest.endpoint)  # expired unreported
            if oldest.request_id and self._by_request.get(oldest.request_id) == oldest_id:
                del self._by_request[oldest.request_id]
        self.assignments.picked(endpoint)
        decision_id = f"{self._boot}-{next(self._ids):x}"
        pending[decision_id] = _Pending(
            request.request_id, request.model, request.adapter, endpoint,
            now + self.decision_ttl_s,
        )
        if request.request_id:
            self._by_request[request.request_id] = decision_id
        return decision_id

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
        Token counts and TTFT (what the gateway read from the answer) go to the recorder
        and the decision log.
        """
        if not decision_id and request_id:
            decision_id = self._by_request.get(request_id, "")
        rec = self._pending.pop(decision_id, None) if decision_id else None
        if rec is None:
            return False
        if rec.request_id and self._by_request.get(rec.request_id) == decision_id:
            del self._by_request[rec.request_id]
        self.assignments.completed(rec.endpoint)  # the one whose count the pick raised
        event = abi.PostResponseEvent(
            request_id=rec.request_id,
            adapter=rec.adapter,
            # The endpoint that picked up the request's history is the one we chose;
            # a gateway that failed over reports the fallback it used.
            endpoint=rec.endpoint,
            status=int(status),
            timestamp_ms=int(self._wall_clock() * 1000),
            model=rec.model,
        )
        for entry in self.policies.post_response:
            try:
                entry.plugin.post_response(event)
            except PluginError as exc:
                self.recorder.policy_error(exc)
                self._rlog.warning((exc.plugin, exc.stage, exc.kind), "%s", exc)
        self.recorder.completion(int(status), prompt_tokens, completion_tokens, ttft_s)
        if self.decisions is not None:
            self.decisions.completion(decision_id, event, endpoint, prompt_tokens,
                                      completion_tokens, ttft_s)
        return True

    @property
    def pending_decisions(self) -> int:
        return len(self._pending)


def _add_scrape_reasons(rows: list[CandidateScore], status: Sequence) -> None:
    """Rows for configured endpoints the snapshot lacks (never scraped successfully), and
    the scrape's story for stale ones: an endpoint never silently vanishes from a view."""
    by_address = {row.endpoint: row for row in rows}
    for st in status:
        row = by_address.get(st.address)
        error = f"; last error: {st.last_error}" if st.last_error else ""
        if row is None:
            rows.append(CandidateScore(
                endpoint=st.address, filtered_by="no-metrics",
                reason=(f"no good scrape of {st.url} yet{error}" if st.last_error
                        else f"not scraped yet ({st.url})"),
            ))
        elif row.filtered_by == FreshFilter.name and st.last_success_age_ms is not None:
            row.reason = (f"metrics are stale: the last good scrape of {st.url} was "
                          f"{st.last_success_age_ms / 1000:.1f} s ago{error}")


def random_seed() -> int:
    """A fresh u64 seed for a request that brought none."""
    return random.getrandbits(64)


def _served(live) -> str:
    """What the fresh, awake endpoints serve, for an UNAVAILABLE message."""

    def names(sets) -> str:
        known = sorted(set().union(*(x for x in sets if x is not None)))
        text = ", ".join(known) if known else "(none)"
        if any(x is None for x in sets):
            text += " (and endpoints that do not say)"
        return text

    return (f"the fleet serves models: {names([i.models for i in live])}; "
            f"adapters: {names([i.adapters for i in live])}")
