"""`epick bench tracing`: Pick p50 with tracing off, at 1% sampling and at 100%, one run.

Four ``epick serve`` processes, identical but for ``[tracing]`` (off; off again, the
A/A control whose ratio to the first is the run's noise; on at ``--ratio``; on at 1.0), 8 endpoints scraped every 50 ms from vLLM-like pages
(:mod:`epick.bench.pages`), the policies of the example config. Only one runs at a time
(the others are stopped with SIGSTOP, as in ``epick bench pick --grpc``), and rounds
alternate them, rotating who goes first, so a busy machine's drift falls on all of
them alike. One synchronous client thread calls Pick back to back (latency, not
throughput). Every call carries a ``traceparent`` with a fresh trace id, so the traced
setups pay for reading and parsing it on every pick; ``parent_based = false`` lets the
ratio decide by trace id (with a sampled parent every pick would be traced).

The spans go to a real OpenTelemetry collector: rotel's agent (PyPI ``rotel``, a dev
dependency) receiving OTLP/gRPC and dropping what it gets (``--exporter blackhole``), so
the 100% setup pays for encoding and sending every span. Without rotel the traced
setups export to a port nothing listens on (the SDK still builds and queues every span;
export errors are logged in the server's log): the table says which.

Prints p50 / p99 per setup and each traced setup's p50 ÷ off's, over all calls and as the
median of the per-round ratios; ``--json`` writes them.

``--in-process`` times the real service's ``PickerService.answer_pick`` instead (as
``python -m epick.bench.answer`` does: validation, scheduling, telemetry, encoding, no
gRPC) with the three tracers on one service, blocks of picks alternating between them:
the pick path's own cost of tracing, without gRPC's and the machine's noise around it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.bench.grpc import Setup, requests

__all__ = ["main", "measure"]


@dataclass
class TracedSetup(Setup):
    """A :class:`Setup` with a ``[tracing]`` table (``ratio`` None: tracing off)."""

    ratio: float | None = None
    collector: str = "http://127.0.0.1:4317"
    rounds_us: list[list[float]] = field(default_factory=list)

    def config(self, pages_port: int) -> str:
        text = super().config(pages_port)
        if self.ratio is None:
            return text
        return text + "\n".join([
            "[tracing]", "enabled = true", f'endpoint = "{self.collector}"',
            f"sample_ratio = {self.ratio}", "parent_based = false",
            "schedule_delay_ms = 200"]) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rotel(tmp: Path) -> tuple[subprocess.Popen | None, str]:
    """rotel's agent on a free port, dropping what it receives; (None, endpoint) when
    the package is not installed."""
    try:
        import rotel
    except ImportError:
        return None, f"http://127.0.0.1:{_free_port()}"
    port = _free_port()
    agent = Path(rotel.__file__).parent / "rotel-agent"
    proc = subprocess.Popen(
        [str(agent), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{port}",
         "--otlp-http-endpoint", f"127.0.0.1:{_free_port()}", "--exporter", "blackhole",
         "--pid-file", str(tmp / "rotel.pid"), "--log-file", str(tmp / "rotel.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError("rotel's agent did not start") from None
            time.sleep(0.05)


def _calls(target: str, seconds: float, reqs) -> list[float]:
    """Pick back to back for ``seconds`` on one channel; µs each."""
    out: list[float] = []
    perf = time.perf_counter
    with grpc.insecure_channel(target) as ch:
        pick = picker_pb2_grpc.EndpointPickerStub(ch).Pick
        stop, i = perf() + seconds, 0
        while True:
            md = (("traceparent", f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"),)
            t0 = perf()
            pick(reqs[i % len(reqs)], timeout=30, metadata=md)
            out.append((perf() - t0) * 1e6)
            i += 1
            if perf() >= stop:
                return out


def measure(*, ratio: float = 0.01, endpoints: int = 8, seconds: float = 2.5,
            rounds: int = 6, settle_s: float = 0.3) -> tuple[list[TracedSetup], str]:
    """Run the four setups for ``rounds`` rounds of ``seconds`` each; (setups, collector)."""
    reqs = requests(4096)
    with tempfile.TemporaryDirectory() as tmp:
        rotel_proc, collector = _rotel(Path(tmp))
        which = "rotel (blackhole)" if rotel_proc else "none listening (rotel not installed)"
        setups = [TracedSetup("off", endpoints, 50),
                  TracedSetup("off (A/A)", endpoints, 50),
                  TracedSetup(f"{ratio:g} sampled", endpoints, 50, ratio=ratio,
                              collector=collector),
                  TracedSetup("1 sampled", endpoints, 50, ratio=1.0, collector=collector)]
        pages = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m",
                                  "epick.bench.pages", "--count", str(endpoints)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            pages_port = int(pages.stdout.readline())
            for k, s in enumerate(setups):
                path = Path(tmp) / f"setup{k}.toml"
                path.write_text(s.config(pages_port))
                s.start(path)
                _calls(s.target, 0.2, reqs)  # warm
                s.pause()
            for r in range(rounds):
                order = setups[r % len(setups):] + setups[:r % len(setups)]
                for s in order:
                    s.resume()
                    time.sleep(settle_s)
                    s.rounds_us.append(_calls(s.target, seconds, reqs))
                    s.pause()
        finally:
            for s in setups:
                s.stop()
            pages.terminate()
            pages.wait()
            if rotel_proc is not None:
                rotel_proc.terminate()
                rotel_proc.wait()
    return setups, which


class _Context:
    """What the tracer reads of a gRPC servicer context: the call's metadata."""

    __slots__ = ("metadata",)

    def __init__(self, traceparent: str) -> None:
        self.metadata = (("user-agent", "grpc-python/1.85"), ("traceparent", traceparent))

    def invocation_metadata(self):
        return self.metadata


