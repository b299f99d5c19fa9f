"""`epick bench pick --grpc --base REF`: Pick ÷ no-op over gRPC, this tree beside a git ref.

Issue 29's gRPC target (Pick ÷ no-op p50 ≤ 1.25) moves with the machine's load by more
than one change to the pick path is worth, so a change is judged side by side: per size,
one ``epick serve`` of the working tree and one of ``REF`` (a clean ``git worktree add
--detach``, imported through ``PYTHONPATH`` as ``epick bench regress`` does), the same
config, pages and requests. Only one server runs at a time (the other is stopped with
SIGSTOP); in each round every size runs both sides back to back, base first in even rounds
and tree first in odd ones, each side one client thread calling the no-op
(``Health/Check``) and then Pick for ``--seconds`` ÷ ``--rounds`` each.

The base gets the tree's ``libepick_scoreall.so`` (``make native``) when its
``epick_scoreall.c`` is the same file, so both sides run the same C loop; otherwise the
base runs its Python scoring path, and the report says so.

Prints, per size and side: no-op and Pick p50 over every round, Pick ÷ no-op (the median
of the rounds' own ratios), Pick − no-op, the server's CPU per call of each (from /proc,
its idle rate subtracted: preemption by other work does not count, as it does in
latency), and its own host time per pick by stage (its ``epick_pick_latency_seconds``
histograms; their p50 is interpolated in buckets up to 100 µs wide, so read it roughly);
then tree ÷ base of Pick p50, of Pick − no-op and of the server CPU a Pick costs beyond
a no-op.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.bench.grpc import Setup, requests, unary_phase

__all__ = ["Side", "measure", "main"]

#: Where ``make native`` puts the C scoring loop, relative to a checkout.
NATIVE_LIB = Path("host/runtime/native/libepick_scoreall.so")
NATIVE_SRC = Path("host/runtime/native/epick_scoreall.c")


@dataclass
class Side:
    """One side's servers (one per size) and what they measured, round by round."""

    name: str
    env: dict[str, str]
    setups: dict[int, Setup] = field(default_factory=dict)
    noop: dict[int, list[list[float]]] = field(default_factory=dict)
    pick: dict[int, list[list[float]]] = field(default_factory=dict)
    cpu_s: dict[tuple[str, int], float] = field(default_factory=dict)
    """Server CPU seconds per (phase, size) over every round, its idle rate (scraping)
    subtracted, as ``epick bench pick --grpc`` reads it from /proc."""

    def cpu_us(self, phase: str, n: int) -> float:
        """Server CPU µs per call of ``phase`` at ``n`` endpoints."""
        rounds = (self.noop if phase == "noop" else self.pick)[n]
        return self.cpu_s[(phase, n)] / sum(len(r) for r in rounds) * 1e6

    def p50(self, phase: str, n: int) -> float:
        rounds = (self.noop if phase == "noop" else self.pick)[n]
        return statistics.median(x for r in rounds for x in r)

    def ratio(self, n: int) -> float:
        """The median of the rounds' own Pick ÷ no-op p50s."""
        return statistics.median(statistics.median(p) / statistics.median(o)
                                 for o, p in zip(self.noop[n], self.pick[n]))


def _cpu_extra(side: Side, n: int) -> float:
    """Server CPU µs a Pick costs beyond a no-op."""
    return side.cpu_us("pick", n) - side.cpu_us("noop", n)


def share_native(tree_root: Path, base_root: Path) -> str:
    """Give the base the tree's built C loop when the sources match; what was done."""
    lib, src, dst = tree_root / NATIVE_LIB, tree_root / NATIVE_SRC, base_root / NATIVE_LIB
    if not lib.exists():
        return "no C loop on either side (make native builds it)"
    base_src = base_root / NATIVE_SRC
    if not base_src.exists() or base_src.read_bytes() != src.read_bytes():
        return "the base's epick_scoreall.c differs or is absent: the base scores in Python"
    shutil.copy2(lib, dst)
    return "both sides run the tree's libepick_scoreall.so"


