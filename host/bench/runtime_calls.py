"""µs per policy call: wasmtime's Func.__call__ vs epick.runtime's fast path, side by side.

    epick bench runtime-calls [--rounds 15] [--calls 2000]

Prints medians (and p10/p90 across rounds) of the per-call time, each round timing
``--calls`` back-to-back calls. Rows:

- trivial module (score writes one constant): ``Func.__call__`` (wasmtime-py),
  ``GuestFunc.call3`` (raw ctypes ``wasmtime_func_call_unchecked`` + epoch deadline),
  ``PolicyInstance.score`` (input copy, sentinel fill, call, count check, result copy),
  ``WasmPolicy.score`` (plus snapshot delivery check, range check, stats, breaker);
- the built policies in host/builtin/ (if present), 64 endpoints (resident snapshot
  when the policy exports ``set_snapshot``, else inline);
- and how long a guest that never returns holds the thread before ``PolicyTimeout``.

Numbers, not goals: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import wasmtime

from epick import abi
from epick.bench.timing import SPURIOUS, per_call_us, snapshot
from epick.config import BUILTIN_POLICY_DIR
from epick.interfaces import Cycle, PoolView
from epick.runtime import Limits, PolicyOutOfFuel, PolicyTimeout, Runtime, WasmPolicy

TRIVIAL = r"""
(module
  (memory (export "memory") 2)
  (global $bump (mut i32) (i32.const 1024))
  (func (export "epick_abi_version") (result i32) (i32.const 1))
  (func (export "alloc") (param $n i32) (result i32) (local $p i32)
    (local.set $p (global.get $bump))
    (global.set $bump (i32.add (global.get $bump) (local.get $n)))
    (local.get $p))
  (func (export "error_ptr") (result i32) (i32.const 0))
  (func (export "error_len") (result i32) (i32.const 0))
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param i32 i32 i32) (result i32)
    (f64.store (local.get 2) (f64.const 0.5))
    (i32.const 0)))
"""

SPIN = TRIVIAL.replace(
    "(f64.store (local.get 2) (f64.const 0.5))", "(loop $forever (br $forever))"
)

DIST = BUILTIN_POLICY_DIR




def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench runtime-calls", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    r, c = args.rounds, args.calls
    rows: list[tuple[str, tuple[float, float, float]]] = []

    with Runtime(Limits()) as rt:
        mod = rt.compile(wasmtime.wat2wasm(TRIVIAL), name="trivial")

        # wasmtime-py's own call path, on its own store (same module, same deadline).
        store = wasmtime.Store(rt.engine)
        inst = wasmtime.Instance(store, mod._module, [])
        score = inst.exports(store)["score"]
        store.set_epoch_deadline(1 << 40)
        store.set_fuel(1 << 62)
        rows.append(("trivial  Func.__call__ (wasmtime-py)", per_call_us(lambda: score(store, 0, 0, 2048), r, c)))

        pi = mod.instantiate()
        fast = pi._funcs["score"]
        out = pi._out_ptr
        rows.append(("trivial  GuestFunc.call3 (ctypes fast path)", per_call_us(lambda: fast.call3(0, 0, out), r, c)))

        blob = abi.encoder.encode(abi.ScoreInput(request=abi.Request(model="m"), candidates=(0,)))
        rows.append(("trivial  PolicyInstance.score (n=1)", per_call_us(lambda: pi.score(blob, 1), r, c)))

        wp = WasmPolicy(mod)
        view = PoolView.build(snapshot(1))
        cycle = Cycle(view=view, request=abi.Request(model="m"))
        rows.append(("trivial  WasmPolicy.score (n=1)", per_call_us(lambda: wp.score(cycle, (0,)), r, c)))

        view64 = PoolView.build(snapshot(64))
        everyone = tuple(range(64))
        for path in sorted(DIST.glob("*.wasm")):
            policy = rt.compile(path.read_bytes(), name=path.stem)
            if "score" not in policy.exports:
                continue
            pi = policy.instantiate()
            request = abi.Request(model="m", adapter="a", prompt="x" * 300)
            if pi.has("set_snapshot"):
                pi.set_snapshot(view64.encoded)
                blob = abi.encoder.encode(abi.ScoreInput(request=request, candidates=everyone))
                label = "resident"
            else:
                blob = abi.encoder.encode(
                    abi.ScoreInput(snapshot=view64.snapshot, request=request, candidates=everyone)
                )
                label = "inline"
            rows.append((f"{path.stem:<8} PolicyInstance.score (64, {label})",
                         per_call_us(lambda: pi.score(blob, 64), r, c)))
            wp = WasmPolicy(policy)
            cycle = Cycle(view=view64, request=request)
            cycle.score_input(everyone, inline_snapshot=not pi.has("set_snapshot"))  # cached per cycle
            rows.append((f"{path.stem:<8} WasmPolicy.score (64, {label})",
                         per_call_us(lambda: wp.score(cycle, everyone), r, c)))

        # How long a guest that never returns keeps the thread (fuel, then the backstop).
        spin = rt.compile(wasmtime.wat2wasm(SPIN), name="spin").instantiate()
        stopped_ms = []
        for _ in range(50):
            t0 = time.perf_counter_ns()
            try:
                spin.score(blob, 64)
            except (PolicyOutOfFuel, PolicyTimeout):
                stopped_ms.append((time.perf_counter_ns() - t0) / 1e6)
        stopped_ms.sort()

    width = max(len(name) for name, _ in rows)
    print(f"{'call':<{width}}  {'median µs':>9}  {'p10':>6}  {'p90':>6}")
    for name, (med, p10, p90) in rows:
        print(f"{name:<{width}}  {med:9.2f}  {p10:6.2f}  {p90:6.2f}")
    q = statistics.quantiles(stopped_ms, n=10)
    lim = Limits()
    print(f"spinning guest stopped after ({lim.fuel:,} fuel, {lim.budget_ms:g} ms backstop, "
          f"50 tries): median "
          f"{statistics.median(stopped_ms):.2f} ms, p10 {q[0]:.2f}, p90 {q[-1]:.2f}, "
          f"max {stopped_ms[-1]:.2f}")
    print(f"({r} rounds x {c} calls; {SPURIOUS['timeouts']} calls hit the wall-clock backstop "
          f"(preemption on a shared machine) and were counted, not retried)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
