"""`epick bench dataplanes`: what routing through epick adds inside NGINX, HAProxy and
Envoy, side by side in one run.

    epick bench dataplanes [--seconds 4] [--rounds 4] [--clients 1,8] [--before REF]

Processes (all loopback): two replicas answering at once (aiohttp, a process each), one
``epick serve`` (HTTP API and ext_proc, the three built-in policies, ``[server]
fallbacks = 1``), and one proxy per path, each from its committed example with only the
addresses rewritten:

    nginx round robin / nginx + epick       examples/nginx (the epick call taken out / in)
    haproxy round robin / haproxy + epick   examples/haproxy
    envoy round robin / envoy + ext_proc    examples/envoy/envoy.yaml (ext_proc disabled /
                                            on: BUFFERED request bodies)
    envoy + ext_proc streamed               examples/envoy/envoy-streaming.yaml

``--load URL`` instead sends ``--requests`` streamed completions to a running proxy at URL,
``--concurrent`` in flight, and prints JSON: status counts, errors (a 200 whose stream is
cut or lacks a token event is one), the peak in flight (tests/dataplanes' 2,000-stream test
runs it in a process of its own, away from the service it loads).

``--before REF`` also runs ``REF``'s NGINX and HAProxy examples through the same epick
(``nginx + epick @REF``): a change to the examples measured before/after in one run.

Rounds alternate every path at every client count, so a slow moment of the machine lands
on all alike. The clients are threads, each a keep-alive socket sending a 1 KB-prompt
completion in one write (:func:`epick.bench.http.http_phase`). "added" is a path's p50
(p99) minus its own proxy's round robin. Issue 25's goal: NGINX's and HAProxy's added p50
<= Envoy ext_proc's (BUFFERED, the default example) at each client count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from epick.bench import checkout
from epick.bench.dataplanes import Proxy, free_port
from epick.bench.grpc import Phase
from epick.bench.http import http_phase, run_aiohttp

__all__ = ["main", "measure", "COMPLETION"]

COMPLETION = json.dumps({"object": "text_completion", "choices": [
    {"index": 0, "text": "hello", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()
PAGE = (b'vllm:num_requests_running{model_name="base"} 0.0\n'
        b'vllm:num_requests_waiting{model_name="base"} 0.0\n'
        b'vllm:kv_cache_usage_perc{model_name="base"} 0.1\n')
BODY = json.dumps({"model": "base", "prompt": "Say hello. " * 100, "max_tokens": 1}).encode()


def serve_replica() -> None:
    """A model server that answers at once: /metrics and POST /v1/completions; prints
    its port."""
    from aiohttp import web

    async def metrics(_request):
        return web.Response(body=PAGE, content_type="text/plain")

    async def complete(request):
        await request.read()
        return web.Response(body=COMPLETION, headers={"Content-Type": "application/json"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", complete)
    run_aiohttp(lambda: web.AppRunner(app, access_log=None))


def _spawn(args: list[str], what: str, log=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True,
                            stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{what} did not start")
    return proc, line.strip()


def examples_at(ref: str, dest: Path) -> Path:
    """``ref``'s examples/nginx and examples/haproxy extracted under ``dest``; the folder
    that holds them."""
    tar = subprocess.run(["git", "-C", str(checkout.REPO), "archive", ref, "examples/nginx",
                          "examples/haproxy"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return dest / "examples"


def epick_config(http_port: int, ext_proc_port: int, replicas: list[str]) -> str:
    lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"', 'metrics_listen = ""',
             "fallbacks = 1", "[admin]", 'listen = ""', "[http]",
             f'listen = "127.0.0.1:{http_port}"', "[ext_proc]",
             f'listen = "127.0.0.1:{ext_proc_port}"', "[openai]", 'base_model = "base"',
             "[pool]", "scrape_interval_ms = 50"]
    for r in replicas:
        lines += ["[[pool.endpoints]]", f'address = "{r}"']
    for p in ("load", "prefix-cache", "lora-affinity"):
        lines += ["[[policies]]", f'name = "{p}"', f'module = "{p}"']
    return "\n".join(lines) + "\n"


def _proxies(http_port: int, ext_proc_port: int, replicas: list[str],
             before: tuple[str, Path] | None, kinds: tuple[str, ...]) -> dict:
    """Path name -> (a started-on-demand proxy: ``.start()``, ``.stop()``, ``.port``)."""
    out: dict = {}
    for kind in ("nginx", "haproxy"):
        if kind not in kinds:
            continue
        out[f"{kind} round robin"] = Proxy(kind, epick_http_port=http_port, replicas=replicas,
                                           epick=False)
        out[f"{kind} + epick"] = Proxy(kind, epick_http_port=http_port, replicas=replicas)
        if before is not None:
            ref, folder = before
            out[f"{kind} + epick @{ref}"] = Proxy(kind, epick_http_port=http_port,
                                                  replicas=replicas, folder=folder / kind)
    if "envoy" in kinds:
        h = checkout.tests_module("envoy", "envoy_harness")
        kw = {"ext_proc_port": ext_proc_port, "replicas": replicas, "access_log": False}
        out["envoy round robin"] = h.Envoy(h.render(h.EXAMPLE.read_text(), ext_proc=False,
                                                    **kw))
        out["envoy + ext_proc"] = h.Envoy(h.render(h.EXAMPLE.read_text(), **kw))
        out["envoy + ext_proc streamed"] = h.Envoy(h.render(h.STREAMING.read_text(), **kw))
    return out


def baseline(name: str) -> str | None:
    """The round-robin path a routed path is compared with (None: it is a baseline)."""
    if "round robin" in name:
        return None
    return name.split(" ", 1)[0] + " round robin"


def measure(*, seconds: float = 4.0, rounds: int = 4, clients=(1, 8), before: str | None = None,
            kinds: tuple[str, ...] = ("nginx", "haproxy", "envoy"), log=print
            ) -> dict[str, dict[int, Phase]]:
    """Every path at every client count, ``seconds`` each over all ``rounds``;
    {path: {clients: Phase}}."""
    procs: list[subprocess.Popen] = []
    proxies: dict = {}
    out: dict[str, dict[int, Phase]] = {}
    with tempfile.TemporaryDirectory(prefix="epick-bench-dataplanes-") as tmp:
        work = Path(tmp)
        try:
            replicas = []
            for _ in range(2):
                proc, port = _spawn([sys.executable, "-m", "epick.bench.proxies",
                                     "--serve-replica"], "a replica")
                procs.append(proc)
                replicas.append(f"127.0.0.1:{port}")
            http_port, ext_proc_port = free_port(), free_port()
            config = work / "epick.toml"
            config.write_text(epick_config(http_port, ext_proc_port, replicas))
            with (work / "epick.log").open("w") as elog:
                epick, line = _spawn([sys.executable, "-m", "epick.cli", "--log-level",
                                      "WARNING", "serve", "--config", str(config)],
                                     "epick serve", log=elog)
            procs.append(epick)
            if "serving Pick on" not in line:
                raise RuntimeError(f"epick serve did not start: {line!r}")
            old = (before, examples_at(before, work / "before")) if before else None
            proxies = _proxies(http_port, ext_proc_port, replicas, old, kinds)
            for p in proxies.values():
                p.start()
            for name, p in proxies.items():  # warm, and check each answers 200
                deadline = time.monotonic() + 30
                while True:
                    try:
                        http_phase(p.port, 1, 0.2, [BODY], "/v1/completions")
                        break
                    except RuntimeError:  # epick's first scrape may not have landed yet
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{name}: not routing after 30 s") from None
                        time.sleep(0.2)
            per = seconds / rounds
            for r in range(rounds):
                for n in clients:
                    for name, p in proxies.items():
                        ph = out.setdefault(name, {}).setdefault(n, Phase())
                        t0 = time.perf_counter()
                        try:
                            lat = http_phase(p.port, n, per, [BODY], "/v1/completions")
                        except RuntimeError as exc:
                            raise RuntimeError(f"{name}, {n} client(s): {exc}") from exc
                        ph.record(lat, time.perf_counter() - t0)
                log(f"# round {r + 1}/{rounds} done")
        finally:
            for p in proxies.values():
                p.stop()
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    return out


def table(res: dict[str, dict[int, Phase]]) -> tuple[list[str], dict]:
    """The printed lines and the JSON document of a :func:`measure` result."""
    lines = [f"{'path':34} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} "
             f"{'added p50 / p99 ms':>20}"]
    doc: dict = {}
    for name, by_n in res.items():
        for n, ph in by_n.items():
            added, base = "", baseline(name)
            row = {"p50_ms": ph.p50 / 1e3, "p99_ms": ph.p99 / 1e3, "req_per_s": ph.rate,
                   "requests": ph.calls}
            if base in res:
                b = res[base][n]
                row["added_p50_ms"] = (ph.p50 - b.p50) / 1e3
                row["added_p99_ms"] = (ph.p99 - b.p99) / 1e3
                added = f"{row['added_p50_ms']:.2f} / {row['added_p99_ms']:.2f}"
            lines.append(f"{name:34} {n:7} {ph.p50 / 1e3:8.2f} {ph.p99 / 1e3:8.2f} "
                         f"{ph.rate:7.0f} {added:>20}")
            doc.setdefault(name, {})[str(n)] = row
    envoy = doc.get("envoy + ext_proc", {})
    for kind in ("nginx", "haproxy"):
        for n, row in doc.get(f"{kind} + epick", {}).items():
            if "added_p50_ms" in row and "added_p50_ms" in envoy.get(n, {}):
                ok = row["added_p50_ms"] <= envoy[n]["added_p50_ms"]
                lines.append(f"goal {kind} added p50 <= Envoy ext_proc's at {n} client(s): "
                             f"{row['added_p50_ms']:.2f} vs {envoy[n]['added_p50_ms']:.2f} ms "
                             f"{'met' if ok else 'MISSED'}")
    return lines, doc


def run_load(args) -> int:
    """``--load``: the streams, in this process (its open-file limit raised to fit them)."""
    import asyncio
    import resource

    from epick.bench.envoy import load_one

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.concurrent * 2 + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    res = asyncio.run(load_one(args.load, args.concurrent, args.requests, model=args.model,
                               max_tokens=args.max_tokens))
    print(json.dumps(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench dataplanes",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="per path and client count, "
                    "over all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", default="1,8", help="client counts, comma-separated")
    ap.add_argument("--before", metavar="REF",
                    help="also run this git ref's NGINX and HAProxy examples")
    ap.add_argument("--only", default="nginx,haproxy,envoy", help="proxies to run")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ap.add_argument("--load", metavar="URL", help="stream completions through this proxy")
    ap.add_argument("--concurrent", type=int, default=2000, help="--load: in flight")
    ap.add_argument("--requests", type=int, default=2000, help="--load: in all")
    ap.add_argument("--model", default="base", help="--load: the body's model")
    ap.add_argument("--max-tokens", type=int, default=8, help="--load: tokens per answer")
    ap.add_argument("--serve-replica", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_replica:
        serve_replica()
        return 0
    if args.load:
        return run_load(args)
    load = os.getloadavg()
    res = measure(seconds=args.seconds, rounds=args.rounds,
                  clients=tuple(int(c) for c in args.clients.split(",")), before=args.before,
                  kinds=tuple(args.only.split(",")))
    lines, doc = table(res)
    print(f"# {os.cpu_count()} CPUs; load average {load[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"loadavg_before": load, "paths": doc}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
