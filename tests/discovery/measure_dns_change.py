"""How long from a DNS change to the first Pick that uses the new endpoint.

    .venv/bin/python tests/discovery/measure_dns_change.py [--changes 10] [--ttl 1]

dnsmasq (TTL ``--ttl``, the source's ``min_ttl_s`` the same) answers ``fleet.test`` with
one of two simulated replicas (127.0.0.2 / 127.0.0.3, same port); each change swaps it
for the other (rewrite the hosts file, SIGHUP) and the clock runs until a Pick (polled
every 5 ms over gRPC) returns the new one: lookup wait (up to the TTL) + the lookup +
the pool's first scrape of the new endpoint (20 ms rounds) + publishing. Prints each
change and p50/p99. A measurement, not a test (latency goals live outside the suite).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]

from dnsmasq import Dnsmasq, free_port  # noqa: E402
from epick_service import make_config, running  # noqa: E402
from fleet_thread import replicas  # noqa: E402

from epick import config as cfg  # noqa: E402
from epick.api.gen.epick.v1 import picker_pb2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=10)
    ap.add_argument("--ttl", type=int, default=1, help="record TTL and min_ttl_s (s)")
    ap.add_argument("--seed", type=int, default=0, help="of the pauses between changes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="epick-dns-measure-"))
    port = free_port("127.0.0.2")
    ips = ["127.0.0.2", "127.0.0.3"]
    with replicas([(ip, port) for ip in ips]) as addresses, \
            Dnsmasq(tmp, hosts={"fleet.test": [ips[0]]}, local_ttl=args.ttl) as dns:
        pool = msgspec.convert({
            "scrape_interval_ms": 20, "stale_after_ms": 400, "timeout_ms": 300,
            "sources": [{"kind": "dns", "name": "fleet.test", "port": port,
                         "resolver": dns.resolver, "min_ttl_s": args.ttl,
                         "max_ttl_s": max(args.ttl, 30)}]}, cfg.PoolConfig)
        config = msgspec.structs.replace(make_config([], policies=("load",), tmp=tmp),
                                         pool=pool)
        with running(config) as svc:
            def pick() -> str:
                try:
                    return svc.picker.Pick(picker_pb2.PickRequest(model="sim-base"),
                                           timeout=2).endpoint
                except Exception:
                    return ""

            deadline = time.monotonic() + 10
            while pick() != addresses[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            took = []
            rng = random.Random(args.seed)
            for i in range(args.changes):
                new = (i + 1) % 2
                # Changes land at a random point of the re-resolution period.
                time.sleep(rng.uniform(0, args.ttl))
                dns.set_hosts({"fleet.test": [ips[new]]})
                t0 = time.monotonic()
                dns.reload()
                while pick() != addresses[new]:
                    if time.monotonic() - t0 > 10 + 2 * args.ttl:
                        raise SystemExit(f"change {i}: {addresses[new]} never picked")
                    time.sleep(0.005)
                took.append(time.monotonic() - t0)
                print(f"change {i + 1}: -> {addresses[new]} picked after "
                      f"{took[-1] * 1000:.0f} ms", flush=True)
    took.sort()
    p50 = took[len(took) // 2]
    p99 = took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]
    print(f"TTL {args.ttl} s, {len(took)} changes: p50 {p50 * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms, max {took[-1] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
