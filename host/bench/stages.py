"""``python -m epick.bench.stages``: where each microsecond of a decision goes, per stage and policy.

    python -m epick.bench.stages [--endpoints 8,64] [--picks 2000] [--rounds 2] [--native]

Builds the real service as ``python -m epick.bench.answer`` does (the three default WASM
policies, ``--endpoints`` vLLM-like pages scraped once) and times ``answer_pick`` on the
same request mix: once with no probe, and once per piece of the pick path (:data:`PROBES`)
with a probe around that piece alone — so a piece's *whole* time carries no other probe's
cost. Turns rotate every :data:`CHUNK` requests, so a load spike on a shared machine hits
every piece alike; each figure is the mean over the fastest nine tenths of its picks (the
slowest tenth, preempted or collecting garbage, would swamp a mean). One run with every
probe in says which piece runs inside which, and a row is its piece's *own* time: its
whole time minus the whole times of the pieces inside it. So the rows add up to the plain
``answer_pick`` (the servicer's own row takes what no probe sees).

Each guest call ("crossing + guest", ``GuestFunc.call*``) is split three ways:

- **crossing**: an empty call through the same path (fuel refill, epoch deadline,
  ``wasmtime_func_call_unchecked`` with the GIL released) on the same engine — the
  ``epick_abi_version`` export of a no-op module;
- **guest: SDK decode**: what the no-op policy (``host/bench/noop/main.zig``, built here
  with the pinned Zig; ``--no-noop`` skips it) spends on the very inputs each policy got,
  minus that crossing — the SDK's entry, the msgpack decode, writing constant scores;
- **guest: policy work**: the rest — the policy's own code.

The scorers are called one by one from Python here (the path that gives each policy's
call its rows); ``--native`` measures the service's default when ``make native`` built
the C loop: one row for its call, every scorer's crossing, guest and read-back in it.

Probes name functions by their current module paths; after a rename a probe that no
longer finds its target is listed as missing (its time goes to its caller's row), and
``tests/bench/test_bench_stages.py`` fails until :data:`PROBES` follows. Decisions are not
completed (as in ``epick.bench.answer``): post_response is not on this path.
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
#: Requests each probe (and no probe) times in its turn before the next takes over.
CHUNK = 50


@dataclass(frozen=True)
class Probe:
    """``target`` is ``module:Class.method`` or ``module:function``; ``label`` a row name,
    or a function of the call's arguments giving one (per policy)."""

    target: str
    label: str | Callable[[tuple], str]


def _policy(what: str) -> Callable[[tuple], str]:
    return lambda a: f"policy {a[0].name}: {what}"


def _guest(a: tuple) -> str:
    # ABI v2: a score carrying the previous pick's pre_request event is the policy's one
    # crossing of the pick; its row is the score's (the event's work is in the guest's).
    export = a[0].export.removesuffix(" (carrying pre_request)")
    return f"policy {a[0].policy}: {export} crossing + guest"


