"""`epick bench pick --grpc`: Pick over real gRPC beside a no-op RPC on the same server.

Starts ``epick serve`` as a separate process against N static vLLM /metrics pages (served
from this process), waits for SERVING, then alternates phases of Pick and of the no-op —
the standard ``grpc.health.v1.Health/Check``, a unary call that does nothing — first with
one client thread (latency), then with ``--threads`` (throughput). Prints picks/s and
p50/p99 for both RPCs and their ratios, per endpoint count.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc

__all__ = ["main"]


def _page(i: int, rng: random.Random) -> bytes:
    adapters = ",".join(rng.sample([f"adapter-{k}" for k in range(16)], 2))
    return (
        f'vllm:num_requests_waiting{{model_name="llama"}} {rng.randint(0, 20)}\n'
        f'vllm:num_requests_running{{model_name="llama"}} {rng.randint(0, 60)}\n'
        f'vllm:kv_cache_usage_perc{{model_name="llama"}} {rng.random():.3f}\n'
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{adapters}",'
        f'waiting_lora_adapters=""}} 1.7e9\n'
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="8192"}} 1\n'
    ).encode()


class _Pages(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, n: int):
        rng = random.Random(5)
        self.pages = [_page(i, rng) for i in range(n)]

        pages = self.pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                try:
                    body = pages[int(self.path.rsplit("/", 1)[1])]
                except (ValueError, IndexError):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def _config(n: int, pages_port: int, scrape_ms: int) -> str:
    lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"', 'metrics_listen = ""',
             "[admin]", 'listen = ""', "[pool]", f"scrape_interval_ms = {scrape_ms}"]
    for i in range(n):
        lines += ["[[pool.endpoints]]", f'address = "10.9.{i // 250}.{i % 250}:8000"',
                  f'metrics_url = "http://127.0.0.1:{pages_port}/metrics/{i}"']
    for name in ("load", "prefix-cache", "lora-affinity"):
        lines += ["[[policies]]", f'name = "{name}"', f'module = "{name}"']
    return "\n".join(lines) + "\n"


def _start_server(config_path: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "epick.cli", "--log-level", "WARNING", "serve",
         "--config", str(config_path)],
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    if "serving Pick on" not in line:
        proc.kill()
        raise RuntimeError(f"epick serve did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def _requests(count: int) -> list[picker_pb2.PickRequest]:
    rng = random.Random(3)
    prompts = [f"You are assistant #{t}. " * 30 for t in range(24)]
    return [
        picker_pb2.PickRequest(
            request_id=f"b{k}", model="llama",
            adapter=f"adapter-{rng.randrange(16)}" if rng.random() < 0.7 else "",
            prompt=rng.choice(prompts) + f"Q{k}", seed=k)
        for k in range(count)
    ]


def _phase(target: str, kind: str, threads: int, seconds: float, reqs) -> list[float]:
    """Run one phase; return per-call latencies in µs (all threads)."""
    out: list[list[float]] = [[] for _ in range(threads)]
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        ch = grpc.insecure_channel(target)
        if kind == "pick":
            stub = picker_pb2_grpc.EndpointPickerStub(ch)
            call, msgs = stub.Pick, reqs
        else:
            stub = health_pb2_grpc.HealthStub(ch)
            call, msgs = stub.Check, [health_pb2.HealthCheckRequest()]
        lat = out[k]
        i = k
        perf = time.perf_counter
        while perf() < stop:
            t0 = perf()
            call(msgs[i % len(msgs)])
            lat.append((perf() - t0) * 1e6)
            i += threads
        ch.close()

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return [x for lat in out for x in lat]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def measure(n: int, *, threads: int, seconds: float, rounds: int, scrape_ms: int) -> dict:
    pages = _Pages(n)
    th = threading.Thread(target=pages.serve_forever, daemon=True)
    th.start()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(_config(n, pages.server_address[1], scrape_ms))
        proc, target = _start_server(cfg)
        try:
            reqs = _requests(4096)
            ch = grpc.insecure_channel(target)
            picker_pb2_grpc.EndpointPickerStub(ch).Pick(reqs[0], timeout=5)  # warm, and check
            ch.close()
            res = {"endpoints": n}
            for label, nthreads in (("seq", 1), ("par", threads)):
                lat = {"pick": [], "noop": []}
                count = {"pick": 0, "noop": 0}
                secs = {"pick": 0.0, "noop": 0.0}
                for _ in range(rounds):
                    for kind in ("noop", "pick"):
                        t0 = time.perf_counter()
                        xs = _phase(target, kind, nthreads, seconds / rounds, reqs)
                        secs[kind] += time.perf_counter() - t0
                        lat[kind] += xs
                        count[kind] += len(xs)
                for kind in ("pick", "noop"):
                    res[f"{label}_{kind}_p50"] = statistics.median(lat[kind])
                    res[f"{label}_{kind}_p99"] = _pct(lat[kind], 0.99)
                    res[f"{label}_{kind}_rps"] = count[kind] / secs[kind]
            return res
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            pages.shutdown()


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="epick bench pick --grpc", description=__doc__)
    ap.add_argument("--sizes", default="8,64")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=6.0, help="per RPC kind and mode")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of noop/pick phases")
    ap.add_argument("--scrape-interval-ms", type=int, default=50)
    args = ap.parse_args(argv)
    rows = [measure(int(n), threads=args.threads, seconds=args.seconds, rounds=args.rounds,
                    scrape_ms=args.scrape_interval_ms) for n in args.sizes.split(",")]
    t = Table(title=f"epick bench pick --grpc — {os.cpu_count()} cores, scrape every "
                    f"{args.scrape_interval_ms} ms; µs per call")
    for c in ("endpoints", "mode", "Pick/s", "no-op/s", "Pick p50", "Pick p99", "no-op p50",
              "no-op p99", "Pick÷no-op p50"):
        t.add_column(c, justify="right")
    for r in rows:
        for label, mode in (("seq", "1 thread"), ("par", f"{args.threads} threads")):
            t.add_row(str(r["endpoints"]), mode, f"{r[f'{label}_pick_rps']:.0f}",
                      f"{r[f'{label}_noop_rps']:.0f}", f"{r[f'{label}_pick_p50']:.0f}",
                      f"{r[f'{label}_pick_p99']:.0f}", f"{r[f'{label}_noop_p50']:.0f}",
                      f"{r[f'{label}_noop_p99']:.0f}",
                      f"{r[f'{label}_pick_p50'] / r[f'{label}_noop_p50']:.2f}")
    Console(width=140).print(t)
    print("goals: >= 4000 picks/s from one host process on 2 cores; Pick ÷ no-op latency <= 1.3")
    return 0
