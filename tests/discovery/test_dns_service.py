"""`epick serve` with a `[[pool.sources]]` DNS source against a real DNS server (dnsmasq):
a record added or removed adds or removes the endpoint without a restart of epick, the
pool scrapes the new endpoint and Pick uses it. Simulated replicas (epick.sim) serve on
loopback addresses (127.0.0.2, 127.0.0.3: Linux routes all of 127/8 to lo)."""

from __future__ import annotations

import time

import grpc
import msgspec
from dnsmasq import Dnsmasq, free_port
from epick_service import config_text, make_config, running
from fleet_thread import replicas

from epick import config as cfg
from epick.api.gen.epick.v1 import picker_pb2

MODEL = "sim-base"


def with_sources(config: cfg.Config, sources: list[dict], endpoints=()) -> cfg.Config:
    pool = msgspec.convert({"scrape_interval_ms": 20, "stale_after_ms": 400,
                            "timeout_ms": 300, "sources": sources,
                            "endpoints": list(endpoints)}, cfg.PoolConfig)
    return msgspec.structs.replace(config, pool=pool)


def wait_for(cond, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def fresh(svc) -> set[str]:
    return {s.address for s in svc.call(svc.service.pool.status) if s.fresh}


def members(svc) -> set[str]:
    return {s.address for s in svc.call(svc.service.pool.status)}


def candidates(svc) -> set[str]:
    """The endpoints a Pick considered (explain lists every one in the snapshot)."""
    try:
        reply = svc.picker.Pick(picker_pb2.PickRequest(model=MODEL, explain=True), timeout=5)
    except grpc.RpcError:
        return set()
    return {c.endpoint for c in reply.explanation.candidates if c.filtered_by == ""}


def test_a_records_added_and_removed_change_the_pool_without_a_restart(tmp_path):
    port = free_port("127.0.0.2")
    with replicas([("127.0.0.2", port), ("127.0.0.3", port)]) as (first, second), \
            Dnsmasq(tmp_path, hosts={"fleet.test": ["127.0.0.2"]}) as dns:
        source = {"kind": "dns", "name": "fleet.test", "port": port, "resolver": dns.resolver,
                  "min_ttl_s": 0.1, "max_ttl_s": 1.0,
                  "template": {"labels": {"found-by": "dns"}}}
        config = with_sources(make_config([], policies=("load",), tmp=tmp_path), [source])
        with running(config) as svc:
            assert members(svc) == {first}
            wait_for(lambda: fresh(svc) == {first}, what="the first replica scraped")
            assert candidates(svc) == {first}

            dns.set_hosts({"fleet.test": ["127.0.0.2", "127.0.0.3"]})
            dns.reload()
            wait_for(lambda: fresh(svc) == {first, second}, what="the added record scraped")
            wait_for(lambda: candidates(svc) == {first, second}, what="Pick sees both")
            info = svc.call(lambda: svc.service.pool.view.info)
            assert {lbl for i in info for lbl in i.labels} == {("found-by", "dns")}

            dns.set_hosts({"fleet.test": ["127.0.0.3"]})
            dns.reload()
            wait_for(lambda: members(svc) == {second}, what="the removed record gone")
            picked = {svc.picker.Pick(picker_pb2.PickRequest(model=MODEL), timeout=5).endpoint
                      for _ in range(20)}
            assert picked == {second}


def test_srv_records_give_each_endpoint_its_port(tmp_path):
    with replicas([("127.0.0.1", 0), ("127.0.0.1", 0)]) as (first, second):
        p1, p2 = (int(a.rsplit(":", 1)[1]) for a in (first, second))
        srv = [("_vllm._tcp.fleet.test", "r1.fleet.test", p1),
               ("_vllm._tcp.fleet.test", "r2.fleet.test", p2)]
        # r2 does not resolve yet: its SRV record gives no endpoint.
        with Dnsmasq(tmp_path, hosts={"r1.fleet.test": ["127.0.0.1"]}, srv=srv) as dns:
            source = {"kind": "dns", "name": "_vllm._tcp.fleet.test",
                      "resolver": dns.resolver, "min_ttl_s": 0.1, "max_ttl_s": 1.0}
            config = with_sources(make_config([], policies=("load",), tmp=tmp_path), [source])
            with running(config) as svc:
                wait_for(lambda: fresh(svc) == {first}, what="r1 scraped")
                dns.set_hosts({"r1.fleet.test": ["127.0.0.1"], "r2.fleet.test": ["127.0.0.1"]})
                dns.reload()
                wait_for(lambda: fresh(svc) == {first, second}, what="r2 scraped")
                wait_for(lambda: candidates(svc) == {first, second}, what="Pick sees both")


def test_a_static_endpoint_at_a_discovered_address_keeps_its_static_spec(tmp_path):
    with replicas([("127.0.0.2", 0)]) as (address,), \
            Dnsmasq(tmp_path, hosts={"fleet.test": ["127.0.0.2"]}) as dns:
        port = int(address.rsplit(":", 1)[1])
        source = {"kind": "dns", "name": "fleet.test", "port": port, "resolver": dns.resolver,
                  "min_ttl_s": 0.1, "template": {"labels": {"from": "dns"}}}
        config = with_sources(make_config([], policies=("load",), tmp=tmp_path), [source],
                              endpoints=[{"address": address, "labels": {"from": "static"}}])
        with running(config) as svc:
            wait_for(lambda: fresh(svc) == {address}, what="scraped")
            specs = svc.call(lambda: svc.service.sources.endpoints)
            assert [(s.address, s.labels) for s in specs] == [(address, {"from": "static"})]
            found = svc.call(svc.service.sources.found)
            assert [s.labels for s in found["dns:fleet.test"]] == [{"from": "dns"}]


def test_a_config_reload_adds_and_removes_a_source_and_keeps_the_static_list(tmp_path):
    with replicas([("127.0.0.2", 0), ("127.0.0.3", 0)]) as (static, found), \
            Dnsmasq(tmp_path, hosts={"fleet.test": ["127.0.0.3"]}) as dns:
        port = int(found.rsplit(":", 1)[1])
        path = tmp_path / "epick.toml"
        base = config_text([static], tmp=tmp_path)
        path.write_text(base)
        source = (f'[[pool.sources]]\nkind = "dns"\nname = "fleet.test"\nport = {port}\n'
                  f'resolver = "{dns.resolver}"\nmin_ttl_s = 0.1\n')
        with running(cfg.load(path), config_path=path) as svc:
            wait_for(lambda: fresh(svc) == {static}, what="the static endpoint")
            path.write_text(base + source)
            assert svc.reload()
            wait_for(lambda: fresh(svc) == {static, found}, what="the source's endpoint")
            path.write_text(base)
            assert svc.reload()
            wait_for(lambda: members(svc) == {static}, what="the source's endpoint gone")
            assert svc.call(svc.service.sources.found) == {}
