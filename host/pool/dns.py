"""The DNS endpoint source (``kind = "dns"``): what a headless Kubernetes Service, Consul
or any DNS server says the fleet is.

- ``port`` set: ``name``'s A and AAAA records, each address at ``port``;
- ``port`` unset: ``name``'s SRV records, each target's A/AAAA addresses at the record's
  port (a target that does not resolve is left out).

Re-resolved after the answer's smallest TTL, clamped to ``[min_ttl_s, max_ttl_s]``. The
name not existing (NXDOMAIN) or having no records is an answer: the set is empty (asked
again after ``min_ttl_s``). A
failed lookup (timeout, SERVFAIL, REFUSED, network) keeps the last set, counts
``epick_discovery_errors_total{source,reason}``, logs (the first failure at WARNING, then
at most once a minute) and retries after ``min_ttl_s``, doubling up to ``max_ttl_s``.

dnspython's ``dns.asyncresolver`` (no cache of its own: every lookup asks the server), on
the asyncio loop the service runs on.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from typing import Annotated

import anyio
import dns.asyncresolver
import dns.exception
import dns.resolver
from anyio.abc import TaskStatus
from msgspec import Meta

from epick import telemetry
from epick.pool.sources import EndpointTemplate, Publish, SourceConfig, register
from epick.pool.spec import EndpointSpec

__all__ = ["DnsSourceConfig", "DnsSource", "LookupFailed", "FAILURE_LOG_EVERY_S"]

log = logging.getLogger("epick.pool.dns")

#: After the first failure is logged, repeats are logged at most this often.
FAILURE_LOG_EVERY_S = 60.0

HostPort = Annotated[str, Meta(pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?$")]


class DnsSourceConfig(SourceConfig, frozen=True, kw_only=True, tag="dns"):
    """One ``[[pool.sources]]`` table with ``kind = "dns"``."""

    name: Annotated[str, Meta(min_length=1, max_length=253,
                              pattern=r"^[A-Za-z0-9_.-]+\.?$")]
    """The DNS name: A/AAAA with ``port``, SRV without it."""
    port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    """Every address's port; unset: ``name`` is an SRV name and each record has its port."""
    resolver: HostPort | None = None
    """``ip:port`` (or ``ip``, port 53; IPv6 in brackets) of the DNS server to ask; unset: the system's
    (``/etc/resolv.conf``)."""
    min_ttl_s: Annotated[float, Meta(gt=0)] = 1.0
    """Re-resolve no sooner than this, whatever the TTL (TTL 0 answers included)."""
    max_ttl_s: Annotated[float, Meta(gt=0)] = 30.0
    """Re-resolve at least this often, whatever the TTL."""
    timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    """Bound on one lookup (all its queries)."""
    template: EndpointTemplate = EndpointTemplate()
    """Engine, labels, metrics URL, KV-event addresses of every endpoint found."""

    def __post_init__(self) -> None:
        if self.min_ttl_s > self.max_ttl_s:
            raise ValueError(f"pool.sources dns {self.name!r}: min_ttl_s {self.min_ttl_s} "
                             f"is above max_ttl_s {self.max_ttl_s}")

        if self.resolver is not None:
            host, port = self.resolver_address()
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"pool.sources dns {self.name!r}: resolver {self.resolver!r} "
                                 "is not an IP address (e.g. '10.96.0.10:53' or "
                                 "'[fd00::a]:53')") from None
            if not 0 < port < 65536:
                raise ValueError(f"pool.sources dns {self.name!r}: resolver {self.resolver!r} "
                                 "has an invalid port")

    def describe(self) -> str:
        return f"dns:{self.name}"

    def resolver_address(self) -> tuple[str, int] | None:
        if self.resolver is None:
            return None
        host, sep, port = self.resolver.rpartition(":")
        if not sep or host.endswith(":") or (not host.startswith("[") and ":" in host):
            host, port = self.resolver, "53"  # no port, or a bare IPv6 address
        return host.strip("[]"), int(port)


