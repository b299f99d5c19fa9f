"""From a metrics change on a replica to the new slot table in the kernel: p50 and p99.

    sudo .venv/bin/python examples/ebpf/measure_latency.py --flips 100

One ``epick serve`` (3 endpoints whose /metrics pages this script serves, scraped every
``--scrape-ms``; ``[weights]`` at its defaults unless told), the agent (agent.py, attached
to a cgroup this script creates and removes; no client connects — only the map matters).
Each flip sets one page's queue over the admission threshold (or back to 0) at a random
moment, and times until the agent reports the table without (or with) that endpoint
written and flipped in the kernel (``applied_at``: after the map update returned). Split:
``stream`` = change -> table received by the agent (scrape + hub + gRPC), ``write`` =
received -> in the kernel. Needs root and the built lb.bpf.o (make -C examples/ebpf).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from epick.bench.grpc import Setup

HERE = Path(__file__).resolve().parent
VIP = "192.0.2.10:8000"
MODEL = "llama"


class Pages:
    """``/metrics/<i>``: a vLLM-like page per endpoint; ``waiting[i]`` is its queue."""

    def __init__(self, n: int) -> None:
        self.waiting = [0] * n
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                i = int(self.path.rsplit("/", 1)[1])
                body = (f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {pages.waiting[i]}\n'
                        f'vllm:num_requests_running{{model_name="{MODEL}"}} 1\n'
                        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def cgroup2_root() -> str:
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, mnt, fs, *_ = line.split()
            if fs == "cgroup2":
                return mnt
    raise SystemExit("no cgroup v2 hierarchy mounted")


def q(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flips", type=int, default=100)
    ap.add_argument("--scrape-ms", type=int, default=50)
    ap.add_argument("--min-interval-ms", type=float, default=500.0,
                    help="[weights] min_interval_ms (500 = the default)")
    ap.add_argument("--object", default=str(HERE / "lb.bpf.o"))
    args = ap.parse_args(argv)
    n = 3
    addresses = [f"10.9.0.{i + 1}:8000" for i in range(n)]
    pages = Pages(n)
    cgroup = Path(cgroup2_root()) / f"epick-ebpf-measure-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    setup = Setup(name="ebpf", endpoints=n, scrape_ms=args.scrape_ms)
    agent = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"',
                     'metrics_listen = "127.0.0.1:0"', "[admin]", 'listen = ""', "[pool]",
                     f"scrape_interval_ms = {args.scrape_ms}", "stale_after_ms = 5000"]
            for i, a in enumerate(addresses):
                lines += ["[[pool.endpoints]]", f'address = "{a}"',
                          f'metrics_url = "http://127.0.0.1:{pages.port}/metrics/{i}"']
            lines += ["[[policies]]", 'name = "load"', 'module = "load"',
                      "[weights]", f"min_interval_ms = {args.min_interval_ms}", ""]
            path = Path(tmp) / "epick.toml"
            path.write_text("\n".join(lines))
            setup.start(path)
            agent = subprocess.Popen(
                [sys.executable, str(HERE / "agent.py"), "--epick", setup.target,
                 "--cgroup", str(cgroup), "--object", args.object,
                 "--vip", f"{VIP},model={MODEL}"], stdout=subprocess.PIPE, text=True)
            events: queue.Queue = queue.Queue()
            threading.Thread(target=lambda: [events.put(json.loads(line))
                                             for line in agent.stdout], daemon=True).start()

            def until(pred, timeout=10.0) -> dict:
                deadline = time.monotonic() + timeout
                while True:
                    e = events.get(timeout=max(deadline - time.monotonic(), 0.01))
                    if e["event"] == "applied" and pred(e):
                        return e

            until(lambda e: len(e["slots"]) == n)
            rng = random.Random(1)
            total, stream, write = [], [], []
            for k in range(args.flips):
                time.sleep(rng.uniform(0.3, 1.0))
                saturate = k % 2 == 0
                t0 = time.time()
                pages.waiting[0] = 50 if saturate else 0
                e = until(lambda e, s=saturate: (addresses[0] in e["slots"]) != s)
                total.append(e["applied_at"] - t0)
                stream.append(e["received_at"] - t0)
                write.append(e["applied_at"] - e["received_at"])
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=10)
        setup.stop()
        pages.close()
        cgroup.rmdir()
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    print(json.dumps({
        "flips": len(total), "scrape_ms": args.scrape_ms,
        "min_interval_ms": args.min_interval_ms,
        "change_to_kernel_ms": {"p50": ms(q(total, 0.5)), "p90": ms(q(total, 0.9)),
                                "p99": ms(q(total, 0.99)),
                                "max": ms(max(total))},
        "stream_ms": {"p50": ms(q(stream, 0.5)), "p99": ms(q(stream, 0.99))},
        "agent_write_ms": {"p50": ms(q(write, 0.5)), "p99": ms(q(write, 0.99))},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