async def _in_process(config_path: Path, ratio: float, collector: str, rounds: int,
                      block: int) -> dict[str, list[list[float]]]:
    import anyio

    from epick.api.picker import PickerService
    from epick.config import load
    from epick.service import Service
    from epick.tracing import PickTracer

    svc = Service(load(config_path))
    reqs = requests(4096)
    ctxs = [_Context(f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01")
            for _ in range(4096)]
    tracers = {"off": None,
               f"{ratio:g} sampled": PickTracer(endpoint=collector, sample_ratio=ratio,
                                                parent_based=False, schedule_delay_ms=200),
               "1 sampled": PickTracer(endpoint=collector, sample_ratio=1.0,
                                       parent_based=False, schedule_delay_ms=200)}
    out: dict[str, list[list[float]]] = {name: [] for name in tracers}
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)
        answers = {name: PickerService(svc.scheduler, svc.recorder, tracer=t).answer_pick
                   for name, t in tracers.items()}
        for answer in answers.values():  # warm
            for k in range(200):
                answer(reqs[k], ctxs[k])
        perf, i = time.perf_counter, 0
        for r in range(rounds):
            names = list(answers)
            names = names[r % 3:] + names[:r % 3]
            for name in names:
                answer, lat = answers[name], []
                for _ in range(block):
                    req, ctx = reqs[i % 4096], ctxs[i % 4096]
                    i += 1
                    t0 = perf()
                    answer(req, ctx)
                    lat.append((perf() - t0) * 1e6)
                out[name].append(lat)
            await anyio.sleep(0.01)  # let the loop (scrapes, exports) breathe
        tg.cancel_scope.cancel()
    for t in tracers.values():
        if t is not None:
            t.shutdown()
    return out


def measure_in_process(*, ratio: float = 0.01, endpoints: int = 8, rounds: int = 60,
                       block: int = 500) -> tuple[list[TracedSetup], str]:
    """The three tracers on one in-process service; setups shaped as :func:`measure`'s."""
    import anyio

    with tempfile.TemporaryDirectory() as tmp:
        rotel_proc, collector = _rotel(Path(tmp))
        which = "rotel (blackhole)" if rotel_proc else "none listening (rotel not installed)"
        pages = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m",
                                  "epick.bench.pages", "--count", str(endpoints)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            pages_port = int(pages.stdout.readline())
            path = Path(tmp) / "epick.toml"
            path.write_text(TracedSetup("in-process", endpoints, 50).config(pages_port))
            rounds_us = anyio.run(_in_process, path, ratio, collector, rounds, block)
        finally:
            pages.terminate()
            pages.wait()
            if rotel_proc is not None:
                rotel_proc.terminate()
                rotel_proc.wait()
    setups = []
    for name, lat in rounds_us.items():
        s = TracedSetup(name, endpoints, 50)
        s.rounds_us = lat
        setups.append(s)
    return setups, which


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench tracing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.01, help="the sampled setup's ratio")
    ap.add_argument("--endpoints", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.5, help="per setup and round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--in-process", action="store_true",
                    help="time answer_pick in process, the tracers alternating by block")
    ap.add_argument("--block", type=int, default=500, help="--in-process: picks per block")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.in_process:
        setups, which = measure_in_process(ratio=args.ratio, endpoints=args.endpoints,
                                           rounds=args.rounds, block=args.block)
        what = (f"answer_pick in process, {args.endpoints} endpoints, {args.rounds} rounds x "
                f"{args.block} picks per tracer")
    else:
        setups, which = measure(ratio=args.ratio, endpoints=args.endpoints,
                                seconds=args.seconds, rounds=args.rounds)
        what = (f"Pick over gRPC, one client, {args.endpoints} endpoints, {args.rounds} "
                f"rounds x {args.seconds:g} s per setup")
    off = setups[0]
    all_off = [x for rd in off.rounds_us for x in rd]
    print(f"{what}; spans to: {which}; load {os.getloadavg()[0]:.2f}")
    print(f"{'setup':<16}{'calls':>8}{'p50 us':>10}{'p99 us':>10}{'p50/off':>10}"
          f"{'median of rounds':>18}")
    out = []
    for s in setups:
        xs = [x for rd in s.rounds_us for x in rd]
        p50 = statistics.median(xs)
        ratio = p50 / statistics.median(all_off)
        per_round = statistics.median(statistics.median(a) / statistics.median(b)
                                      for a, b in zip(s.rounds_us, off.rounds_us,
                                                      strict=True))
        print(f"{s.name:<16}{len(xs):>8}{p50:>10.1f}{_p(xs, 0.99):>10.1f}{ratio:>10.3f}"
              f"{per_round:>18.3f}")
        out.append({"setup": s.name, "calls": len(xs), "p50_us": p50, "p99_us": _p(xs, 0.99),
                    "p50_ratio": ratio, "p50_ratio_median_of_rounds": per_round})
    if args.json:
        args.json.write_text(json.dumps({"collector": which, "setups": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
