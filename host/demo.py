"""`epick demo` (what `make demo` runs): a simulated fleet, epick, a gateway and load.

    python -m epick.sim serve      6 simulated vLLM replicas, 8 LoRA adapters, max_lora 2
    epick serve                    the default policies (load, prefix-cache, lora-affinity)
    the reference gateway          epick.gateway.proxy, in this process
    a load generator               Poisson arrivals mixing adapters and shared prefixes

It prints where everything listens first: Pick on 127.0.0.1:9002, the admin API on
127.0.0.1:9003 (token ``demo``), metrics on 127.0.0.1:9090 — the addresses the README's
commands use; a port already taken falls back to a free one, and the demo says so.

A live table shows each replica (queue, KV, adapters, picks/s) and epick (decisions/s,
p99 decision latency, prefix hit rate). It stops by itself after ``--duration`` seconds
(Ctrl-C or SIGTERM stops it early, cleanly, with the summary so far) and prints a summary. Every process it starts is its
child and is stopped before it returns.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio
from aiohttp import web
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from epick.gateway.proxy import Gateway, make_app
from epick.pool import parse_metrics

__all__ = ["main"]

BASE_MODEL = "sim-base"
TENANTS = 12
#: The demo's admin token (the demo only listens on 127.0.0.1).
DEMO_TOKEN = "demo"
#: The ports the README's commands use: the config defaults. Taken ones fall back to
#: a free port, and the demo says which.
DEFAULT_PORTS = {"pick": 9002, "admin": 9003, "metrics": 9090}


@dataclass
class LoadStats:
    sent: int = 0
    status: dict[int, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


def _tenant_prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("policy", "routing", "adapter", "cache", "replica", "tenant", "token", "queue",
             "latency", "gateway", "model", "prefix", "score", "weight", "metric", "pool")
    return [f"[tenant {t}] You are a helpful assistant. " +
            " ".join(rng.choice(words) for _ in range(400)) for t in range(TENANTS)]


async def _read_ready(lines: BufferedByteReceiveStream, marker: str, count: int,
                      timeout: float) -> list[str]:
    """Read stdout lines until ``count`` lines start with ``marker``; return their rest."""
    found: list[str] = []
    with anyio.fail_after(timeout):
        while len(found) < count:
            text = (await lines.receive_until(b"\n", 65536)).decode().strip()
            if text.startswith(marker):
                found.append(text[len(marker):].strip())
    return found


def _port_or_zero(port: int) -> int:
    """``port`` when 127.0.0.1 can bind it now (as the servers bind: SO_REUSEADDR), else 0."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return 0
    return port


def _epick_config(addresses: list[str], ports: dict[str, int] | None = None,
                  decisions_log: Path | None = None) -> str:
    ports = ports or {k: 0 for k in DEFAULT_PORTS}
    lines = ["version = 1", "[server]", f'listen = "127.0.0.1:{ports["pick"]}"',
             f'metrics_listen = "127.0.0.1:{ports["metrics"]}"', "[admin]",
             f'listen = "127.0.0.1:{ports["admin"]}"', f'token = "{DEMO_TOKEN}"']
    if decisions_log is not None:
        lines += ["[decisions]", f"log = {json.dumps(str(decisions_log.resolve()))}"]
    for a in addresses:
        lines += ["[[pool.endpoints]]", f'address = "{a}"']
    for p in ("load", "prefix-cache", "lora-affinity"):
        lines += ["[[policies]]", f'name = "{p}"', f'module = "{p}"']
    return "\n".join(lines) + "\n"


async def _one_request(http: aiohttp.ClientSession, url: str, body: dict,
                       stats: LoadStats) -> None:
    t0 = time.perf_counter()
    stats.sent += 1
    try:
        async with http.post(url, json=body) as r:
            stats.status[r.status] = stats.status.get(r.status, 0) + 1
            if r.status != 200:
                await r.read()
                return
            first = None
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    if first is None:
                        first = time.perf_counter() - t0
                    stats.tokens += 1
            if first is not None:
                stats.ttft_s.append(first)
            stats.e2e_s.append(time.perf_counter() - t0)
    except aiohttp.ClientError:
        stats.errors += 1


async def _closing(http: aiohttp.ClientSession) -> None:
    """Close ``http`` even when its owner is being cancelled: an ``async with`` session
    left by a cancellation never finishes closing, and aiohttp then warns (``Unclosed
    client session``, ``Unclosed connector``) when it is collected."""
    with anyio.CancelScope(shield=True):
        await http.close()