#: In pick-path order; a row's place in the table is its first probe's.
PROBES: tuple[Probe, ...] = (
    Probe("epick.api.decide:pin_of", "validation (pin_of, to_request)"),
    Probe("epick.api.decide:to_request", "validation (pin_of, to_request)"),
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
    Probe("epick.runtime.frame:frame_for", "score frame encode (ABI v2, once a cycle)"),
    Probe("epick.runtime.scoreall:_call",
          "scoring: the native loop's C call (--native: every scorer's write, guest, read-back)"),
    Probe("epick.runtime.instance:PolicyInstance.score_frame",
          _policy("score, input written + scores read back")),
    Probe("epick.runtime.instance:PolicyInstance.defer_pre_request",
          _policy("pre_request, deferred to the next score (ABI v2)")),
    Probe("epick.runtime.instance:PolicyInstance.flush",
          _policy("pre_request, flushed by its own call (ABI v2)")),
    Probe("epick.runtime.instance:PolicyInstance.set_snapshot",
          _policy("set_snapshot, host side")),
    Probe("epick.runtime._guest:GuestFunc.call0", _guest),
    Probe("epick.runtime._guest:GuestFunc.call1", _guest),
    Probe("epick.runtime._guest:GuestFunc.call2", _guest),
    Probe("epick.runtime._guest:GuestFunc.call3", _guest),
    Probe("epick.scheduler.pickers:MaxScorePicker.pick", "picker"),
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


ROOT = "servicer: answer_pick's own code"


class Profile:
    """Time and calls per row of the probes it installs (``with profile.installed():``).

    With one probe installed (how rows are timed) a row's time is its piece's whole time;
    with all of them (:meth:`parents`, run once) it learns which row runs inside which.
    """

    def __init__(self, probes: tuple[Probe, ...] = PROBES) -> None:
        self.probes = probes
        self.ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.parent: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.order: dict[str, int] = {}
        self.missing: list[str] = []
        self._stack: list[str] = []

    def wrap(self, fn: Callable, label, rank: int) -> Callable:
        perf, stack, ns, calls = time.perf_counter_ns, self._stack, self.ns, self.calls
        parent, order = self.parent, self.order

        @functools.wraps(fn)
        def probed(*args, **kwargs):
            name = label if isinstance(label, str) else label(args)
            parent[name][stack[-1] if stack else ROOT] += 1
            stack.append(name)
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[name] += perf() - t0
                calls[name] += 1
                stack.pop()
                order.setdefault(name, rank)
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
                setattr(owner, attr, self.wrap(owner.__dict__[attr], probe.label,
                                               PROBES.index(probe) if probe in PROBES else rank))
            try:
                yield self
            finally:
                for owner, attr, original in reversed(undo):
                    setattr(owner, attr, original)
        return cm()


def probe_cost_ns(n: int = 20_000) -> float:
    """A probe's own cost inside its row (the perf_counter pair and bookkeeping)."""
    profile = Profile(())
    noop = profile.wrap(lambda: None, "noop", 0)
    best = float("inf")
    for _ in range(5):
        profile.ns.clear()
        for _ in range(n):
            noop()
        best = min(best, profile.ns["noop"] / n)
    return best


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
    from epick.policies_build import BuildError, Policy, build, check_zig

    if not (NOOP_SOURCE / "main.zig").is_file():
        raise SystemExit(f"epick.bench.stages: the no-op policy's source {NOOP_SOURCE}/main.zig "
                         "is not here (an installed wheel?): run from a checkout, or pass "
                         "--no-noop")
    try:
        check_zig()
        return build(Policy("noop", NOOP_SOURCE, "zig"), out_dir)
    except BuildError as exc:
        raise SystemExit(f"epick.bench.stages: cannot build the no-op policy ({exc}); "
                         "pass --no-noop to skip the decode/work split") from None


@dataclass
class Result:
    endpoints: int
    picks: int
    plain_us: list[float]
    rows: list[tuple[str, float, float]]  # label, µs per pick (own time), calls per pick
    whole: dict[str, float]  # label -> µs per pick with what runs inside it
    missing: list[str]
    probe_ns: float  # a probe's own cost, taken out of each row per call


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


def _trimmed_mean(values: list[float], totals: list[float]) -> float:
    """Mean of ``values`` over the picks whose total is in the fastest nine tenths: the
    slowest tenth (preempted, a GC pass) would swamp a mean on a shared machine."""
    cut = sorted(totals)[int(len(totals) * 0.9)]
    kept = [v for v, t in zip(values, totals, strict=True) if t <= cut]
    return statistics.fmean(kept)


async def _measure(config_path: Path, endpoints: int, picks: int, rounds: int,
                   noop_wasm: Path | None) -> Result:
    from epick.api.picker import PickerService
    from epick.bench.grpc import requests
    from epick.config import load
    from epick.service import Service

    svc = Service(load(config_path))
    reqs = requests(picks)
    perf = time.perf_counter_ns
    calls: dict[str, float] = {}
    cost = probe_cost_ns()
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)

        def servicer():
            # Built after the probes are in: the servicer binds telemetry at its init.
            return PickerService(svc.scheduler, svc.recorder).answer_pick

        for r in reqs[:500]:  # warm
            servicer()(r)
        structure = Profile()
        with structure.installed():
            answer = servicer()
            for r in reqs[:200]:
                answer(r)
        # Every probe (and no probe) takes a turn on each chunk of CHUNK requests, so a
        # load spike on this shared machine hits all of them alike; one probe at a time,
        # so a piece's whole time carries no other probe's cost.
        turns: list[Probe | None] = [None, *PROBES]
        totals: dict[int, list[int]] = collections.defaultdict(list)
        pieces: dict[int, list[dict[str, int]]] = collections.defaultdict(list)
        counts: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        for _ in range(rounds):
            for start in range(0, len(reqs), CHUNK):
                chunk = reqs[start:start + CHUNK]
                for i, probe in enumerate(turns):
                    profile = Profile(() if probe is None else (probe,))
                    with profile.installed():
                        if profile.missing:
                            continue
                        answer, ns = servicer(), profile.ns
                        for r in chunk:
                            before = dict(ns)
                            t0 = perf()
                            answer(r)
                            totals[i].append(perf() - t0)
                            pieces[i].append({k: v - before.get(k, 0) for k, v in ns.items()})
                    counts[i].update(profile.calls)
                await anyio.sleep(0)  # let the loop breathe between chunks
        plain_us = [t / 1e3 for t in totals[0]]
        span: dict[str, float] = collections.Counter()
        span[ROOT] = _trimmed_mean(plain_us, plain_us)
        for i in range(1, len(turns)):
            n = len(totals[i])
            for label, c in counts[i].items():
                mean = _trimmed_mean([p.get(label, 0) for p in pieces[i]], totals[i])
                # Probes sharing a row (two validation functions, three telemetry
                # methods) add up.
                span[label] += (mean - cost * c / n) / 1e3
                calls[label] = calls.get(label, 0.0) + c / n
        crossing, decode = None, {}
        if noop_wasm is not None:
            crossing, decode = _guest_floor(svc, servicer(), reqs[:300], noop_wasm)
        tg.cancel_scope.cancel()
    span = dict(span)
    calls[ROOT] = 1.0
    # A row's own time: its whole time minus the whole time of the rows inside it.
    parent_of = {label: c.most_common(1)[0][0] for label, c in structure.parent.items()}
    rows = dict(span)
    for label, parent in parent_of.items():
        if label in span and parent in rows:
            rows[parent] -= span[label]
    _split_guest(rows, calls, crossing, decode)
    rank = {**structure.order, ROOT: -1}

    def key(label: str) -> tuple:
        for stem in (" crossing", " guest"):
            if stem in label:
                return rank.get(label.split(stem)[0] + " crossing + guest", 99), label
        return rank.get(label, 99), label

    ordered = [(label, rows[label], calls.get(label, 0.0)) for label in sorted(rows, key=key)]
    return Result(endpoints, picks, plain_us, ordered, span, sorted(set(structure.missing)),
                  cost)


