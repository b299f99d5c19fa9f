"""`epick bench pick`: the host's own per-pick cost, in process (no gRPC).

For 8, 64 and 256 endpoints it runs the same request stream through the scheduler twice,
interleaved in one run — once with the three default policies as WASM modules, once with
the same three written in plain Python (epick.bench.pypolicies) — and prints p50/p99 per
pick and the WASM ÷ Python ratio. Absolute times drift on a noisy machine; the ratio,
measured side by side, holds.

``--with latency`` measures instead what one more WASM policy adds: the three defaults
beside the three defaults plus ``latency`` (the learning policy, issue 30's cost target
"Pick p50 with it ≤ 1.10× without"), interleaved in rounds in one run. Every pick is
completed with a TTFT and token counts, so the policy learns and its models, pending picks
and sessions are as in service.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from epick import abi
from epick.bench.pypolicies import PyLoad, PyLoraAffinity, PyPrefixCache
from epick.config import resolve_module
from epick.interfaces import PoolView
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler

__all__ = ["synthetic_view", "request_stream", "wasm_policies", "python_policies", "run",
           "run_with"]

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


def request_stream(count: int, *, seed: int = 1, latency: bool = False) -> list[abi.Request]:
    """Requests mixing adapters (and base model) and shared ~700-byte system prompts;
    ``latency``: a third with a TTFT SLO, a third in one of 64 sessions, all with a prompt
    token count (what the latency policy reads)."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        prompt = rng.choice(SYSTEM_PROMPTS) + f"Question {rng.randrange(10**6)}: why?"
        adapter = rng.choice(ADAPTERS) if rng.random() < 0.7 else ""
        extra = {}
        if latency:
            extra = {"prompt_tokens": len(prompt) // 4,
                     "slo_ttft_ms": 500 if rng.random() < 1 / 3 else 0,
                     "session_id": f"s{rng.randrange(64)}" if rng.random() < 1 / 3 else ""}
        # Distinct ids per stream with latency: the policy keys its pending picks by id.
        rid = f"r{seed}-{k}" if latency else f"r{k}"
        out.append(abi.Request(request_id=rid, model="llama", adapter=adapter,
                               prompt=prompt, seed=rng.getrandbits(64), **extra))
    return out


def wasm_policies(runtime, names=("load", "prefix-cache", "lora-affinity")) -> PolicySet:
    from epick.runtime import WasmPolicy

    entries = []
    for name in names:
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


def _time_picks_completed(scheduler: Scheduler, requests, samples: list[float],
                          rng: random.Random) -> None:
    """As :func:`_time_picks`, each pick completed with a TTFT and token counts (untimed)."""
    perf = time.perf_counter
    for r in requests:
        t0 = perf()
        d = scheduler.schedule(r)
        t1 = perf()
        scheduler.complete(decision_id=d.decision_id, prompt_tokens=r.prompt_tokens,
                           completion_tokens=rng.randint(2, 200),
                           ttft_s=rng.uniform(0.02, 0.4))
        samples.append((t1 - t0) * 1e6)


def run_with(extra: str, sizes=(8, 64), picks: int = 3000, rounds: int = 10,
             warmup: int = 300, noop: Path | None = None) -> list[Result]:
    """The three default WASM policies ("defaults") beside them plus ``extra``
    ("+extra"), interleaved in ``rounds`` rounds; every pick completed. ``noop`` (a built
    ``host/bench/noop`` module): also beside them plus it ("+noop"), the floor any fourth
    policy with a score and a pre_request pays (the SDK's entry and decode, the crossing,
    the host's side), so that +extra − +noop is the extra policy's own work."""
    from epick.runtime import Runtime, WasmPolicy

    base = ("load", "prefix-cache", "lora-affinity")
    results = []
    with Runtime() as runtime:
        for n in sizes:
            view = synthetic_view(n)
            scheds = {
                "defaults": Scheduler(lambda p=view: p, wasm_policies(runtime, base)),
                f"+{extra}": Scheduler(lambda p=view: p, wasm_policies(runtime, (*base, extra))),
            }
            if noop is not None:
                module = runtime.compile(noop.read_bytes(), name="noop")
                entries = (*wasm_policies(runtime, base).entries,
                           PolicyEntry("noop", WasmPolicy(module, {}, name="noop")))
                scheds["+noop"] = Scheduler(lambda p=view: p, PolicySet(entries))
            reqs = request_stream(picks, latency=True)
            samples = {k: [] for k in scheds}
            for s in scheds.values():
                _time_picks_completed(s, request_stream(warmup, seed=99, latency=True), [],
                                      random.Random(7))
            chunk = max(1, picks // rounds)
            rngs = {k: random.Random(5) for k in scheds}  # the same completions for all
            for start in range(0, picks, chunk):
                for k, s in scheds.items():
                    _time_picks_completed(s, reqs[start:start + chunk], samples[k], rngs[k])
            results += [Result(n, k, v) for k, v in samples.items()]
    return results


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
    ap.add_argument("--with", dest="extra", default="", metavar="POLICY",
                    help="instead: the 3 default WASM policies beside them plus POLICY "
                         "(e.g. latency), per-pick µs and the ratio")
    ap.add_argument("--floor", action="store_true",
                    help="with --with: also the defaults plus a no-op policy (built from "
                         "host/bench/noop with Zig), the floor a fourth policy pays")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    if args.extra:
        return _main_with(args.extra, sizes, args.picks, args.floor)
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


def _main_with(extra: str, sizes, picks: int, floor: bool) -> int:
    import tempfile

    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        noop = None
        if floor:
            from epick.bench.stages import build_noop

            noop = build_noop(Path(tmp) / "noop")
        results = run_with(extra, sizes, picks=picks, noop=noop)
    with_key = f"+{extra}"
    table = Table(title=f"epick bench pick --with {extra} — in process, WASM, every pick "
                        "completed, per-pick µs")
    cols = ["endpoints", "defaults p50", "defaults p99", f"{with_key} p50", f"{with_key} p99",
            "ratio p50", "ratio p99"]
    if floor:
        cols += ["+noop p50", "+noop÷defaults p50"]
    for col in cols:
        table.add_column(col, justify="right")
    by = {(r.endpoints, r.impl): r for r in results}
    for n in sizes:
        d, w = by[(n, "defaults")], by[(n, with_key)]
        row = [str(n), f"{d.p50:.1f}", f"{d.p99:.1f}", f"{w.p50:.1f}", f"{w.p99:.1f}",
               f"{w.p50 / d.p50:.2f}", f"{w.p99 / d.p99:.2f}"]
        if floor:
            f = by[(n, "+noop")]
            row += [f"{f.p50:.1f}", f"{f.p50 / d.p50:.2f}"]
        table.add_row(*row)
    Console(width=160).print(table)
    print("target (issue 30): Pick p50 with latency <= 1.10x without")
    return 0
