"""``python -m epick.bench.answer``: the service's own answer to one Pick, timed in process.

Builds the real :class:`~epick.service.Service` from the gRPC benchmark's config (the
three default policies, ``--endpoints`` vLLM-like pages from :mod:`epick.bench.pages`,
scraped once and then left alone), and times ``PickerService.answer_pick`` — validation,
scheduling, telemetry, encoding: everything a Pick costs but gRPC — on the benchmark's
request mix. Where ``epick bench pick`` times the scheduler alone and ``epick bench pick
--grpc`` the whole RPC, this is the part in between, with warm caches (inside the gRPC
server the same code runs ~2× slower: docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

__all__ = ["measure", "main"]


async def _time(config_path: Path, picks: int, rounds: int) -> list[float]:
    from epick.api.picker import PickerService
    from epick.bench.grpc import requests
    from epick.config import load
    from epick.service import Service

    svc = Service(load(config_path))
    reqs = requests(picks)
    out: list[float] = []
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)
        answer = PickerService(svc.scheduler, svc.recorder).answer_pick
        for r in reqs[:500]:  # warm
            answer(r)
        perf = time.perf_counter
        for _ in range(rounds):
            for r in reqs:
                t0 = perf()
                answer(r)
                out.append((perf() - t0) * 1e6)
            await anyio.sleep(0.05)  # let the loop breathe between rounds
        tg.cancel_scope.cancel()
    return out


def measure(endpoints: int = 64, picks: int = 4096, rounds: int = 5) -> list[float]:
    """µs per ``answer_pick`` over ``rounds`` × ``picks`` calls."""
    from epick.bench.grpc import NO_SCRAPE_MS, Setup

    pages = subprocess.Popen([sys.executable, "-m", "epick.bench.pages", "--count",
                              str(endpoints)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "epick.toml"
            path.write_text(Setup("answer", endpoints, NO_SCRAPE_MS).config(port))
            return anyio.run(_time, path, picks, rounds)
    finally:
        pages.terminate()
        pages.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.bench.answer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=64)
    ap.add_argument("--picks", type=int, default=4096, help="picks per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    lat = sorted(measure(args.endpoints, args.picks, args.rounds))
    print(f"answer_pick, {args.endpoints} endpoints, {len(lat)} picks: "
          f"p50 {statistics.median(lat):.1f} µs, p99 {lat[int(len(lat) * 0.99)]:.1f} µs, "
          f"mean {statistics.fmean(lat):.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
