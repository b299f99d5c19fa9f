"""What fuel and the epoch deadline cost, per shipped policy, side by side in one run.

    epick bench sandbox-overhead [--rounds 21] [--calls 1000]

For every policy in host/builtin/ that scores, four engines run the same call —
``WasmPolicy.score`` over 64 endpoints (resident snapshot when the policy exports
``set_snapshot``), the path a pick takes:

- ``none``   neither fuel nor epoch interruption (what the guest code costs bare);
- ``epoch``  epoch interruption only (the old limit);
- ``fuel``   fuel only;
- ``both``   fuel + epoch (what the service runs).

Rounds are interleaved (none, epoch, fuel, both, none, …) so a noisy neighbour hits all
four alike; the table prints the median µs per call of each and the ratio to ``none``.
The fuel column also gives the fuel one call used (deterministic). A second table times
the guest call alone (``GuestFunc.call3`` on an input already in guest memory: the
guest's code plus ~1 µs of ctypes), where the instrumentation's share shows undiluted
by the host's per-call work. Numbers, not goals.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from epick import abi
from epick.bench.timing import snapshot
from epick.config import BUILTIN_POLICY_DIR
from epick.interfaces import Cycle, PoolView
from epick.runtime import Limits, Runtime, WasmPolicy

DIST = BUILTIN_POLICY_DIR
ENGINES = {"none": (False, False), "epoch": (False, True), "fuel": (True, False),
           "both": (True, True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench sandbox-overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args(argv)
    runtimes = {k: Runtime(Limits(), fuel=f, epoch=e) for k, (f, e) in ENGINES.items()}
    view = PoolView.build(snapshot(64))
    everyone = tuple(range(64))
    request = abi.Request(model="m", adapter="a", prompt="You are a helpful assistant. " * 20)
    header = (f"{'policy':<14}" + "".join(f"{k + ' µs':>11}" for k in ENGINES)
              + f"{'epoch x':>9}{'fuel x':>8}{'both x':>8}{'fuel/call':>11}")
    rows: dict[str, list[str]] = {}
    try:
        for path in sorted(DIST.glob("*.wasm")):
            data = path.read_bytes()
            plugins, cycles = {}, {}
            for key, rt in runtimes.items():
                mod = rt.compile(data, name=path.stem)
                if "score" not in mod.exports:
                    break
                plugins[key] = WasmPolicy(mod)
                cycles[key] = Cycle(view=view, request=request)
            if not plugins:
                continue
            for key, plugin in plugins.items():  # warm up: snapshot delivered, caches hot
                for _ in range(200):
                    plugin.score(cycles[key], everyone)
            fuel = plugins["both"].supervisor.instance.fuel_used("score")
            guest = {}
            for key, plugin in plugins.items():  # the last input is still in guest memory
                inst = plugin.supervisor.instance
                size = len(cycles[key].score_input(everyone, inline_snapshot=not plugin._resident))
                guest[key] = (inst._score.call3, inst._in_ptr, size, inst._out_ptr)
            samples: dict[str, list[float]] = {k: [] for k in plugins}
            raw: dict[str, list[float]] = {k: [] for k in plugins}
            for _ in range(args.rounds):
                for key, plugin in plugins.items():
                    c, score = cycles[key], plugin.score
                    t0 = time.perf_counter_ns()
                    for _ in range(args.calls):
                        score(c, everyone)
                    samples[key].append((time.perf_counter_ns() - t0) / args.calls / 1000)
                    call, a, b, out = guest[key]
                    t0 = time.perf_counter_ns()
                    for _ in range(args.calls):
                        call(a, b, out)
                    raw[key].append((time.perf_counter_ns() - t0) / args.calls / 1000)
            for table, data in (("WasmPolicy.score", samples), ("guest call only", raw)):
                med = {k: statistics.median(v) for k, v in data.items()}
                rows.setdefault(table, []).append(
                    f"{path.stem:<14}" + "".join(f"{med[k]:11.2f}" for k in ENGINES)
                    + "".join(f"{med[k] / med['none']:9.3f}" if k == "epoch" else
                              f"{med[k] / med['none']:8.3f}" for k in ("epoch", "fuel", "both"))
                    + f"{fuel:>11,}")
            for plugin in plugins.values():
                plugin.close()
    finally:
        for rt in runtimes.values():
            rt.close()
    for table, lines in rows.items():
        print(f"{table}, 64 endpoints:\n{header}")
        print("\n".join(lines))
    print(f"({args.rounds} interleaved rounds x {args.calls} calls; x = median / median of "
          f"'none')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