async def _load(gateway_url: str, rate: float, duration: float, adapters: int,
                stats: LoadStats, seed: int) -> None:
    rng = random.Random(seed)
    prompts = _tenant_prompts(seed)
    url = f"{gateway_url}/v1/completions"
    deadline = anyio.current_time() + duration
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    try:
        async with anyio.create_task_group() as tg:
            while anyio.current_time() < deadline:
                await anyio.sleep(rng.expovariate(rate))
                # 60% of requests name an adapter (skewed: the first ones are popular).
                model = BASE_MODEL
                if rng.random() < 0.6:
                    model = f"adapter-{min(int(rng.expovariate(0.5)), adapters - 1)}"
                body = {"model": model, "stream": True,
                        "max_tokens": rng.randint(16, 64),
                        "prompt": rng.choice(prompts) + f"\nQuestion {rng.randrange(10**6)}?"}
                tg.start_soon(_one_request, http, url, body, stats)
    finally:
        await _closing(http)


async def _scrape_text(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.get(url) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):  # a busy machine: skip this refresh
        return None


def _epick_numbers(text: str | None) -> tuple[float, dict[float, float]]:
    """(ok picks so far, cumulative latency buckets {le: count}) from epick's /metrics."""
    ok, buckets = 0.0, {}
    if text:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "epick_picks_total" and s.labels.get("outcome") == "ok":
                    ok = s.value
                elif (s.name == "epick_pick_latency_seconds_bucket"
                      and s.labels.get("stage") == "total"):
                    buckets[float(s.labels["le"])] = s.value
    return ok, buckets


def _quantile(buckets_now: dict, buckets_then: dict, q: float) -> float | None:
    """The q-quantile's bucket bound of the observations between two scrapes."""
    delta = sorted((le, buckets_now[le] - buckets_then.get(le, 0.0)) for le in buckets_now)
    if not delta or delta[-1][1] <= 0:
        return None
    total = delta[-1][1]
    for le, count in delta:
        if count >= q * total:
            return le
    return None


