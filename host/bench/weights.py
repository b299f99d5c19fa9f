"""`epick bench weights`: what the weights stream (``WatchWeights``) costs the pick path,
and how fast a metrics change reaches a subscriber.

One ``epick serve`` process (8 endpoints whose pages change on every scrape, from
:mod:`epick.bench.pages`, plus one page this benchmark controls; the three built-in
policies; ``[weights]`` defaults) and, in alternating rounds of one run:

    0 subscribers      sequential unary Picks from this process       (Pick p50, p99)
    N subscribers      the same, while a child process holds N WatchWeights streams over
                       ``--keys`` (model, adapter) keys and reads every table

Pick p50 with N ÷ without is the cost (issue 28: ≤ 1.05 at N = 1,000). Then, with the N
subscribers still there, the controlled page flips between idle and saturated
(``waiting`` over the admission threshold) ``--flips`` times; the delay is from the flip
to the first table that shows it (its endpoint at weight 0, or back above 0): scrape
interval + the hub's poll + ``min_interval_ms`` + the stream.

    epick bench weights --rules     the share rule on the simulated fleet instead:
                                    proportional vs softmax(T) vs round-robin, each
                                    routing every request by the table of its adapter
                                    (what an L4 data plane following the stream does)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc

__all__ = ["main"]

ADAPTERS = 16


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# -- the subscribers (a child process: their client work must not share our GIL) ----------

async def _subscribers(target: str, count: int, keys: int) -> None:
    channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, count // 100))]
    stubs = [picker_pb2_grpc.EndpointPickerStub(c) for c in channels]
    received = [0]
    ready = asyncio.Event()
    started = [0]

    async def one(k: int) -> None:
        adapter = "" if k % keys == 0 else f"adapter-{k % keys - 1}"
        call = stubs[k % len(stubs)].WatchWeights(
            picker_pb2.WeightsRequest(model="llama", adapter=adapter))
        first = True
        async for _ in call:
            received[0] += 1
            if first:
                first = False
                started[0] += 1
                if started[0] == count:
                    ready.set()

    tasks = [asyncio.create_task(one(k)) for k in range(count)]
    await ready.wait()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(f"received {received[0]}", flush=True)
    for t in tasks:
        t.cancel()
    for c in channels:
        await c.close()


class _Subscribers:
    def __init__(self, target: str, count: int, keys: int) -> None:
        # At niceness 19, as the pages: they stand in for data planes on other machines,
        # so on a small machine their reading must not take the server's CPU.
        self.proc = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "epick.bench.weights", "--child",
             target, str(count),
             str(keys)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the subscriber process did not start: {line!r}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        out = self.proc.communicate(timeout=30)[0]
        return int(out.split()[-1]) if out.strip() else 0


# -- the page this benchmark controls --------------------------------------------------

class _Page:
    """One vLLM-like page whose queue depth the benchmark sets."""

    def __init__(self) -> None:
        self.waiting = 0
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                from epick.bench.pages import page as make_page

                body = make_page(0, 0, "adapter-0,adapter-1").replace(
                    b'vllm:num_requests_waiting{model_name="llama"} 0',
                    f'vllm:num_requests_waiting{{model_name="llama"}} {page.waiting}'.encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the scraper gave up (timeout) or went away
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


# -- the measurement -------------------------------------------------------------------

def _picks(stub, seconds: float) -> list[float]:
    from epick.bench.grpc import requests

    reqs = requests(2000)
    out: list[float] = []
    end = time.perf_counter() + seconds
    k = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        stub.Pick(reqs[k % len(reqs)], timeout=10)
        out.append(time.perf_counter() - t0)
        k += 1
    return out


def _delays(stub, page: _Page, address: str, flips: int) -> list[float]:
    """Seconds from each flip of the controlled page to the first table showing it."""
    call = stub.WatchWeights(picker_pb2.WeightsRequest(model="llama"))
    tables: list = []
    cond = threading.Condition()

    def read() -> None:
        try:
            for t in call:
                w = next((e.weight for e in t.endpoints if e.endpoint == address), 0.0)
                with cond:
                    tables.append((time.perf_counter(), w))
                    cond.notify_all()
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    delays = []
    for k in range(flips):
        saturate = k % 2 == 0
        time.sleep(0.3)
        with cond:
            seen = len(tables)
        t0 = time.perf_counter()
        page.waiting = 50 if saturate else 0
        with cond:
            ok = cond.wait_for(lambda s=saturate, n=seen: any((w == 0) == s
                                                              for _, w in tables[n:]),
                               timeout=5)
            if ok:
                t1 = next(t for t, w in tables[seen:] if (w == 0) == saturate)
                delays.append(t1 - t0)
    call.cancel()
    return delays


def measure(*, subscribers: int, keys: int, rounds: int, seconds: float, flips: int,
            threshold: float = 0.02, min_interval_ms: float = 100.0, log=print) -> dict:
    from epick.bench.grpc import Setup

    pages = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "epick.bench.pages",
                              "--count", "8"], stdout=subprocess.PIPE, text=True)
    page = _Page()
    setup = Setup(name="weights", endpoints=8, scrape_ms=50)
    controlled = "10.9.9.9:8000"
    try:
        pages_port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "weights.toml"
            path.write_text(setup.config(pages_port) + "\n".join([
                "[[pool.endpoints]]", f'address = "{controlled}"',
                f'metrics_url = "http://127.0.0.1:{page.port}/metrics"',
                "[weights]", f"threshold = {threshold}",
                f"min_interval_ms = {min_interval_ms}", ""]))
            setup.start(path)
            try:
                channel = grpc.insecure_channel(setup.target)
                stub = picker_pb2_grpc.EndpointPickerStub(channel)
                _picks(stub, 1.0)  # warm up
                without: list[float] = []
                with_: list[float] = []
                received = 0
                cpu_without = cpu_with = 0.0
                delays_alone = _delays(stub, page, controlled, flips)
                for r in range(rounds):
                    c0 = setup.cpu()
                    without += _picks(stub, seconds)
                    cpu_without += setup.cpu() - c0
                    subs = _Subscribers(setup.target, subscribers, keys)
                    c0 = setup.cpu()
                    with_ += _picks(stub, seconds)
                    cpu_with += setup.cpu() - c0
                    last = r == rounds - 1
                    delays = _delays(stub, page, controlled, flips) if last else []
                    received += subs.stop()
                    log(f"round {r + 1}/{rounds}: p50 {_q(without, .5) * 1e6:.0f} µs "
                        f"without, {_q(with_, .5) * 1e6:.0f} µs with {subscribers}")
                channel.close()
            finally:
                setup.stop()
    finally:
        page.close()
        pages.terminate()
        pages.wait(timeout=10)
    return {
        "subscribers": subscribers, "keys": keys, "rounds": rounds,
        "picks_without": len(without), "picks_with": len(with_),
        "pick_p50_us_without": _q(without, .5) * 1e6,
        "pick_p50_us_with": _q(with_, .5) * 1e6,
        "pick_p99_us_without": _q(without, .99) * 1e6,
        "pick_p99_us_with": _q(with_, .99) * 1e6,
        "p50_ratio": _q(with_, .5) / _q(without, .5),
        "tables_received": received,
        "threshold": threshold, "min_interval_ms": min_interval_ms,
        "server_cpu_s_per_s_without": cpu_without / (rounds * seconds),
        "server_cpu_s_per_s_with": cpu_with / (rounds * seconds),
        "delay_alone_p50_ms": _q(delays_alone, .5) * 1e3,
        "delay_alone_p99_ms": _q(delays_alone, .99) * 1e3,
        "delay_flips": len(delays),
        "delay_p50_ms": _q(delays, .5) * 1e3, "delay_p99_ms": _q(delays, .99) * 1e3,
        "delay_mean_ms": statistics.fmean(delays) * 1e3 if delays else float("nan"),
    }


# -- the share rule on the simulated fleet -------------------------------------------

class _TableRouter:
    """Routes each request by weighted random over its adapter's weights table, the
    table recomputed once per snapshot version (as a data plane following the stream)."""

    def __init__(self, policies, rule: str, temperature: float, seed: int) -> None:
        import random

        from epick.api.weights import WeightsHub
        from epick.bench.quality import EpickRouter

        self._inner = EpickRouter(policies, seed=seed)
        self._hub = WeightsHub(self._inner.scheduler, rule=rule, temperature=temperature)
        self._rng = random.Random(seed)
        self._tables: dict[str, tuple[int, list[int], list[float]]] = {}

    def route(self, req, view) -> int:
        inner = self._inner
        inner._view = view  # the snapshot rebuild of EpickRouter.route, without its pick
        key = tuple(view.scraped_at(i) for i in range(len(view)))
        if key != inner._key:
            from epick import abi
            from epick.interfaces import PoolView

            inner._key = key
            inner._version += 1
            inner._pool_view = PoolView.build(abi.Snapshot(
                version=inner._version, timestamp_ms=int(view.now * 1000),
                endpoints=view.all_metrics()))
            self._index = {a: i for i, a in enumerate(view.addresses)}
        got = self._tables.get(req.adapter)
        if got is None or got[0] != inner._version:
            table = self._hub.table("base", req.adapter)
            rows = [(self._index[e.endpoint], e.weight) for e in table.endpoints if e.weight > 0]
            got = (inner._version, [i for i, _ in rows], [w for _, w in rows])
            self._tables[req.adapter] = got
        if not got[1]:
            return self._rng.randrange(len(view))
        return self._rng.choices(got[1], got[2])[0]

    def on_complete(self, req, replica: int) -> None:
        pass


def rules(*, duration_s: float, seed: int, log=print) -> list[dict]:
    import msgspec

    from epick.bench.quality import BENCH_LIMITS, DEFAULT_WEIGHTS, wasm_set
    from epick.runtime import Runtime
    from epick.sim import workload as wl
    from epick.sim.config import DEFAULT_CONFIG
    from epick.sim.fleet import Fleet
    from epick.sim.routers import RoundRobinRouter

    cases = [("multi-lora", 10, 40.0, lambda: wl.multi_lora(
                 qps=40.0, duration_s=duration_s, seed=seed, adapters=15,
                 split=(0.6, 0.3, 0.1))),
             ("zero-hit", 8, 40.0, lambda: wl.zero_hit(qps=40.0, duration_s=duration_s,
                                                       seed=seed))]
    routers = [("round-robin", None, 0.1), ("proportional", "proportional", 0.1),
               ("softmax T=0.3", "softmax", 0.3), ("softmax T=0.1", "softmax", 0.1),
               ("softmax T=0.03", "softmax", 0.03)]
    out = []
    with Runtime(limits=BENCH_LIMITS) as runtime:
        for wname, replicas, rate, make in cases:
            config = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=3)
            fleet = Fleet(replicas, config, seed=seed)
            requests = make()
            for name, rule, temperature in routers:
                router = (RoundRobinRouter() if rule is None else
                          _TableRouter(wasm_set(runtime, DEFAULT_WEIGHTS), rule, temperature,
                                       seed))
                s = fleet.run(requests, router, scrape_interval_s=0.05).summary
                row = {"workload": wname, "rate": rate, "router": name,
                       "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s,
                       "e2e_p90_s": s.e2e_p90_s, "tok_s": s.output_tok_s,
                       "adapter_loads": s.adapter_loads}
                out.append(row)
                log(f"{wname:11s} {rate:4.0f} qps  {name:15s} ttft p50 {s.ttft_p50_s:6.3f}s "
                    f"p90 {s.ttft_p90_s:6.3f}s  e2e p90 {s.e2e_p90_s:6.2f}s  "
                    f"tok/s {s.output_tok_s:6.0f}  adapter loads {s.adapter_loads}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        asyncio.run(_subscribers(argv[1], int(argv[2]), int(argv[3])))
        return 0
    p = argparse.ArgumentParser(prog="epick bench weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subscribers", type=int, default=1000)
    p.add_argument("--keys", type=int, default=4,
                   help="(model, adapter) keys the subscribers spread over (default 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="per phase per round")
    p.add_argument("--flips", type=int, default=40, help="page flips timed for the delay")
    p.add_argument("--threshold", type=float, default=0.02, help="[weights] threshold")
    p.add_argument("--min-interval-ms", type=float, default=100.0,
                   help="[weights] min_interval_ms")
    p.add_argument("--rules", action="store_true",
                   help="compare the share rules on the simulated fleet instead")
    p.add_argument("--duration", type=float, default=20.0, help="--rules: virtual seconds")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.rules:
        result: object = rules(duration_s=args.duration, seed=1)
    else:
        result = measure(subscribers=args.subscribers, keys=args.keys, rounds=args.rounds,
                         seconds=args.seconds, flips=args.flips, threshold=args.threshold,
                         min_interval_ms=args.min_interval_ms)
        r = result
        print(f"Pick p50 {r['pick_p50_us_without']:.0f} µs with 0 subscribers, "
              f"{r['pick_p50_us_with']:.0f} µs with {r['subscribers']} "
              f"(ratio {r['p50_ratio']:.3f}; goal ≤ 1.05); p99 "
              f"{r['pick_p99_us_without']:.0f} / {r['pick_p99_us_with']:.0f} µs; "
              f"{r['tables_received']} tables received")
        print(f"server CPU {r['server_cpu_s_per_s_without']:.2f} s/s without, "
              f"{r['server_cpu_s_per_s_with']:.2f} s/s with subscribers "
              f"(threshold {r['threshold']}, min_interval_ms {r['min_interval_ms']:g})")
        print(f"metrics change -> table: p50 {r['delay_alone_p50_ms']:.0f} ms, "
              f"p99 {r['delay_alone_p99_ms']:.0f} ms with 1 subscriber; "
              f"p50 {r['delay_p50_ms']:.0f} ms, p99 {r['delay_p99_ms']:.0f} ms with "
              f"{r['subscribers'] + 1} ({r['delay_flips']} flips each)")
    if args.json:
        import json

        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
