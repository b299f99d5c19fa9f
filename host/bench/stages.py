"""``python -m epick.bench.stages``: where each microsecond of a decision goes, per stage and policy.

Builds the real service as ``python -m epick.bench.answer`` does (the three default WASM
policies, ``--endpoints`` vLLM-like pages scraped once) and times ``answer_pick`` on the
same request mix twice, alternating rounds: plain, and with a probe around each piece of
the pick path (:data:`PROBES`). A probe keeps its piece's *own* time (minus the probed
pieces inside it), so the rows add up to the instrumented total; the probes' own cost is
the gap between that and the plain total, printed below the table.

Two rows are not a probe's own time but split one: each guest call ("crossing + guest",
``GuestFunc.call*``) is divided into

- **crossing**: an empty call through the same path (fuel refill, epoch deadline,
  ``wasmtime_func_call_unchecked`` with the GIL released) on the same engine — the
  ``epick_abi_version`` export of a no-op module;
- **guest: SDK decode**: what the no-op policy (``host/bench/noop/main.zig``, built here
  with the pinned Zig) spends on the very inputs each policy got, minus that crossing —
  the SDK's entry, the msgpack decode, writing constant scores;
- **guest: policy work**: the rest — the policy's own code.

Probes name functions by their current module paths; after a rename, a probe that no
longer finds its target is listed as missing (its time goes to its caller's row), not an
error. Decisions are not completed (as in ``epick.bench.answer``): post_response is not
on this path.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

__all__ = ["PROBES", "Probe", "Profile", "measure", "main"]

NOOP_SOURCE = Path(__file__).resolve().parent / "noop"


@dataclass(frozen=True)
class Probe:
    """``target`` is ``module:Class.method`` or ``module:function``; ``label`` a row name,
    or a function of the call's arguments giving one (per policy)."""

    target: str
    label: str | Callable[[tuple], str]


def _policy(what: str) -> Callable[[tuple], str]:
    return lambda a: f"policy {a[0].name}: {what}"


def _guest(a: tuple) -> str:
    return f"policy {a[0].policy}: {a[0].export} crossing + guest"


#: In pick-path order; a row's place in the table is its first probe's.
PROBES: tuple[Probe, ...] = (
    Probe("epick.api.picker:PickerService.answer_pick", "servicer: answer_pick's own code"),
    Probe("epick.api.picker:pin_of", "validation (pin_of, to_request)"),
    Probe("epick.api.picker:to_request", "validation (pin_of, to_request)"),
    Probe("epick.scheduler.scheduler:Scheduler.schedule",
          "scheduler: schedule's own code (cycle, Decision)"),
    Probe("epick.scheduler.scheduler:Scheduler._filter", "host filters: the stage's own code"),
    Probe("epick.scheduler.filters:FreshFilter.filter", "host filters: fresh"),
    Probe("epick.scheduler.filters:AwakeFilter.filter", "host filters: awake"),
    Probe("epick.scheduler.filters:ServesModelFilter.filter", "host filters: serves model"),
    Probe("epick.scheduler.filters:AdmissionFilter.filter", "host filters: admission"),
    Probe("epick.scheduler.scheduler:Scheduler._score",
          "scoring: the stage's own code (weights, totals)"),
    Probe("epick.interfaces.cycle:Cycle.score_input", "ScoreInput encode (msgpack, once a cycle)"),
    Probe("epick.interfaces.cycle:Cycle.assigned", "ScoreInput: assignment counts"),
    Probe("epick.interfaces.cycle:Cycle.kv_counts", "ScoreInput: KV counts"),
    Probe("epick.interfaces.cycle:Cycle.kv_cleared", "ScoreInput: KV counts"),
    Probe("epick.runtime.plugin:WasmPolicy.score",
          _policy("score, plugin (breaker, stats, range checks)")),
    Probe("epick.runtime.instance:PolicyInstance.score_checked",
          _policy("score, input written + scores read back")),
    Probe("epick.runtime.instance:PolicyInstance.set_snapshot",
          _policy("set_snapshot, host side")),
    Probe("epick.runtime._guest:GuestFunc.call0", _guest),
    Probe("epick.runtime._guest:GuestFunc.call1", _guest),
    Probe("epick.runtime._guest:GuestFunc.call2", _guest),
    Probe("epick.runtime._guest:GuestFunc.call3", _guest),
    Probe("epick.scheduler.scheduler:Scheduler._pick", "picker"),
    Probe("epick.scheduler.scheduler:Scheduler._pre_request", "hooks: the stage's own code"),
    Probe("epick.interfaces.cycle:Cycle.pre_request_input",
          "PreRequestEvent encode (msgpack, once a cycle)"),
    Probe("epick.runtime.plugin:WasmPolicy.pre_request",
          _policy("pre_request, plugin (breaker, stats)")),
    Probe("epick.runtime.instance:PolicyInstance.pre_request",
          _policy("pre_request, input written")),
    Probe("epick.scheduler.memory:DecisionMemory.remember", "decision memory"),
    Probe("epick.scheduler.assignments:Assignments.picked", "assignment bookkeeping"),
    Probe("epick.service:TelemetryRecorder.pick_done", "telemetry"),
    Probe("epick.service:TelemetryRecorder.stages", "telemetry"),
    Probe("epick.service:TelemetryRecorder.policy_latency", "telemetry"),
    Probe("epick.api.picker:to_response", "encoding the answer (to_response)"),
)


