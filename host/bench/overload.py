"""The overload workload of ``epick bench quality`` (issue 26): flow control off vs on.

    epick bench quality --workloads overload [--quick] [--seed 1]

A virtual-time fleet (``--replicas`` simulated vLLM replicas, ``max_num_seqs`` 8 each, so a
replica saturates at a rate this machine can simulate) is routed by epick's real scheduler
and WASM policies (the default set), scraped every ``--scrape-interval-ms``. Its capacity
is measured first (a flood of STANDARD requests: completions / makespan). Then, at 0.5x,
1.5x and 3x that capacity, one seeded workload runs twice, side by side: flow control off
(every request scheduled at arrival; SHEDDABLE ones shed by ``[admission]``) and on (the
real ``epick.flow.FlowController`` on the simulator's clock, pumped after every arrival,
engine step and scrape). Two tenants (fairness ids) at a 10:1 request rate; 10% CRITICAL,
30% SHEDDABLE, the rest STANDARD.

Flow control runs seven times: with the defaults; with ``queue_threshold`` 1 (a request is
let through to a replica only when its scraped queue is empty and nothing was sent to it
since that scrape: the tightest bound, at most one new request per replica per scrape);
with ``max_in_flight`` = ``max_num_seqs`` (``mif=8``: a replica is given at most as many
requests as its batch holds, counted by epick itself, so a dispatched request starts at
once); that with ``precedence = "fairness"`` (``fair``: below CRITICAL, tenants take turns
first, then bands within a tenant); and that with ``reserved_in_flight`` 4 and 6 (``r=N``:
the pool's last N free slots only for urgent requests: CRITICAL, and a tenant below its
fair share of dispatch); and the last of those with ``urgent_placement = "least-busy"``
(``lb``: an urgent request goes to the endpoints with the fewest picks since their
scrape, then the fewest in flight).

Per run: p90 TTFT (from arrival, queue wait included) of CRITICAL requests (and the p90 of
its two parts: the wait in epick's queue, and from reaching the engine), of each tenant
(all, and without its SHEDDABLE requests) and overall; the makespan (last first token); served and refused by reason, and lost (must be 0); the engines' queue
(``num_requests_waiting``) at each scrape: its max, and how often it exceeded the
detector's threshold plus what epick sent that replica since its previous scrape.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field

import msgspec

from epick import abi
from epick.config import FlowControlConfig
from epick.flow import FlowController, QueueFull
from epick.interfaces import PoolView
from epick.scheduler.pickers import make_picker
from epick.scheduler.scheduler import Scheduler, SchedulingError

__all__ = ["run", "table", "MULTIPLES"]

MULTIPLES = (0.5, 1.5, 3.0)
#: ``reserved_in_flight`` values run (with max_in_flight = the batch, fairness first).
RESERVES = (4, 6)
CRIT_SHARE, SHED_SHARE = 0.10, 0.30
NOISY_SHARE = 10 / 11
#: Criticality -> priority band (as epick.api.decide maps it).
PRIORITY = {abi.Criticality.CRITICAL: 1, abi.Criticality.STANDARD: 0,
            abi.Criticality.SHEDDABLE: -1}
_STEP, _SCRAPE = 0, 1


@dataclass(slots=True)
class Arrival:
    request_id: str
    t: float
    prompt: str
    max_tokens: int
    tenant: str
    criticality: int
    outcome: str = ""
    ttft_s: float | None = None
    sent_s: float | None = None
    """When it reached an engine (after any wait in epick's queue)."""


def workload(rate: float, duration_s: float, seed: int, *, mixed: bool = True
             ) -> list[Arrival]:
    """Poisson arrivals at ``rate``/s for ``duration_s``; unique prompts (no prefix hits)."""
    rng = random.Random(seed)
    out, t, n = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        tenant = "noisy" if rng.random() < NOISY_SHARE else "quiet"
        u = rng.random()
        crit = (abi.Criticality.CRITICAL if u < CRIT_SHARE
                else abi.Criticality.SHEDDABLE if u < CRIT_SHARE + SHED_SHARE
                else abi.Criticality.STANDARD) if mixed else abi.Criticality.STANDARD
        words = rng.randint(60, 300)
        prompt = f"{tenant}-{n} " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))
        out.append(Arrival(f"r{n}", t, prompt, rng.randint(32, 96), tenant, int(crit)))
        n += 1


