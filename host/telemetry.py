"""Every Prometheus metric the service exports, defined once, in one registry.

All metrics live in :data:`REGISTRY`, a dedicated :class:`~prometheus_client.CollectorRegistry`
(not the library's global default), so tests read exact values with
``REGISTRY.get_sample_value(name, labels)`` and nothing from other libraries leaks in.
Every name starts with ``epick_``; latencies are in seconds, as Prometheus expects.

Label values are bounded sets (stages, outcomes, kinds, reasons) except ``policy`` and
``endpoint``, which are bounded by the configuration. Whoever removes an endpoint from the
pool removes its per-endpoint series too (:func:`forget_endpoint`).

Serve them with :func:`start_metrics_server`.
"""

from __future__ import annotations

import functools
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = [
    "REGISTRY",
    "PICK_LATENCY",
    "POLICY_SCORE_LATENCY",
    "PICKS",
    "POLICY_ERRORS",
    "SCRAPE_ERRORS",
    "ENDPOINT_FRESH",
    "ENDPOINT_SCRAPE_AGE",
    "POOL_LAST_RESORT",
    "SNAPSHOT_REBUILDS",
    "SNAPSHOT_ENDPOINTS",
    "DISCOVERY_ERRORS",
    "DISCOVERY_ENDPOINTS",
    "SHADOW_AGREEMENT",
    "SHADOW_SCORE_DELTA",
    "COMPLETIONS",
    "COMPLETION_TOKENS",
    "TTFT",
    "EVENT_LOOP_LAG",
    "EVENT_LOOP_STALLS",
    "DECISION_LOG_RECORDS",
    "DECISION_LOG_DROPPED",
    "DECISION_LOG_BYTES",
    "DECISION_LOG_DROP_REASONS",
    "PICK_OUTCOMES",
    "FLOW_OUTCOMES",
    "FLOW_QUEUE_REQUESTS",
    "FLOW_QUEUE_BYTES",
    "FLOW_QUEUE_WAIT",
    "FLOW_POOL_SATURATION",
    "FLOW_DISPATCHES",
    "SCRAPE_ERROR_REASONS",
    "POLICY_STATS",
    "Children",
    "fast_inc",
    "LoopHistogram",
    "fold_loop_histograms",
    "MetricsServer",
    "start_metrics_server",
    "forget_endpoint",
]

REGISTRY = CollectorRegistry(auto_describe=True)
"""The service's registry; every metric below is registered here and only here."""

#: Label values of ``epick_picks_total{outcome}``.
PICK_OUTCOMES = ("ok", "shed", "unavailable", "invalid", "error", "queue_full", "queue_expired")
#: Label values of ``epick_scrape_errors_total{reason}`` (= ``epick.pool.ScrapeError.kind``).
SCRAPE_ERROR_REASONS = (
    "network",  # refused, reset, DNS, protocol: no usable HTTP answer
    "timeout",  # no complete answer within timeout_ms
    "http-status",  # answered with a status other than 200
    "parse",  # the body is not Prometheus text
    "missing-metric",  # a required metric (queue, KV) is absent
    "invalid-value",  # a metric holds a value outside its domain
    "worker",  # the scrape worker process died or hung (scrape_in = "process")
)

# The host's own per-pick work is a few to a few hundred µs (the goal: keep it well
# under 100 µs), so the buckets are dense from 5 µs to 1 ms and sparse above it.
_MICRO_BUCKETS = (
    5e-6, 10e-6, 20e-6, 35e-6, 50e-6, 75e-6, 100e-6, 150e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0,
)  # fmt: skip
# Score deltas between a shadow and the live policy are in [0, 1].
_DELTA_BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)



class LoopHistogram:
    """A labelled histogram for the pick path: observed from the event-loop thread only.

    prometheus_client's ``Histogram.observe`` walks the buckets in Python and takes two
    locks, ~0.7 µs; a pick makes eight of them (total, four stages, three policies),
    ~10% of the host's work in process (docs/performance.md). A child's ``observe`` here
    is a list's ``append`` (no Python frame: ~0.05 µs); the observations are sorted into
    bucket counts and a sum when someone reads them — the exposition, built at scrape
    time, is the same ``_bucket{le}`` / ``_count`` / ``_sum`` families a ``Histogram``
    gives — or when :data:`FOLD_AT` of them wait (:meth:`LoopHistogram.fold_if_due`,
    which the pick path calls once per pick, then :func:`fold_loop_histograms`). Only one thread observes (the loop); a
    reader on another thread folds what was appended before it looked, under the child's
    lock, and leaves the rest.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name, self._doc, self._labelnames = name, documentation, tuple(labelnames)
        self._bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _LoopChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _LoopChild:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: {len(values)} label values for "
                             f"{len(self._labelnames)} labels {self._labelnames}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _LoopChild(self._bounds)
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def fold(self) -> None:
        """Sort every child's waiting observations into its counts and sum now."""
        for child in list(self._children.values()):
            child.fold()

    def describe(self):
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        edges = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for values, child in list(self._children.items()):
            counts, total = child.read()
            cumulative = list(accumulate(counts))
            family.add_metric(list(values), list(zip(edges, cumulative)), total)
        yield family


