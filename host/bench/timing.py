"""Shared by the call-cost benchmarks in this folder: median µs per call over rounds."""

from __future__ import annotations

import statistics
import time

from epick import abi
from epick.runtime import PolicyTimeout

#: Calls that overran the wall-clock budget (a preempted thread on a shared machine);
#: counted and reported instead of ending the run (WasmPolicy retries them itself).
SPURIOUS = {"timeouts": 0}


def per_call_us(fn, rounds: int, calls: int, *, warmup: int = 500) -> tuple[float, float, float]:
    """(median, 10th percentile, 90th percentile) of µs per call, one sample a round."""

    def call() -> None:
        try:
            fn()
        except PolicyTimeout:
            SPURIOUS["timeouts"] += 1

    for _ in range(min(calls, warmup)):
        call()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter_ns() - t0) / calls / 1000)
    samples.sort()
    q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else samples * 9
    return statistics.median(samples), q[0], q[-1]


def snapshot(n: int) -> abi.Snapshot:
    """A pool of ``n`` endpoints with varied queues, KV use and adapters (the call benches)."""
    return abi.Snapshot(
        version=1, timestamp_ms=1_700_000_000_000,
        endpoints=tuple(
            abi.EndpointMetrics(
                address=f"10.0.{i // 256}.{i % 256}:8000", waiting=i % 9, running=i % 5,
                kv_usage=(i % 10) / 10, running_adapters=("a", "b")[: i % 3],
                waiting_adapters=("c",) if i % 4 == 1 else (), max_lora=4,
            )
            for i in range(n)
        ),
    )