class Profile:
    """Own time and calls per row while installed (``with profile.installed(): ...``)."""

    def __init__(self, probes: tuple[Probe, ...] = PROBES) -> None:
        self.probes = probes
        self.own_ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.order: dict[str, int] = {}
        self.missing: list[str] = []
        self._stack: list[int] = []

    def reset(self) -> None:
        self.own_ns.clear()
        self.calls.clear()

    def wrap(self, fn: Callable, label, rank: int) -> Callable:
        perf, stack, own, calls, order = (time.perf_counter_ns, self._stack, self.own_ns,
                                          self.calls, self.order)

        @functools.wraps(fn)
        def probed(*args, **kwargs):
            stack.append(0)
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = perf() - t0
                inner = stack.pop()
                name = label if isinstance(label, str) else label(args)
                own[name] += spent - inner
                calls[name] += 1
                order.setdefault(name, rank)
                if stack:
                    stack[-1] += spent
        return probed

    def installed(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            undo = []
            for rank, probe in enumerate(self.probes):
                owner, attr = _resolve(probe.target)
                if owner is None:
                    self.missing.append(probe.target)
                    continue
                undo.append((owner, attr, owner.__dict__[attr]))
                setattr(owner, attr, self.wrap(owner.__dict__[attr], probe.label, rank))
            try:
                yield self
            finally:
                for owner, attr, original in reversed(undo):
                    setattr(owner, attr, original)
        return cm()


def _resolve(target: str):
    """(object holding the attribute, attribute name), or (None, None) if it is gone."""
    module_name, _, path = target.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return None, None
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p, None)
        if owner is None:
            return None, None
    if attr not in getattr(owner, "__dict__", {}):
        return None, None
    return owner, attr


def build_noop(out_dir: Path) -> Path:
    from epick.policies_build import Policy, build, check_zig

    check_zig()
    return build(Policy("noop", NOOP_SOURCE, "zig"), out_dir)


@dataclass
class Result:
    endpoints: int
    picks: int
    plain_us: list[float]
    instrumented_us: list[float]
    rows: list[tuple[str, float, float]]  # label, µs per pick (mean own time), calls per pick
    missing: list[str]


def _split_guest(rows: dict[str, float], calls: dict[str, float],
                 crossing_us: float | None, decode_us: dict[tuple[str, str], float]) -> None:
    """Replace each "crossing + guest" row by crossing / SDK decode / policy work."""
    for label in [x for x in rows if x.endswith(" crossing + guest")]:
        policy, export = label[len("policy "):-len(" crossing + guest")].split(": ")
        if crossing_us is None:
            continue
        total, n = rows.pop(label), calls.pop(label)
        base = f"policy {policy}: {export} "
        rows[base + "crossing"], calls[base + "crossing"] = crossing_us * n, n
        guest = total - crossing_us * n
        decode = decode_us.get((policy, export))
        if decode is None:
            rows[base + "guest (decode + work)"], calls[base + "guest (decode + work)"] = guest, n
        else:
            dec = min(max(decode - crossing_us, 0.0) * n, guest)
            rows[base + "guest: SDK decode"], calls[base + "guest: SDK decode"] = dec, n
            rows[base + "guest: policy work"], calls[base + "guest: policy work"] = guest - dec, n


