"""`epick bench dataplanes`: the table's "added" columns and the goal lines, from phases
made up here (the runs themselves need the proxies: `make test-dataplanes` territory)."""

from __future__ import annotations

from epick.bench.grpc import Phase
from epick.bench.proxies import baseline, table


def phase(*ms: float) -> Phase:
    p = Phase()
    p.record([x * 1e3 for x in ms], 1.0)
    return p


def test_each_routed_path_is_compared_with_its_own_proxys_round_robin():
    assert baseline("nginx + epick") == "nginx round robin"
    assert baseline("nginx + epick @abc123") == "nginx round robin"
    assert baseline("envoy + ext_proc streamed") == "envoy round robin"
    assert baseline("haproxy round robin") is None


def test_added_latency_and_the_goal_lines():
    res = {"nginx round robin": {1: phase(1, 1, 1)}, "nginx + epick": {1: phase(2, 2, 2)},
           "haproxy round robin": {1: phase(1, 1, 1)}, "haproxy + epick": {1: phase(5, 5, 5)},
           "envoy round robin": {1: phase(1, 1, 1)}, "envoy + ext_proc": {1: phase(3, 3, 3)}}
    lines, doc = table(res)
    assert doc["nginx + epick"]["1"]["added_p50_ms"] == 1.0
    assert doc["envoy + ext_proc"]["1"]["added_p50_ms"] == 2.0
    assert "added_p50_ms" not in doc["nginx round robin"]["1"]
    goals = [ln for ln in lines if ln.startswith("goal")]
    assert goals == [
        "goal nginx added p50 <= Envoy ext_proc's at 1 client(s): 1.00 vs 2.00 ms met",
        "goal haproxy added p50 <= Envoy ext_proc's at 1 client(s): 4.00 vs 2.00 ms MISSED"]