def _prefix_rate(texts: list[str | None]) -> float | None:
    hits = queries = 0.0
    for text in texts:
        if not text:
            continue
        # Only the two counters: a vLLM page has ~600 lines, parsing all costs ~10 ms.
        text = "\n".join(ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_"))
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
    return hits / queries if queries else None


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def demo(args: argparse.Namespace, console: Console,
               stop: anyio.Event | None = None, live: anyio.Event | None = None) -> dict:
    """Run the demo; its summary. ``stop`` set ends the load early (the summary covers
    what ran); ``live`` is set once the load runs (before that there is nothing to sum)."""
    py = sys.executable
    stop = stop or anyio.Event()
    stats = LoadStats()
    summary: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        fleet = await anyio.open_process(
            [py, "-m", "epick.sim", "serve", "--replicas", str(args.replicas), "--adapters",
             str(args.adapters), "--max-lora", str(args.max_lora), "--duration",
             str(args.duration + 60)], stderr=sys.stderr)
        epick = None
        try:
            addresses = await _read_ready(BufferedByteReceiveStream(fleet.stdout), "READY",
                                          args.replicas, timeout=60)
            config = Path(tmp) / "epick.toml"
            ports = {k: _port_or_zero(p) for k, p in DEFAULT_PORTS.items()}
            config.write_text(_epick_config(addresses, ports, args.decisions_log))
            epick = await anyio.open_process(
                [py, "-m", "epick.cli", "--log-level", "WARNING", "serve", "--config",
                 str(config)], stderr=sys.stderr)
            epick_out = BufferedByteReceiveStream(epick.stdout)
            target = (await _read_ready(epick_out, "epick: serving Pick on", 1, timeout=60))[0]
            metrics_url = (await _read_ready(epick_out, "epick: metrics on", 1, timeout=10))[0]
            admin = (await _read_ready(epick_out, "epick: admin on", 1, timeout=10))[0]
            gateway = Gateway(target, BASE_MODEL)
            runner = web.AppRunner(make_app(gateway))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            gw_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            console.print(f"fleet {' '.join(addresses)}\n"
                          f"load: {args.rate:g} req/s for {args.duration:g} s, "
                          f"{args.adapters} adapters, {TENANTS} tenants with shared prompts")
            console.print(_try_it(target, admin, metrics_url, gw_url, args.adapters,
                                  busy=[DEFAULT_PORTS[k] for k, p in ports.items() if not p]),
                          highlight=False)
            try:
                if live is not None:
                    live.set()
                summary = await _run_live(args, console, gateway, gw_url, addresses, stats,
                                          epick_metrics=metrics_url, stop=stop)
            finally:
                with anyio.CancelScope(shield=True):  # a cancelled start-up still cleans up
                    await runner.cleanup()
        finally:
            # Shielded: on Ctrl-C or SIGTERM this runs inside a cancelled scope, and the
            # children must still be stopped, not orphaned.
            with anyio.CancelScope(shield=True):
                for proc in (epick, fleet):
                    if proc is not None and proc.returncode is None:
                        proc.terminate()
                with anyio.move_on_after(10):
                    for proc in (epick, fleet):
                        if proc is not None:
                            await proc.wait()
                for proc in (epick, fleet):
                    if proc is not None and proc.returncode is None:
                        proc.kill()
    return summary


async def _demo_until_signal(args: argparse.Namespace,
                             console: Console) -> tuple[dict, int | None]:
    """:func:`demo`, stopped cleanly by SIGTERM or Ctrl-C: (its summary, the signal or None).

    Once the load runs, a signal ends it early and the summary covers what ran; during
    start-up it cancels the start-up (the summary is then ``{}``). Either way the children
    are stopped and every client session is closed.
    """
    out: dict = {}
    got: list[int] = []
    stop, live = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    got.append(signum)
                    stop.set()
                    if not live.is_set():
                        tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        out = await demo(args, console, stop, live)
        tg.cancel_scope.cancel()
    return out, (got[0] if got else None)


def _try_it(target: str, admin: str, metrics_url: str, gateway_url: str, adapters: int,
            busy: list[int]) -> str:
    """Where everything listens, and the README's commands (README: "Try it")."""
    lines = [
        f"epick Pick API    {target}",
        f"epick admin API   {admin}   token: {DEMO_TOKEN}   (export EPICK_ADMIN_TOKEN={DEMO_TOKEN})",
        f"epick metrics     {metrics_url}",
        f"gateway           {gateway_url}/v1/completions   (OpenAI-compatible)",
        f"model             {BASE_MODEL}, adapters adapter-0 … adapter-{adapters - 1}",
        f"try               .venv/bin/grpcurl -plaintext {target} list",
    ]
    if busy:
        lines.append(f"note              port(s) {', '.join(map(str, busy))} were in use: "
                     "use the addresses above in the README's commands")
    return "\n".join(lines)


async def _run_live(args, console, gateway: Gateway, gw_url: str, addresses: list[str],
                    stats: LoadStats, epick_metrics: str | None,
                    stop: anyio.Event) -> dict:
    picks_prev = {a: 0 for a in addresses}
    hist_first: dict = {}
    hist_prev: dict = {}
    ok_prev = 0.0
    t_prev = time.perf_counter()
    decisions_s = 0.0
    p99 = None
    latest: dict[str, object] = {}
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
    try:

        def render(elapsed: float) -> Group:
            t = Table(title=f"simulated fleet — {elapsed:4.0f}/{args.duration:g} s")
            for c in ("replica", "queue", "running", "KV", "running adapters",
                      "waiting adapters", "picks/s", "picks"):
                t.add_column(c, justify="right" if c not in ("replica", "running adapters",
                                                             "waiting adapters") else "left")
            for a in addresses:
                m = latest.get(a)
                rate = latest.get(f"rate:{a}", 0.0)
                if m is None:
                    t.add_row(a, "-", "-", "-", "-", "-", f"{rate:.1f}",
                              str(gateway.stats.picks[a]))
                    continue
                t.add_row(a, str(m.waiting), str(m.running), f"{m.kv_usage:.0%}",
                          ",".join(m.running_adapters) or "-",
                          ",".join(m.waiting_adapters) or "-", f"{rate:.1f}",
                          str(gateway.stats.picks[a]))
            e = Table(title="epick")
            for c in ("decisions/s", "p99 decision (host)", "Pick RTT p99 (gateway)",
                      "prefix hit rate", "requests", "OK", "429/503", "TTFT p50", "TTFT p90"):
                e.add_column(c, justify="right")
            hit = latest.get("hit")
            rtt = gateway.stats.pick_latency_s[-2000:]
            e.add_row(f"{decisions_s:.1f}", f"≤ {p99 * 1e6:.0f} µs" if p99 else "-",
                      f"{_pct(rtt, 0.99) * 1e3:.2f} ms" if rtt else "-",
                      f"{hit:.0%}" if hit is not None else "-", str(stats.sent),
                      str(stats.status.get(200, 0)),
                      str(stats.status.get(429, 0) + stats.status.get(503, 0)),
                      f"{_pct(stats.ttft_s, 0.5) * 1e3:.0f} ms" if stats.ttft_s else "-",
                      f"{_pct(stats.ttft_s, 0.9) * 1e3:.0f} ms" if stats.ttft_s else "-")
            return Group(t, e)

        start = time.perf_counter()
        with Live(render(0), console=console, refresh_per_second=2,
                  transient=False) as live:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_load, gw_url, args.rate, args.duration, args.adapters, stats,
                              args.seed)
                while time.perf_counter() - start < args.duration + 0.5:
                    with anyio.move_on_after(1.0):
                        await stop.wait()
                    if stop.is_set():
                        break
                    now = time.perf_counter()
                    dt = now - t_prev
                    texts = []
                    for a in addresses:
                        text = await _scrape_text(http, f"http://{a}/metrics")
                        texts.append(text)
                        if text:
                            try:
                                latest[a] = parse_metrics(text, engine="vllm", url=a,
                                                          previous=latest.get(a), address=a)
                            except Exception:  # a page mid-restart: keep the last one
                                pass
                        latest[f"rate:{a}"] = (gateway.stats.picks[a] - picks_prev[a]) / dt
                        picks_prev[a] = gateway.stats.picks[a]
                    latest["hit"] = _prefix_rate(texts)
                    if epick_metrics:
                        ok, hist = _epick_numbers(await _scrape_text(http, epick_metrics))
                        decisions_s = (ok - ok_prev) / dt
                        p99 = _quantile(hist, hist_prev, 0.99)
                        hist_first = hist_first or hist
                        ok_prev, hist_prev = ok, hist
                    else:
                        n = sum(gateway.stats.picks.values())
                        decisions_s = (n - ok_prev) / dt
                        ok_prev = n
                    t_prev = now
                    live.update(render(now - start))
                tg.cancel_scope.cancel()
    finally:
        await _closing(http)
    rtt = gateway.stats.pick_latency_s
    return {
        "duration_s": time.perf_counter() - start,
        "requests": stats.sent,
        "status": dict(sorted(stats.status.items())),
        "client_errors": stats.errors,
        "output_tokens": stats.tokens,
        "ttft_p50_ms": _pct(stats.ttft_s, 0.5) * 1e3,
        "ttft_p90_ms": _pct(stats.ttft_s, 0.9) * 1e3,
        "e2e_p50_s": _pct(stats.e2e_s, 0.5),
        "pick_rtt_p50_ms": _pct(rtt, 0.5) * 1e3,
        "pick_rtt_p99_ms": _pct(rtt, 0.99) * 1e3,
        "picks": {a: gateway.stats.picks[a] for a in addresses},
        "prefix_hit_rate": latest.get("hit"),
        "decisions": ok_prev if epick_metrics else None,
        "decision_p99_s": _quantile(hist_prev, {}, 0.99) if hist_prev else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second")
    ap.add_argument("--replicas", type=int, default=6)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-lora", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--decisions-log", type=Path, metavar="PATH",
                    help="record every decision here, for `epick replay PATH`")
    args = ap.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=130)
    try:
        summary, signum = anyio.run(_demo_until_signal, args, console, backend="asyncio")
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the handler is in place
        console.print("stopped")
        return 130
    # Stopped by a signal: its summary still prints, and the exit status says which.
    stopped = {signal.SIGTERM: 143, signal.SIGINT: 130}.get(signum) if signum else None
    if not summary:
        console.print("stopped")
        return stopped or 143
    t = Table(title="epick demo — summary")
    t.add_column("")
    t.add_column("", justify="right")
    s = summary
    rows = [
        ("requests sent", str(s["requests"])),
        ("HTTP status counts", ", ".join(f"{k}: {v}" for k, v in s["status"].items())),
        ("output tokens/s", f"{s['output_tokens'] / max(s['duration_s'], 1e-9):.0f}"),
        ("TTFT p50 / p90", f"{s['ttft_p50_ms']:.0f} ms / {s['ttft_p90_ms']:.0f} ms"),
        ("end-to-end p50", f"{s['e2e_p50_s']:.2f} s"),
        ("Pick round trip p50 / p99 (gateway)",
         f"{s['pick_rtt_p50_ms']:.2f} ms / {s['pick_rtt_p99_ms']:.2f} ms"),
        ("epick decisions", "-" if s["decisions"] is None else f"{s['decisions']:.0f}"),
        ("epick decision time p99 (host, bucket bound)", "-" if s["decision_p99_s"] is None
         else f"≤ {s['decision_p99_s'] * 1e6:.0f} µs"),
        ("prefix cache hit rate", "-" if s["prefix_hit_rate"] is None
         else f"{s['prefix_hit_rate']:.0%}"),
        ("picks per replica", " ".join(str(v) for v in s["picks"].values())),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if args.decisions_log is not None:
        console.print(f"decision log: {args.decisions_log} — try "
                      f"`epick replay {args.decisions_log} --weights load=3`")
    if stopped is not None:
        console.print(f"stopped after {s['duration_s']:.0f} s")
        return stopped
    return 0 if s["status"].get(200, 0) > 0 else 1
