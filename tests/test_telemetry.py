"""telemetry: the service's metrics live in their own registry and are served over HTTP."""

from __future__ import annotations

import httpx
import prometheus_client
import pytest

from epick import telemetry

EXPECTED = {
    "epick_pick_latency_seconds": ("histogram", ("stage",)),
    "epick_policy_score_latency_seconds": ("histogram", ("policy",)),
    "epick_picks": ("counter", ("outcome",)),
    "epick_policy_errors": ("counter", ("policy", "kind")),
    "epick_scrape_errors": ("counter", ("endpoint", "reason")),
    "epick_endpoint_fresh": ("gauge", ("endpoint",)),
    "epick_endpoint_scrape_age_seconds": ("gauge", ("endpoint",)),
    "epick_pool_last_resort_endpoints": ("gauge", ()),
    "epick_snapshot_rebuilds": ("counter", ()),
    "epick_snapshot_endpoints": ("gauge", ()),
    "epick_discovery_errors": ("counter", ("source", "reason")),
    "epick_discovery_endpoints": ("gauge", ("source",)),
    "epick_shadow_agreement": ("counter", ("policy", "agree")),
    "epick_shadow_score_delta": ("histogram", ("policy",)),
    "epick_completions": ("counter", ("status",)),
    "epick_completion_tokens": ("counter", ("kind",)),
    "epick_ttft_seconds": ("histogram", ()),
    "epick_event_loop_lag_seconds": ("histogram", ()),
    "epick_event_loop_stalls": ("counter", ()),
    "epick_decision_log_records": ("counter", ("kind",)),
    "epick_decision_log_dropped": ("counter", ("reason",)),
    "epick_decision_log_bytes": ("counter", ()),
    "epick_flow_queue_requests": ("gauge", ("priority", "fairness_id")),
    "epick_flow_queue_bytes": ("gauge", ("priority", "fairness_id")),
    "epick_flow_queue_wait_seconds": ("histogram", ("outcome",)),
    "epick_flow_pool_saturation": ("gauge", ()),
    "epick_flow_dispatches": ("counter", ("priority", "path")),
}


def test_every_service_metric_is_declared_with_its_type_and_labels():
    declared = {
        metric._name: (metric._type, tuple(metric._labelnames))  # noqa: SLF001
        for name in telemetry.__all__
        if isinstance(metric := getattr(telemetry, name), prometheus_client.metrics.MetricWrapperBase)
    }
    declared |= {
        metric._name: ("histogram", metric._labelnames)  # noqa: SLF001
        for name in telemetry.__all__
        if isinstance(metric := getattr(telemetry, name), telemetry.LoopHistogram)
    }
    assert declared == EXPECTED


#: Read at scrape time from the live plugins (telemetry.POLICY_STATS), not declared.
COLLECTED = {"epick_policy_recoveries", "epick_policy_timeout_retries",
             "epick_policy_breaker_opens", "epick_policy_breaker_open"}
#: Read at scrape time from the KV-event subscribers (epick.kv.metrics.KV_STATS).
KV_COLLECTED = {"epick_kv_frames", "epick_kv_bad_frames", "epick_kv_gaps", "epick_kv_replays",
                "epick_kv_replay_failures", "epick_kv_restarts", "epick_kv_index_blocks"}


def test_service_metrics_are_in_the_dedicated_registry_only():
    import epick.kv.metrics  # noqa: F401 - registers KV_COLLECTED (the service imports it)

    ours = {m.name for m in telemetry.REGISTRY.collect()}
    assert ours == set(EXPECTED) | COLLECTED | KV_COLLECTED
    default = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not ours & default


def test_pick_latency_buckets_resolve_microseconds():
    telemetry.PICK_LATENCY.labels("filter").observe(7e-6)
    assert telemetry.REGISTRY.get_sample_value(
        "epick_pick_latency_seconds_bucket", {"stage": "filter", "le": "1e-05"}
    ) >= 1


def test_a_loop_histogram_exposes_what_a_prometheus_histogram_does():
    """Same observations, same buckets: the same samples (names, labels, values), edges
    and the +Inf bucket included; and its children cost no label lookup."""
    import random

    buckets = (5e-6, 1e-5, 5e-5, 1e-3, 0.25)
    ours, theirs = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    fast = telemetry.LoopHistogram("h_seconds", "doc", ["stage"], buckets, ours)
    slow = prometheus_client.Histogram("h_seconds", "doc", ["stage"], buckets=buckets,
                                       registry=theirs)
    rng = random.Random(1)
    values = [0.0, 5e-6, 1e-5, 1e-3, 0.25, 0.3, 7.0] + [rng.expovariate(2e4) for _ in range(500)]
    for k, v in enumerate(values):
        stage = ("a", "b")[k % 2]
        fast.labels(stage).observe(v)
        slow.labels(stage).observe(v)

    def samples(registry):
        return sorted((s.name, tuple(sorted(s.labels.items())), round(s.value, 12))
                      for m in registry.collect() for s in m.samples
                      if not s.name.endswith("_created"))

    assert samples(ours) == samples(theirs)
    assert fast.labels("a") is fast.labels("a")
    with pytest.raises(ValueError, match="1 labels"):
        fast.labels("a", "b")