async def _measure(config_path: Path, endpoints: int, picks: int, rounds: int,
                   noop_wasm: Path | None) -> Result:
    from epick.api.picker import PickerService
    from epick.bench.grpc import requests
    from epick.config import load
    from epick.service import Service

    svc = Service(load(config_path))
    reqs = requests(picks)
    plain: list[float] = []
    probed: list[float] = []
    profile = Profile()
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)
        answer = PickerService(svc.scheduler, svc.recorder).answer_pick
        for r in reqs[:500]:  # warm
            answer(r)
        perf = time.perf_counter_ns
        for k in range(2 * rounds):
            out = plain if k % 2 == 0 else probed
            with profile.installed() if k % 2 else _nothing():
                for r in reqs:
                    t0 = perf()
                    answer(r)
                    out.append((perf() - t0) / 1e3)
            await anyio.sleep(0.05)
        crossing, decode = None, {}
        if noop_wasm is not None:
            crossing, decode = _guest_floor(svc, answer, reqs[:300], noop_wasm)
        tg.cancel_scope.cancel()
    n = len(probed)
    rows = {label: ns / 1e3 / n for label, ns in profile.own_ns.items()}
    calls = {label: c / n for label, c in profile.calls.items()}
    _split_guest(rows, calls, crossing, decode)
    rank = profile.order

    def key(label: str) -> tuple:
        for stem in (" crossing", " guest"):
            if stem in label:
                return rank.get(label.split(stem)[0] + " crossing + guest", 99), label
        return rank.get(label, 99), label

    ordered = [(label, rows[label], calls[label]) for label in sorted(rows, key=key)]
    return Result(endpoints, picks, plain, probed, ordered, sorted(set(profile.missing)))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _guest_floor(svc, answer, reqs, noop_wasm: Path) -> tuple[float | None, dict]:
    """(empty crossing µs, {(policy, export): no-op guest call µs on that policy's inputs})."""
    from epick.interfaces.cycle import Cycle
    from epick.runtime import PolicyInstance

    blobs: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
    snapshots: list[bytes] = []
    originals = {name: PolicyInstance.__dict__[name] for name in ("score_checked", "pre_request")}
    score_input = Cycle.__dict__["score_input"]

    def keep(name):
        def wrapper(self, blob, *rest):
            blobs[(self.name, "score" if name == "score_checked" else name)].append((blob, *rest))
            return originals[name](self, blob, *rest)
        return wrapper

    def keep_snapshot(self, *args, **kwargs):
        # The resident policies got the snapshot once, at the first pick: the no-op needs
        # the same one to decode their inputs (which leave it out).
        encoded = getattr(getattr(self, "pool", None), "encoded", None)
        if encoded is not None and not snapshots:
            snapshots.append(encoded)
        return score_input(self, *args, **kwargs)

    for name in originals:
        setattr(PolicyInstance, name, keep(name))
    Cycle.score_input = keep_snapshot
    try:
        for r in reqs:
            answer(r)
    finally:
        for name, fn in originals.items():
            setattr(PolicyInstance, name, fn)
        Cycle.score_input = score_input
    noop = PolicyInstance(svc.runtime.compile(noop_wasm.read_bytes(), name="noop"), {})
    try:
        if snapshots:
            noop.set_snapshot(snapshots[0])
        funcs = getattr(noop, "_funcs", {})
        version = funcs.get("epick_abi_version")
        perf = time.perf_counter_ns
        crossing = None
        if version is not None:
            lat = []
            for _ in range(3):
                for _ in range(2000):
                    t0 = perf()
                    version.call0()
                    lat.append(perf() - t0)
            crossing = statistics.fmean(sorted(lat)[: len(lat) * 9 // 10]) / 1e3
        profile = Profile((Probe("epick.runtime._guest:GuestFunc.call3", "score"),
                           Probe("epick.runtime._guest:GuestFunc.call2", "pre_request")))
        decode = {}
        with profile.installed():
            for (policy, export), got in blobs.items():
                profile.reset()
                for _ in range(3):
                    for args in got:
                        if export == "score":
                            noop.score_checked(*args)
                        else:
                            noop.pre_request(*args)
                if profile.calls[export]:
                    decode[(policy, export)] = profile.own_ns[export] / profile.calls[export] / 1e3
        return crossing, decode
    finally:
        noop.close()


def measure(endpoints: int = 64, picks: int = 4096, rounds: int = 3,
            noop: bool = True) -> Result:
    """Plain and probed ``answer_pick`` at ``endpoints``; see the module docstring."""
    from epick.bench.grpc import NO_SCRAPE_MS, Setup

    pages = subprocess.Popen([sys.executable, "-m", "epick.bench.pages", "--count",
                              str(endpoints)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "epick.toml"
            path.write_text(Setup("stages", endpoints, NO_SCRAPE_MS).config(port))
            wasm = build_noop(Path(tmp) / "noop") if noop else None
            return anyio.run(_measure, path, endpoints, picks, rounds, wasm)
    finally:
        pages.terminate()
        pages.wait(timeout=10)


def render(res: Result) -> str:
    total = sum(us for _, us, _ in res.rows)
    plain, probed = statistics.fmean(res.plain_us), statistics.fmean(res.instrumented_us)
    width = max(len(label) for label, _, _ in res.rows)
    out = [f"answer_pick, {res.endpoints} endpoints: own time per pick (mean of "
           f"{len(res.instrumented_us)} probed picks)",
           f"  {'stage':<{width}}  µs/pick  calls/pick  share"]
    for label, us, calls in res.rows:
        out.append(f"  {label:<{width}}  {us:7.2f}  {calls:10.2f}  {us / total:5.1%}")
    out += [f"  {'sum of the rows (probed)':<{width}}  {total:7.2f}",
            f"plain answer_pick: mean {plain:.1f} µs, p50 {statistics.median(res.plain_us):.1f}"
            f" µs; probed: mean {probed:.1f} µs, p50 {statistics.median(res.instrumented_us):.1f}"
            f" µs (the probes' own cost: {probed - plain:+.1f} µs a pick)"]
    if res.missing:
        out.append("probes whose target is gone (renamed?): " + ", ".join(res.missing))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.bench.stages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", default="8,64", help="endpoint counts, comma-separated")
    ap.add_argument("--picks", type=int, default=4096, help="picks per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating")
    ap.add_argument("--no-noop", action="store_true",
                    help="skip building the no-op policy (no Zig): no decode/work split")
    args = ap.parse_args(argv)
    for n in (int(s) for s in args.endpoints.split(",")):
        print(render(measure(n, args.picks, args.rounds, noop=not args.no_noop)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
