"""How long from a pod event to the first Pick that uses (or stops using) its endpoint,
with the InferencePool source watching the Kubernetes API emulator (kmock).

    .venv/bin/python tests/discovery/measure_pod_change.py [--changes 20] [--seed 0]

Two simulated replicas (127.0.0.2 / 127.0.0.3, same port) stand for two pods of one
InferencePool. Each round makes the not-Ready pod Ready ("join": the clock runs until a
Pick's candidates include it) and then the other pod not Ready ("leave": until a Pick's
candidates no longer include it). Picks are polled every 5 ms over gRPC with ``explain``.
The time is the emulator answering the PATCH + the watch event + publishing + (join
only) the pool's first scrape of the endpoint (20 ms rounds). Prints each change and
p50/p99 per kind. A measurement, not a test.
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

from dnsmasq import free_port  # noqa: E402
from epick_service import make_config, running  # noqa: E402
from fleet_thread import replicas  # noqa: E402
from kube_emulator import PODS, POOLS, emulator, pod, pool  # noqa: E402
from test_dns_service import candidates  # noqa: E402

from epick import config as cfg  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=20, help="rounds (a join and a leave)")
    ap.add_argument("--seed", type=int, default=0, help="of the pauses between changes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="epick-k8s-measure-"))
    port = free_port("127.0.0.2")
    ips = ["127.0.0.2", "127.0.0.3"]
    labels = {"app": "vllm"}
    with replicas([(ip, port) for ip in ips]) as addresses, emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=labels, ports=[port]))
        emu.create(PODS, pod("pod-0", labels=labels, ip=ips[0], ready=True))
        emu.create(PODS, pod("pod-1", labels=labels, ip=ips[1], ready=False))
        pool_cfg = msgspec.convert({
            "scrape_interval_ms": 20, "stale_after_ms": 400, "timeout_ms": 300,
            "sources": [{"kind": "inference-pool", "name": "fleet",
                         "api_server": emu.url}]}, cfg.PoolConfig)
        config = msgspec.structs.replace(make_config([], policies=("load",), tmp=tmp),
                                         pool=pool_cfg)
        with running(config) as svc:
            def until(cond, what: str) -> float:
                t0 = time.monotonic()
                while not cond(candidates(svc)):
                    if time.monotonic() - t0 > 10:
                        raise SystemExit(f"{what}: not seen in 10 s")
                    time.sleep(0.005)
                return time.monotonic() - t0

            until(lambda c: c == {addresses[0]}, "start")
            joins, leaves = [], []
            rng = random.Random(args.seed)
            for i in range(args.changes):
                new, old = (i + 1) % 2, i % 2
                time.sleep(rng.uniform(0.05, 0.3))
                t0 = time.monotonic()
                emu.set_ready(f"pod-{new}", ips[new])
                until(lambda c, a=addresses[new]: a in c, f"join {i}")
                joins.append(time.monotonic() - t0)
                time.sleep(rng.uniform(0.05, 0.3))
                t0 = time.monotonic()
                emu.set_ready(f"pod-{old}", ips[old], ready=False)
                until(lambda c, a=addresses[old]: a not in c, f"leave {i}")
                leaves.append(time.monotonic() - t0)
                print(f"round {i + 1}: {addresses[new]} joined after {joins[-1] * 1000:.0f} ms,"
                      f" {addresses[old]} left after {leaves[-1] * 1000:.0f} ms", flush=True)
    for kind, took in (("join (pod Ready -> Pick uses it)", joins),
                       ("leave (pod not Ready -> Pick stops using it)", leaves)):
        print(f"{kind}: {len(took)} changes, p50 {pct(took, 0.5) * 1000:.0f} ms, "
              f"p99 {pct(took, 0.99) * 1000:.0f} ms, max {max(took) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