def _guest_floor(svc, answer, reqs, noop_wasm: Path) -> tuple[float | None, dict]:
    """(empty crossing µs, {(policy, export): no-op guest call µs on that policy's inputs})."""
    from epick.interfaces.cycle import Cycle
    from epick.runtime import PolicyInstance

    blobs: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
    snapshots: list[bytes] = []
    # ABI v1 policies get msgpack (score_checked, pre_request); v2 ones a score frame
    # (score_frame) and their pre_request events deferred (defer_pre_request).
    originals = {name: PolicyInstance.__dict__[name] for name in
                 ("score_checked", "pre_request", "score_frame", "defer_pre_request")}
    export_of = {"score_checked": "score", "score_frame": "score_frame",
                 "pre_request": "pre_request", "defer_pre_request": "pre_request"}

    score_input = Cycle.__dict__["score_input"]

    def keep(name):
        def wrapper(self, blob, *rest):
            if name != "pre_request" or not self.pending:  # a flush: counted once
                blobs[(self.name, export_of[name])].append((blob, *rest))
            return originals[name](self, blob, *rest)
        return wrapper

    def keep_snapshot(self, *args, **kwargs):
        # The resident policies got the snapshot once, at the first pick: the no-op needs
        # the same one to decode their inputs (which leave it out).
        # (``self`` is a Cycle: read its view plainly, so a rename fails here, loudly.)
        if not snapshots:
            snapshots.append(self.view.encoded)
        return score_input(self, *args, **kwargs)

    from epick.runtime import frame as frames
    frame_for = frames.frame_for

    def keep_frame_snapshot(cycle, *args, **kwargs):
        # ABI v2 policies get frames: the same snapshot, taken from the cycle they come from.
        if not snapshots:
            snapshots.append(cycle.view.encoded)
        return frame_for(cycle, *args, **kwargs)

    for name in originals:
        setattr(PolicyInstance, name, keep(name))
    Cycle.score_input = keep_snapshot
    frames.frame_for = keep_frame_snapshot
    try:
        for r in reqs:
            answer(r)
    finally:
        for name, fn in originals.items():
            setattr(PolicyInstance, name, fn)
        Cycle.score_input = score_input
        frames.frame_for = frame_for
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
        cost = probe_cost_ns(2000)
        with profile.installed():
            for (policy, export), got in blobs.items():
                passes = []
                # The quietest of five passes: these run in one burst, not in the
                # rotating turns, so a load spike here would inflate the decode.
                for _ in range(5):
                    profile.ns.clear()
                    profile.calls.clear()
                    for args in got:
                        if export == "score":
                            noop.score_checked(*args)
                        elif export == "score_frame":
                            noop.score_frame(*args)
                        else:
                            noop.pre_request(*args)
                    row = "pre_request" if export == "pre_request" else "score"
                    if profile.calls[row]:
                        passes.append(profile.ns[row] / profile.calls[row] - cost)
                if passes:
                    decode[(policy, "score" if export == "score_frame" else export)] = \
                        min(passes) / 1e3
        return crossing, decode
    finally:
        noop.close()