#: Observations a :class:`LoopHistogram` child holds before the pick path folds them
#: (when nothing scrapes the metrics sooner): ~32 KiB of floats per child.
FOLD_AT = 1024


class _LoopChild:
    __slots__ = ("_counts", "_sum", "_bounds", "_pending", "_lock", "observe", "waiting")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self._sum = 0.0
        self._pending: list[float] = []
        self._lock = threading.Lock()  # between folders only: observe never takes it
        #: Record one observation (seconds): the waiting list's append, bound once.
        self.observe = self._pending.append
        #: The observations not folded yet (the same list, for ``len``: the pick path
        #: tests it against :data:`FOLD_AT` without a call).
        self.waiting = self._pending

    def fold(self) -> None:
        """Sort the observations waiting so far into the counts and the sum."""
        if self._pending:
            with self._lock:
                self._fold_locked()

    def fold_if_due(self) -> bool:
        """:meth:`fold` when :data:`FOLD_AT` observations wait; whether it did."""
        if len(self._pending) < FOLD_AT:
            return False
        self.fold()
        return True

    def read(self) -> tuple[list[int], float]:
        """Every observation so far: (count per bucket, the last one +Inf; sum)."""
        with self._lock:
            self._fold_locked()
            return list(self._counts), self._sum

    def _fold_locked(self) -> None:
        # In the order they came: the sum adds them one by one, as Histogram.observe does.
        pending = self._pending
        n = len(pending)
        if not n:
            return
        batch = pending[:n]
        del pending[:n]  # one step under the GIL: what the loop appended meanwhile stays
        counts, bounds, total = self._counts, self._bounds, self._sum
        for amount in batch:
            # bisect_left: the first bound >= amount, i.e. Prometheus' "le" bucket.
            counts[bisect_left(bounds, amount)] += 1
            total += amount
        self._sum = total

    @property
    def counts(self) -> list[int]:
        return self.read()[0]

    @property
    def sum(self) -> float:
        return self.read()[1]


PICK_LATENCY = LoopHistogram(
    "epick_pick_latency_seconds",
    "Host-side time of one Pick, by stage (total|filter|score|pick|hooks).",
    ["stage"],
    buckets=_MICRO_BUCKETS,
    registry=REGISTRY,
)
def fold_loop_histograms() -> None:
    """Fold every waiting observation of the pick path's histograms (a scrape does it on
    its own; the pick path calls this when one child has :data:`FOLD_AT` waiting)."""
    PICK_LATENCY.fold()
    POLICY_SCORE_LATENCY.fold()


