"""What routing through epick adds to a request, measured through a real Envoy, in both
ext_proc body modes; and a load run of many concurrent streaming requests.

    epick bench envoy latency [--requests 2000] [--concurrency 1,8] [--workers 1]
    epick bench envoy load [--concurrent 500,1000] [--requests 2000] [--workers 1,2]
                           [--modes buffered,streamed,observed] [--rounds 3]
                           [--frontend python,native,native-fixed,native@PATH]
    epick bench envoy pick [--workers 1,2] [--requests 4000] [--frontend python,native]

Processes (all loopback): a replica (aiohttp, one process; answers at once, or streams
SSE chunks), epick (``epick serve``, its own process: load, prefix-cache, lora-affinity),
three Envoys on the committed examples, and this process as the client:

    envoy            examples/envoy/envoy.yaml with the ext_proc filter disabled: the
                     replica directly (the baseline)
    buffered         examples/envoy/envoy.yaml (BUFFERED request body -> epick)
    streamed         examples/envoy/envoy-streaming.yaml (FULL_DUPLEX_STREAMED request and
                     response bodies through epick, upstream's mode)
    observed         examples/envoy/envoy-observer.yaml (the request as streamed; the
                     answer only observed: an ext_proc filter in observability_mode; a
                     ``load`` mode only, not in the default list)

``latency``: each client thread alternates the three paths in blocks of 50 requests, so
machine noise hits all alike; prints p50/p99 per path and what each mode adds over Envoy
alone. ``load``: ``--concurrent`` streaming requests in flight at once (asyncio), each
reading a whole SSE answer; per concurrency, Envoy alone first, then per epick worker
count (``--workers``: ``[server] workers``, epick restarted for each; ``--frontend``:
``[server] frontend``, each worker count run with each) and body mode:
errors by source (epick's JSON answers vs Envoy's own local replies, client-side errors,
cut streams), throughput and its ratio to Envoy alone, p50/p99, and the load average
when the run ended. ``pick``: no Envoy: one epick per ``--workers`` value, all running at once, and one client
thread sending unary gRPC Picks to each in turn in blocks of 200 (so noise hits all
alike): p50/p99 per worker count and its ratio to the first (the Pick API stays in the
service's process; this shows what the workers beside it cost the quiet case). Nothing is
asserted; it reports. ``--frontend native`` needs ``make native`` (the C++ ext_proc worker);
``--frontend native-fixed`` (load only) is that worker with EPICK_EXTPROC_FIXED=1: it
replays the first answer of each shape without asking the hub (no decision, no report),
so Envoy with an ext_proc server that decides nothing: the ceiling of any front end on
this machine (the observed mode is left out of its runs). ``native@PATH`` (load) is the
native front end served by the worker binary at PATH: two builds side by side in the same
rounds (``--frontend native@/tmp/base/epick-extproc,native``).

``--rounds N`` (load; default 3): every epick (front end × worker count) and its Envoys
start at once, and per concurrency N rounds alternate Envoy alone and every cell (each
round starting one cell later); the ratio of a run is to its round's Envoy alone, and
the medians over the rounds are printed at the end (errors summed). One round swings
with the machine (Envoy alone did 794–1,152 req/s in runs a minute apart), so the default
is 3; ``--rounds 1`` is the old one-pass table.

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


def start_epick(replica: str, work: Path, workers: int = 1, *, pick_port: int = 0,
                frontend: str = "python") -> tuple[subprocess.Popen, int]:
    ext_proc = free_port()
    name, binary = split_frontend(frontend)
    conf = work / f"epick-{len(list(work.glob('epick-*.toml')))}-{name}-{workers}.toml"
    env = None
    if name == "native-fixed":  # the bench's ceiling (FRONTENDS): no decisions
        env = {**os.environ, "EPICK_EXTPROC_FIXED": "1"}
    if binary is not None:  # another build of the native worker, beside this one
        env = {**(env or os.environ), "EPICK_EXTPROC_BINARY": str(binary)}
    lines = ["version = 1", "[server]", f'listen = "127.0.0.1:{pick_port or free_port()}"',
             'metrics_listen = ""', f"workers = {workers}",
             f'frontend = "{name.removesuffix("-fixed")}"',
             "[admin]", 'listen = ""', "[runtime]",
             f'cache_dir = "{work / "cache"}"', "[ext_proc]",
             f'listen = "127.0.0.1:{ext_proc}"', 'base_model = "base"', "[pool]",
             # One replica process serves every stream and its own /metrics: saturated,
             # it answers scrapes late; this bench is about epick's front ends.
             "stale_after_ms = 10000",
             "[[pool.endpoints]]", f'address = "{replica}"']
    for p in ("load", "prefix-cache", "lora-affinity"):
        lines += ["[[policies]]", f'name = "{p}"', f'module = "{p}"']
    conf.write_text("\n".join(lines) + "\n")
    log = open(work / "epick.log", "ab")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("epick")), "--log-level", "WARNING",
                             "serve", "--config", str(conf)], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, env=env)
    wait_port(ext_proc, "epick")
    return proc, ext_proc


def envoys(ext_proc: int, replica: str, paths=("envoy", "buffered", "streamed")) -> dict:
    """Body mode (or ``envoy``: ext_proc off) -> an ``envoy_harness.Envoy``, not started."""
    h = checkout.tests_module("envoy", "envoy_harness")
    kw = {"ext_proc_port": ext_proc, "replicas": [replica], "access_log": False}
    files = {"envoy": h.EXAMPLE, "buffered": h.EXAMPLE, "streamed": h.STREAMING,
             "observed": h.OBSERVER}
    return {name: h.Envoy(h.render(files[name].read_text(), ext_proc=name != "envoy", **kw))
            for name in paths}


def wait_routing(urls: dict[str, str], work: Path) -> None:
    """Until a request through each URL is answered 200 (epick serves once one is)."""
    for url in urls.values():
        deadline = time.monotonic() + 30
        while httpx.post(f"{url}/v1/completions", json={"model": "base"},
                         timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                sys.exit(f"{url}: not routing after 30 s (see {work}/epick.log)")
            time.sleep(0.2)


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
    sources: Counter = Counter()
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
                        if resp.status != 200:
                            # epick's answers are OpenAI JSON errors; Envoy's local replies
                            # (504 message timeout, 503 breaker/ext_proc error) plain text.
                            kind = ("epick" if resp.content_type == "application/json"
                                    else "envoy")
                            sources[kind] += 1
                            errors[f"{kind} {resp.status}: "
                                   f"{raw[:160].decode(errors='replace')}"] += 1
                        elif not raw.endswith(b"data: [DONE]\n\n"):
                            sources["cut"] += 1
                            errors["200 but the stream was cut"] += 1
                        elif resp.status == 200 and max_tokens is not None and (
                                raw.count(b'"text":') + raw.count(b'"content":')
                                < max_tokens):
                            errors["200 but a token event is missing"] += 1
                except (TimeoutError, aiohttp.ClientError) as exc:
                    statuses["client error"] += 1
                    sources["client"] += 1
                    errors[repr(exc)[:160]] += 1
                finally:
                    inflight -= 1
                    lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrent)))
        wall = time.perf_counter() - t0
    xs = np.array(lat)
    return {"statuses": {str(k): v for k, v in statuses.items()}, "errors": dict(errors),
            "errors_by_source": {k: sources[k] for k in ("epick", "envoy", "client", "cut")},
            "peak_in_flight": peak, "wall_s": round(wall, 2),
            "req_per_s": round(requests / wall, 1),
            "p50_ms": round(float(np.percentile(xs, 50)) * 1e3, 1),
            "p99_ms": round(float(np.percentile(xs, 99)) * 1e3, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


LOAD_HEADER = (f"{'front':<12} {'workers':>7} {'mode':<9} {'conc':>5} {'ok':>5} {'epick':>5} {'envoy':>5} "
               f"{'client':>6} {'cut':>4} {'req/s':>7} {'x envoy':>7} {'p50 ms':>7} "
               f"{'p99 ms':>7} {'load':>5}")


def _load_row(workers: str, name: str, conc: int, row: dict, base: float | None,
              frontend: str = "-") -> str:
    src = row["errors_by_source"]
    ratio = f"{row['req_per_s'] / base:.2f}" if base else "-"
    return (f"{frontend:<12} {workers:>7} {name:<9} {conc:>5} {row['statuses'].get('200', 0):>5} "
            f"{src['epick']:>5} {src['envoy']:>5} {src['client']:>6} {src['cut']:>4} "
            f"{row['req_per_s']:>7} {ratio:>7} {row['p50_ms']:>7} {row['p99_ms']:>7} "
            f"{row['load_avg_1m']:>5}")


#: Envoy's counters that say why ext_proc failed a request (docs: ext_proc filter stats).
EXT_PROC_STATS = ("streams_started", "streams_failed", "server_half_closed", "stream_msgs_sent",
                  "message_timeouts", "failure_mode_allowed",
                  "clear_route_cache_upstream_ignored")


#: The ext_proc cluster's counters that say why a stream to epick failed: connects, the
#: pool, resets, and the connection closed under its streams (by Envoy: ``local``, e.g. its
#: HTTP/2 flood checks, ``http2.*_flood``; by epick: ``remote``) — any ``http2.`` counter.
EXT_PROC_CLUSTER_STATS = (
    "upstream_cx_connect_timeout", "upstream_cx_connect_fail",
    "upstream_rq_pending_failure_eject", "upstream_rq_pending_overflow",
    "upstream_cx_destroy_local_with_active_rq", "upstream_cx_destroy_remote_with_active_rq",
    "upstream_cx_protocol_error", "upstream_cx_close_notify", "upstream_rq_timeout",
    "upstream_cx_total", "upstream_rq_rx_reset", "upstream_rq_tx_reset")
#: ``http2.`` stats of the ext_proc cluster that are gauges, not failures.
_HTTP2_GAUGES = ("streams_active", "pending_send_bytes", "deferred_stream_close",
                 "outbound_frames_active", "outbound_control_frames_active")


def _ext_proc_stats(envoy) -> dict[str, int]:
    stats = envoy.stats("http.inference.ext_proc.")
    head = "http.inference.ext_proc."
    # The routing filter's counters, and the observer's as ``observer.<name>``.
    out = {k[len(head):]: v for k, v in stats.items()
           if k.rsplit(".", 1)[1] in EXT_PROC_STATS and k.startswith(head)}
    prefix = "cluster.epick_ext_proc."
    for key, value in envoy.stats(prefix).items():
        name = key[len(prefix):] if key.startswith(prefix) else ""
        if name in EXT_PROC_CLUSTER_STATS or (
                name.startswith("http2.") and name[len("http2."):] not in _HTTP2_GAUGES):
            out[f"ext_proc_cluster.{name}"] = value
    return out


def _cpu_s(pid: int, children: bool = True) -> float:
    """CPU seconds (user + system) of ``pid`` and (``children``) its live children
    (epick's workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir() if children else ():
            pids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


#: ``--frontend`` names: ``[server] frontend``, and the bench-only ``native-fixed`` (the
#: native worker answering every request with the first answer of its shape, replayed
#: without asking the hub: EPICK_EXTPROC_FIXED=1; the ceiling of any front end here).
FRONTENDS = ("python", "native", "native-fixed")


def split_frontend(frontend: str) -> tuple[str, Path | None]:
    """``native@PATH`` (and ``native-fixed@PATH``): the native front end served by the
    worker binary at PATH (EPICK_EXTPROC_BINARY), so two builds run side by side in one
    load run's rounds (e.g. ``--frontend native@/tmp/base/epick-extproc,native``)."""
    name, sep, path = frontend.partition("@")
    return name, (Path(path) if sep else None)


#: The replica process's pid (``main`` sets it), for its CPU per request.
REPLICA_PID = 0


def _measure(url: str, conc: int, requests: int, pids: dict[str, int],
             envoy=None) -> dict:
    """One load run, with the CPU each of ``pids`` spent per request and (given the
    Envoy) its ext_proc counters' change."""
    before = _ext_proc_stats(envoy) if envoy is not None else {}
    # The client (this process, not its children) and the replica too: with the path's
    # Envoy and epick, all the CPU a request costs on this machine.
    pids = {**pids, "client": os.getpid(), **({"replica": REPLICA_PID} if REPLICA_PID else {})}
    cpu0 = {k: _cpu_s(p, k != "client") for k, p in pids.items()}
    row = asyncio.run(load_one(url, conc, requests))
    for k, p in pids.items():
        row[f"{k}_cpu_ms_per_req"] = round((_cpu_s(p, k != "client") - cpu0[k])
                                           / requests * 1e3, 2)
    row["total_cpu_ms_per_req"] = round(sum(row[f"{k}_cpu_ms_per_req"] for k in pids), 2)
    if envoy is not None:
        after = _ext_proc_stats(envoy)
        # Why Envoy's own errors happened (its ext_proc filter's counters).
        row["envoy_ext_proc"] = {k: after[k] - before.get(k, 0)
                                 for k in after if after[k] != before.get(k, 0)}
    return row


def _median(xs) -> float:
    return float(np.median(xs)) if len(xs) else float("nan")


SUMMARY_HEADER = (f"{'front':<12} {'workers':>7} {'mode':<9} {'conc':>5} {'rounds':>6} "
                  f"{'ok':>6} {'epick':>5} {'envoy':>5} {'client':>6} {'cut':>4} "
                  f"{'req/s':>7} {'x envoy':>7} {'(min-max)':>11} {'p50 ms':>7} "
                  f"{'epick ms':>8} {'envoy ms':>8} {'total ms':>8} {'x by CPU':>8}")


def summarize(runs: list[dict]) -> list[dict]:
    """Per cell (concurrency, front end, workers, mode): the medians over its rounds of
    req/s, of the ratio to the Envoy-alone run of the same round, of p50 and of the CPU
    per request; errors by source and ok summed."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (r["concurrent"], r["frontend"] if r["path"] != "envoy" else "-",
               r["workers"] if r["path"] != "envoy" else "-", r["path"])
        cells.setdefault(key, []).append(r)
    out = []
    for (conc, frontend, workers, path), rs in cells.items():
        ratios = [r["x_envoy"] for r in rs if "x_envoy" in r]
        out.append({
            "concurrent": conc, "frontend": frontend, "workers": workers, "path": path,
            "rounds": len(rs), "ok": sum(r["statuses"].get("200", 0) for r in rs),
            "errors_by_source": {k: sum(r["errors_by_source"][k] for r in rs)
                                 for k in ("epick", "envoy", "client", "cut")},
            "req_per_s": round(_median([r["req_per_s"] for r in rs]), 1),
            "x_envoy": round(_median(ratios), 3) if ratios else None,
            "x_envoy_min": round(min(ratios), 3) if ratios else None,
            "x_envoy_max": round(max(ratios), 3) if ratios else None,
            "p50_ms": round(_median([r["p50_ms"] for r in rs]), 1),
            "p99_ms": round(_median([r["p99_ms"] for r in rs]), 1),
            "epick_cpu_ms_per_req": round(_median(
                [r["epick_cpu_ms_per_req"] for r in rs if "epick_cpu_ms_per_req" in r]), 2),
            "envoy_cpu_ms_per_req": round(_median(
                [r["envoy_cpu_ms_per_req"] for r in rs]), 2),
            "total_cpu_ms_per_req": round(_median(
                [r["total_cpu_ms_per_req"] for r in rs]), 2),
            "x_envoy_cpu": round(_median([r["x_envoy_cpu"] for r in rs]), 3)
            if ratios else None})
    return out


def _summary_row(c: dict) -> str:
    src = c["errors_by_source"]
    ratio = f"{c['x_envoy']:.2f}" if c["x_envoy"] is not None else "-"
    spread = (f"{c['x_envoy_min']:.2f}-{c['x_envoy_max']:.2f}"
              if c["x_envoy"] is not None else "-")
    epick = "-" if np.isnan(c["epick_cpu_ms_per_req"]) else c["epick_cpu_ms_per_req"]
    return (f"{c['frontend']:<12} {c['workers']!s:>7} {c['path']:<9} {c['concurrent']:>5} "
            f"{c['rounds']:>6} {c['ok']:>6} {src['epick']:>5} {src['envoy']:>5} "
            f"{src['client']:>6} {src['cut']:>4} {c['req_per_s']:>7} {ratio:>7} "
            f"{spread:>11} {c['p50_ms']:>7} {epick!s:>8} {c['envoy_cpu_ms_per_req']!s:>8} "
            f"{c['total_cpu_ms_per_req']!s:>8} "
            f"{'-' if c['x_envoy_cpu'] is None else format(c['x_envoy_cpu'], '.2f'):>8}")


def run_load(args, replica: str, work: Path) -> dict:
    """Every epick (front end × worker count) and its mode Envoys started at once; per
    concurrency, ``--rounds`` rounds of: Envoy alone, then every cell (front end, workers,
    mode) back to back, each round starting one cell later than the one before (so no
    cell always runs first after Envoy alone). Each cell's ratio compares it with its
    round's Envoy alone, seconds apart; with several rounds the medians are printed."""
    report = {"concurrent": args.concurrent, "requests": args.requests, "chunks": args.chunks,
              "chunk_delay_s": args.chunk_delay, "modes": args.modes,
              "frontends": args.frontend, "rounds": args.rounds, "runs": []}
    alone = envoys(free_port(), replica, ("envoy",))["envoy"]
    epicks: dict[tuple[str, int], subprocess.Popen] = {}
    started: dict[tuple[str, int], dict] = {}
    try:
        alone.start()
        wait_routing({"envoy": alone.url}, work)
        for frontend, workers in [(f, w) for f in args.frontend for w in args.workers]:
            epick, ext_proc = start_epick(replica, work, workers, frontend=frontend)
            epicks[frontend, workers] = epick
            # The observed file needs observer streams: every front end but the fixed one.
            modes = [m for m in args.modes
                     if split_frontend(frontend)[0] != "native-fixed" or m != "observed"]
            started[frontend, workers] = envoys(ext_proc, replica, modes)
            for e in started[frontend, workers].values():
                e.start()
            wait_routing({k: e.url for k, e in started[frontend, workers].items()}, work)
        cells = [(f, w, name) for (f, w), es in started.items() for name in es]
        print(LOAD_HEADER)
        for conc in args.concurrent:
            requests = args.requests or 2 * conc
            # Warm every path (connections, pools, the fixed worker's first answers), not
            # counted: the first run of a cold Envoy is the slowest.
            warm = min(conc, 200)
            asyncio.run(load_one(alone.url, warm, warm))
            for f, w, name in cells:
                asyncio.run(load_one(started[f, w][name].url, warm, warm))
            for r in range(args.rounds):
                if args.rounds > 1:
                    print(f"# round {r + 1} of {args.rounds}, {conc} concurrent", flush=True)
                base = _measure(alone.url, conc, requests, {"envoy": alone.proc.pid})
                report["runs"].append({"frontend": "-", "workers": "-", "path": "envoy",
                                       "concurrent": conc, "round": r, **base})
                print(_load_row("-", "envoy", conc, base, None), flush=True)
                print(f"{'':>30} CPU ms per request: Envoy {base['envoy_cpu_ms_per_req']}, "
                      f"replica {base.get('replica_cpu_ms_per_req', '-')}, client "
                      f"{base['client_cpu_ms_per_req']}; total {base['total_cpu_ms_per_req']}",
                      flush=True)
                k = r % len(cells)
                for f, w, name in cells[k:] + cells[:k]:
                    envoy = started[f, w][name]
                    row = _measure(envoy.url, conc, requests,
                                   {"epick": epicks[f, w].pid, "envoy": envoy.proc.pid}, envoy)
                    row["x_envoy"] = round(row["req_per_s"] / base["req_per_s"], 3)
                    # What the CPU alone predicts on a saturated machine: Envoy alone's
                    # CPU per request over this path's (both this round's).
                    row["x_envoy_cpu"] = round(base["total_cpu_ms_per_req"]
                                               / max(row["total_cpu_ms_per_req"], 1e-9), 3)
                    report["runs"].append({"frontend": f, "workers": w, "path": name,
                                           "concurrent": conc, "round": r, **row})
                    print(_load_row(str(w), name, conc, row, base["req_per_s"], f), flush=True)
                    print(f"{'':>30} CPU ms per request: epick "
                          f"{row['epick_cpu_ms_per_req']}, Envoy {row['envoy_cpu_ms_per_req']}, "
                          f"replica {row.get('replica_cpu_ms_per_req', '-')}, client "
                          f"{row['client_cpu_ms_per_req']}; total "
                          f"{row['total_cpu_ms_per_req']} (x envoy by CPU {row['x_envoy_cpu']})",
                          flush=True)
                    for what, n in sorted(row["errors"].items(), key=lambda kv: -kv[1])[:3]:
                        print(f"{'':>30} {n} x {what}")
                    if sum(row["errors_by_source"].values()):
                        print(f"{'':>30} Envoy's ext_proc counters: {row['envoy_ext_proc']}")
        if args.rounds > 1:
            report["summary"] = summarize(report["runs"])
            print(f"# medians over {args.rounds} rounds (x envoy: each run / its round's "
                  "Envoy alone; errors and ok summed; CPU ms per request); load average "
                  f"{os.getloadavg()[0]:.2f}")
            print(SUMMARY_HEADER)
            for c in report["summary"]:
                print(_summary_row(c), flush=True)
    finally:
        for es in started.values():
            for e in es.values():
                e.stop()
        for epick in epicks.values():
            epick.terminate()
            epick.wait(15)
        alone.stop()
    return report


def run_pick(args, replica: str, work: Path) -> dict:
    """Unary gRPC Pick p50/p99 at one client, per worker count (all epicks at once)."""
    import grpc

    from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc

    procs, stubs, channels = {}, {}, []
    try:
        for frontend, w in [(f, w) for f in args.frontend for w in args.workers]:
            port = free_port()
            # A label per epick: the worker count, with the front end when several run.
            key = w if len(args.frontend) == 1 else f"{frontend}/{w}"
            procs[key], _ext = start_epick(replica, work, w, pick_port=port,
                                           frontend=frontend)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            channels.append(channel)
            stubs[key] = picker_pb2_grpc.EndpointPickerStub(channel)
        request = picker_pb2.PickRequest(model="base", prompt="You are a helpful assistant. "
                                         * 30 + "Say hi.")
        for w, stub in stubs.items():  # serving (policies loaded, a fresh scrape) + warm
            deadline = time.monotonic() + 60
            while True:
                try:
                    stub.Pick(request, timeout=5)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        sys.exit(f"epick (workers {w}) not picking after 60 s ({work})")
                    time.sleep(0.2)
            for _ in range(200):
                stub.Pick(request, timeout=5)
        lat: dict = {w: [] for w in stubs}
        per = max(200, args.requests // len(stubs))
        while min(len(x) for x in lat.values()) < per:
            for w, stub in stubs.items():
                for _ in range(200):
                    t0 = time.perf_counter()
                    stub.Pick(request, timeout=5)
                    lat[w].append(time.perf_counter() - t0)
    finally:
        for c in channels:
            c.close()
        for p in procs.values():
            p.terminate()
            p.wait(15)
    report = {"requests_each": per, "load_avg_1m": round(os.getloadavg()[0], 2), "runs": []}
    first = None
    print(f"{'workers':>9} {'picks':>6} {'p50 us':>8} {'p99 us':>8} {'p50 / first':>11}")
    for w, xs in lat.items():
        p50, p99 = (float(np.percentile(xs, q)) * 1e6 for q in (50, 99))
        first = first or p50
        report["runs"].append({"workers": w, "picks": len(xs), "p50_us": round(p50, 1),
                               "p99_us": round(p99, 1), "p50_ratio": round(p50 / first, 3)})
        print(f"{w!s:>9} {len(xs):>6} {p50:>8.1f} {p99:>8.1f} {p50 / first:>11.3f}")
    print(f"# load average {report['load_avg_1m']}")
    return report


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench envoy", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["latency", "load", "pick"])
    ap.add_argument("--requests", type=int, default=None,
                    help="latency: per path and concurrency (2000); load: per run "
                         "(default twice the concurrency)")
    ap.add_argument("--concurrency", default="1,8", help="latency: client threads (list)")
    ap.add_argument("--concurrent", type=_ints, default=[500],
                    help="load: requests in flight (a list: 1000,2000)")
    ap.add_argument("--workers", type=_ints, default=[1],
                    help="epick's [server] workers (load: a list, epick restarted for each; "
                         "latency: the first)")
    ap.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m],
                    default=["buffered", "streamed"],
                    help="load: body modes through epick (buffered = envoy.yaml, streamed = "
                         "envoy-streaming.yaml, observed = envoy-observer.yaml)")
    ap.add_argument("--frontend", type=lambda t: [f for f in t.split(",") if f],
                    default=["python"],
                    help="load, pick: epick's [server] frontend, a list (python, native: "
                         "the C++ ext_proc worker, `make native`; load only: native-fixed, "
                         "the native worker replaying one answer without deciding: the "
                         "ceiling); each with every --workers")
    ap.add_argument("--rounds", type=int, default=3,
                    help="load: rounds of (Envoy alone, then every front end / workers / "
                         "mode), alternated in one run; with more than one, per-cell medians "
                         "of req/s and of the ratio to the round's Envoy alone")
    ap.add_argument("--chunks", type=int, default=None,
                    help="SSE events per streamed answer (latency 1, load 20)")
    ap.add_argument("--chunk-delay", type=float, default=0.02, help="seconds between events")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.chunks is None:
        args.chunks = 1 if args.what == "latency" else 20
    if args.what == "latency" and args.requests is None:
        args.requests = 2000
    if args.what == "pick" and args.requests is None:
        args.requests = 4000
    unknown = set(args.modes) - {"buffered", "streamed", "observed"}
    if unknown:
        ap.error(f"--modes: unknown {', '.join(sorted(unknown))} (buffered, streamed, observed)")
    names = {split_frontend(f)[0] for f in args.frontend}
    unknown = names - set(FRONTENDS)
    if unknown:
        ap.error(f"--frontend: unknown {', '.join(sorted(unknown))} ({', '.join(FRONTENDS)})")
    if "native-fixed" in names and args.what != "load":
        ap.error("--frontend native-fixed: a load ceiling (no decisions), for `load` only")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    for f in args.frontend:
        name, binary = split_frontend(f)
        if binary is not None and name == "python":
            ap.error(f"--frontend {f}: @PATH names a native worker binary (native@PATH)")
        if binary is not None and not binary.is_file():
            ap.error(f"--frontend {f}: no native worker binary at {binary}")
    if {"native", "native-fixed"} & {f for f in args.frontend if "@" not in f}:
        from epick.frontend.supervisor import native_binary

        try:
            native_binary()
        except FileNotFoundError as exc:
            ap.error(str(exc))

    work = Path(tempfile.mkdtemp(prefix="epick-bench-"))
    port = free_port()
    replica = mp.get_context("spawn").Process(
        target=replica_main, args=(port, args.chunks, args.chunk_delay), daemon=True)
    replica.start()
    global REPLICA_PID
    REPLICA_PID = replica.pid
    epick = None
    try:
        wait_port(port, "the replica")
        print(f"# {os.cpu_count()} CPUs; {args.what}; replica streams {args.chunks} events "
              f"{args.chunk_delay * 1e3:.0f} ms apart; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        if args.what == "load":
            report = run_load(args, f"127.0.0.1:{port}", work)
        elif args.what == "pick":
            report = run_pick(args, f"127.0.0.1:{port}", work)
        else:
            epick, ext_proc = start_epick(f"127.0.0.1:{port}", work, args.workers[0],
                                          frontend=args.frontend[0])
            started = envoys(ext_proc, f"127.0.0.1:{port}")
            try:
                for e in started.values():
                    e.start()
                urls = {k: e.url for k, e in started.items()}
                wait_routing(urls, work)
                report = run_latency(args, urls)
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