@dataclass
class _Run:
    """One simulated run: fleet, scheduler, optional flow control."""

    policies: object
    replicas: int
    config: object
    scrape_s: float
    flow: FlowControlConfig | None
    seed: int
    now: float = 0.0
    samples: list = field(default_factory=list)  # (waiting, threshold + sent since scrape)

    def go(self, arrivals: list[Arrival]) -> list[Arrival]:
        from epick.sim.fleet import CLOCK_ORIGIN, FleetView
        from epick.sim.metrics import MetricsPage
        from epick.sim.replica import Replica

        n = self.replicas
        reps = [Replica(self.config, report_tokens=False) for _ in range(n)]
        view = FleetView(tuple(f"10.0.0.{i + 1}:8000" for i in range(n)),
                         [MetricsPage(r, clock_origin=CLOCK_ORIGIN) for r in reps])
        state = {"pool": None, "version": -1}

        def pool_view() -> PoolView:
            if state["version"] != view.version:
                state["version"] = view.version
                state["pool"] = PoolView.build(abi.Snapshot(
                    version=view.version, timestamp_ms=int(view.now * 1000),
                    endpoints=view.all_metrics()))
            return state["pool"]

        sched = Scheduler(pool_view, self.policies, fallbacks=0, picker=make_picker("max"),
                          decision_ttl_s=1e9, max_decisions=10**7,
                          wall_clock=lambda: self.now)
        index = {a: i for i, a in enumerate(view.addresses)}
        heap: list = []
        seq = 0
        next_step: list[float | None] = [None] * n
        busy = 0
        threshold = self.flow.queue_threshold if self.flow else 5

        def reschedule(i: int) -> None:
            nonlocal seq
            t = reps[i].next_event_time()
            if t != next_step[i]:
                next_step[i] = t
                if t is not None:
                    seq += 1
                    heapq.heappush(heap, (t, _STEP, seq, i))

        def route(a: Arrival, subset=None) -> None:
            nonlocal busy
            request = abi.Request(request_id=a.request_id, model="base", prompt=a.prompt,
                                  criticality=a.criticality,
                                  seed=(self.seed * 1_000_003 + int(a.request_id[1:])))
            try:
                decision = (sched.schedule(request) if subset is None
                            else sched.schedule(request, subset=subset))
            except SchedulingError as exc:
                a.outcome = exc.outcome
                return
            i = index[decision.endpoint]
            reps[i].submit(a.request_id, a.prompt, a.max_tokens, self.now, handle=a)
            a.sent_s = self.now
            busy += 1
            reschedule(i)

        def refused(ticket, outcome: str) -> None:
            ticket.payload.outcome = "queue_expired" if outcome == "expired" else outcome

        fc = None
        if self.flow is not None:
            fc = FlowController(self.flow, view=pool_view, counts=sched.assignments,
                                on_dispatch=lambda t: route(t.payload, fc.room),
                                on_refuse=refused,
                                clock=lambda: self.now, metrics=False)

        def run_until(t_limit: float) -> None:
            nonlocal busy
            while heap and heap[0][0] <= t_limit:
                t, kind, _, i = heapq.heappop(heap)
                self.now = view.now = t
                if kind == _STEP:
                    if next_step[i] != t:
                        continue
                    next_step[i] = None
                    for req in reps[i].advance(t).finished:
                        busy -= 1
                        a = req.handle
                        a.outcome = "served"
                        a.ttft_s = req.first_token_at - a.t
                        sched.assignments.completed(view.addresses[i])
                    reschedule(i)
                else:
                    address = view.addresses[i]
                    self.samples.append((reps[i].num_waiting, threshold
                                         + sched.assignments.picked_since_scrape(address)))
                    view._scrape(i, t)
                    sched.assignments.scraped(address)
                    if busy or pending or (fc is not None and fc.waiting):
                        heapq.heappush(heap, (t + self.scrape_s, _SCRAPE, i, i))
                if fc is not None and fc.waiting:
                    fc.pump()

        rng = random.Random(self.seed)
        for i in range(n):
            view._scrape(i, 0.0)
            heapq.heappush(heap, (rng.uniform(0, self.scrape_s), _SCRAPE, i, i))
        pending = True
        for a in arrivals:
            run_until(a.t)
            self.now = view.now = a.t
            if fc is None:
                route(a)
                continue
            try:
                ticket = fc.submit(flow=a.tenant, priority=PRIORITY[a.criticality],
                                   size=len(a.prompt), payload=a)
            except QueueFull:
                a.outcome = "queue_full"
                continue
            if ticket is None:
                route(a, fc.room)
        pending = False
        while busy or (fc is not None and fc.waiting):
            if not heap:
                raise RuntimeError("requests wait but nothing is scheduled (bench bug)")
            run_until(heap[0][0])
        return arrivals


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def summarize(arrivals: list[Arrival], samples: list) -> dict:
    served = [a for a in arrivals if a.outcome == "served"]
    out: dict = {"requests": len(arrivals), "served": len(served)}
    for reason in ("shed", "queue_full", "queue_expired", "unavailable", "error"):
        out[reason] = sum(a.outcome == reason for a in arrivals)
    out["makespan_s"] = max((a.t + a.ttft_s for a in served), default=0.0)
    out["lost"] = len(arrivals) - sum(out[k] for k in (
        "served", "shed", "queue_full", "queue_expired", "unavailable", "error"))
    out["ttft_p90_s"] = _p90([a.ttft_s for a in served])
    critical = [a for a in served if a.criticality == abi.Criticality.CRITICAL]
    out["critical_ttft_p90_s"] = _p90([a.ttft_s for a in critical])
    # CRITICAL's TTFT split: the wait in epick's queue, and from reaching the engine.
    out["critical_wait_p90_s"] = _p90([a.sent_s - a.t for a in critical])
    out["critical_engine_p90_s"] = _p90([a.t + a.ttft_s - a.sent_s for a in critical])
    for tenant in ("quiet", "noisy"):
        out[f"{tenant}_ttft_p90_s"] = _p90([a.ttft_s for a in served if a.tenant == tenant])
        out[f"{tenant}_unshed_ttft_p90_s"] = _p90(
            [a.ttft_s for a in served
             if a.tenant == tenant and a.criticality != abi.Criticality.SHEDDABLE])
        out[f"{tenant}_served"] = sum(a.tenant == tenant for a in served)
        out[f"{tenant}_requests"] = sum(a.tenant == tenant for a in arrivals)
    waiting = [w for w, _ in samples]
    out["engine_waiting_max"] = max(waiting, default=0)
    out["engine_waiting_mean"] = statistics.fmean(waiting) if waiting else 0.0
    out["engine_waiting_over_bound"] = sum(w > bound for w, bound in samples)
    out["scrape_samples"] = len(samples)
    return out


