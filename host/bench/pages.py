"""vLLM-like ``/metrics`` pages for the gRPC benchmark, served from a process of their own.

    python -m epick.bench.pages --count 64      prints the port, then serves until killed

``GET /metrics/<i>`` answers page ``i``. Each answer differs from the last one (the queue
depths and the KV-cache use move with a per-page hit counter), as a busy replica's page
does, so every scrape parses a new page and every round rebuilds the snapshot: the
benchmark measures scraping at its dearest. aiohttp with keep-alive, like a real
model server, in its own process so that serving pages costs the benchmark's client no
GIL time.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from aiohttp import web

__all__ = ["page", "main"]


def page(i: int, hit: int, adapters: str) -> bytes:
    """Page ``i`` on its ``hit``-th answer, running ``adapters`` (comma-separated)."""
    return (
        f'vllm:num_requests_waiting{{model_name="llama"}} {(i * 7 + hit) % 21}\n'
        f'vllm:num_requests_running{{model_name="llama"}} {(i * 13 + hit) % 61}\n'
        f'vllm:kv_cache_usage_perc{{model_name="llama"}} {((i * 37 + hit) % 100) / 100:.2f}\n'
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{adapters}",'
        f'waiting_lora_adapters=""}} 1.7e9\n'
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="8192"}} 1\n'
    ).encode()


def app(count: int) -> web.Application:
    hits = [0] * count
    rng = random.Random(5)
    adapters = [",".join(rng.sample([f"adapter-{k}" for k in range(16)], 2))
                for _ in range(count)]

    async def metrics(request: web.Request) -> web.Response:
        try:
            i = int(request.match_info["i"])
            hits[i] += 1
        except (ValueError, IndexError):
            raise web.HTTPNotFound() from None
        return web.Response(body=page(i, hits[i], adapters[i]),
                            content_type="text/plain", charset="utf-8")

    application = web.Application()
    application.router.add_get("/metrics/{i}", metrics)
    return application


async def _serve(count: int) -> None:
    runner = web.AppRunner(app(count), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(port, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.bench.pages", description=__doc__)
    ap.add_argument("--count", type=int, required=True, help="pages /metrics/0 .. count-1")
    args = ap.parse_args(argv)
    try:
        asyncio.run(_serve(args.count))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
