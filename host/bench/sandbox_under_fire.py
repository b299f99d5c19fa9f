"""The sandbox under fire: Pick latency while a hostile module is live, and hot swaps
under load on a busy machine. Run once and report; not part of `make test`.

    epick bench sandbox-under-fire [--seconds 5] [--threads 3] [--swaps 1000]
                                   [--burn 1] [--cases spin,every-other]

Each run starts ``epick serve`` as its own process (so client and server do not share a
GIL) over 8 static vLLM /metrics pages (``python -m http.server``, a third process), with ``--burn`` extra processes spinning on the
CPU (a busy machine; stopped by PID at the end).

Part 1, per case of tests/runtime/hostile.py (read from the checkout) (``benign`` first: the baseline): the
module is loaded beside ``load`` through the admin API (conformance off: these modules
pass the smoke run and turn hostile in service), ``--threads`` clients pick for
``--seconds``; prints picks/s, p50/p99/max and failed picks, and what the sandbox did
(recoveries, breaker opens, calls skipped while rebuilding).

Part 2: ``--swaps`` LoadPolicy of the shipped load.wasm (alternating two param sets),
each through the full gate (smoke run + conformance), while the clients pick; prints
refusals, failed picks, pick p50/p99 and swap time.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from epick.api.gen.epick.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    picker_pb2,
    picker_pb2_grpc,
)
from epick.bench import checkout
from epick.config import resolve_module

TOKEN = "bench-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(pages_port: int, admin_port: int, cache: Path, *, gate: bool) -> str:
    lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"', 'metrics_listen = ""',
             "[admin]", f'listen = "127.0.0.1:{admin_port}"', f'token = "{TOKEN}"',
             f"require_conformance = {'true' if gate else 'false'}",
             "[runtime]", f'cache_dir = "{cache}"', "[pool]", "scrape_interval_ms = 50"]
    for i in range(8):
        lines += ["[[pool.endpoints]]", f'address = "10.9.0.{i}:8000"',
                  f'metrics_url = "http://127.0.0.1:{pages_port}/metrics/{i}"']
    lines += ["[[policies]]", 'name = "load"', 'module = "load"']
    return "\n".join(lines) + "\n"


def _page(i: int, rng: random.Random, model: str) -> bytes:
    """A static vLLM-like page for endpoint ``i`` serving ``model`` (queues, KV use)."""
    adapters = ",".join(rng.sample([f"adapter-{k}" for k in range(16)], 2))
    return (
        f'vllm:num_requests_waiting{{model_name="{model}"}} {rng.randint(0, 20)}\n'
        f'vllm:num_requests_running{{model_name="{model}"}} {rng.randint(0, 60)}\n'
        f'vllm:kv_cache_usage_perc{{model_name="{model}"}} {rng.random():.3f}\n'
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{adapters}",'
        f'waiting_lora_adapters=""}} 1.7e9\n'
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="8192"}} 1\n'
    ).encode()


def _start_server(config_path: Path) -> tuple[subprocess.Popen, str]:
    """``epick serve`` in its own process; returns it and the Pick address it printed."""
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


class Pages:
    """The 8 /metrics pages, served by ``python -m http.server`` in a process of its own:
    in this process the picking threads would starve it of the GIL and the pool would
    see stale metrics that say nothing about epick."""

    def __init__(self, tmp: Path, model: str) -> None:
        folder = tmp / "pages"
        (folder / "metrics").mkdir(parents=True)
        rng = random.Random(5)
        for i in range(8):
            (folder / "metrics" / str(i)).write_bytes(_page(i, rng, model))
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
             "--directory", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


class Clients:
    """``threads`` gRPC clients picking until stopped; latencies (ms) and failures,
    both counted only after ``warmup_s`` (connections up, caches warm)."""

    def __init__(self, target: str, threads: int, model: str, warmup_s: float = 0.0) -> None:
        self.lat: list[float] = []
        self.failures: list[str] = []
        self._from = time.perf_counter() + warmup_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(target, model, k))
                         for k in range(threads)]

    def _run(self, target: str, model: str, k: int) -> None:
        with grpc.insecure_channel(target) as ch:
            pick = picker_pb2_grpc.EndpointPickerStub(ch).Pick
            i = k
            while not self._stop.is_set():
                req = picker_pb2.PickRequest(model=model, prompt=f"prompt {i % 50} " * 20,
                                             seed=i)
                t0 = time.perf_counter()
                try:
                    pick(req, timeout=30)
                    if t0 >= self._from:
                        self.lat.append((time.perf_counter() - t0) * 1e3)
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                i += 7

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


def _serve(tmp: Path, pages: Pages, *, gate: bool):
    admin_port = _free_port()
    path = tmp / f"epick-{admin_port}.toml"
    path.write_text(_config(pages.port, admin_port, tmp / "cache", gate=gate))
    proc, target = _start_server(path)
    admin_ch = grpc.insecure_channel(f"127.0.0.1:{admin_port}")
    grpc.channel_ready_future(admin_ch).result(timeout=30)
    return proc, target, admin_ch, admin_pb2_grpc.AdminStub(admin_ch)


def _stop(proc: subprocess.Popen, admin_ch: grpc.Channel) -> None:
    admin_ch.close()
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def hostile_cases(tmp: Path, pages: Pages, args, hostile) -> None:
    print(f"Part 1: picks while a hostile module is live ({args.threads} clients x "
          f"{args.seconds:g} s, {args.burn} CPU burner(s))")
    print(f"{'case':<16}{'picks/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'failed':>8}"
          f"{'recov':>7}{'opens':>7}{'skips':>7}  breakers")
    for case in args.cases:
        what, wasm = hostile.HOSTILE[case]
        proc, target, admin_ch, admin = _serve(tmp, pages, gate=False)
        try:
            admin.LoadPolicy(admin_pb2.LoadPolicyRequest(name="hostile", wasm=wasm),
                             metadata=AUTH, timeout=60)
            with Clients(target, args.threads, hostile.MODEL, warmup_s=1.0) as c:
                time.sleep(1.0 + args.seconds)
            info = {p.name: p for p in admin.ListPolicies(admin_pb2.ListPoliciesRequest(),
                                                          metadata=AUTH).policies}["hostile"]
        finally:
            _stop(proc, admin_ch)
        print(f"{case:<16}{len(c.lat) / args.seconds:9.0f}{_pct(c.lat, 50):9.2f}"
              f"{_pct(c.lat, 99):9.2f}{max(c.lat, default=float('nan')):9.2f}"
              f"{len(c.failures):8d}{info.recoveries:7d}{info.breaker_opens:7d}"
              f"{info.recovering_skips:7d}  {info.breakers}   ({what})")


def hot_swaps(tmp: Path, pages: Pages, args) -> None:
    load = resolve_module("load").read_bytes()
    params = [json.dumps({"queue_weight": 1.0, "kv_weight": 0.0}),
              json.dumps({"queue_weight": 0.0, "kv_weight": 1.0})]
    proc, target, admin_ch, admin = _serve(tmp, pages, gate=True)
    refused: list[str] = []
    swap_ms: list[float] = []
    try:
        with Clients(target, args.threads, args.model) as c:
            t_start = time.perf_counter()
            for k in range(args.swaps):
                t0 = time.perf_counter()
                try:
                    admin.LoadPolicy(admin_pb2.LoadPolicyRequest(
                        name="load", wasm=load, params_json=params[k % 2]),
                        metadata=AUTH, timeout=120)
                except grpc.RpcError as exc:
                    refused.append(f"{exc.code().name}: {exc.details()}")
                swap_ms.append((time.perf_counter() - t0) * 1e3)
            elapsed = time.perf_counter() - t_start
    finally:
        _stop(proc, admin_ch)
    print(f"\nPart 2: {args.swaps} hot swaps of load.wasm through LoadPolicy (smoke run + "
          f"conformance gate) in {elapsed:.1f} s, {args.threads} clients picking, "
          f"{args.burn} CPU burner(s)")
    print(f"  refused: {len(refused)}   failed picks: {len(c.failures)} of "
          f"{len(c.lat) + len(c.failures)}   pick p50 {_pct(c.lat, 50):.2f} ms, "
          f"p99 {_pct(c.lat, 99):.2f} ms, max {max(c.lat, default=float('nan')):.2f} ms")
    print(f"  swap p50 {_pct(swap_ms, 50):.0f} ms, p99 {_pct(swap_ms, 99):.0f} ms")
    for line in sorted(set(refused))[:5]:
        print("  refusal:", line[:300])
    for line in sorted(set(c.failures))[:5]:
        print("  failed pick:", line[:300])


def main(argv: list[str] | None = None) -> int:
    # The hostile modules are the sandbox tests' own (tests/runtime/hostile.py).
    hostile = checkout.tests_module("runtime", "hostile")
    ap = argparse.ArgumentParser(prog="epick bench sandbox-under-fire", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--swaps", type=int, default=1000)
    ap.add_argument("--burn", type=int, default=1, help="CPU-burning processes meanwhile")
    ap.add_argument("--cases", default=",".join(hostile.HOSTILE),
                    type=lambda s: [c for c in s.split(",") if c])
    args = ap.parse_args(argv)
    # The service refuses a model no page lists: every page serves the hostile cases' model.
    args.model = hostile.MODEL
    for case in args.cases:
        if case not in hostile.HOSTILE:
            ap.error(f"unknown case {case!r}; one of {', '.join(hostile.HOSTILE)}")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burn)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            pages = Pages(Path(tmp), args.model)
            try:
                if args.cases:
                    hostile_cases(Path(tmp), pages, args, hostile)
                if args.swaps:
                    hot_swaps(Path(tmp), pages, args)
            finally:
                pages.close()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