def run(*, quick: bool = False, seed: int = 1, scrape_interval_ms: float = 50.0,
        replicas: int = 4, progress=None, weights: dict[str, float] | None = None,
        low_threshold: int = 1) -> dict:
    """Capacity, then every multiple with flow control off, on (the defaults), on with
    ``queue_threshold`` = ``low_threshold``, on with ``max_in_flight`` = the batch size,
    that with ``precedence = "fairness"``, and that with each of :data:`RESERVES` as
    ``reserved_in_flight``, and the last with ``urgent_placement = "least-busy"``; the
    JSON-shaped results."""
    from epick.bench.quality import BENCH_LIMITS, DEFAULT_WEIGHTS, wasm_set
    from epick.runtime import Runtime
    from epick.sim.config import DEFAULT_CONFIG

    batch = 8
    config = msgspec.structs.replace(DEFAULT_CONFIG, max_num_seqs=batch)
    duration = 10.0 if quick else 30.0
    flow = FlowControlConfig(enabled=True)
    capped = msgspec.structs.replace(flow, max_in_flight=batch)
    modes = (("off", None), ("on", flow),
             (f"on q={low_threshold}", msgspec.structs.replace(
                 flow, queue_threshold=low_threshold)),
             (f"on mif={batch}", capped),
             (f"on mif={batch} fair", msgspec.structs.replace(capped, precedence="fairness")),
             *((f"on mif={batch} fair r={r}", msgspec.structs.replace(
                 capped, precedence="fairness", reserved_in_flight=r)) for r in RESERVES),
             (f"on mif={batch} fair r={RESERVES[-1]} lb", msgspec.structs.replace(
                 capped, precedence="fairness", reserved_in_flight=RESERVES[-1],
                 urgent_placement="least-busy")))
    scrape_s = scrape_interval_ms / 1000
    say = progress or (lambda _s: None)
    out: dict = {"replicas": replicas, "max_num_seqs": batch, "duration_s": duration,
                 "seed": seed, "scrape_interval_ms": scrape_interval_ms,
                 "flow_control": msgspec.to_builtins(flow), "runs": []}
    with Runtime(limits=BENCH_LIMITS) as runtime:
        def policies():
            return wasm_set(runtime, weights or DEFAULT_WEIGHTS)

        # Capacity: a flood of STANDARD requests, completions per second of makespan.
        flood = workload(400.0, 4.0 if quick else 8.0, seed + 7, mixed=False)
        done = _Run(policies(), replicas, config, scrape_s, None, seed).go(flood)
        makespan = max(a.t + a.ttft_s for a in done if a.ttft_s is not None)
        capacity = sum(a.outcome == "served" for a in done) / makespan
        out["capacity_rps"] = capacity
        say(f"overload: fleet capacity ~{capacity:.1f} req/s ({replicas} replicas)")
        for m in MULTIPLES:
            arrivals = workload(m * capacity, duration, seed)
            for mode, fc in modes:
                r = _Run(policies(), replicas, config, scrape_s, fc, seed)
                summary = summarize(r.go([Arrival(a.request_id, a.t, a.prompt, a.max_tokens,
                                                  a.tenant, a.criticality)
                                          for a in arrivals]), r.samples)
                summary |= {"multiple": m, "rate_rps": m * capacity, "flow_control": mode}
                out["runs"].append(summary)
                say(f"overload: {m}x {mode}: p90 TTFT crit "
                    f"{_fmt(summary['critical_ttft_p90_s'])} quiet "
                    f"{_fmt(summary['quiet_ttft_p90_s'])} noisy "
                    f"{_fmt(summary['noisy_ttft_p90_s'])}")
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}s"


