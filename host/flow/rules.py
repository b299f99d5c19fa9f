"""The ordering and fairness rules (``epick.interfaces.OrderingPolicy`` /
``FairnessPolicy``) and their registries, named by ``[flow_control] ordering`` and
``fairness``. A new rule is a class here plus a registry row."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from epick.interfaces import FairnessPolicy, FlowItem, OrderingPolicy

__all__ = ["Fcfs", "Edf", "RoundRobin", "WeightedRoundRobin", "ORDERINGS", "FAIRNESS",
           "make_ordering", "make_fairness"]


class Fcfs:
    """First come, first served."""

    name = "fcfs"

    def key(self, item: FlowItem) -> tuple:
        return (item.seq,)


class Edf:
    """Earliest deadline first: the TTFT objective's deadline (arrival + ``slo_ttft_ms``)
    when the request has one, else when it would expire. With no SLOs and one TTL this
    is arrival order."""

    name = "edf"

    def key(self, item: FlowItem) -> tuple:
        deadline = item.slo_deadline if item.slo_deadline is not None else item.expires
        return (deadline, item.seq)


class RoundRobin:
    """Flows of a band take one turn each, in the order they first queued."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, str]] = {}  # band -> (index, flow) served last

    def choose(self, band: int, flows: Sequence[str]) -> str:
        last = self._last.get(band)
        if last is None:
            i = 0
        else:
            j, flow = last
            # The flow after the last one served; if that one left, the one in its place.
            i = j + 1 if j < len(flows) and flows[j] == flow else j
        i %= len(flows)
        self._last[band] = (i, flows[i])
        return flows[i]

    def forget(self, band: int, flow: str) -> None:
        pass  # an index that no longer names its flow is handled in choose


class WeightedRoundRobin:
    """Smooth weighted round-robin (nginx's): over any stretch a flow of weight w gets
    w / (sum of the waiting flows' weights) of the band's dispatches, interleaved."""

    name = "weighted"

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self._current: dict[int, dict[str, float]] = {}

    def choose(self, band: int, flows: Sequence[str]) -> str:
        current = self._current.setdefault(band, {})
        total, best, best_value = 0.0, flows[0], float("-inf")
        for flow in flows:
            w = self.weights.get(flow, 1.0)
            total += w
            value = current.get(flow, 0.0) + w
            current[flow] = value
            if value > best_value:
                best, best_value = flow, value
        current[best] -= total
        return best

    def forget(self, band: int, flow: str) -> None:
        current = self._current.get(band)
        if current is not None:
            current.pop(flow, None)


ORDERINGS: dict[str, Callable[[], OrderingPolicy]] = {"edf": Edf, "fcfs": Fcfs}
FAIRNESS: dict[str, Callable[..., FairnessPolicy]] = {
    "round-robin": lambda weights=None: RoundRobin(),
    "weighted": WeightedRoundRobin,
}


def make_ordering(name: str) -> OrderingPolicy:
    try:
        return ORDERINGS[name]()
    except KeyError:
        raise ValueError(f"unknown flow ordering {name!r} (known: "
                         f"{', '.join(sorted(ORDERINGS))})") from None


def make_fairness(name: str, weights: Mapping[str, float] | None = None) -> FairnessPolicy:
    try:
        factory = FAIRNESS[name]
    except KeyError:
        raise ValueError(f"unknown flow fairness {name!r} (known: "
                         f"{', '.join(sorted(FAIRNESS))})") from None
    return factory(weights)
