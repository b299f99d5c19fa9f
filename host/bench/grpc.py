"""`epick bench pick --grpc`: Pick over real gRPC beside a no-op RPC, side by side, in one run.

Starts one ``epick serve`` process per setup — 8 endpoints scraped every 50 ms, 64
endpoints scraped every 50 ms, 64 endpoints not scraped after the first round (pages
parsed by the scrape worker process, the default), and 64 endpoints scraped every 50 ms
with pages parsed on the event loop (``scrape_in = "loop"``, for contrast), and 8
endpoints with scheduling stubbed (:mod:`epick.bench.floor`: the ratios' floor) — all
against vLLM-like /metrics pages served by a process of their own at niceness 19
(:mod:`epick.bench.pages`; the pages change on every answer, so every scrape parses and
every round rebuilds the snapshot). Only one setup runs at a time: the others are
stopped with SIGSTOP, so on a 2-core machine an idle setup's scraping does not steal CPU
from the measured one. Rounds alternate the setups and, within a setup, the phases:

    seq    one client thread: the no-op, then Pick                       (latency)
    par    ``--threads`` client threads, each its own channel             (throughput)
    stream ``--streams`` PickStream streams, ``--window`` picks in flight each

The no-op is ``grpc.health.v1.Health/Check`` on the same server: a unary call that does
nothing, so Pick ÷ no-op is what a pick costs beyond gRPC itself. Unary clients are
synchronous gRPC threads; the stream client is grpc.aio on one thread (a high-rate
gateway's client is asynchronous). Server CPU per call is read from /proc with the
setup's idle CPU rate (its scraping) subtracted.

Prints the table and every ratio the serving path is held to (issue 17), with its goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc

__all__ = ["main", "measure", "Setup", "Phase", "run_clients"]

#: An hour: the "no scraping" setup scrapes once at start and then never again, and its
#: endpoints stay fresh for the whole run.
NO_SCRAPE_MS = 3_600_000


@dataclass
class Phase:
    """One kind of load on one setup, summed over the rounds."""

    latencies_us: list[float] = field(default_factory=list)
    calls: int = 0
    seconds: float = 0.0
    server_cpu_s: float = 0.0

    def record(self, latencies_us: list[float], seconds: float) -> None:
        """Add one run of this phase: its calls' latencies and how long it took."""
        self.latencies_us += latencies_us
        self.calls += len(latencies_us)
        self.seconds += seconds

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_us) if self.latencies_us else float("nan")

    @property
    def p99(self) -> float:
        s = sorted(self.latencies_us)
        return s[min(len(s) - 1, int(len(s) * 0.99))] if s else float("nan")

    @property
    def cpu_us(self) -> float:
        """Server CPU per call, its idle rate subtracted."""
        return self.server_cpu_s / self.calls * 1e6 if self.calls else float("nan")


