"""The DNS source alone against dnsmasq: what one lookup gives, when the next one is due,
and a failed lookup keeping the last set (logs and metrics say so)."""

from __future__ import annotations

import logging
import math

import anyio
from dnsmasq import Dnsmasq

from epick import telemetry
from epick.config import PoolConfig
from epick.pool import Sources
from epick.pool.dns import DnsSource, DnsSourceConfig


def dns_config(**kw) -> DnsSourceConfig:
    import msgspec

    return msgspec.convert({"kind": "dns", **kw}, DnsSourceConfig)


def errors(source: str, reason: str) -> float:
    value = telemetry.REGISTRY.get_sample_value(
        "epick_discovery_errors_total", {"source": source, "reason": reason})
    return value or 0.0


async def test_a_and_srv_lookups_and_the_ttl_clamp(tmp_path):
    with Dnsmasq(tmp_path, hosts={"f.test": ["127.0.0.3", "127.0.0.2"], "r.test": ["10.0.0.9"]},
                 srv=[("_h._tcp.f.test", "r.test", 8123), ("_h._tcp.f.test", "gone.test", 1)],
                 local_ttl=7) as dns:
        source = DnsSource(dns_config(name="f.test", port=80, resolver=dns.resolver,
                                      min_ttl_s=1, max_ttl_s=5))
        specs, ttl = await source.lookup()
        assert [s.address for s in specs] == ["127.0.0.2:80", "127.0.0.3:80"]
        assert ttl == 7
        published = []
        assert await source._once(published.append) == 5  # TTL 7 clamped to max_ttl_s
        assert [s.address for s in published[-1]] == ["127.0.0.2:80", "127.0.0.3:80"]

        srv = DnsSource(dns_config(name="_h._tcp.f.test", resolver=dns.resolver))
        specs, _ = await srv.lookup()
        assert [s.address for s in specs] == ["10.0.0.9:8123"]  # gone.test: no address

        missing = DnsSource(dns_config(name="nobody.test", port=80, resolver=dns.resolver,
                                       min_ttl_s=0.5))
        assert await missing.lookup() == ([], math.inf)  # NXDOMAIN: an empty fleet
        assert await missing._once(published.append) == 0.5
        assert published[-1] == []


async def test_a_failed_lookup_keeps_the_last_set_and_says_so(tmp_path, caplog):
    dns = Dnsmasq(tmp_path, hosts={"keep.test": ["127.0.0.2"]}).start()
    try:
        config = dns_config(name="keep.test", port=80, resolver=dns.resolver,
                            min_ttl_s=0.05, max_ttl_s=0.2, timeout_s=0.2)
        applied = []
        runner = Sources([], [config], lambda specs: applied.append([s.address for s in specs]))
        before = errors("dns:keep.test", "timeout")
        caplog.set_level(logging.INFO, logger="epick.pool.dns")
        async with anyio.create_task_group() as tg:
            await tg.start(runner.run)
            assert applied == [["127.0.0.2:80"]]
            dns.stop()  # nobody answers now: every lookup times out
            with anyio.fail_after(10):
                while errors("dns:keep.test", "timeout") < before + 3:
                    await anyio.sleep(0.05)
            assert applied == [["127.0.0.2:80"]]
            gauge = telemetry.REGISTRY.get_sample_value("epick_discovery_endpoints",
                                                        {"source": "dns:keep.test"})
            assert gauge == 1
            dns.start()  # back on the same port, with a second address
            dns.set_hosts({"keep.test": ["127.0.0.2", "127.0.0.4"]})
            dns.reload()
            with anyio.fail_after(10):
                while applied[-1] != ["127.0.0.2:80", "127.0.0.4:80"]:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    finally:
        dns.stop()
    lines = [r for r in caplog.records if r.name == "epick.pool.dns"]
    warnings = [r for r in lines if r.levelno == logging.WARNING]
    # Rate-limited: one WARNING for the first failure, not one per failed lookup.
    assert len(warnings) == 1 and "keeping the last 1 endpoints" in warnings[0].getMessage()
    assert any("recovered" in r.getMessage() for r in lines)


def test_pool_config_lists_dns_sources():
    assert "sources" in PoolConfig.__struct_fields__