COLUMNS = (("multiple", "x cap"), ("flow_control", "flow"), ("requests", "reqs"),
           ("served", "served"), ("shed", "shed"), ("queue_full", "full"),
           ("queue_expired", "ttl"), ("lost", "lost"), ("ttft_p90_s", "p90 all"),
           ("critical_ttft_p90_s", "p90 CRIT"), ("critical_wait_p90_s", "CRIT wait"),
           ("critical_engine_p90_s", "CRIT engine"), ("quiet_ttft_p90_s", "p90 quiet"),
           ("quiet_unshed_ttft_p90_s", "p90 quiet non-SHED"),
           ("noisy_ttft_p90_s", "p90 noisy"), ("makespan_s", "makespan"),
           ("engine_waiting_max", "eng wait max"),
           ("engine_waiting_over_bound", "over bound"))


def table(results: dict) -> list[str]:
    lines = [f"overload: capacity {results['capacity_rps']:.1f} req/s, "
             f"{results['replicas']} replicas x max_num_seqs {results['max_num_seqs']}, "
             f"{results['duration_s']:.0f} s per run, seed {results['seed']}",
             " | ".join(h for _, h in COLUMNS)]
    for r in results["runs"]:
        cells = []
        for key, _ in COLUMNS:
            v = r[key]
            cells.append(_fmt(v) if key.endswith("_s") else
                         f"{v:g}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    return lines
