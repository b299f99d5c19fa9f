"""What routing through epick adds to a request, measured through a real Envoy.

    .venv/bin/python scripts/envoy_bench.py [--requests 2000] [--concurrency 1,8]

Two Envoys run the committed example (examples/envoy/envoy.yaml) in front of the same
replica, which answers instantly (so the difference is all routing):

    with epick     ext_proc -> epick (default policies: load, prefix-cache, lora-affinity)
                   -> ORIGINAL_DST to the replica epick picked
    without        the same file with the ext_proc filter disabled -> the replica directly

Requests alternate between the two in blocks of 50, so machine noise hits both alike. It
prints p50/p99 latency per path and their differences ("added"), per concurrency.
Latency goals are not asserted anywhere; this script only reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import httpx
import msgspec
import numpy as np

from epick import config as cfg
from epick.api.ext_proc_envoy import EXAMPLE, Envoy, render
from epick.service import Service

PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="base"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="base"} 0.1
"""
ANSWER = json.dumps({"object": "text_completion", "choices": [
    {"index": 0, "text": "hello", "finish_reason": "stop"}]}).encode()


class InstantReplica(ThreadingHTTPServer):
    """A model server that answers at once: /metrics and any POST."""

    daemon_threads = True

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def _send(self, body: bytes, ctype: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                self._send(PAGE.encode(), "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send(ANSWER, "application/json")

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def start_epick(address: str, tmp: Path):
    conf = msgspec.convert({
        "version": 1,
        "server": {"listen": "127.0.0.1:0", "metrics_listen": ""},
        "admin": {"listen": ""},
        "pool": {"endpoints": [{"address": address}]},
        "policies": [{"name": p, "module": p} for p in ("load", "prefix-cache", "lora-affinity")],
        "runtime": {"cache_dir": str(tmp)},
        "ext_proc": {"listen": "127.0.0.1:0", "base_model": "base"},
    }, cfg.Config)
    ready, box = threading.Event(), {}

    async def main() -> None:
        service = Service(conf)
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            box["service"], box["loop"] = service, asyncio.get_running_loop()
            ready.set()

    thread = threading.Thread(target=lambda: anyio.run(main, backend="asyncio"), daemon=True)
    thread.start()
    if not ready.wait(30):
        sys.exit("epick did not start within 30 s")
    return box["service"], box["loop"], thread


def run(urls: dict[str, str], requests: int, concurrency: int) -> dict[str, np.ndarray]:
    """Latencies (s) per path; requests alternate paths in blocks of 50 per worker."""
    body = json.dumps({"model": "base", "max_tokens": 16,
                       "prompt": "You are a helpful assistant. " * 30 + "Say hi."}).encode()
    per_worker = max(1, requests // concurrency)

    def worker(_i: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {k: [] for k in urls}
        clients = {k: httpx.Client(base_url=u, timeout=10) for k, u in urls.items()}
        try:
            for c in clients.values():  # warm the connections
                c.post("/v1/completions", content=body)
            done = 0
            while done < per_worker:
                for name, c in clients.items():
                    for _ in range(50):
                        t0 = time.perf_counter()
                        r = c.post("/v1/completions", content=body,
                                   headers={"content-type": "application/json"})
                        out[name].append(time.perf_counter() - t0)
                        if r.status_code != 200:
                            raise RuntimeError(f"{name}: HTTP {r.status_code}: {r.text}")
                done += 50
        finally:
            for c in clients.values():
                c.close()
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        parts = list(pool.map(worker, range(concurrency)))
    return {k: np.array([x for p in parts for x in p[k]]) for k in urls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="per path and concurrency")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated client counts")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()

    import tempfile
    replica = InstantReplica()
    tmp = Path(tempfile.mkdtemp(prefix="epick-bench-"))
    service, loop, thread = start_epick(replica.address, tmp)
    report = {"requests": args.requests, "runs": []}
    with Envoy(render(EXAMPLE.read_text(), ext_proc_port=service.ext_proc_port,
                      replicas=[replica.address], access_log=False)) as with_epick, \
         Envoy(render(EXAMPLE.read_text(), ext_proc_port=service.ext_proc_port,
                      replicas=[replica.address], access_log=False, ext_proc=False)) as without:
        urls = {"envoy+epick": with_epick.url, "envoy": without.url}
        print(f"{'concurrency':>11} {'path':<12} {'p50 ms':>8} {'p99 ms':>8}")
        for conc in (int(c) for c in args.concurrency.split(",")):
            t0 = time.perf_counter()
            lat = run(urls, args.requests, conc)
            wall = time.perf_counter() - t0
            row = {"concurrency": conc}
            for name, xs in lat.items():
                p50, p99 = np.percentile(xs, 50) * 1e3, np.percentile(xs, 99) * 1e3
                row[name] = {"p50_ms": round(p50, 3), "p99_ms": round(p99, 3), "n": len(xs)}
                print(f"{conc:>11} {name:<12} {p50:>8.2f} {p99:>8.2f}")
            added50 = row["envoy+epick"]["p50_ms"] - row["envoy"]["p50_ms"]
            added99 = row["envoy+epick"]["p99_ms"] - row["envoy"]["p99_ms"]
            row["added_p50_ms"], row["added_p99_ms"] = round(added50, 3), round(added99, 3)
            print(f"{conc:>11} {'added':<12} {added50:>8.2f} {added99:>8.2f}   "
                  f"({sum(map(len, lat.values())) / wall:.0f} req/s both paths together)")
            report["runs"].append(row)
    loop.call_soon_threadsafe(service.stop)
    thread.join(15)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
