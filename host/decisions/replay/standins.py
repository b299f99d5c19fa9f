"""Stand-ins a replayed decision runs with: policies as they failed or recovered live,
the recorded assignment and KV counts (given to each ``schedule`` call), and the
replay scheduler's recorder."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from epick.decisions.replay.report import SCORE_EPSILON
from epick.interfaces import Capabilities, PluginError

__all__ = ["FailedLive", "Recovering", "RecordedCounts", "RecordedKv", "ErrorCount",
           "LIVE_FAILURE"]

#: The kind of the error a policy that failed live raises again (not counted as new).
LIVE_FAILURE = "failed-live"


class FailedLive:
    """A policy as it was on a decision where it failed live: its score/filter fail the
    same way (so the pick is made without it, as it was), its hooks run as usual."""

    def __init__(self, plugin, reason: str) -> None:
        self._plugin = plugin
        self._reason = reason
        self.name = plugin.name
        # a wrapper for one decision: it hands no state over
        self.capabilities = ((plugin.capabilities & ~Capabilities.STATE)
                             | Capabilities.SCORES_IN_RANGE)

    def score(self, cycle, candidates):
        raise PluginError(self.name, "score", LIVE_FAILURE, self._reason)

    def filter(self, cycle, candidates):
        raise PluginError(self.name, "filter", LIVE_FAILURE, self._reason)

    def pre_request(self, cycle, endpoint):
        self._plugin.pre_request(cycle, endpoint)

    def post_response(self, event):
        self._plugin.post_response(event)



class Recovering:
    """A policy whose live instance was re-created during this decision, at a stage the
    log does not say: during ``score`` (the scores were computed on the checkpoint's
    state) or during a hook (after scoring). The recorded scores tell which: if the
    current state reproduces them, the recovery comes after scoring."""

    def __init__(self, plugin, recorded: np.ndarray | None) -> None:
        self._plugin = plugin
        self._recorded = recorded
        self.done = False
        self.name = plugin.name
        # a wrapper for one decision: it hands no state over
        self.capabilities = ((plugin.capabilities & ~Capabilities.STATE)
                             | Capabilities.SCORES_IN_RANGE)

    def recover(self) -> None:
        if not self.done:
            self.done = True
            self._plugin.recover()

    def score(self, cycle, candidates):
        if not self.done:
            scores = self._plugin.score(cycle, candidates)
            rec = self._recorded
            if (rec is not None and len(rec) == len(scores)
                    and np.all(np.abs(scores - rec) <= SCORE_EPSILON)):
                return scores  # recovered later, in a hook
            self.recover()
        return self._plugin.score(cycle, candidates)

    def filter(self, cycle, candidates):
        self.recover()
        return self._plugin.filter(cycle, candidates)

    def pre_request(self, cycle, endpoint):
        self.recover()
        self._plugin.pre_request(cycle, endpoint)

    def post_response(self, event):
        self._plugin.post_response(event)


class RecordedCounts:
    """The assignment counts of one replayed decision (given to that ``schedule``
    call): the recorded per-candidate counts; the pick it makes changes nothing."""

    def __init__(self, counts: dict[str, tuple[int, int]], given: bool) -> None:
        self._counts, self._given = counts, given

    def of(self, addresses):
        if not self._given:
            return (), ()
        got = [self._counts.get(a, (0, 0)) for a in addresses]
        return tuple(c[0] for c in got), tuple(c[1] for c in got)

    def in_flight(self, address: str) -> int:
        return self._counts.get(address, (0, 0))[0]

    def picked_since_scrape(self, address: str) -> int:
        return self._counts.get(address, (0, 0))[1]

    def picked(self, address: str) -> None:
        pass

    def completed(self, address: str) -> None:
        pass

    def scraped(self, address: str) -> None:
        pass

    def __bool__(self) -> bool:
        return self._given


class RecordedKv:
    """The KV counts of one replayed decision (given to that ``schedule`` call): the
    recorded per-candidate prefix counts (the engines' events are not in the log)."""

    def __init__(self, counts: dict[str, tuple[int, int]],
                 cleared: dict[str, int] | None = None) -> None:
        self._counts = counts
        self._cleared = cleared

    def counts(self, request, endpoints, candidates):
        got = [self._counts.get(endpoints[i].address, (0, -1)) for i in candidates]
        return tuple(c[0] for c in got), tuple(c[1] for c in got)

    def cleared(self, endpoints, candidates):
        if self._cleared is None:  # a log from before the field: nothing recorded
            return ()
        return tuple(self._cleared.get(endpoints[i].address, 0) for i in candidates)


class ErrorCount:
    """The replay scheduler's recorder: counts policy errors (not mirrored live ones)."""

    def __init__(self) -> None:
        self.errors: dict[str, int] = defaultdict(int)

    def policy_error(self, error: PluginError) -> None:
        if error.kind != LIVE_FAILURE:
            self.errors[f"{error.plugin}: {error.kind}"] += 1

    def policy_latency(self, policy: str, seconds: float) -> None:
        pass

    def shadow(self, policy: str, agree: bool, delta: float) -> None:
        pass

    def stages(self, *a) -> None:
        pass

    def completion(self, *a) -> None:
        pass
