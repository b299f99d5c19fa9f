"""`epick bench pick`: the host's own per-pick cost, in process (no gRPC).

For 8, 64 and 256 endpoints it runs the same request stream through the scheduler twice,
interleaved in one run — once with the three default policies as WASM modules, once with
the same three written in plain Python (epick.bench.pypolicies) — and prints p50/p99 per
pick and the WASM ÷ Python ratio. Absolute times drift on a noisy machine; the ratio,
measured side by side, holds.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from epick import abi
from epick.bench.pypolicies import PyLoad, PyLoraAffinity, PyPrefixCache
from epick.config import resolve_module
from epick.interfaces import PoolView
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler

__all__ = ["synthetic_view", "request_stream", "wasm_policies", "python_policies", "run"]

ADAPTERS = [f"adapter-{i}" for i in range(16)]
SYSTEM_PROMPTS = [f"You are assistant #{t}. " * 30 for t in range(24)]


def synthetic_view(n: int, *, seed: int = 0, version: int = 1) -> PoolView:
    """``n`` endpoints with varied queues, KV use and LoRA sets (max_lora 4)."""
    rng = random.Random(seed)
    endpoints = []
    for i in range(n):
        loaded = rng.sample(ADAPTERS, rng.randint(0, 4))
        endpoints.append(abi.EndpointMetrics(
            address=f"10.{i // 250}.{i % 250}.1:8000",
            waiting=rng.randint(0, 20), running=rng.randint(0, 64),
            kv_usage=round(rng.random(), 3),
            running_adapters=tuple(loaded[:3]), waiting_adapters=tuple(loaded[3:]),
            max_lora=4, num_gpu_blocks=8192, block_size=16,
        ))
    return PoolView.build(abi.Snapshot(version=version, timestamp_ms=1_700_000_000_000,
                                           endpoints=tuple(endpoints)))


def request_stream(count: int, *, seed: int = 1) -> list[abi.Request]:
    """Requests mixing adapters (and base model) and shared ~700-byte system prompts."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        prompt = rng.choice(SYSTEM_PROMPTS) + f"Question {rng.randrange(10**6)}: why?"
        adapter = rng.choice(ADAPTERS) if rng.random() < 0.7 else ""
        out.append(abi.Request(request_id=f"r{k}", model="llama", adapter=adapter,
                               prompt=prompt, seed=rng.getrandbits(64)))
    return out


def wasm_policies(runtime) -> PolicySet:
    from epick.runtime import WasmPolicy

    entries = []
    for name in ("load", "prefix-cache", "lora-affinity"):
        module = runtime.compile(resolve_module(name).read_bytes(), name=name)
        entries.append(PolicyEntry(name, WasmPolicy(module, {}, name=name)))
    return PolicySet(tuple(entries))


def python_policies() -> PolicySet:
    return PolicySet.of(PolicyEntry("load", PyLoad()), PolicyEntry("prefix-cache", PyPrefixCache()),
                        PolicyEntry("lora-affinity", PyLoraAffinity()))


@dataclass
class Result:
    endpoints: int
    impl: str
    samples_us: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def p99(self) -> float:
        s = sorted(self.samples_us)
        return s[min(len(s) - 1, int(len(s) * 0.99))]


def _time_picks(scheduler: Scheduler, requests, samples: list[float]) -> None:
    perf = time.perf_counter
    for r in requests:
        t0 = perf()
        d = scheduler.schedule(r)
        t1 = perf()
        scheduler.complete(decision_id=d.decision_id)
        samples.append((t1 - t0) * 1e6)


def run(sizes=(8, 64, 256), picks: int = 3000, rounds: int = 5, warmup: int = 300):
    """Measure; returns a list of :class:`Result` (WASM and Python per size)."""
    from epick.runtime import Runtime

    results = []
    with Runtime() as runtime:
        for n in sizes:
            view = synthetic_view(n)
            scheds = {
                "wasm": Scheduler(lambda p=view: p, wasm_policies(runtime)),
                "python": Scheduler(lambda p=view: p, python_policies()),
            }
            reqs = request_stream(picks)
            samples = {k: [] for k in scheds}
            for s in scheds.values():
                _time_picks(s, request_stream(warmup, seed=99), [])
            # Interleave implementations in rounds so drift hits both alike.
            chunk = max(1, picks // rounds)
            for start in range(0, picks, chunk):
                for k, s in scheds.items():
                    _time_picks(s, reqs[start:start + chunk], samples[k])
            results += [Result(n, k, v) for k, v in samples.items()]
    return results


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rich.console import Console
    from rich.table import Table

    argv = list(argv or [])
    if "--grpc" in argv:
        from epick.bench.grpc import main as grpc_main

        return grpc_main([a for a in argv if a != "--grpc"])
    ap = argparse.ArgumentParser(prog="epick bench pick", description=__doc__)
    ap.add_argument("--grpc", action="store_true",
                    help="measure Pick over gRPC against a no-op RPC instead (epick.bench.grpc)")
    ap.add_argument("--picks", type=int, default=3000, help="timed picks per size and impl")
    ap.add_argument("--sizes", default="8,64,256", help="endpoint counts, comma-separated")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    results = run(sizes, picks=args.picks)
    table = Table(title="epick bench pick — in process, 3 policies (load, prefix-cache, "
                        "lora-affinity), per-pick µs")
    for col in ("endpoints", "WASM p50", "WASM p99", "Python p50", "Python p99",
                "WASM÷Python p50", "WASM÷Python p99"):
        table.add_column(col, justify="right")
    by = {(r.endpoints, r.impl): r for r in results}
    for n in sizes:
        w, p = by[(n, "wasm")], by[(n, "python")]
        table.add_row(str(n), f"{w.p50:.1f}", f"{w.p99:.1f}", f"{p.p50:.1f}", f"{p.p99:.1f}",
                      f"{w.p50 / p.p50:.2f}", f"{w.p99 / p.p99:.2f}")
    Console(width=140).print(table)
    print("goals at 64 endpoints: WASM p50 <= 50 µs, p99 <= 200 µs, WASM÷Python <= 1.0")
    return 0