POLICY_SCORE_LATENCY = LoopHistogram(
    "epick_policy_score_latency_seconds",
    "Time of one policy's score (or filter) call, including the payload copy.",
    ["policy"],
    buckets=_MICRO_BUCKETS,
    registry=REGISTRY,
)
PICKS = Counter(
    "epick_picks",
    "Pick requests by outcome (ok|shed|unavailable|invalid|error|queue_full|queue_expired).",
    ["outcome"],
    registry=REGISTRY,
)
#: Label values of ``epick_flow_queue_wait_seconds{outcome}``.
FLOW_OUTCOMES = ("dispatched", "expired", "full", "unavailable", "cancelled")
FLOW_QUEUE_REQUESTS = Gauge(
    "epick_flow_queue_requests",
    "Requests waiting in flow control, by priority band and fairness id (ids past "
    "[flow_control] metrics_max_flows are counted as \"other\").",
    ["priority", "fairness_id"],
    registry=REGISTRY,
)
FLOW_QUEUE_BYTES = Gauge(
    "epick_flow_queue_bytes",
    "Bytes (prompts) waiting in flow control, by priority band and fairness id.",
    ["priority", "fairness_id"],
    registry=REGISTRY,
)
FLOW_QUEUE_WAIT = Histogram(
    "epick_flow_queue_wait_seconds",
    "Time a request spent in flow control's queue, by how it left "
    "(dispatched|expired|full|unavailable|cancelled); a request that went straight "
    "through is not counted.",
    ["outcome"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
FLOW_POOL_SATURATION = Gauge(
    "epick_flow_pool_saturation",
    "Share of the pool's endpoints flow control counts as saturated (stale, or queue + "
    "picks since its scrape at the threshold, or KV at the threshold), when last checked.",
    registry=REGISTRY,
)
FLOW_DISPATCHES = Counter(
    "epick_flow_dispatches",
    "Requests flow control let through, by priority band and path (direct: nothing "
    "waited and there was room; queued: after waiting).",
    ["priority", "path"],
    registry=REGISTRY,
)
POLICY_ERRORS = Counter(
    "epick_policy_errors",
    "Failed policy calls by kind (error|trap|timeout|out-of-fuel|invalid-output|"
    "circuit-open|recovering).",
    ["policy", "kind"],
    registry=REGISTRY,
)
SCRAPE_ERRORS = Counter(
    "epick_scrape_errors",
    "Failed metric scrapes by endpoint and reason (see epick.pool.ScrapeError.kind).",
    ["endpoint", "reason"],
    registry=REGISTRY,
)
ENDPOINT_FRESH = Gauge(
    "epick_endpoint_fresh",
    "1 if the endpoint's last good scrape is younger than stale_after, else 0.",
    ["endpoint"],
    registry=REGISTRY,
)
POOL_LAST_RESORT = Gauge(
    "epick_pool_last_resort_endpoints",
    "Endpoints picks use on late metrics because none is fresh: their pages timed out or "
    "are still coming (the engine is busy, not gone), for at most [pool] stale_grace_ms "
    "past stale_after_ms. 0 in normal operation.",
    registry=REGISTRY,
)
ENDPOINT_SCRAPE_AGE = Gauge(
    "epick_endpoint_scrape_age_seconds",
    "Age of the endpoint's last good scrape when the snapshot was last checked.",
    ["endpoint"],
    registry=REGISTRY,
)
SNAPSHOT_REBUILDS = Counter(
    "epick_snapshot_rebuilds",
    "Pool snapshots built (each one a metrics, freshness or endpoint-set change).",
    registry=REGISTRY,
)
SNAPSHOT_ENDPOINTS = Gauge(
    "epick_snapshot_endpoints",
    "Endpoints in the current pool snapshot (fresh or stale).",
    registry=REGISTRY,
)
DISCOVERY_ERRORS = Counter(
    "epick_discovery_errors",
    "Failed lookups of an endpoint source ([[pool.sources]]; the last set is kept), by "
    "source (e.g. dns:NAME) and reason (timeout|servfail|refused|network|error).",
    ["source", "reason"],
    registry=REGISTRY,
)
DISCOVERY_ENDPOINTS = Gauge(
    "epick_discovery_endpoints",
    "Endpoints an endpoint source reports now (before merging with the static list).",
    ["source"],
    registry=REGISTRY,
)
SHADOW_AGREEMENT = Counter(
    "epick_shadow_agreement",
    "Picks where a shadow policy's choice agreed (or not) with the live one.",
    ["policy", "agree"],
    registry=REGISTRY,
)
COMPLETIONS = Counter(
    "epick_completions",
    "Reported completions by status (ok|error|cancelled), from ReportCompletion or ext_proc.",
    ["status"],
    registry=REGISTRY,
)
COMPLETION_TOKENS = Counter(
    "epick_completion_tokens",
    "Tokens of reported completions, by kind (prompt|completion), as the gateway read them.",
    ["kind"],
    registry=REGISTRY,
)
TTFT = Histogram(
    "epick_ttft_seconds",
    "Time to first token of reported completions (request received -> first answer byte).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
EVENT_LOOP_LAG = Histogram(
    "epick_event_loop_lag_seconds",
    "How late the event loop woke a task that asked to wake (sampled every 50 ms): the "
    "time picks queue behind whatever runs on the loop.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
EVENT_LOOP_STALLS = Counter(
    "epick_event_loop_stalls_total",
    "Times the event loop was held past [server] loop_stall_warn_ms (each one is logged "
    "as a warning naming what ran).",
    registry=REGISTRY,
)
SHADOW_SCORE_DELTA = Histogram(
    "epick_shadow_score_delta",
    "Per pick: a shadow policy's score of its own best endpoint minus its score of the "
    "endpoint picked live (0 when it agrees).",
    ["policy"],
    buckets=_DELTA_BUCKETS,
    registry=REGISTRY,
)

#: Label values of ``epick_decision_log_dropped_total{reason}``.
DECISION_LOG_DROP_REASONS = ("queue-full", "write-error")
DECISION_LOG_RECORDS = Counter(
    "epick_decision_log_records",
    "Records written to the decision log, by kind (decision|completion).",
    ["kind"],
    registry=REGISTRY,
)
DECISION_LOG_DROPPED = Counter(
    "epick_decision_log_dropped",
    "Decision-log records lost, by reason (queue-full: the writer fell behind; "
    "write-error: the disk refused them). A pick never waits for the log.",
    ["reason"],
    registry=REGISTRY,
)
DECISION_LOG_BYTES = Counter(
    "epick_decision_log_bytes",
    "Bytes written to the decision log files.",
    registry=REGISTRY,
)


class Children:
    """The children of one labelled metric, each looked up once and then kept.

    ``metric.labels(...)`` costs ~0.7 µs (a lock and a dict of label tuples); the hot
    path calls ``children(value, ...)`` instead, a plain dict hit after the first time.
    Only for label values bounded by the configuration (policies, outcomes, kinds):
    children are never dropped.
    """

    __slots__ = ("_metric", "_children")

    def __init__(self, metric) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def __call__(self, *values: str):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


def fast_inc(child) -> Callable[[], None]:
    """``child.inc`` (a prometheus_client counter's child) as a call that adds 1 with one
    Python frame instead of four: its value's own ``inc(1)`` (the same lock, the same
    number). A child without that value (another client version) keeps its ``inc``."""
    inc = getattr(getattr(child, "_value", None), "inc", None)
    return functools.partial(inc, 1) if callable(inc) else child.inc


def forget_endpoint(address: str) -> None:
    """Drop every per-endpoint series of ``address`` (it left the pool).

    Series never exported are skipped. (``remove`` per known label value rather than
    ``remove_by_labels``, which needs prometheus-client >= 0.23.)
    """
    removals = [(ENDPOINT_FRESH, (address,)), (ENDPOINT_SCRAPE_AGE, (address,))]
    removals += [(SCRAPE_ERRORS, (address, reason)) for reason in SCRAPE_ERROR_REASONS]
    for metric, labels in removals:
        try:
            metric.remove(*labels)
        except KeyError:
            pass


@dataclass(slots=True)
class MetricsServer:
    """A running ``/metrics`` HTTP server; :meth:`close` stops it and joins its thread."""

    host: str
    port: int
    _server: ThreadingHTTPServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _PolicyStats:
    """Per-policy counters the runtime keeps itself (``WasmPolicy.stats`` and its
    breakers), read at scrape time from :attr:`source`: ``() -> [(name, plugin)]``,
    set by the service. Exposes ``epick_policy_recoveries_total``,
    ``epick_policy_timeout_retries_total``, ``epick_policy_breaker_opens_total`` and
    ``epick_policy_breaker_open{policy,stage}`` (1 while that stage's breaker is not
    closed: the supervisor's one state, so also while the instance is re-created)."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[tuple[str, object]]] | None = None

    def describe(self):  # no families until a service sets a source
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        recoveries = CounterMetricFamily(
            "epick_policy_recoveries", "Policy instances re-created after a trap, timeout "
            "or running out of fuel.", labels=["policy"])
        retries = CounterMetricFamily(
            "epick_policy_timeout_retries", "Policy calls re-run once after hitting the "
            "wall-clock backstop.", labels=["policy"])
        opens = CounterMetricFamily(
            "epick_policy_breaker_opens", "Times any of a policy's circuit breakers opened.",
            labels=["policy"])
        open_now = GaugeMetricFamily(
            "epick_policy_breaker_open", "1 while the breaker of a policy's stage is open or "
            "half-open (open also while its instance is being re-created).",
            labels=["policy", "stage"])
        source = self.source
        for name, plugin in (source() if source is not None else ()):
            stats = getattr(plugin, "stats", None)
            if stats is None:
                continue
            recoveries.add_metric([name], stats.recoveries)
            retries.add_metric([name], stats.timeout_retries)
            opens.add_metric([name], getattr(plugin, "breaker_opens", 0))
            for stage, state in getattr(plugin, "breaker_states", {}).items():
                open_now.add_metric([name, stage], 0.0 if state == "closed" else 1.0)
        return [recoveries, retries, opens, open_now]


POLICY_STATS = _PolicyStats()
REGISTRY.register(POLICY_STATS)


def start_metrics_server(
    host: str = "127.0.0.1", port: int = 0, registry: CollectorRegistry = REGISTRY
) -> MetricsServer:
    """Serve ``registry`` in the Prometheus text format at ``http://host:port/metrics``.

    ``port=0`` binds a free port; read it back from the returned
    :class:`MetricsServer`. The server runs in prometheus_client's own thread (it is a
    blocking stdlib server); call :meth:`MetricsServer.close` on shutdown so that the
    thread ends with the service instead of being left to die with the process.

    Raises ``OSError`` if the address cannot be bound.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host=host, port=server.server_port, _server=server, _thread=thread)
