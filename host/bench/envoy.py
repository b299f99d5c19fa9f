"""What routing through epick adds to a request, measured through a real Envoy, in both
ext_proc body modes; and a load run of many concurrent streaming requests.

    epick bench envoy latency [--requests 2000] [--concurrency 1,8]
    epick bench envoy load [--concurrent 500] [--requests 2000]

Processes (all loopback): a replica (aiohttp, one process; answers at once, or streams
SSE chunks), epick (``epick serve``, its own process: load, prefix-cache, lora-affinity),
three Envoys on the committed examples, and this process as the client:

    envoy            examples/envoy/envoy.yaml with the ext_proc filter disabled: the
                     replica directly (the baseline)
    buffered         examples/envoy/envoy.yaml (BUFFERED request body -> epick)
    streamed         examples/envoy/envoy-streaming.yaml (FULL_DUPLEX_STREAMED request and
                     response bodies through epick, upstream's mode)

``latency``: each client thread alternates the three paths in blocks of 50 requests, so
machine noise hits all alike; prints p50/p99 per path and what each mode adds over Envoy
alone. ``load``: ``--concurrent`` streaming requests in flight at once (asyncio), per mode,
each reading a whole SSE answer; prints status counts (5xx split into epick's JSON errors
and Envoy's own), the peak in-flight count and latency. Nothing is asserted; it reports.

Envoy runs through the Envoy tests' own harness (tests/envoy/envoy_harness.py: the
committed examples, ports rewritten), so this runs from a git checkout with ``make envoy``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from epick.bench import checkout

PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="base"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="base"} 0.1
"""
ANSWER = json.dumps({"object": "text_completion", "choices": [
    {"index": 0, "text": "hello", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_main(port: int, chunks: int, chunk_delay_s: float) -> None:
    """The replica process: /metrics, and POST answers (JSON, or SSE when stream: true)."""
    from aiohttp import web

    async def metrics(_request):
        return web.Response(text=PAGE)

    async def complete(request):
        doc = json.loads(await request.read())
        if not doc.get("stream"):
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            if i:
                await asyncio.sleep(chunk_delay_s)
            await resp.write(b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i)
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":10,'
                         b'"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % chunks)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", complete)
    web.run_app(app, host="127.0.0.1", port=port, print=None, backlog=4096,
                access_log=None)


def wait_port(port: int, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"{what} did not listen on port {port} within {timeout_s} s")


def start_epick(replica: str, work: Path) -> tuple[subprocess.Popen, int]:
    ext_proc = free_port()
    conf = work / "epick.toml"
    lines = ["version = 1", "[server]", f'listen = "127.0.0.1:{free_port()}"',
             'metrics_listen = ""', "[admin]", 'listen = ""', "[runtime]",
             f'cache_dir = "{work / "cache"}"', "[ext_proc]",
             f'listen = "127.0.0.1:{ext_proc}"', 'base_model = "base"', "[pool]",
             "[[pool.endpoints]]", f'address = "{replica}"']
    for p in ("load", "prefix-cache", "lora-affinity"):
        lines += ["[[policies]]", f'name = "{p}"', f'module = "{p}"']
    conf.write_text("\n".join(lines) + "\n")
    log = open(work / "epick.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("epick")), "--log-level", "WARNING",
                             "serve", "--config", str(conf)], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL)
    wait_port(ext_proc, "epick")
    return proc, ext_proc


def envoys(ext_proc: int, replica: str) -> dict:
    """Body mode (or ``envoy``: ext_proc off) -> an ``envoy_harness.Envoy``, not started."""
    h = checkout.tests_module("envoy", "envoy_harness")
    kw = {"ext_proc_port": ext_proc, "replicas": [replica], "access_log": False}
    return {
        "envoy": h.Envoy(h.render(h.EXAMPLE.read_text(), ext_proc=False, **kw)),
        "buffered": h.Envoy(h.render(h.EXAMPLE.read_text(), **kw)),
        "streamed": h.Envoy(h.render(h.STREAMING.read_text(), **kw)),
    }


# -- latency ---------------------------------------------------------------------------------

def latency(urls: dict[str, str], requests: int, concurrency: int, stream: bool
            ) -> dict[str, np.ndarray]:
    """Latencies (s) per path; requests alternate paths in blocks of 50 per worker."""
    body = json.dumps({"model": "base", "max_tokens": 16, "stream": stream,
                       "prompt": "You are a helpful assistant. " * 30 + "Say hi."}).encode()
    per_worker = max(1, requests // concurrency)

    def worker(_i: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {k: [] for k in urls}
        clients = {k: httpx.Client(base_url=u, timeout=30) for k, u in urls.items()}
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


def run_latency(args, urls: dict[str, str]) -> dict:
    report = {"requests": args.requests, "runs": []}
    print(f"{'conc':>4} {'answer':<6} {'path':<10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'+p50 ms':>8} {'+p99 ms':>8}")
    for stream in (False, True):
        for conc in (int(c) for c in args.concurrency.split(",")):
            lat = latency(urls, args.requests, conc, stream)
            row = {"concurrency": conc, "stream": stream}
            base50, base99 = (np.percentile(lat["envoy"], q) * 1e3 for q in (50, 99))
            for name, xs in lat.items():
                p50, p99 = np.percentile(xs, 50) * 1e3, np.percentile(xs, 99) * 1e3
                row[name] = {"p50_ms": round(p50, 3), "p99_ms": round(p99, 3), "n": len(xs),
                             "added_p50_ms": round(p50 - base50, 3),
                             "added_p99_ms": round(p99 - base99, 3)}
                added = ("" if name == "envoy"
                         else f"{p50 - base50:>8.2f} {p99 - base99:>8.2f}")
                print(f"{conc:>4} {'sse' if stream else 'json':<6} {name:<10} {p50:>8.2f} "
                      f"{p99:>8.2f} {added}")
            report["runs"].append(row)
    return report


# -- load ------------------------------------------------------------------------------------

async def load_one(url: str, concurrent: int, requests: int, *, model: str = "base",
                   max_tokens: int | None = None) -> dict:
    """``requests`` streamed completions, ``concurrent`` in flight; a 200 whose stream does
    not end with ``[DONE]`` (or, given ``max_tokens``, lacks one of its token events) is
    counted as cut."""
    body = {"model": model, "prompt": "You are a helpful assistant. " * 30, "stream": True,
            "stream_options": {"include_usage": True}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    statuses: Counter = Counter()
    errors: Counter = Counter()
    lat: list[float] = []
    inflight = peak = 0
    todo = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrent + 10, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def worker() -> None:
            nonlocal inflight, peak
            for _ in todo:
                inflight += 1
                peak = max(peak, inflight)
                t0 = time.perf_counter()
                try:
                    async with http.post(f"{url}/v1/completions", json=body) as resp:
                        raw = await resp.read()
                        statuses[resp.status] += 1
                        if resp.status >= 500:
                            kind = ("epick" if resp.content_type == "application/json"
                                    else "envoy")
                            errors[f"{kind}: {raw[:160].decode(errors='replace')}"] += 1
                        elif resp.status == 200 and not raw.endswith(b"data: [DONE]\n\n"):
                            errors["200 but the stream was cut"] += 1
                        elif resp.status == 200 and max_tokens is not None and (
                                raw.count(b'"text":') + raw.count(b'"content":')
                                < max_tokens):
                            errors["200 but a token event is missing"] += 1
                except (TimeoutError, aiohttp.ClientError) as exc:
                    statuses["client error"] += 1
                    errors[repr(exc)[:160]] += 1
                finally:
                    inflight -= 1
                    lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrent)))
        wall = time.perf_counter() - t0
    xs = np.array(lat)
    return {"statuses": {str(k): v for k, v in statuses.items()}, "errors": dict(errors),
            "peak_in_flight": peak, "wall_s": round(wall, 2),
            "req_per_s": round(requests / wall, 1),
            "p50_ms": round(float(np.percentile(xs, 50)) * 1e3, 1),
            "p99_ms": round(float(np.percentile(xs, 99)) * 1e3, 1)}


def run_load(args, urls: dict[str, str]) -> dict:
    report = {"concurrent": args.concurrent, "requests": args.requests, "chunks": args.chunks,
              "chunk_delay_s": args.chunk_delay, "paths": {}}
    for name in ("envoy", "buffered", "streamed"):
        row = asyncio.run(load_one(urls[name], args.concurrent, args.requests))
        report["paths"][name] = row
        print(f"{name:<9} statuses={row['statuses']} peak_in_flight={row['peak_in_flight']} "
              f"{row['req_per_s']} req/s p50={row['p50_ms']} ms p99={row['p99_ms']} ms")
        for what, n in row["errors"].items():
            print(f"          {n} x {what}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench envoy", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["latency", "load"])
    ap.add_argument("--requests", type=int, default=2000,
                    help="latency: per path and concurrency; load: per path")
    ap.add_argument("--concurrency", default="1,8", help="latency: client threads (list)")
    ap.add_argument("--concurrent", type=int, default=500, help="load: requests in flight")
    ap.add_argument("--chunks", type=int, default=None,
                    help="SSE events per streamed answer (latency 1, load 20)")
    ap.add_argument("--chunk-delay", type=float, default=0.02, help="seconds between events")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.chunks is None:
        args.chunks = 1 if args.what == "latency" else 20

    work = Path(tempfile.mkdtemp(prefix="epick-bench-"))
    port = free_port()
    replica = mp.get_context("spawn").Process(
        target=replica_main, args=(port, args.chunks, args.chunk_delay), daemon=True)
    replica.start()
    epick = None
    try:
        wait_port(port, "the replica")
        epick, ext_proc = start_epick(f"127.0.0.1:{port}", work)
        started = envoys(ext_proc, f"127.0.0.1:{port}")
        try:
            for e in started.values():
                e.start()
            urls = {k: e.url for k, e in started.items()}
            for url in urls.values():  # epick is serving once a routed request succeeds
                deadline = time.monotonic() + 30
                while httpx.post(f"{url}/v1/completions", json={"model": "base"},
                                 timeout=10).status_code != 200:
                    if time.monotonic() > deadline:
                        sys.exit(f"{url}: not routing after 30 s (see {work}/epick.log)")
                    time.sleep(0.2)
            print(f"# {os.cpu_count()} CPUs; {args.what}; replica streams {args.chunks} events "
                  f"{args.chunk_delay * 1e3:.0f} ms apart")
            report = run_latency(args, urls) if args.what == "latency" else run_load(args, urls)
        finally:
            for e in started.values():
                e.stop()
    finally:
        if epick is not None:
            epick.terminate()
            epick.wait(10)
        replica.terminate()
        replica.join(10)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
