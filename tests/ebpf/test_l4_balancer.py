"""epick's eBPF L4 load balancer end to end: real replicas, a real epick, the agent
following WatchWeights, the cgroup/connect4 program in the kernel, and client processes
whose connect() the kernel rewrites. Each test records one ``RESULT`` line (printed in
the run's summary)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from ebpf_results import result
from epick_service import make_config, running
from fakes import vllm_page

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.config import WeightsConfig

VIP = "192.0.2.10"  # TEST-NET-1: never routed; connect4 swaps it before a packet exists
MAPS = {"vips", "slots", "stats"}  # lb.bpf.c's maps, as the agent pins them
SATURATED = vllm_page(waiting=50, running=20, kv=0.95)  # over [admission] thresholds


def epick(addresses, tmp: Path, policies=("load",)):
    # The [weights] defaults (threshold 0.02, 500 ms); scraped every 50 ms; generous
    # staleness so a busy machine does not make a live replica look stale.
    config = make_config(addresses, policies=policies, tmp=tmp, scrape_interval_ms=50,
                         stale_after_ms=5000, timeout_ms=2000)
    return running(msgspec.structs.replace(config, weights=WeightsConfig()))


def epick_weights(svc, **request) -> dict[str, float]:
    call = svc.picker.WatchWeights(pb.WeightsRequest(**({"model": "m"} | request)),
                                   timeout=10)
    table = next(iter(call))
    call.cancel()
    return {e.endpoint: e.weight for e in table.endpoints}


def test_new_connections_land_in_proportion_to_the_weights(
        replicas, tmp_path, agent, connect_many):
    # KV use 0 / 20 / 40 %: shares of roughly a half, a third and a fifth (softmax)
    pool = [r for kv in (0.0, 0.2, 0.4) for r in replicas(1, vllm_page(kv=kv))]
    addresses = [r.address for r in pool]
    vip = f"{VIP}:8000"
    with epick(addresses, tmp_path) as svc:
        lb = agent(svc.target, [f"{vip},model=m"])
        first = lb.table(vip, lambda e: len(e["slots"]) == 3)
        weights = epick_weights(svc)
        counts = connect_many(vip, 1000)
    assert sum(counts.values()) == 1000
    assert set(counts) <= set(addresses), counts  # every connect() reached a replica
    assert max(weights.values()) - min(weights.values()) > 0.1, weights  # a real test
    share = {a: counts[a] / 1000 for a in addresses}
    result("proportion", weights={a: round(w, 3) for a, w in weights.items()},
           connections=dict(counts), slots=first["slots"])
    for a in addresses:
        assert first["slots"][a] == pytest.approx(weights[a] * 1024, abs=1)
        assert abs(share[a] - weights[a]) <= 0.05, (a, share, weights)


def test_a_saturated_replica_loses_its_share_within_one_second(
        replicas, tmp_path, agent, connect_many):
    a, b, c = replicas(3, vllm_page(waiting=1))
    vip = f"{VIP}:8001"
    with epick([a.address, b.address, c.address], tmp_path) as svc:
        lb = agent(svc.target, [f"{vip},model=m"])
        lb.table(vip, lambda e: len(e["slots"]) == 3)
        before = connect_many(vip, 150)
        changed_at = time.time()
        b.page = SATURATED  # what the next scrape of b sees
        gone = lb.table(vip, lambda e: b.address not in e["slots"], timeout=5)
        after = connect_many(vip, 300)
    delay = gone["applied_at"] - changed_at
    result("saturated", delay_s=round(delay, 3), before=dict(before), after=dict(after),
           slots_after=gone["slots"])
    assert before[b.address] > 0
    assert delay <= 1.0
    assert after[b.address] == 0 and sum(after.values()) == 300
    assert set(after) == {a.address, c.address}


def test_a_per_adapter_virtual_address_goes_where_the_adapter_is_resident(
        replicas, tmp_path, agent, connect_many):
    resident = replicas(2, vllm_page(running_adapters="sql-lora", max_lora=1))
    others = replicas(2, vllm_page(running_adapters="other-lora", max_lora=1))
    addresses = [r.address for r in resident + others]
    base_vip, adapter_vip = f"{VIP}:8002", f"{VIP}:8003"
    with epick(addresses, tmp_path, policies=("load", "prefix-cache", "lora-affinity")) as svc:
        lb = agent(svc.target, [f"{base_vip},model=m", f"{adapter_vip},model=m,adapter=sql-lora"])
        lb.table(adapter_vip, lambda e: set(e["slots"]) == {r.address for r in resident})
        lb.table(base_vip, lambda e: len(e["slots"]) == 4)
        weights = epick_weights(svc, adapter="sql-lora")
        on_adapter = connect_many(adapter_vip, 1000)
        on_base = connect_many(base_vip, 400)
    there = sum(on_adapter[r.address] for r in resident)
    result("adapter", resident_share=there / 1000, adapter_vip=dict(on_adapter),
           base_vip=dict(on_base), weights={a: round(w, 3) for a, w in weights.items()})
    assert sum(on_adapter.values()) == 1000 and set(on_adapter) <= set(addresses)
    assert there >= 900
    # The base model's address is its own table: it spreads over every replica.
    assert set(on_base) == set(addresses)


def test_no_eligible_replica_refuses_the_connect_and_the_agent_cleans_up(
        replicas, tmp_path, cgroup, bpffs, agent, connect_many):
    (only,) = replicas(1, vllm_page())
    vip = f"{VIP}:8004"
    with epick([only.address], tmp_path) as svc:
        lb = agent(svc.target, [f"{vip},model=m,criticality=SHEDDABLE"])
        lb.table(vip, lambda e: e["slots"] == {only.address: 1024})
        attached = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup],
                                  capture_output=True, text=True, check=True).stdout
        assert [p["name"] for p in json.loads(attached)] == ["epick_connect4"]
        vips = json.loads(subprocess.run(["bpftool", "-j", "map", "dump", "pinned",
                                          f"{bpffs}/vips"], capture_output=True,
                                         text=True, check=True).stdout)
        assert len(vips) == 1
        assert {p.name for p in Path(bpffs).iterdir()} >= MAPS
        only.page = SATURATED  # SHEDDABLE: an empty table, every connect() refused
        lb.table(vip, lambda e: e["slots"] == {} and e["reason"])
        refused = connect_many(vip, 20)
        assert lb.stop() == 0
    assert refused == {"error EPERM": 20}
    # The agent detached its program and unpinned its maps.
    shown = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup],
                           capture_output=True, text=True, check=True).stdout
    assert json.loads(shown.strip() or "[]") == []
    # (a fresh bpffs also holds the kernel's own maps.debug and progs.debug)
    assert not {p.name for p in Path(bpffs).iterdir()} & MAPS