@dataclass
class Setup:
    """One ``epick serve`` process: ``endpoints`` scraped every ``scrape_ms``."""

    name: str
    endpoints: int
    scrape_ms: int
    scrape_in: str = "process"
    """``[pool] scrape_in``: pages parsed by the worker process, or on the event loop."""
    floor: bool = False
    """Serve with scheduling stubbed (:mod:`epick.bench.floor`): the ratios' floor."""
    serve_cpus: tuple[int, ...] = ()
    worker_cpus: tuple[int, ...] = ()
    """``--pin``: the server's CPUs and its scrape worker's (``[pool] scrape_worker_cpus``)."""
    extra: str = ""
    """``--with``: a built-in policy served after the three defaults."""
    env: dict[str, str] | None = None
    """The server's environment (``None``: this process's); ``--base`` gives the base
    side one that imports the base checkout's ``epick``."""
    proc: subprocess.Popen | None = None
    target: str = ""
    metrics_url: str = ""
    phases: dict[str, Phase] = field(default_factory=dict)
    host_us: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Host time per pick by stage and policy, (median, mean) µs, from the server's own
    histograms."""

    def config(self, pages_port: int) -> str:
        stale = NO_SCRAPE_MS if self.scrape_ms >= NO_SCRAPE_MS else 2000
        lines = ["version = 1", "[server]", 'listen = "127.0.0.1:0"',
                 'metrics_listen = "127.0.0.1:0"',
                 "[admin]", 'listen = ""', "[pool]", f"scrape_interval_ms = {self.scrape_ms}",
                 f"stale_after_ms = {stale}", f'scrape_in = "{self.scrape_in}"']
        if self.worker_cpus:
            lines.append(f"scrape_worker_cpus = {list(self.worker_cpus)}")
        for i in range(self.endpoints):
            lines += ["[[pool.endpoints]]", f'address = "10.9.{i // 250}.{i % 250}:8000"',
                      f'metrics_url = "http://127.0.0.1:{pages_port}/metrics/{i}"']
        for name in ("load", "prefix-cache", "lora-affinity", *filter(None, [self.extra])):
            lines += ["[[policies]]", f'name = "{name}"', f'module = "{name}"']
        return "\n".join(lines) + "\n"

    def start(self, config_path: Path) -> None:
        # Its log goes to a file: a pause makes in-flight scrapes time out on resume,
        # and their warnings would garble the table.
        log = config_path.with_suffix(".log")
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "epick.bench.floor" if self.floor else "epick.cli",
                 "--log-level", "WARNING", "serve", "--config", str(config_path)],
                stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True,  # pause/resume/cpu cover its scrape worker too
                preexec_fn=_on_cpus(self.serve_cpus), env=self.env,
            )
        line = self.proc.stdout.readline()
        if "serving Pick on" not in line:
            self.stop()
            raise RuntimeError(f"epick serve ({self.name}) did not start: {line!r}\n"
                               f"{log.read_text()[-2000:]}")
        self.target = line.rsplit(" ", 1)[1].strip()
        line = self.proc.stdout.readline()
        if "metrics on" not in line:
            self.stop()
            raise RuntimeError(f"epick serve ({self.name}) printed no metrics URL: {line!r}")
        self.metrics_url = line.split()[-1]

    def read_host_times(self) -> None:
        """Fill :attr:`host_us` from the server's /metrics, over every pick since start:
        ``key`` → (median as Prometheus' histogram_quantile interpolates it, mean)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.metrics_url, timeout=30).read().decode()
        sums: dict[str, float] = {}
        buckets: dict[str, list[tuple[float, float]]] = {}
        for family in text_string_to_metric_families(text):
            if family.name not in ("epick_pick_latency_seconds",
                                   "epick_policy_score_latency_seconds"):
                continue
            for sample in family.samples:
                key = sample.labels.get("stage") or f"policy {sample.labels.get('policy')}"
                if sample.name.endswith("_sum"):
                    sums[key] = sample.value
                elif sample.name.endswith("_bucket"):
                    buckets.setdefault(key, []).append((float(sample.labels["le"]),
                                                        sample.value))
        self.host_us = {}
        for key, bs in buckets.items():
            bs.sort()
            count = bs[-1][1]
            if not count:
                continue
            lo_bound, lo_count, median = 0.0, 0.0, float("nan")
            for bound, cum in bs:
                if cum >= count / 2:
                    if math.isinf(bound):
                        median = lo_bound
                    else:
                        median = lo_bound + (bound - lo_bound) * (
                            (count / 2 - lo_count) / max(cum - lo_count, 1))
                    break
                lo_bound, lo_count = bound, cum
            self.host_us[key] = (median * 1e6, sums[key] / count * 1e6)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def cpu(self) -> float:
        """User + system CPU seconds so far of the server and its scrape worker."""
        total = 0
        for pid in _tree(self.proc.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited between listing and reading
                continue
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except ProcessLookupError:  # it never started, or died: only reap it
            self.proc.wait()
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _on_cpus(cpus: tuple[int, ...]):
    """A ``preexec_fn`` that pins the child to ``cpus`` (None: no pinning)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def pin_split() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``--pin``: (serving CPUs, scraping CPUs) — the first allowed CPU for the servers
    and the clients, the others for the scrape workers and the page server."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs at least 2 CPUs; this process may use {cpus}")
    return (cpus[0],), tuple(cpus[1:])


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc (children of every thread)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def requests(count: int) -> list[picker_pb2.PickRequest]:
    """A seeded mix: 70% with one of 16 adapters, 24 shared ~700-byte prompt prefixes."""
    rng = random.Random(3)
    prompts = [f"You are assistant #{t}. " * 30 for t in range(24)]
    return [
        picker_pb2.PickRequest(
            request_id=f"b{k}", model="llama",
            adapter=f"adapter-{rng.randrange(16)}" if rng.random() < 0.7 else "",
            prompt=rng.choice(prompts) + f"Q{k}", seed=k)
        for k in range(count)
    ]


def run_clients(threads: int, client: Callable[[int, list[float]], None],
                what: str) -> list[float]:
    """``threads`` client threads, each running ``client(k, latencies)``; every latency
    (µs), or a RuntimeError naming ``what`` and the first client's failure."""
    out: list[list[float]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            client(k, out[k])
        except Exception as exc:  # reported by the caller's thread, below
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError(f"{what} failed during the benchmark: {errors[0]}")
    return [x for lat in out for x in lat]


def unary_phase(target: str, kind: str, threads: int, seconds: float,
                reqs: list[picker_pb2.PickRequest]) -> list[float]:
    """``threads`` synchronous clients calling Pick (or the no-op) for ``seconds``; µs each."""
    stop = time.perf_counter() + seconds

    def client(k: int, lat: list[float]) -> None:
        with grpc.insecure_channel(target) as ch:
            if kind == "pick":
                call, msgs = picker_pb2_grpc.EndpointPickerStub(ch).Pick, reqs
            else:
                call, msgs = (health_pb2_grpc.HealthStub(ch).Check,
                              [health_pb2.HealthCheckRequest()])
            i, perf = k, time.perf_counter
            while True:  # at least one call, however late this thread starts
                t0 = perf()
                call(msgs[i % len(msgs)], timeout=30)
                lat.append((perf() - t0) * 1e6)
                i += threads
                if perf() >= stop:
                    break

    return run_clients(threads, client, kind)


async def _stream_phase(target: str, streams: int, window: int, seconds: float,
                        reqs: list[picker_pb2.PickRequest]) -> int:
    stop = time.perf_counter() + seconds

    async def one(k: int) -> int:
        async with grpc.aio.insecure_channel(target) as ch:
            call = picker_pb2_grpc.EndpointPickerStub(ch).PickStream()
            room = asyncio.Semaphore(window)

            async def write() -> None:
                i = k
                while True:  # at least one pick
                    await room.acquire()
                    await call.write(picker_pb2.PickStreamRequest(id=i, pick=reqs[i % len(reqs)]))
                    i += streams
                    if time.perf_counter() >= stop:
                        break
                await call.done_writing()

            writer = asyncio.ensure_future(write())
            answered, expect = 0, k
            async for r in call:
                room.release()
                if r.id != expect or r.WhichOneof("kind") != "pick":
                    writer.cancel()
                    raise RuntimeError(f"PickStream answered {r} to message {expect}")
                answered, expect = answered + 1, expect + streams
            await writer
            return answered

    return sum(await asyncio.gather(*(one(k) for k in range(streams))))


def stream_phase(target: str, streams: int, window: int, seconds: float,
                 reqs: list[picker_pb2.PickRequest]) -> int:
    """``streams`` PickStream calls with ``window`` picks in flight each; picks answered."""
    return asyncio.run(_stream_phase(target, streams, window, seconds, reqs))


#: py-spy's sampling rate for ``--py-spy`` (Hz).
SPY_RATE = 250


@dataclass
class Profile:
    """One py-spy recording of one setup's phase: GIL-holding stacks of the server."""

    setup: str
    phase: str
    path: Path
    seconds: int
    calls_per_s: float = 0.0


def _spy(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen(
        [exe, "record", "--gil", "--nonblocking", "-r", str(SPY_RATE), "-f", "raw",
         "-d", str(seconds), "-p", str(pid), "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(*, sizes=(8, 64), threads: int = 8, streams: int = 2, window: int = 32,
            seconds: float = 4.0, rounds: int = 4, scrape_ms: int = 50,
            settle_s: float = 0.5, py_spy: Path | None = None,
            profiles: list[Profile] | None = None, pin: bool = False,
            extra: str = "") -> list[Setup]:
    """Run every setup and phase; ``seconds`` is per phase and setup over all rounds.

    With ``py_spy`` (a folder), the first round also records each setup's seq and stream
    phases with py-spy (GIL-holding samples only) and appends a :class:`Profile` per
    recording to ``profiles``.
    """
    setups = [Setup(f"{n} endpoints", n, scrape_ms) for n in sizes]
    setups.append(Setup(f"{max(sizes)} endpoints, no scraping", max(sizes), NO_SCRAPE_MS))
    setups.append(Setup(f"{max(sizes)} endpoints, parsed on the loop", max(sizes), scrape_ms,
                        scrape_in="loop"))
    setups.append(Setup(f"{min(sizes)} endpoints, scheduling stubbed", min(sizes), scrape_ms,
                        floor=True))
    if extra:  # the defaults plus one policy, beside the defaults (issue 30's cost target)
        setups += [Setup(f"{n} endpoints +{extra}", n, scrape_ms, extra=extra) for n in sizes]
    serving, scraping = pin_split() if pin else ((), ())
    for s in setups:
        s.serve_cpus = serving
        s.worker_cpus = scraping if s.scrape_in == "process" else ()
    own_cpus = os.sched_getaffinity(0)
    if serving:  # the clients share the servers' CPU, as a gateway beside epick would
        os.sched_setaffinity(0, serving)
    reqs = requests(4096)
    # The pages stand in for engines on other machines: at niceness 19 their CPU takes
    # as little as the kernel allows from what is measured here.
    pages = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "epick.bench.pages",
                              "--count", str(max(sizes))], stdout=subprocess.PIPE, text=True,
                             preexec_fn=_on_cpus(scraping))
    try:
        pages_port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            for s in setups:
                path = Path(tmp) / f"{s.endpoints}-{s.scrape_ms}-{s.scrape_in}{s.extra}.toml"
                path.write_text(s.config(pages_port))
                s.start(path)
                with grpc.insecure_channel(s.target) as ch:  # warm, and check it answers
                    picker_pb2_grpc.EndpointPickerStub(ch).Pick(reqs[0], timeout=30)
                s.pause()
            per = seconds / rounds
            kinds = (("seq", "noop", 1), ("seq", "pick", 1), ("par", "noop", threads),
                     ("par", "pick", threads), ("stream", "pick", streams))
            for round_ in range(rounds):
                for s in setups:
                    s.resume()
                    c0, t0 = s.cpu(), time.perf_counter()
                    time.sleep(settle_s)  # fresh again after the pause; idle CPU rate
                    idle_rate = (s.cpu() - c0) / (time.perf_counter() - t0)
                    for mode, kind, n in kinds:
                        key = f"{mode}_{kind}"
                        ph = s.phases.setdefault(key, Phase())
                        spy = prof = None
                        if py_spy is not None and round_ == 0 and mode != "par":
                            prof = Profile(s.name, key, py_spy / f"{s.endpoints}-"
                                           f"{'scrape' if s.scrape_ms < NO_SCRAPE_MS else 'idle'}"
                                           f"-{s.scrape_in}"
                                           f"-{key}.txt", max(1, math.floor(per)))
                            spy = _spy(s.proc.pid, prof.seconds, prof.path)
                        c0, t0 = s.cpu(), time.perf_counter()
                        if mode == "stream":
                            calls = stream_phase(s.target, n, window, per, reqs)
                        else:
                            lat = unary_phase(s.target, kind, n, per, reqs)
                            ph.latencies_us += lat
                            calls = len(lat)
                        ph.calls += calls
                        dt = time.perf_counter() - t0
                        if spy is not None:
                            spy.wait(timeout=60)
                            prof.calls_per_s = calls / dt
                            profiles.append(prof)
                        ph.seconds += dt
                        ph.server_cpu_s += max(0.0, s.cpu() - c0 - idle_rate * dt)
                    s.pause()
            for s in setups:
                s.resume()
                s.read_host_times()
                s.pause()
    finally:
        try:
            for s in setups:
                s.stop()
        finally:  # the page server and this process's CPUs, whatever a stop raised
            pages.terminate()
            pages.wait(timeout=10)
            os.sched_setaffinity(0, own_cpus)
    return setups


@dataclass
class Ratio:
    what: str
    value: float
    goal: str
    ok: bool


def ratios(setups: list[Setup], sizes, threads: int = 8) -> list[Ratio]:
    by = {(s.endpoints, s.scrape_ms < NO_SCRAPE_MS): s.phases for s in setups
          if s.scrape_in == "process" and not s.floor and not s.extra}
    on_loop = next((s.phases for s in setups if s.scrape_in == "loop"), None)
    floor = next((s for s in setups if s.floor), None)
    out = []
    if floor is not None:  # what the ratios cannot go below: a Pick that schedules nothing
        p = floor.phases
        for q, goal in (("p50", 1.15), ("p99", 1.5)):
            r = getattr(p["seq_pick"], q) / getattr(p["seq_noop"], q)
            out.append(Ratio(f"floor: stubbed Pick ÷ no-op {q}, 1 client, {floor.endpoints} "
                             "endpoints", r, f"(goal {goal} applies above)", True))
        r = p["par_pick"].rate / p["par_noop"].rate
        out.append(Ratio(f"floor: stubbed Pick ÷ no-op calls/s, {threads} threads", r,
                         "(goal 0.85 applies above)", True))
    for n in sizes:
        p = by[(n, True)]
        r = p["seq_pick"].p50 / p["seq_noop"].p50
        out.append(Ratio(f"Pick ÷ no-op p50, 1 client, {n} endpoints", r, "<= 1.15", r <= 1.15))
        r = p["seq_pick"].p99 / p["seq_noop"].p99
        out.append(Ratio(f"Pick ÷ no-op p99, 1 client, {n} endpoints", r, "<= 1.5", r <= 1.5))
    for n in sizes:
        p = by[(n, True)]
        r = p["par_pick"].rate / p["par_noop"].rate
        out.append(Ratio(f"unary Pick ÷ no-op calls/s, {threads} threads, {n} endpoints", r,
                         ">= 0.85", r >= 0.85))
    for n in sizes:
        p = by[(n, True)]
        r = p["stream_pick"].rate / p["par_pick"].rate
        out.append(Ratio(f"PickStream ÷ unary Pick picks/s, {n} endpoints", r, ">= 2", r >= 2))
    n = max(sizes)
    on, off = by[(n, True)], by[(n, False)]
    r = on["seq_pick"].p50 / off["seq_pick"].p50
    out.append(Ratio(f"Pick p50 with ÷ without scraping, 1 client, {n} endpoints", r,
                     "<= 1.10", r <= 1.10))
    r = on["seq_pick"].p99 / off["seq_pick"].p99
    out.append(Ratio(f"Pick p99 with ÷ without scraping, 1 client, {n} endpoints", r,
                     "<= 1.20", r <= 1.20))
    if on_loop is not None:  # the same with pages parsed on the event loop, for contrast
        for q in ("p50", "p99"):
            r = getattr(on_loop["seq_pick"], q) / getattr(off["seq_pick"], q)
            out.append(Ratio(f"Pick {q} with ÷ without scraping, parsed on the loop", r,
                             "(contrast)", True))
    for s in setups:
        if s.extra:
            r = s.phases["seq_pick"].p50 / by[(s.endpoints, True)]["seq_pick"].p50
            out.append(Ratio(f"Pick p50 with ÷ without {s.extra}, 1 client, {s.endpoints} "
                             "endpoints", r, "<= 1.10", r <= 1.10))
    return out


def _print_profiles(console, profiles: list[Profile]) -> None:
    from epick.bench.profile import summarize

    console.print("server GIL time per call by part (py-spy --gil, first round's phases):")
    for p in profiles:
        if not p.path.exists():
            console.print(f"  py-spy wrote nothing for {p.setup} {p.phase} ({p.path})")
            continue
        total, shares = summarize(p.path)
        # samples / rate = GIL seconds over the recording; per call at the phase's rate.
        per_call_us = total / SPY_RATE / (p.seconds * p.calls_per_s) * 1e6
        console.print(f"  {p.path.stem}: {p.calls_per_s:,.0f} calls/s, {total} samples, "
                      f"{per_call_us:.0f} µs of GIL time per call")
        for part, share in shares:
            console.print(f"    {share * per_call_us:6.0f} µs {share:6.1%}  {part}")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    if any(a == "--base" or a.startswith("--base=") for a in argv or []):
        from epick.bench.grpc_ab import main as ab_main  # this tree beside a git ref

        return ab_main(list(argv or []))

    ap = argparse.ArgumentParser(prog="epick bench pick --grpc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64", help="endpoint counts, comma-separated")
    ap.add_argument("--threads", type=int, default=8, help="unary client threads (par)")
    ap.add_argument("--streams", type=int, default=2, help="PickStream streams (stream)")
    ap.add_argument("--window", type=int, default=32, help="picks in flight per stream")
    ap.add_argument("--seconds", type=float, default=4.0,
                    help="per phase and setup, summed over the rounds")
    ap.add_argument("--rounds", type=int, default=4, help="alternations of setups and phases")
    ap.add_argument("--scrape-interval-ms", type=int, default=50)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--with", dest="extra", default="", metavar="POLICY",
                    help="also serve the defaults plus this built-in policy (e.g. latency) "
                         "per size, and give Pick p50 with ÷ without it")
    ap.add_argument("--pin", action="store_true",
                    help="pin the servers and the clients to the first CPU, the scrape "
                         "workers and the page server to the others (the engines on other "
                         "machines, a core for scraping)")
    ap.add_argument("--base", metavar="REF",
                    help="instead: Pick ÷ no-op of this tree beside a git ref's, side by "
                         "side per size (epick.bench.grpc_ab; its own --help)")
    ap.add_argument("--py-spy", type=Path, metavar="DIR",
                    help="profile the server in the first round's seq and stream phases "
                         "(py-spy on PATH or beside python) into DIR, and print where its "
                         "GIL time goes per call")
    args = ap.parse_args(argv)
    profiles: list[Profile] = []
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    sizes = tuple(int(n) for n in args.sizes.split(","))
    t_start = time.time()
    load_before = os.getloadavg()
    setups = measure(sizes=sizes, threads=args.threads, streams=args.streams,
                     window=args.window, seconds=args.seconds, rounds=args.rounds,
                     scrape_ms=args.scrape_interval_ms, py_spy=args.py_spy, profiles=profiles,
                     pin=args.pin, extra=args.extra)
    load_after = os.getloadavg()

    console = Console(width=150)
    pinned = " (--pin)" if args.pin else ""
    t = Table(title=f"epick bench pick --grpc{pinned} — {os.cpu_count()} cores, load average "
                    f"{load_before[0]:.1f} before / {load_after[0]:.1f} after; µs per call")
    for c in ("setup", "mode", "RPC", "calls/s", "p50 µs", "p99 µs", "server CPU µs/call"):
        t.add_column(c, justify="right")
    labels = {"seq": "1 thread", "par": f"{args.threads} threads",
              "stream": f"{args.streams} streams × {args.window}"}
    for s in setups:
        for key, ph in s.phases.items():
            mode, kind = key.split("_")
            rpc = "PickStream" if mode == "stream" else ("Pick" if kind == "pick" else "no-op")
            t.add_row(s.name, labels[mode], rpc, f"{ph.rate:.0f}",
                      "" if mode == "stream" else f"{ph.p50:.0f}",
                      "" if mode == "stream" else f"{ph.p99:.0f}", f"{ph.cpu_us:.0f}")
    console.print(t)
    ht = Table(title="host time per pick inside the server, p50 / mean µs over every pick of "
                     "the run (its epick_pick_latency_seconds and "
                     "epick_policy_score_latency_seconds; p50 interpolated in the buckets)")
    ht.add_column("stage")
    for s in setups:
        ht.add_column(s.name, justify="right")
    for key in sorted({k for s in setups for k in s.host_us},
                      key=lambda k: (k.startswith("policy"), k != "total", k)):
        ht.add_row(key, *("{:.0f} / {:.0f}".format(*s.host_us[key]) if key in s.host_us
                          else "" for s in setups))
    console.print(ht)
    rt = Table(title="the serving path's ratios (one run, side by side)")
    for c in ("ratio", "measured", "goal", ""):
        rt.add_column(c, justify="right")
    rs = ratios(setups, sizes, args.threads)
    for r in rs:
        rt.add_row(r.what, f"{r.value:.2f}", r.goal, "ok" if r.ok else "MISSED")
    console.print(rt)
    if profiles:
        _print_profiles(console, profiles)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "epick bench pick --grpc " + " ".join(argv or []),
            "started": t_start, "cpu_count": os.cpu_count(), "pin": args.pin,
            "loadavg_before": load_before, "loadavg_after": load_after,
            "setups": [{"name": s.name, "endpoints": s.endpoints, "scrape_ms": s.scrape_ms,
                        "scrape_in": s.scrape_in, "floor": s.floor, "extra": s.extra,
                        "host_us": s.host_us,
                        "phases": {k: {"calls_per_s": p.rate, "calls": p.calls,
                                       "p50_us": p.p50 if p.latencies_us else None,
                                       "p99_us": p.p99 if p.latencies_us else None,
                                       "server_cpu_us": p.cpu_us}
                                   for k, p in s.phases.items()}} for s in setups],
            "ratios": [{"what": r.what, "value": r.value, "goal": r.goal, "ok": r.ok}
                       for r in rs],
        }, indent=2, default=float) + "\n")
    return 0
