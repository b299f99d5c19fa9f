"""`epick bench decisions`: what the decision log costs a pick, its size, replay speed.

The same request stream (epick.bench.pick: adapters, shared system prompts) goes through
three schedulers, each with its own three WASM policies, in interleaved rounds in one
run: no log, a log (zlib chunks, the default) and an uncompressed log. Each pick is
timed (``schedule``: the pick path, where the log only enqueues) and completed at once
(``complete``: post_response hooks, also logged); the writer thread runs meanwhile, so
its CPU and GIL share show up in the logged rounds. The pool gets a new snapshot every
``--snapshot-every`` picks, as scrapes change it. Then each log's bytes per 1,000
decisions (modules not embedded: they are written once per file) and the speed of
``epick replay`` on it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from epick.bench.pick import request_stream, synthetic_view, wasm_policies
from epick.scheduler.scheduler import Scheduler

__all__ = ["run", "main"]

VARIANTS = ("off", "log", "log-raw")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def run(*, endpoints: int = 8, rounds: int = 20, per_round: int = 250,
        snapshot_every: int = 10, folder: Path) -> dict:
    from epick.decisions import DecisionLog, replay
    from epick.runtime import Limits, Runtime

    total = rounds * per_round
    requests = request_stream(total)
    views = [synthetic_view(endpoints, seed=v, version=v + 1)
             for v in range(total // snapshot_every + 1)]
    out: dict = {"endpoints": endpoints, "picks_per_variant": total,
                 "snapshot_every": snapshot_every, "variants": {}}
    with Runtime(Limits(budget_ms=50.0)) as runtime:
        state = {}
        for name in VARIANTS:
            box = {"view": views[0]}
            sched = Scheduler(lambda box=box: box["view"], wasm_policies(runtime),
                              decision_ttl_s=1e9)
            log = None
            if name != "off":
                log = DecisionLog(folder / f"{name}.declog", embed_modules=False,
                                  compress=name == "log").attach(sched).start()
            state[name] = (sched, box, log, [], [])
        try:
            for r in range(rounds):
                order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
                for name in order:
                    sched, box, _log, pick_us, complete_us = state[name]
                    for k in range(r * per_round, (r + 1) * per_round):
                        box["view"] = views[k // snapshot_every]
                        t0 = time.perf_counter()
                        d = sched.schedule(requests[k])
                        t1 = time.perf_counter()
                        sched.complete(decision_id=d.decision_id)
                        t2 = time.perf_counter()
                        pick_us.append((t1 - t0) * 1e6)
                        complete_us.append((t2 - t1) * 1e6)
        finally:
            for name in VARIANTS:
                if state[name][2] is not None:
                    state[name][2].close()
        for name in VARIANTS:
            sched, _box, log, pick_us, complete_us = state[name]
            row = {"pick_p50_us": statistics.median(pick_us), "pick_p99_us": _pct(pick_us, 99),
                   "complete_p50_us": statistics.median(complete_us)}
            if log is not None:
                size = sum(p.stat().st_size for p in folder.glob(f"{name}.declog*"))
                row.update(dropped=dict(log.dropped), written=dict(log.written),
                           bytes=size, bytes_per_1000=size / total * 1000)
                rep = replay([folder / f"{name}.declog"], runtime=runtime)
                row.update(replay_agreement=rep.agreement,
                           replay_decisions_per_s=rep.decisions_per_s)
            for e in sched.policies.entries:
                e.plugin.close()
            out["variants"][name] = row
    base = out["variants"]["off"]
    for name in VARIANTS[1:]:
        v = out["variants"][name]
        v["pick_p50_ratio"] = v["pick_p50_us"] / base["pick_p50_us"]
        v["pick_p99_ratio"] = v["pick_p99_us"] / base["pick_p99_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="epick bench decisions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", default="8,64", help="comma-separated pool sizes")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=250)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    console = Console(width=150)
    results = []
    for n in (int(x) for x in args.endpoints.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(endpoints=n, rounds=args.rounds, per_round=args.per_round,
                               snapshot_every=args.snapshot_every, folder=Path(tmp)))
    t = Table(title=f"decision log cost ({args.rounds} interleaved rounds × "
                    f"{args.per_round} picks per variant; new snapshot every "
                    f"{args.snapshot_every} picks)")
    for c in ("endpoints", "variant", "pick p50 µs", "pick p99 µs", "p50 ÷ off", "p99 ÷ off",
              "complete p50 µs", "bytes / 1000 decisions", "dropped", "replay decisions/s",
              "replay agreement"):
        t.add_column(c, justify="right")
    for res in results:
        for name, v in res["variants"].items():
            t.add_row(str(res["endpoints"]), name, f"{v['pick_p50_us']:.1f}",
                      f"{v['pick_p99_us']:.1f}",
                      f"{v['pick_p50_ratio']:.3f}" if "pick_p50_ratio" in v else "-",
                      f"{v['pick_p99_ratio']:.3f}" if "pick_p99_ratio" in v else "-",
                      f"{v['complete_p50_us']:.1f}",
                      f"{v['bytes_per_1000']:,.0f}" if "bytes" in v else "-",
                      str(sum(v["dropped"].values())) if "dropped" in v else "-",
                      f"{v['replay_decisions_per_s']:,.0f}" if "bytes" in v else "-",
                      f"{v['replay_agreement']:.2%}" if "bytes" in v else "-",
                      end_section=name == VARIANTS[-1])
    console.print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        console.print(f"wrote {args.json}")
    return 0
