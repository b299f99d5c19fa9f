"""Where a server's GIL time goes: py-spy's raw stacks folded into the serving path's parts.

    python -m epick.bench.profile FILE.txt [FILE.txt ...]

``FILE.txt`` is ``py-spy record --gil --format raw`` output (one ``frame;frame;... count``
line per stack), as ``epick bench pick --grpc --py-spy DIR`` writes it. Each sample goes to
the first part, in :data:`PARTS` order, whose marker is one of its frames; what matches
none is the gRPC core and asyncio running C code between our frames.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

__all__ = ["PARTS", "summarize", "main"]

#: (part, frame-name markers), first match wins: telemetry before the scheduler that
#: calls it, the policies before the scheduler around them.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pick: telemetry", ("TelemetryRecorder.",)),
    ("pick: policies score (WASM)", ("WasmPolicy.score", "WasmPolicy.filter")),
    ("pick: policies pre_request (WASM)", ("WasmPolicy.pre_request", "pre_request_all")),
    ("pick: validation (to_request)", ("to_request ",)),
    ("pick: encode (to_response)", ("to_response ",)),
    ("pick: scheduler (filters, picker, bookkeeping)", ("Scheduler.schedule",)),
    # PickStream reads and writes run gRPC C code under our frames: counted here.
    ("pick: servicer, PickStream reads and writes", ("PickerService.",)),
    ("completion (post_response)", ("Scheduler.complete",)),
    ("scrape: fetch (aiohttp, timeouts)", ("Pool._fetch",)),
    ("scrape: parse (parse_metrics)", ("parse_metrics",)),
    ("scrape: rounds, publish, snapshot", ("Pool._loop", "Pool._round", "Pool._publish",
                                           "Pool.run")),
    ("policy checkpoints", ("checkpoint_all",)),
    ("health loop", ("Service._health_loop", "Service._update_health")),
    ("event loop waiting (epoll)", ("EpollSelector.select",)),
    ("GC", ("gc_collect",)),
)
OTHER = "gRPC core + asyncio (C, between our frames)"


def _frame_names(stack: str) -> list[str]:
    return [f.split(" (", 1)[0] + " " for f in stack.split(";")]


def summarize(path: Path) -> tuple[int, list[tuple[str, float]]]:
    """Total samples and each part's share of them, largest first."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        names = _frame_names(stack)
        part = next((p for p, markers in PARTS
                     if any(n_.startswith(m) for n_ in names for m in markers)), OTHER)
        counts[part] += int(n)
        total += int(n)
    return total, [(p, c / total) for p, c in counts.most_common()] if total else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.bench.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    for path in args.files:
        total, parts = summarize(path)
        print(f"{path.name}: {total} samples holding the GIL")
        for part, share in parts:
            print(f"  {share:6.1%}  {part}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