class LookupFailed(Exception):
    """The DNS server did not answer (``reason``: timeout|servfail|refused|network|error)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class DnsSource:
    """Runs one :class:`DnsSourceConfig` (see the module docstring)."""

    def __init__(self, config: DnsSourceConfig, *,
                 clock=time.monotonic) -> None:
        self.config = config
        self.name = config.describe()
        self._clock = clock
        resolver = dns.asyncresolver.Resolver(configure=config.resolver is None)
        address = config.resolver_address()
        if address is not None:
            resolver.nameservers = [address[0]]
            resolver.port = address[1]
        resolver.lifetime = config.timeout_s
        resolver.timeout = config.timeout_s
        self._resolver = resolver
        self._errors = {r: telemetry.DISCOVERY_ERRORS.labels(self.name, r)
                        for r in ("timeout", "servfail", "refused", "network", "error")}
        self._gauge = telemetry.DISCOVERY_ENDPOINTS.labels(self.name)
        self.failures = 0
        self._logged_at = -math.inf
        self._last_count = 0

    async def run(self, publish: Publish, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        try:
            while True:
                delay = await self._once(publish)
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(delay)
        finally:
            telemetry.DISCOVERY_ENDPOINTS.remove(self.name)

    async def _once(self, publish: Publish) -> float:
        """One lookup; publish on success. Returns the seconds until the next one."""
        cfg = self.config
        try:
            try:
                with anyio.fail_after(cfg.timeout_s):  # all the lookup's queries together
                    specs, ttl = await self.lookup()
            except TimeoutError:
                raise LookupFailed("timeout", f"{cfg.name}: no answer in {cfg.timeout_s} s"
                                   ) from None
        except LookupFailed as exc:
            self.failures += 1
            self._errors[exc.reason].inc()
            now = self._clock()
            if self.failures == 1 or now - self._logged_at >= FAILURE_LOG_EVERY_S:
                self._logged_at = now
                log.log(logging.WARNING if self.failures == 1 else logging.INFO,
                        "source %s: lookup failed (%d in a row, %s): %s; keeping the last "
                        "%d endpoints", self.name, self.failures, exc.reason, exc,
                        self._last_count)
            return min(cfg.min_ttl_s * 2 ** min(self.failures - 1, 30), cfg.max_ttl_s)
        if self.failures:
            log.info("source %s: lookup recovered after %d failures", self.name,
                     self.failures)
            self.failures = 0
        self._last_count = len(specs)
        self._gauge.set(len(specs))
        publish(specs)
        if math.isinf(ttl):  # no records: ask again soon, the fleet may be coming up
            return cfg.min_ttl_s
        return min(max(ttl, cfg.min_ttl_s), cfg.max_ttl_s)

    async def lookup(self) -> tuple[list[EndpointSpec], float]:
        """The endpoints ``name`` gives now and the smallest TTL seen (inf: no records)."""
        cfg = self.config
        template: EndpointTemplate = cfg.template
        if cfg.port is not None:
            hosts, ttl = await self._addresses(cfg.name)
            return [template.spec(h, cfg.port) for h in hosts], ttl
        records, ttl = await self._query(cfg.name, "SRV")
        # Lowest priority first, then heavier weight: the order the snapshot keeps.
        records = sorted(records, key=lambda r: (r.priority, -r.weight, str(r.target), r.port))
        specs: dict[str, EndpointSpec] = {}
        for record in records:
            hosts, host_ttl = await self._addresses(record.target.to_text())
            ttl = min(ttl, host_ttl)
            for host in hosts:
                spec = template.spec(host, record.port)
                specs.setdefault(spec.address, spec)
        return list(specs.values()), ttl

    async def _addresses(self, name: str) -> tuple[list[str], float]:
        a, ttl_a = await self._query(name, "A")
        aaaa, ttl_aaaa = await self._query(name, "AAAA")
        hosts = sorted({r.address for r in a}, key=ipaddress.ip_address)
        hosts += sorted({r.address for r in aaaa}, key=ipaddress.ip_address)
        return hosts, min(ttl_a, ttl_aaaa)

    async def _query(self, name: str, rdtype: str) -> tuple[list, float]:
        try:
            answer = await self._resolver.resolve(name, rdtype, search=False,
                                                  raise_on_no_answer=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return [], math.inf
        except dns.resolver.LifetimeTimeout as exc:
            raise LookupFailed("timeout", f"{rdtype} {name}: no answer in "
                               f"{self.config.timeout_s} s") from exc
        except dns.resolver.NoNameservers as exc:
            text = str(exc)
            reason = ("servfail" if "SERVFAIL" in text
                      else "refused" if "REFUSED" in text else "error")
            raise LookupFailed(reason, f"{rdtype} {name}: {text}") from exc
        except OSError as exc:
            raise LookupFailed("network", f"{rdtype} {name}: {exc}") from exc
        except dns.exception.DNSException as exc:
            raise LookupFailed("error", f"{rdtype} {name}: {exc}") from exc
        if answer.rrset is None:
            return [], math.inf
        return list(answer.rrset), float(answer.rrset.ttl)


register(DnsSourceConfig, DnsSource)
