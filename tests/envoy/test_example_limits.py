"""The example Envoy configs are sized for thousands of concurrent streams (issue 31), and
epick's ext_proc server takes every stream they let through.

Read from the committed YAML, no Envoy needed: each cluster's circuit breakers sit above
the 2,000 concurrent requests the load bench asks for (Envoy's default, 1,024, answered
503 past it), the ext_proc cluster spreads its streams over connections (so SO_REUSEPORT
spreads them over `[server] workers`), and no more ext_proc streams can be in flight
than gRPC Core will hold for epick's loop (epick.api.grpc_server; its default of 1,000
refused streams at 2,000 concurrent), nor leaves one waiting longer than gRPC Core holds it
before cancelling it (its default of 30 s cut streamed requests at 2,000 concurrent:
Envoy's FULL_DUPLEX_STREAMED mode has no message timer to fire first).
"""

from __future__ import annotations

import pytest
import yaml
from envoy_harness import ALL_EXAMPLES as EXAMPLES

from epick.api.grpc_server import MAX_PENDING_CALLS, MAX_UNREQUESTED_S

CONCURRENT = 2_000


def _clusters(path) -> dict[str, dict]:
    doc = yaml.safe_load(path.read_text())
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_circuit_breakers_above_thousands_of_streams(mode):
    for name, cluster in _clusters(EXAMPLES[mode]).items():
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        for key in ("max_connections", "max_pending_requests", "max_requests"):
            assert limits[key] >= CONCURRENT, (mode, name, key)


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_ext_proc_streams_never_outnumber_what_epick_holds(mode):
    cluster = _clusters(EXAMPLES[mode])["epick_ext_proc"]
    (limits,) = cluster["circuit_breakers"]["thresholds"]
    assert limits["max_requests"] <= MAX_PENDING_CALLS
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    per_connection = options["explicit_http_config"]["http2_protocol_options"][
        "max_concurrent_streams"]
    assert per_connection <= CONCURRENT // 10  # many connections for SO_REUSEPORT to spread


def _seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_ext_proc_connect_timeout_outlasts_a_busy_envoy(mode):
    """A connect that fails fails every stream waiting in Envoy's pool: at 0.25 s, one
    timed-out connect failed 861 requests at once (connects took up to 1.15 s at 2,000
    concurrent on 2 cores)."""
    cluster = _clusters(EXAMPLES[mode])["epick_ext_proc"]
    assert _seconds(cluster["connect_timeout"]) >= 2


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_message_timeout_outlasts_a_burst_of_thousands(mode):
    """5 s lost half of 4,000 BUFFERED requests to 504 at 2,000 concurrent on one epick
    process; the streaming file's 30 s lost none."""
    doc = yaml.safe_load(EXAMPLES[mode].read_text())
    (listener,) = doc["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    assert _seconds(ext_proc["typed_config"]["message_timeout"]) >= 30


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_epick_holds_a_waiting_stream_longer_than_envoy_waits_for_it(mode):
    """Every wait Envoy bounds (message_timeout, the idle timeouts) ends before gRPC Core
    would cancel the stream in epick: Envoy's bound fires and counts, Core's never does
    (tests/envoy/test_busy_loop.py)."""
    doc = yaml.safe_load(EXAMPLES[mode].read_text())
    (listener,) = doc["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    waits = [_seconds(ext_proc["typed_config"]["message_timeout"]),
             _seconds(hcm["stream_idle_timeout"])]
    waits += [_seconds(route["route"]["idle_timeout"])
              for vhost in hcm["route_config"]["virtual_hosts"] for route in vhost["routes"]]
    assert max(waits) < MAX_UNREQUESTED_S, (mode, waits)