def measure(endpoints: int = 64, picks: int = 2000, rounds: int = 2,
            noop: bool = True, native: bool = False) -> Result:
    """Plain and probed ``answer_pick`` at ``endpoints``; see the module docstring.
    ``native``: with the C loop for the scorers (when built), else one by one."""
    from epick.runtime import scoreall

    was = scoreall.enabled
    scoreall.enabled = native and scoreall.available
    try:
        return _measure_at(endpoints, picks, rounds, noop)
    finally:
        scoreall.enabled = was


def _measure_at(endpoints: int, picks: int, rounds: int, noop: bool) -> Result:
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
    width = max(len(label) for label, _, _ in res.rows)
    out = [f"answer_pick, {res.endpoints} endpoints: own time per pick (µs, means of the "
           f"fastest nine tenths, one probe at a time)",
           f"  {'stage':<{width}}  µs/pick  calls/pick   share  (whole, with what it calls)"]
    for label, us, calls in res.rows:
        if calls < 0.005 and abs(us) < 0.005:
            continue  # e.g. a recovery's init/import_state once in thousands of picks
        whole = res.whole.get(label)
        out.append(f"  {label:<{width}}  {us:7.2f}  {calls:10.2f}  {us / total:6.1%}"
                   + (f"  ({whole:.2f})" if whole is not None and abs(whole - us) > 0.005 else ""))
    out += [f"  {'total (plain answer_pick)':<{width}}  {total:7.2f}",
            f"plain answer_pick p50 {statistics.median(res.plain_us):.1f} µs over "
            f"{len(res.plain_us)} picks; a probe's own cost, taken out per call: "
            f"{res.probe_ns:.0f} ns"]
    if res.missing:
        out.append("probes whose target is gone (renamed?): " + ", ".join(res.missing))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.bench.stages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", default="8,64", help="endpoint counts, comma-separated")
    ap.add_argument("--picks", type=int, default=2000,
                    help="requests per round (each piece times them all)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the requests")
    ap.add_argument("--no-noop", action="store_true",
                    help="skip building the no-op policy (no Zig): no decode/work split")
    ap.add_argument("--native", action="store_true",
                    help="the scorers in one C call (libepick_scoreall.so, the service's "
                         "default when built); without it each is called from Python, "
                         "so each policy's crossing, decode and work get a row")
    args = ap.parse_args(argv)
    for n in (int(s) for s in args.endpoints.split(",")):
        print(render(measure(n, args.picks, args.rounds, noop=not args.no_noop,
                             native=args.native)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
