"""``python -m epick.sim``: serve a simulated fleet over HTTP, or run one in virtual time.

``serve`` prints one line per replica, ``READY host:port``, once every replica is
listening, then serves until SIGINT/SIGTERM or ``--duration`` seconds. ``run`` serves a
generated workload in virtual time and prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import anyio
import msgspec

from .config import DEFAULT_CONFIG, ReplicaConfig, load_config
from .fleet import Fleet
from .routers import LeastQueueRouter, RandomRouter, RoundRobinRouter
from .server import serve_fleet
from .workload import adapter_names, multi_lora, shared_prefix, zero_hit


def _config(args: argparse.Namespace) -> ReplicaConfig:
    cfg = DEFAULT_CONFIG
    if args.config:
        path = Path(args.config)
        cfg = load_config(path.read_bytes(), source=str(path))
    if args.max_lora is not None:
        cfg = msgspec.structs.replace(cfg, max_loras=args.max_lora)
    if args.lora_metrics is not None:
        cfg = msgspec.structs.replace(cfg, lora_metrics=args.lora_metrics)
    return cfg


async def _serve(args: argparse.Namespace) -> None:
    cfg = _config(args)
    async with serve_fleet(
        args.replicas, adapters=adapter_names(args.adapters), config=cfg,
        host=args.host, base_port=args.base_port, kv_events=args.kv_events,
    ) as fleet:
        for address in fleet.addresses:
            print(f"READY {address}", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            with anyio.move_on_after(args.duration):
                async for _ in signals:
                    break


def _run(args: argparse.Namespace) -> None:
    cfg = _config(args)
    common = dict(qps=args.qps, duration_s=args.duration, seed=args.seed)
    if args.workload == "multi-lora":
        wl = multi_lora(adapters=args.adapters, **common)
    elif args.workload == "shared-prefix":
        wl = shared_prefix(tenants=args.tenants, prefix_tokens=args.prefix_tokens, **common)
    else:
        wl = zero_hit(**common)
    router = {
        "random": lambda: RandomRouter(args.seed),
        "round-robin": RoundRobinRouter,
        "least-queue": LeastQueueRouter,
    }[args.router]()
    res = Fleet(args.replicas, cfg, seed=args.seed).run(wl, router, args.scrape_interval)
    out = msgspec.structs.asdict(res.summary) | {"cpu_s": round(res.cpu_s, 3)}
    print(msgspec.json.format(msgspec.json.encode(out)).decode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epick.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def fleet_args(p: argparse.ArgumentParser, replicas: int) -> None:
        p.add_argument("--replicas", type=int, default=replicas)
        p.add_argument("--adapters", type=int, default=8, help="adapters adapter-0..N-1")
        p.add_argument("--max-lora", type=int, default=None, help="LoRA slots per replica")
        p.add_argument("--config", help="JSON ReplicaConfig file (unknown keys are errors)")
        p.add_argument("--lora-metrics", choices=["current", "older"], default=None,
                       help="lora_requests_info semantics (default: the config's, current)")

    s = sub.add_parser("serve", help="HTTP servers, one port per replica")
    fleet_args(s, 6)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--base-port", type=int, default=0, help="replica i on base+i; 0 = free ports")
    s.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    s.add_argument("--kv-events", action="store_true",
                   help="publish vLLM's KV-cache events over ZMQ (GET /kv_event_sources says where)")

    r = sub.add_parser("run", help="a generated workload in virtual time; prints the summary")
    fleet_args(r, 10)
    r.add_argument("--workload", choices=["multi-lora", "shared-prefix", "zero-hit"],
                   default="multi-lora")
    r.add_argument("--router", choices=["random", "round-robin", "least-queue"], default="random")
    r.add_argument("--qps", type=float, default=50.0)
    r.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    r.add_argument("--tenants", type=int, default=150)
    r.add_argument("--prefix-tokens", type=int, default=6000)
    r.add_argument("--scrape-interval", type=float, default=0.05)
    r.add_argument("--seed", type=int, default=0)

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            anyio.run(_serve, args, backend="asyncio")
        else:
            _run(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
