"""µs per call of each built-in policy at 64 endpoints, and prefix-cache memory when full.

    epick bench policies-calls [--rounds 15] [--calls 2000] [--endpoints 64]

Through the real runtime (``epick.runtime.PolicyInstance``: input copy, ctypes call with
an epoch deadline, result copy). Rows per policy: ``score`` (or ``filter``) with the
snapshot resident (``set_snapshot`` delivered once) and inline (the whole snapshot in
every call), ``set_snapshot`` itself, and the hooks. Medians with p10/p90 across rounds.
prefix-cache is measured on a 4 KiB prompt (64 blocks) with half its blocks recorded on
every endpoint, and again with nothing recorded; then its linear memory is measured after
filling all 64 LRUs to their 31,250-hash capacity.

Numbers, not goals: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import sys
import time

from epick import abi
from epick.bench.timing import SPURIOUS, per_call_us
from epick.config import BUILTIN_POLICY_DIR
from epick.runtime import Limits, Runtime

DIST = BUILTIN_POLICY_DIR
PROMPT = "".join(f"{i:04d} lorem ipsum dolor sit amet, consectetur adipiscing elit.. " for i in range(64))




def snapshot(n: int, version: int = 1) -> abi.Snapshot:
    adapters = [f"lora-{i}" for i in range(15)]
    return abi.Snapshot(version=version, timestamp_ms=1_700_000_000_000, endpoints=tuple(
        abi.EndpointMetrics(
            address=f"10.0.{i // 250}.{i % 250}:8000", waiting=(i * 7) % 23, running=(i * 5) % 31,
            kv_usage=(i % 10) / 10, running_adapters=tuple(adapters[(i + k) % 15] for k in range(2)),
            waiting_adapters=(adapters[(i + 5) % 15],) if i % 3 == 0 else (), max_lora=3,
            num_gpu_blocks=30_000, block_size=16)
        for i in range(n)))


def request(**kw) -> abi.Request:
    base = dict(request_id="req-1", model="llama-3-8b", adapter="lora-3", prompt=PROMPT, criticality=0, seed=42)
    return abi.Request(**{**base, **kw})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench policies-calls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--endpoints", type=int, default=64)
    args = ap.parse_args(argv)
    r, c, n = args.rounds, args.calls, args.endpoints
    snap = snapshot(n)
    snap_blob = abi.encoder.encode(snap)
    cands = tuple(range(n))
    rt = Runtime(Limits())  # the production budget: 1 ms per call
    rows: list[tuple[str, tuple[float, float, float]]] = []

    def row(label: str, fn) -> None:
        rows.append((label, per_call_us(fn, r, c)))

    for name in ("load", "lora-affinity", "prefix-cache", "legacy-v1", "example-c"):
        mod = rt.compile((DIST / f"{name}.wasm").read_bytes(), name=name)
        inst = mod.instantiate({})
        export = "filter" if name == "legacy-v1" else "score"
        call = getattr(inst, export)
        inline = abi.encoder.encode(abi.ScoreInput(snapshot=snap, request=request(), candidates=cands))
        resident = abi.encoder.encode(abi.ScoreInput(snapshot=None, request=request(), candidates=cands))
        if inst.has("set_snapshot"):
            inst.set_snapshot(snap_blob)
            if name == "prefix-cache":
                half = request(prompt=PROMPT[: len(PROMPT) // 2])
                for e in snap.endpoints:
                    inst.pre_request(abi.encoder.encode(abi.PreRequestEvent(request=half, endpoint=e.address)))
            row(f"{name}.{export} (resident snapshot)", lambda: call(resident, n))
            if name == "prefix-cache":
                miss = abi.encoder.encode(abi.ScoreInput(request=request(model="other"), candidates=cands))
                row(f"{name}.{export} (resident, all miss)", lambda: call(miss, n))
                short = abi.encoder.encode(abi.ScoreInput(request=request(prompt="hi"), candidates=cands))
                row(f"{name}.{export} (resident, no whole block)", lambda: call(short, n))
            row(f"{name}.set_snapshot", lambda: inst.set_snapshot(snap_blob))
        if name == "prefix-cache":
            # a fresh instance: inline delivery must not pay for the resident one
            inst = mod.instantiate({})
            call = inst.score
        row(f"{name}.{export} (inline snapshot)", lambda: call(inline, n))
        if inst.has("pre_request"):
            ev = abi.encoder.encode(abi.PreRequestEvent(request=request(), endpoint=snap.endpoints[5].address))
            row(f"{name}.pre_request", lambda: inst.pre_request(ev))
        if inst.has("post_response"):
            done = abi.encoder.encode(abi.PostResponseEvent(request_id="req-1", adapter="lora-3",
                                                            endpoint=snap.endpoints[5].address))
            row(f"{name}.post_response", lambda: inst.post_response(done))

    width = max(len(label) for label, _ in rows)
    print(f"{'call (' + str(n) + ' endpoints)':<{width}}  median µs   p10    p90")
    for label, (med, p10, p90) in rows:
        print(f"{label:<{width}}  {med:9.2f} {p10:6.2f} {p90:6.2f}")
    print(f"({r} rounds x {c} calls; {SPURIOUS['timeouts']} calls overran the 1 ms budget and were counted)")

    # Memory of one prefix-cache instance with every LRU full (a roomy budget: filling is
    # ~8,000 pre_request calls and none may be lost to preemption).
    rt.close()
    rt = Runtime(Limits(budget_ms=1000.0))
    inst = rt.compile((DIST / "prefix-cache.wasm").read_bytes(), name="prefix-cache").instantiate({})
    inst.set_snapshot(snap_blob)
    empty = inst._memory.size
    t0 = time.perf_counter()
    for e in snap.endpoints:
        for j in range(123):  # 123 x 256 blocks > 31,250
            q = request(prompt=f"{e.address}/{j:04d}/".ljust(64, "x") * 256)
            inst.pre_request(abi.encoder.encode(abi.PreRequestEvent(request=q, endpoint=e.address)))
    fill_s = time.perf_counter() - t0
    full = inst._memory.size
    state = inst.export_state()
    print(f"prefix-cache memory: {empty / 2**20:.1f} MiB empty, {full / 2**20:.1f} MiB with {n} x 31,250 hashes "
          f"({(full - empty) / n / 1024:.0f} KiB per endpoint; filled in {fill_s:.1f} s), "
          f"{inst._memory.size / 2**20:.1f} MiB after export_state ({len(state) / 2**20:.1f} MiB of state)")
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