def test_a_loop_histogram_read_while_the_loop_observes_counts_each_observation_once():
    """Observations wait in a list until read: a scrape on another thread folds what was
    there and leaves what the loop appends meanwhile, so none is lost or counted twice."""
    import threading

    hist = telemetry.LoopHistogram("race_seconds", "doc", ["stage"], (1e-5, 1e-3),
                                   prometheus_client.CollectorRegistry())
    child = hist.labels("a")
    done = threading.Event()
    reads: list[int] = []

    def scrape():
        while not done.is_set():
            counts, _ = child.read()
            reads.append(sum(counts))

    reader = threading.Thread(target=scrape)
    reader.start()
    try:
        for k in range(200_000):
            child.observe((k % 3) * 1e-4)  # 0, 1e-4, 2e-4: every third in the first bucket
    finally:
        done.set()
        reader.join()
    counts, total = child.read()
    assert counts == [66_667, 133_333, 0]
    assert total == pytest.approx(sum((k % 3) * 1e-4 for k in range(200_000)))
    assert reads == sorted(reads) and len(reads) > 1  # the reader saw it grow


def test_the_pick_path_folds_its_histograms_before_they_hold_more_than_fold_at():
    from epick.service import TelemetryRecorder

    recorder = TelemetryRecorder()
    recorder.policy_latency("fold-test", 2e-6)
    total = telemetry.PICK_LATENCY.labels("total")
    policy = telemetry.POLICY_SCORE_LATENCY.labels("fold-test")
    total.fold()
    for _ in range(telemetry.FOLD_AT):
        recorder.stages(1e-6, 1e-6, 1e-6, 1e-6)
        recorder.pick_done("ok", 3e-6)
    assert not total._pending and not policy._pending  # noqa: SLF001 - folded by pick_done
    assert policy.counts[0] == 1  # and counted, once


def test_forget_endpoint_drops_every_series_of_that_endpoint_only():
    telemetry.ENDPOINT_FRESH.labels("gone:1").set(1)
    telemetry.ENDPOINT_SCRAPE_AGE.labels("gone:1").set(0.5)
    telemetry.SCRAPE_ERRORS.labels("gone:1", "timeout").inc()
    telemetry.SCRAPE_ERRORS.labels("gone:1", "parse").inc()
    telemetry.ENDPOINT_FRESH.labels("stays:1").set(1)
    telemetry.forget_endpoint("gone:1")
    get = telemetry.REGISTRY.get_sample_value
    assert get("epick_endpoint_fresh", {"endpoint": "gone:1"}) is None
    assert get("epick_endpoint_scrape_age_seconds", {"endpoint": "gone:1"}) is None
    assert get("epick_scrape_errors_total", {"endpoint": "gone:1", "reason": "timeout"}) is None
    assert get("epick_scrape_errors_total", {"endpoint": "gone:1", "reason": "parse"}) is None
    assert get("epick_endpoint_fresh", {"endpoint": "stays:1"}) == 1
    telemetry.forget_endpoint("never-seen:1")  # harmless


def test_metrics_server_serves_the_registry_on_a_free_port_until_closed():
    telemetry.PICKS.labels("shed").inc()
    server = telemetry.start_metrics_server("127.0.0.1", 0)
    try:
        assert server.port > 0
        body = httpx.get(server.url).text
        assert 'epick_picks_total{outcome="shed"}' in body
    finally:
        server.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url)


def test_children_look_each_label_set_up_once_and_keep_it():
    children = telemetry.Children(telemetry.POLICY_ERRORS)
    a = children("p-children", "trap")
    assert children("p-children", "trap") is a
    assert children("p-children", "timeout") is not a
    a.inc()
    assert telemetry.REGISTRY.get_sample_value(
        "epick_policy_errors_total", {"policy": "p-children", "kind": "trap"}) == 1


def test_fast_inc_adds_one_to_the_counter_as_inc_does():
    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("fast_picks", "doc", ["outcome"], registry=registry)
    add = telemetry.fast_inc(counter.labels("ok"))
    for _ in range(3):
        add()
    counter.labels("ok").inc()
    assert registry.get_sample_value("fast_picks_total", {"outcome": "ok"}) == 4

    class Other:  # a child without prometheus_client's value: its own inc is kept
        def inc(self):
            pass

    other = Other()
    assert telemetry.fast_inc(other) == other.inc


def test_pick_done_counts_each_outcome_once():
    from epick.service import TelemetryRecorder

    get = telemetry.REGISTRY.get_sample_value
    before = {o: get("epick_picks_total", {"outcome": o}) or 0.0
              for o in telemetry.PICK_OUTCOMES}
    recorder = TelemetryRecorder()
    for outcome, n in (("ok", 3), ("shed", 1), ("queue_full", 2)):
        for _ in range(n):
            recorder.pick_done(outcome, 1e-5)
    after = {o: get("epick_picks_total", {"outcome": o}) or 0.0
             for o in telemetry.PICK_OUTCOMES}
    assert {o: after[o] - before[o] for o in after} == {
        "ok": 3, "shed": 1, "queue_full": 2, "unavailable": 0, "invalid": 0, "error": 0,
        "queue_expired": 0}
