"""What scraping costs: ``epick bench scrape --endpoints 64 --interval-ms 50`` (or
``python -m epick.bench.scrape``).

Starts N model-server stand-ins in a child process (stdlib HTTP servers, keep-alive,
each serving a vLLM-v1-sized page: the five gauges the pool reads plus 14 histograms it
skips, ~37 KB), runs a :class:`~epick.pool.Pool` over them in this process for a few
seconds and prints scrapes per second, this process's CPU per scrape and its share of
one core — once with pages parsed on this process's event loop (``scrape_in = "loop"``)
and once by the scrape worker process (``"process"``, whose own CPU is printed beside).
The servers' own CPU is not counted. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio

from epick.pool import SCRAPE_IN, Pool, reader_for
from epick.pool.spec import EndpointSpec
from epick.pool.worker import ScrapeWorker

_MODEL = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
_BUCKETS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
            "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0",
            "640.0", "2560.0", "+Inf")  # fmt: skip


def vllm_v1_page() -> str:
    """A page shaped like vLLM v1's: the routing gauges among many histograms."""
    lines = []
    for i in range(14):
        name = f"vllm:histogram_{i}_seconds"
        lines += [f"# HELP {name} A latency histogram.", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{{_MODEL},le="{le}"}} 123.0' for le in _BUCKETS]
        lines += [f"{name}_count{{{_MODEL}}} 123.0", f"{name}_sum{{{_MODEL}}} 45.6"]
    lines += [
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{_MODEL}}} 3.0",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{_MODEL}}} 7.0",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{_MODEL}}} 0.4",
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
        'waiting_lora_adapters=""} 1.7e9',
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="30000"} 1.0',
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _serve(n: int) -> None:
    """Child process: n servers; print their addresses, then their total hits at EOF."""
    body = vllm_v1_page().encode()
    hits = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_GET(self) -> None:  # noqa: N802
            hits[0] += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(n)]
    for server in servers:
        server.daemon_threads = True  # the child exits when the parent is done with it
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(" ".join(f"127.0.0.1:{s.server_address[1]}" for s in servers), flush=True)
    sys.stdin.read()
    print(hits[0], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epick bench scrape", description=__doc__)
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--interval-ms", type=float, default=50)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--scrape-in", choices=(*SCRAPE_IN, "both"), default="both")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0

    child = subprocess.Popen(
        [sys.executable, "-m", "epick.bench.scrape", "--serve", str(args.endpoints)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    modes = SCRAPE_IN if args.scrape_in == "both" else (args.scrape_in,)
    try:
        addresses = child.stdout.readline().split()
        for mode in modes:
            _measure(addresses, mode, args)
    finally:
        child.kill()
        child.wait()
    return 0


def _cpu_of(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(addresses: list[str], mode: str, args: argparse.Namespace) -> None:
    scrapes = [0]

    def count(_address: str) -> None:
        scrapes[0] += 1

    reader = reader_for(mode)
    pool = Pool([EndpointSpec(address=a) for a in addresses],
                scrape_interval_ms=args.interval_ms, on_scrape=count, reader=reader)

    async def measure() -> tuple[float, float, float]:
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)
            worker = reader.pid if isinstance(reader, ScrapeWorker) else None
            w0 = _cpu_of(worker) if worker else 0.0
            n0 = scrapes[0]
            cpu, wall = time.process_time(), time.perf_counter()
            await anyio.sleep(args.seconds)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            w = _cpu_of(worker) - w0 if worker else 0.0
            scrapes[0] -= n0
            tg.cancel_scope.cancel()
        return cpu, wall, w

    cpu, wall, worker_cpu = anyio.run(measure)
    n = max(scrapes[0], 1)
    wanted = args.endpoints * 1000 / args.interval_ms
    fresh = sum(s.fresh for s in pool.status())
    extra = (f"; worker {worker_cpu / n * 1e6:.0f} us per scrape, "
             f"{worker_cpu / wall * 100:.0f}% of a core" if mode == "process" else "")
    print(
        f"scrape_in={mode}: {args.endpoints} endpoints every {args.interval_ms:g} ms for "
        f"{wall:.1f} s: {scrapes[0] / wall:.0f} scrapes/s (schedule asks {wanted:.0f}/s), "
        f"{cpu / n * 1e6:.0f} us CPU per scrape in the pool's process, at "
        f"{cpu / wall * 100:.0f}% of one core{extra}, {fresh}/{args.endpoints} fresh"
    )


if __name__ == "__main__":
    sys.exit(main())