def measure(tree_env: dict[str, str], base_env: dict[str, str], *, sizes=(8, 64),
            seconds: float = 12.0, rounds: int = 6, scrape_ms: int = 50,
            settle_s: float = 0.5, log=print) -> list[Side]:
    import sys

    sides = [Side("base", base_env), Side("tree", tree_env)]
    reqs = requests(4096)
    pages = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "epick.bench.pages",
                              "--count", str(max(sizes))], stdout=subprocess.PIPE, text=True)
    every: list[Setup] = []
    try:
        pages_port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            for side in sides:
                for n in sizes:
                    s = Setup(f"{side.name} {n}", n, scrape_ms, env=side.env)
                    path = Path(tmp) / f"{side.name}-{n}.toml"
                    path.write_text(s.config(pages_port))
                    s.start(path)
                    every.append(s)
                    with grpc.insecure_channel(s.target) as ch:  # warm, and check it answers
                        for r in reqs[:200]:
                            picker_pb2_grpc.EndpointPickerStub(ch).Pick(r, timeout=30)
                    s.pause()
                    side.setups[n] = s
                    side.noop[n], side.pick[n] = [], []
            per = seconds / rounds
            for k in range(rounds):
                order = sides if k % 2 == 0 else sides[::-1]
                for n in sizes:
                    for side in order:
                        s = side.setups[n]
                        s.resume()
                        c0, t0 = s.cpu(), time.perf_counter()
                        time.sleep(settle_s)  # fresh again after the pause; idle CPU rate
                        idle = (s.cpu() - c0) / (time.perf_counter() - t0)
                        for phase, into in (("noop", side.noop), ("pick", side.pick)):
                            c0, t0 = s.cpu(), time.perf_counter()
                            into[n].append(unary_phase(s.target, phase, 1, per, reqs))
                            used = s.cpu() - c0 - idle * (time.perf_counter() - t0)
                            side.cpu_s[(phase, n)] = side.cpu_s.get((phase, n), 0.0) + max(
                                0.0, used)
                        s.pause()
                log(f"round {k + 1}/{rounds}: " + ", ".join(
                    f"{n}: " + " ".join(f"{side.name} {statistics.median(side.pick[n][-1]):.0f}"
                                        f"/{statistics.median(side.noop[n][-1]):.0f}"
                                        for side in sides) for n in sizes) + " µs Pick/no-op")
            for s in every:
                s.resume()
                s.read_host_times()
                s.pause()
    finally:
        for s in every:
            s.stop()
        pages.terminate()
        pages.wait(timeout=10)
    return sides


def main(argv: list[str]) -> int:
    import argparse

    from rich.console import Console
    from rich.table import Table

    from epick.bench.regress import RegressError, base_checkout, preflight, tree_side

    ap = argparse.ArgumentParser(prog="epick bench pick --grpc --base REF",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git ref to compare with")
    ap.add_argument("--sizes", default="8,64", help="endpoint counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=12.0,
                    help="per phase, side and size, summed over the rounds")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--scrape-interval-ms", type=int, default=50)
    args = ap.parse_args(argv)
    sizes = tuple(int(n) for n in args.sizes.split(","))
    try:
        tree = tree_side()
        preflight(tree)
        with base_checkout(tree.root, args.base) as base:
            preflight(base)
            native = share_native(tree.root, base.root)
            print(f"tree {tree.root}, base {args.base} ({base.root}); {native}")
            t0, load0 = time.time(), os.getloadavg()
            sides = measure(tree.env, base.env, sizes=sizes, seconds=args.seconds,
                            rounds=args.rounds, scrape_ms=args.scrape_interval_ms)
            load1 = os.getloadavg()
    except RegressError as exc:
        print(f"epick bench pick --grpc --base: {exc}")
        return 2
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0))
    t = Table(title=f"Pick ÷ no-op over gRPC, tree beside {args.base} — {when}, "
                    f"{os.cpu_count()} cores, load {load0[0]:.1f} → {load1[0]:.1f}")
    for c in ("endpoints", "side", "no-op p50 µs", "Pick p50 µs", "Pick ÷ no-op p50",
              "Pick − no-op µs", "server CPU µs/call no-op / Pick", "server host p50 µs"):
        t.add_column(c, justify="right")
    by = {s.name: s for s in sides}
    for n in sizes:
        for s in sides:
            host = s.setups[n].host_us.get("total", (float("nan"),))[0]
            noop, pick = s.p50("noop", n), s.p50("pick", n)
            t.add_row(str(n), s.name, f"{noop:.0f}", f"{pick:.0f}", f"{s.ratio(n):.3f}",
                      f"{pick - noop:.0f}",
                      f"{s.cpu_us('noop', n):.0f} / {s.cpu_us('pick', n):.0f}", f"{host:.0f}")
    console = Console(width=150)
    console.print(t)
    ht = Table(title="host time per pick inside each server, p50 / mean µs (its "
                     "epick_pick_latency_seconds and epick_policy_score_latency_seconds)")
    ht.add_column("stage")
    cols = [(n, s) for n in sizes for s in sides]
    for n, s in cols:
        ht.add_column(f"{s.name} {n}", justify="right")
    keys = sorted({k for n, s in cols for k in s.setups[n].host_us},
                  key=lambda k: (k.startswith("policy"), k != "total", k))
    for key in keys:
        ht.add_row(key, *("{:.1f} / {:.1f}".format(*s.setups[n].host_us[key])
                          if key in s.setups[n].host_us else "" for n, s in cols))
    console.print(ht)
    for n in sizes:
        b, tr = by["base"], by["tree"]
        extra_b = b.p50("pick", n) - b.p50("noop", n)
        extra_t = tr.p50("pick", n) - tr.p50("noop", n)
        console.print(f"{n} endpoints: tree ÷ base Pick p50 "
                      f"{tr.p50('pick', n) / b.p50('pick', n):.3f}, Pick − no-op "
                      f"{extra_t / extra_b if extra_b > 0 else float('nan'):.3f}, server CPU "
                      f"per Pick − per no-op "
                      f"{_cpu_extra(tr, n) / _cpu_extra(b, n) if _cpu_extra(b, n) > 0 else float('nan'):.3f}; "
                      f"Pick ÷ no-op tree {tr.ratio(n):.3f} (goal <= 1.25), "
                      f"base {b.ratio(n):.3f}")
    return 0
