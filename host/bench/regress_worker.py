"""One side of ``epick bench regress``'s interleaved mode: a warm ``answer_pick`` that runs
only when told to.

The guard runs this file's *source* (``python -c``) in each side's environment, so the
``epick`` it imports is that side's (the working tree, or the base ref's worktree on
``PYTHONPATH``): it must import nothing from epick at module level and use only what
``python -m epick.bench.answer`` has used since it exists (cb0583f): ``epick.service.Service``,
``epick.config.load``, ``epick.api.picker.PickerService``, ``epick.bench.grpc``'s
``requests``/``Setup``/``NO_SCRAPE_MS`` and ``epick.bench.pages``.

It builds the service as ``epick.bench.answer`` does (the three default policies,
``--endpoints`` vLLM-like pages scraped once), makes ``--warm`` untimed picks, pins itself
to ``--cpu`` (after starting the pages process, which keeps the parent's CPUs), prints one
``{"ready": …}`` JSON line and then answers its stdin, one command a line:

- ``run N``: N picks, timed each with ``time.perf_counter`` (wall) and
  ``time.thread_time`` (this thread's CPU); answers ``{"wall": […], "cpu": […]}`` in µs;
- ``quit``: stops the service and the pages process, exits 0.

While it waits for a command its event loop is blocked, so it takes no CPU from the other
side's turn; before each turn the loop gets a few milliseconds to run what came due.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["main", "parse_command"]


def parse_command(line: str) -> int | None:
    """``run N`` → N (> 0); ``quit`` or end of input → None; anything else is an error."""
    words = line.split()
    if not words or words == ["quit"]:
        return None
    if len(words) == 2 and words[0] == "run" and words[1].isdigit() and int(words[1]) > 0:
        return int(words[1])
    raise ValueError(f"regress worker: bad command {line.strip()!r} (expected 'run N' or 'quit')")


def _reply(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def _serve(config_path, endpoints: int, warm: int, cpu: int | None) -> None:
    import time

    import anyio

    import epick
    from epick.api.picker import PickerService
    from epick.bench.grpc import requests
    from epick.config import load
    from epick.service import Service

    svc = Service(load(config_path))
    reqs = requests(4096)
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)
        answer = PickerService(svc.scheduler, svc.recorder).answer_pick
        for i in range(warm):
            answer(reqs[i % len(reqs)])
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        _reply({"ready": {"endpoints": endpoints, "pid": os.getpid(), "epick": epick.__file__,
                          "cpus": sorted(os.sched_getaffinity(0))}})
        perf, cpu_time = time.perf_counter, time.thread_time
        at = 0
        readline = sys.stdin.readline
        while (n := parse_command(readline())) is not None:
            await anyio.sleep(0.002)  # let the loop run what came due while it waited
            wall, used = [], []
            for _ in range(n):
                r = reqs[at]
                at = (at + 1) % len(reqs)
                c0 = cpu_time()
                t0 = perf()
                answer(r)
                t1 = perf()
                c1 = cpu_time()
                wall.append(round((t1 - t0) * 1e6, 2))
                used.append(round((c1 - c0) * 1e6, 2))
            _reply({"wall": wall, "cpu": used})
        tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import subprocess
    import tempfile
    from pathlib import Path

    import anyio

    ap = argparse.ArgumentParser(prog="regress worker")
    ap.add_argument("--endpoints", type=int, required=True)
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--cpu", type=int, default=None)
    args = ap.parse_args(argv)

    from epick.bench.grpc import NO_SCRAPE_MS, Setup

    pages = subprocess.Popen([sys.executable, "-m", "epick.bench.pages", "--count",
                              str(args.endpoints)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "epick.toml"
            path.write_text(Setup("answer", args.endpoints, NO_SCRAPE_MS).config(port))
            anyio.run(_serve, path, args.endpoints, args.warm, args.cpu)
    finally:
        pages.terminate()
        pages.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
