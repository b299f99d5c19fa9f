"""`epick bench quality`: routing quality on the virtual-time simulated fleet.

The same seeded workloads run through the same fleet under each router, side by side in
one run. Routing signals are the replicas' /metrics as scraped every
``--scrape-interval-ms`` (staleness included); epick's routers run the real scheduler
with the real WASM policies, and the router's own time per decision is measured.

Routers: random, round-robin, least-queue (sim baselines); legacy-v1 (the WASM filter
policy); epick (load + prefix-cache + lora-affinity, weights in DEFAULT_WEIGHTS); and
each scorer alone (load, prefix-cache, lora-affinity).

Workloads: multi-lora (10 replicas, 15 adapters, 60/30/10 traffic over three groups,
max_lora 3, a rate sweep from light to overloaded), shared-prefix (many tenants, each
with a long system prompt), zero-hit (unique prompts, no adapters). Opt-in: overload
(flow control off vs on past the fleet's capacity, ``epick.bench.overload``:
``--workloads overload``).

Precise prefix routing (issue 16): the router ``epick-precise`` is epick with the
``precise-prefix`` policy in place of ``prefix-cache``, its per-candidate counts from an
index fed by the simulated replicas' own KV-cache events (``epick.bench.kvsim``;
``--kv-delay-ms`` after each step). Its workloads, opt-in: prefix-pressure (shared
prefixes on small KV caches: evictions) and prefix-restart (one replica restarts mid-run;
hit rate per window after it, and how long it takes to get back — also against the same
run without the restart, which each point runs too). E.g.
``--workloads prefix-pressure,prefix-restart --routers round-robin,epick,epick-precise``.

Learning latency (issue 30): the router ``latency`` is epick with the ``latency`` policy
beside the defaults (weight ``LATENCY_WEIGHT``; ``load`` with ``LATENCY_LOAD_PARAMS``); the workload ``heterogeneous``, opt-in, is
a fleet of replicas of different speeds and KV sizes (``HETERO_REPLICAS``: per-replica
configs) under unique prompts of 100–3,000 tokens, every request with a TTFT SLO
(``HETERO_SLO_TTFT_MS``); its rows add the SLO attainment (share of requests within it).
E.g. ``--workloads heterogeneous --routers round-robin,least-queue,epick,latency``.
``--slo-ms MS`` gives every request of every workload that TTFT SLO instead (and counts
the attainment against it; 0 = none), e.g. ``--slo-ms 500 --rates heterogeneous=20:30:40``.

With ``--trace LOG`` the workload is a recorded decision log instead (arrival times,
prompts as stand-in blocks, adapters, output lengths from the completions; as many
replicas as the log's pool, its max_lora), and the routers are ``recorded`` (the log's
policy set) and ``candidate`` (that set with ``--policy``/``--weights``/``--params``),
beside the baselines in ``--routers`` (default round-robin, least-queue).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from epick import abi
from epick.api.validate import estimate_tokens
from epick.config import resolve_module
from epick.interfaces import PoolView
from epick.runtime.limits import Limits
from epick.scheduler.pickers import make_picker
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler, SchedulingError

__all__ = ["EpickRouter", "DEFAULT_WEIGHTS", "WORKLOADS", "run", "main"]

#: epick's default weights, chosen with this benchmark (see docs/quality.md).
#: Limits for benchmark runs (see ``run``).
BENCH_LIMITS = Limits(budget_ms=200.0)

DEFAULT_WEIGHTS = {"load": 1.0, "prefix-cache": 1.0, "lora-affinity": 1.0}

#: What the JSON output calls each router.
ROUTERS = ("random", "round-robin", "least-queue", "legacy-v1", "epick", "load",
           "prefix-cache", "lora-affinity", "epick-no-prefix")

#: Routers that follow the replicas' KV-cache events (opt-in with ``--routers``).
KV_ROUTERS = ("epick-precise",)

#: The learning router (issue 30, opt-in with ``--routers``): epick's defaults with the
#: ``latency`` policy beside them at this weight.
LATENCY_WEIGHT = 1.0
#: ... and ``load`` without its recent picks there: ``latency`` already counts the prefill
#: each endpoint has ahead, so they would count it twice (docs/quality.md, "Zero-hit").
LATENCY_LOAD_PARAMS = {"recent_requests": 0.0}
LATENCY_ROUTERS = ("latency",)


class EpickRouter:
    """Routes a virtual-time fleet with epick's scheduler and WASM policies.

    The pool's view is rebuilt only when a replica was re-scraped (as the service does
    once per metrics change); ``decision_us`` accumulates the router's own wall time per
    decision, snapshot rebuilds included.
    """

    def __init__(self, policies: PolicySet, *, model: str = "base", picker: str = "max",
                 seed: int = 0, kv=None, kv_delay_s: float = 0.0, slo_ttft_ms: int = 0) -> None:
        self.model = model
        self.slo_ttft_ms = slo_ttft_ms
        """Every request's TTFT SLO (``Request.slo_ttft_ms``, as the header would set it)."""
        # The fleet's virtual clock stamps hooks too, as it stamps snapshots: a policy
        # compares the two (LoRA reconcile, request TTL).
        self._view = None
        self.scheduler = Scheduler(lambda: self._pool_view, policies, fallbacks=0, kv=kv,
                                   picker=make_picker(picker), decision_ttl_s=1e9,
                                   max_decisions=10**7,
                                   wall_clock=lambda: self._view.now if self._view else 0.0)
        self._pool_view: PoolView | None = None
        self._key: tuple | None = None
        self._index: dict[str, int] = {}
        self._version = 0
        self._seed = seed
        self.decision_s = 0.0
        self.decisions = 0
        self.failures = 0
        self.kv = kv
        """``epick.bench.kvsim.SimKvCounts`` for the precise router, else None."""
        self.fleet_options: dict = {}
        """Extra ``Fleet.run`` arguments this router needs (its KV-event listener)."""
        if kv is not None:
            self.fleet_options = {"kv_events": kv.on_batch, "kv_event_delay_s": kv_delay_s}

    def route(self, req, view) -> int:
        t0 = time.perf_counter()
        self._view = view
        key = tuple(view.scraped_at(i) for i in range(len(view)))
        if key != self._key:
            old = self._key or (None,) * len(key)
            for i, (was, now) in enumerate(zip(old, key)):
                if was != now:  # a new scrape of replica i: its picks are visible now
                    self.scheduler.assignments.scraped(view.addresses[i])
            self._key = key
            self._version += 1
            self._pool_view = PoolView.build(abi.Snapshot(
                version=self._version, timestamp_ms=int(view.now * 1000),
                endpoints=view.all_metrics()))
            if not self._index:
                self._index = {a: i for i, a in enumerate(view.addresses)}
        request = abi.Request(request_id=req.request_id, model=self.model, adapter=req.adapter,
                              prompt=req.prompt, cache_salt=req.cache_salt,
                              seed=(self._seed * 1_000_003 + self.decisions) & (2**64 - 1),
                              slo_ttft_ms=self.slo_ttft_ms,
                              prompt_tokens=estimate_tokens(req.prompt))
        try:
            decision = self.scheduler.schedule(request)
            choice = self._index[decision.endpoint]
        except SchedulingError:
            # legacy-v1 sheds non-critical requests when nothing has capacity; the
            # simulated gateway then sends them anywhere (the fleet has no 429 path).
            self.failures += 1
            choice = self.decisions % len(view)
        self.decision_s += time.perf_counter() - t0
        self.decisions += 1
        return choice

    def on_complete(self, req, replica: int) -> None:
        self.scheduler.complete(request_id=req.request_id, completion_tokens=req.max_tokens)

    def on_finished(self, req, replica: int, record) -> None:
        """The gateway's completion report: what ext_proc measures on a real stream."""
        if record is None:  # aborted by a restart: reported as before this hook existed
            self.on_complete(req, replica)
            return
        self.scheduler.complete(request_id=req.request_id, prompt_tokens=record.prompt_tokens,
                                completion_tokens=record.output_tokens, ttft_s=record.ttft_s)

    @property
    def decision_us(self) -> float:
        return self.decision_s / self.decisions * 1e6 if self.decisions else 0.0


def wasm_set(runtime, weights: dict[str, float], params: dict[str, dict] | None = None
             ) -> PolicySet:
    from epick.runtime import WasmPolicy

    entries = []
    for name, weight in weights.items():
        module = runtime.compile(resolve_module(name).read_bytes(), name=name)
        p = (params or {}).get(name, {})
        entries.append(PolicyEntry(name, WasmPolicy(module, p, name=name), weight=weight))
    return PolicySet(tuple(entries))


def make_router(name: str, runtime, seed: int, weights: dict[str, float] | None = None,
                *, kv_blocks: int = 0, kv_delay_s: float = 0.01, slo_ttft_ms: int = 0):
    from epick.sim.routers import LeastQueueRouter, RandomRouter, RoundRobinRouter

    if name == "random":
        return RandomRouter(seed)
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-queue":
        return LeastQueueRouter()
    if name == "legacy-v1":
        return EpickRouter(wasm_set(runtime, {"legacy-v1": 1.0}), seed=seed,
                           slo_ttft_ms=slo_ttft_ms)
    weights = weights or DEFAULT_WEIGHTS
    if name == "epick":
        return EpickRouter(wasm_set(runtime, weights), seed=seed, slo_ttft_ms=slo_ttft_ms)
    if name == "latency":
        return EpickRouter(wasm_set(runtime, {**weights, "latency": LATENCY_WEIGHT},
                                    {"load": LATENCY_LOAD_PARAMS}), seed=seed,
                           slo_ttft_ms=slo_ttft_ms)
    if name == "epick-no-prefix":  # the zero-hit overhead baseline: epick minus prefix
        return EpickRouter(wasm_set(runtime, {k: w for k, w in weights.items()
                                              if k != "prefix-cache"}), seed=seed)
    if name in DEFAULT_WEIGHTS:
        return EpickRouter(wasm_set(runtime, {name: 1.0}), seed=seed)
    if name == "epick-precise":  # precise-prefix in prefix-cache's place, same weight
        from epick.bench.kvsim import SimKvCounts

        precise = {("precise-prefix" if k == "prefix-cache" else k): w for k, w in weights.items()}
        return EpickRouter(wasm_set(runtime, precise), seed=seed,
                           kv=SimKvCounts(max(kv_blocks, 1) * 2), kv_delay_s=kv_delay_s)
    raise ValueError(f"unknown router {name!r}; expected one of "
                     f"{', '.join(ROUTERS + KV_ROUTERS + LATENCY_ROUTERS)}")


@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int
    rates: tuple[float, ...]
    duration_s: float
    make: Callable[[float, float, int], list]
    """(rate, duration_s, seed) -> requests"""
    max_lora: int = 3
    config: dict = field(default_factory=dict)
    """ReplicaConfig changes (prefix-pressure: small KV caches)."""
    restart_at: float | None = None
    """Fraction of the duration at which replica 0 restarts (prefix-restart)."""
    replica_configs: tuple[dict, ...] = ()
    """Per replica ReplicaConfig changes over ``config`` (heterogeneous: one per replica)."""
    slo_ttft_ms: int = 0
    """Every request's TTFT SLO; > 0 adds SLO attainment (share of requests within it)."""


def _workloads(quick: bool) -> dict[str, Workload]:
    from epick.sim import workload as wl

    dur = 20.0 if quick else 60.0
    return {
        "multi-lora": Workload(
            "multi-lora", 10, (10.0, 40.0) if quick else (10.0, 20.0, 40.0, 60.0, 80.0), dur,
            lambda rate, d, seed: wl.multi_lora(qps=rate, duration_s=d, seed=seed,
                                                adapters=15, split=(0.6, 0.3, 0.1))),
        "shared-prefix": Workload(
            "shared-prefix", 8, (30.0, 60.0) if quick else (10.0, 30.0, 50.0, 70.0, 90.0), dur,
            lambda rate, d, seed: wl.shared_prefix(qps=rate, duration_s=d, seed=seed)),
        "zero-hit": Workload(
            "zero-hit", 8, (10.0, 40.0) if quick else (10.0, 20.0, 40.0, 60.0), dur,
            lambda rate, d, seed: wl.zero_hit(qps=rate, duration_s=d, seed=seed)),
        # Issue 16: tenants' prefixes outgrow the KV caches, so engines evict what the
        # approximate estimate still believes they hold.
        "prefix-pressure": Workload(
            "prefix-pressure", 8, PRESSURE_RATES_QUICK if quick else PRESSURE_RATES, dur,
            lambda rate, d, seed: wl.shared_prefix(qps=rate, duration_s=d, seed=seed,
                                                   **PRESSURE_PREFIX),
            config=PRESSURE_CONFIG),
        "prefix-restart": Workload(
            "prefix-restart", 4, RESTART_RATES_QUICK if quick else RESTART_RATES, dur,
            lambda rate, d, seed: wl.shared_prefix(qps=rate, duration_s=d, seed=seed,
                                                   **RESTART_PREFIX),
            restart_at=0.5),
        # Issue 30: replicas of different speeds and KV sizes, prompts of very different
        # lengths; a TTFT SLO most requests can meet on the right replica.
        "heterogeneous": Workload(
            "heterogeneous", len(HETERO_REPLICAS), HETERO_RATES_QUICK if quick else HETERO_RATES,
            dur, lambda rate, d, seed: wl.zero_hit(qps=rate, duration_s=d, seed=seed,
                                                   **HETERO_REQUESTS),
            replica_configs=HETERO_REPLICAS, slo_ttft_ms=HETERO_SLO_TTFT_MS),
    }


#: heterogeneous: 2 fast replicas (the calibration's H100), 3 at a third of its speed, 3
#: at a tenth with a small KV cache (an older GPU, a CPU replica).
_MEDIUM = {"prefill_tokens_per_s": 8_000.0, "decode_step_base_s": 0.015,
           "per_context_token_s": 0.12e-6, "num_gpu_blocks": 12_000}
_SLOW = {"prefill_tokens_per_s": 2_500.0, "decode_step_base_s": 0.04,
         "per_context_token_s": 0.4e-6, "num_gpu_blocks": 4_000}
HETERO_REPLICAS: tuple[dict, ...] = ({}, {}, _MEDIUM, _MEDIUM, _MEDIUM, _SLOW, _SLOW, _SLOW)
HETERO_REQUESTS = {"prompt_tokens": (100, 3000), "output_tokens": (20, 200)}
HETERO_RATES = (10.0, 20.0, 30.0, 40.0)
HETERO_RATES_QUICK = (20.0, 40.0)
HETERO_SLO_TTFT_MS = 1000


#: prefix-pressure: the workload and the KV caches (see docs/quality.md, "Precise").
PRESSURE_PREFIX = {"tenants": 150, "prefix_tokens": 6000}
PRESSURE_CONFIG = {"num_gpu_blocks": 6000}
PRESSURE_RATES = (10.0, 20.0, 30.0, 40.0, 50.0)
PRESSURE_RATES_QUICK = (20.0, 40.0)
#: prefix-restart: 4 replicas, replica 0 restarts halfway (caches warm by then); hit
#: rates per window after it, against the windows just before.
RESTART_PREFIX = {"tenants": 24, "prefix_tokens": 6000}
RESTART_RATES = (10.0, 20.0, 30.0)
RESTART_RATES_QUICK = (20.0, 30.0)
RESTART_WINDOW_S = 2.0
RESTART_WINDOWS = 4
#: The finer view, against the same run without the restart (2 s windows against the level
#: before all read "recovered after 2 s"): per 0.5 s window over the same 8 s, recovered
#: when every later window's hit rate is back to 90% of the calm run's in that window; and
#: the prefix-cache hits the restart cost in the 4 s after it: (cached tokens without it -
#: with it) / prompt tokens, and the full misses (< half the prompt cached) it added.
RESTART_FINE_WINDOW_S = 0.5
RESTART_FINE_WINDOWS = 16
RESTART_LOST_S = 4.0


WORKLOADS = ("multi-lora", "shared-prefix", "zero-hit")
#: Flow control's overload workload (opt-in, ``epick.bench.overload``): flow control off
#: vs on at 0.5x, 1.5x and 3x the fleet's capacity.
OVERLOAD = "overload"
#: Opt-in with ``--workloads``.
EXTRA_WORKLOADS = ("prefix-pressure", "prefix-restart", "heterogeneous")


def run(*, quick: bool = False, workloads=WORKLOADS, routers=ROUTERS, seed: int = 1,
        scrape_interval_ms: float = 50.0, weights: dict[str, float] | None = None,
        rates: dict[str, tuple[float, ...]] | None = None,
        progress: Callable[[str], None] | None = None, kv_delay_ms: float = 10.0,
        slo_ttft_ms: int | None = None) -> dict:
    """Run every (workload, rate, router); return the JSON-shaped results.

    ``slo_ttft_ms``: every request's TTFT SLO, in place of each workload's own
    (heterogeneous: ``HETERO_SLO_TTFT_MS``; the others none); 0 = none."""
    import msgspec

    from epick.runtime import Runtime
    from epick.sim.config import DEFAULT_CONFIG
    from epick.sim.fleet import Fleet

    out: dict = {"workloads": {}, "scrape_interval_ms": scrape_interval_ms, "seed": seed,
                 "quick": quick, "epick_weights": weights or DEFAULT_WEIGHTS,
                 "kv_delay_ms": kv_delay_ms}
    specs = _workloads(quick)
    # Virtual time: a policy call that overruns the live 1 ms budget on a busy machine
    # would be skipped and change the decision, so the benchmark's results would depend on
    # the machine's load. Here the budget is only a backstop against a hung policy.
    with Runtime(limits=BENCH_LIMITS) as runtime:
        for wname in workloads:
            w = specs[wname]
            if slo_ttft_ms is not None:
                w = dataclasses.replace(w, slo_ttft_ms=slo_ttft_ms)
            config = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=w.max_lora, **w.config)
            configs = ([msgspec.structs.replace(config, **c) for c in w.replica_configs]
                       if w.replica_configs else None)
            fleet = Fleet(w.replicas, config, seed=seed, configs=configs)
            per_router: dict = {r: {k: [] for k in (
                "rate", "throughput_tok_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                "e2e_p50_s", "e2e_p90_s", "adapter_loads", "hit_rate", "decision_cpu_us",
                "shed", "kv_evictions")} for r in routers}
            restart_t = w.duration_s * w.restart_at if w.restart_at is not None else None
            for rate in (rates or {}).get(wname, w.rates):
                requests = w.make(rate, w.duration_s, seed)
                for rname in routers:
                    router = make_router(rname, runtime, seed, weights,
                                         kv_blocks=config.num_gpu_blocks,
                                         kv_delay_s=kv_delay_ms / 1000,
                                         slo_ttft_ms=w.slo_ttft_ms)
                    options = dict(getattr(router, "fleet_options", {}))
                    if restart_t is not None:
                        options["restarts"] = [(restart_t, 0)]
                    t0 = time.perf_counter()
                    res = fleet.run(requests, router, scrape_interval_s=scrape_interval_ms / 1000,
                                    **options)
                    s = res.summary
                    row = per_router[rname]
                    row["rate"].append(rate)
                    row["throughput_tok_s"].append(s.output_tok_s)
                    row["ttft_p50_s"].append(s.ttft_p50_s)
                    row["ttft_p90_s"].append(s.ttft_p90_s)
                    row["ttft_p99_s"].append(s.ttft_p99_s)
                    row["e2e_p50_s"].append(s.e2e_p50_s)
                    row["e2e_p90_s"].append(s.e2e_p90_s)
                    row["adapter_loads"].append(s.adapter_loads)
                    row["hit_rate"].append(s.prefix_cache_hit_rate)
                    row["decision_cpu_us"].append(getattr(router, "decision_us", 0.0))
                    row["shed"].append(getattr(router, "failures", 0))
                    row["kv_evictions"].append(sum(r.kv_evictions for r in res.replicas))
                    if w.slo_ttft_ms:
                        slo_s = w.slo_ttft_ms / 1000
                        row.setdefault("slo_ttft_ms", []).append(w.slo_ttft_ms)
                        row.setdefault("slo_attainment", []).append(
                            sum(1 for r in res.records if r.ttft_s <= slo_s) / len(res.records)
                            if res.records else float("nan"))
                    if restart_t is not None:
                        # The same requests, router and seed without the restart: what the
                        # restart cost is the difference (the level before is too noisy).
                        calm = make_router(rname, runtime, seed, weights,
                                           kv_blocks=config.num_gpu_blocks,
                                           kv_delay_s=kv_delay_ms / 1000)
                        base = fleet.run(requests, calm,
                                         scrape_interval_s=scrape_interval_ms / 1000,
                                         **getattr(calm, "fleet_options", {}))
                        _restart_stats(row, res.records, restart_t, base.records)
                    if progress:
                        progress(f"{wname:13s} rate {rate:5.1f}  {rname:13s} "
                                 f"tok/s {s.output_tok_s:8.0f}  ttft p90 {s.ttft_p90_s:7.3f}s  "
                                 f"loads {s.adapter_loads:5d}  hit {s.prefix_cache_hit_rate:.2f}"
                                 f"  evictions {row['kv_evictions'][-1]}"
                                 + (f"  SLO {w.slo_ttft_ms} ms met "
                                    f"{row['slo_attainment'][-1]:.1%}" if w.slo_ttft_ms else "")
                                 + f"  ({time.perf_counter() - t0:.1f}s)")
                        if restart_t is not None:
                            after = " ".join(f"{v:.2f}" for v in row["hit_rate_after_restart"][-1])
                            progress(f"{'':13s} restart of replica 0 at {restart_t:g} s: hit "
                                     f"before {row['hit_rate_before_restart'][-1]:.2f}, per "
                                     f"{RESTART_WINDOW_S:g} s after: {after}; recovered after "
                                     f"{row['recovery_s'][-1]} s; TTFT p90 of the "
                                     f"{2 * RESTART_WINDOW_S:g} s after "
                                     f"{row['ttft_p90_after_restart_s'][-1]:.3f} s; against "
                                 f"no restart, per {RESTART_FINE_WINDOW_S:g} s recovered "
                                 f"after {row['recovery_fine_s'][-1]} s, hits lost in the "
                                 f"{RESTART_LOST_S:g} s after "
                                 f"{row['hit_lost_after_restart'][-1]:.3f}, misses added "
                                 f"{row['misses_added_by_restart'][-1]}")
            out["workloads"][wname] = per_router
    return out


def _restart_stats(row: dict, records, restart_t: float, calm=None) -> None:
    """Hit rate before the restart (the windows just before it), per window after it, and
    the recovery time: the end of the first window from which every later one is back to
    at least 90% of the level before. With ``calm`` (the records of the same run without
    the restart): the finer recovery and the hits lost against it."""
    import numpy as np

    from epick.bench.kvsim import windowed_hit_rates

    before = windowed_hit_rates(records, restart_t - 2 * RESTART_WINDOW_S, 2 * RESTART_WINDOW_S, 1)[0]
    after = windowed_hit_rates(records, restart_t, RESTART_WINDOW_S, RESTART_WINDOWS)
    soon = [r.ttft_s for r in records if restart_t <= r.arrival_s < restart_t + 2 * RESTART_WINDOW_S]
    row.setdefault("ttft_p90_after_restart_s", []).append(
        float(np.percentile(soon, 90)) if soon else float("nan"))
    row.setdefault("hit_rate_before_restart", []).append(before)
    row.setdefault("hit_rate_after_restart", []).append(after)
    row.setdefault("recovery_s", []).append(_recovered(after, before, RESTART_WINDOW_S))
    if calm is None:
        return
    fine = windowed_hit_rates(records, restart_t, RESTART_FINE_WINDOW_S, RESTART_FINE_WINDOWS)
    level = windowed_hit_rates(calm, restart_t, RESTART_FINE_WINDOW_S, RESTART_FINE_WINDOWS)
    row.setdefault("hit_rate_after_restart_fine", []).append(fine)
    row.setdefault("recovery_fine_s", []).append(
        _recovered(fine, level, RESTART_FINE_WINDOW_S))
    hit, prompt, misses = _window(records, restart_t, restart_t + RESTART_LOST_S)
    hit0, _, misses0 = _window(calm, restart_t, restart_t + RESTART_LOST_S)
    row.setdefault("hit_lost_after_restart", []).append(
        (hit0 - hit) / prompt if prompt else float("nan"))
    row.setdefault("misses_added_by_restart", []).append(misses - misses0)


def _window(records, start: float, end: float) -> tuple[int, int, int]:
    """Cached tokens, prompt tokens and full misses of the requests arriving in [start, end)."""
    sel = [r for r in records if start <= r.arrival_s < end]
    return (sum(max(r.cached_tokens, 0) for r in sel), sum(r.prompt_tokens for r in sel),
            sum(1 for r in sel if r.cached_tokens < r.prompt_tokens / 2))


def _recovered(after: list[float], level, window_s: float) -> float | None:
    """The end of the first window from which every later one is back to at least 90%
    of ``level`` (one number, or one per window); None = not within the windows."""
    levels = level if isinstance(level, list) else [level] * len(after)
    for k in range(len(after)):
        # NaN (an empty window) passes
        if all(not v < 0.9 * lv for v, lv in zip(after[k:], levels[k:])):
            return (k + 1) * window_s
    return None


def run_trace(paths, changes=None, *, routers=("round-robin", "least-queue"), seed: int = 1,
              scrape_interval_ms: float = 50.0, default_max_tokens: int = 64,
              progress: Callable[[str], None] | None = None, runtime=None) -> dict:
    """Simulate a recorded log under the recorded and the candidate policy sets."""
    from contextlib import nullcontext

    import msgspec

    from epick.decisions.trace import load_trace, policy_set
    from epick.runtime import Runtime
    from epick.sim.config import DEFAULT_CONFIG
    from epick.sim.fleet import Fleet

    trace = load_trace(paths, default_max_tokens=default_max_tokens)
    reqs = trace.requests
    span = reqs[-1].arrival_s if len(reqs) > 1 else 1.0
    rate = len(reqs) / span if span > 0 else float(len(reqs))
    config = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=max(trace.max_lora, 1))
    fleet = Fleet(trace.replicas, config, seed=seed)
    out: dict = {"workloads": {}, "scrape_interval_ms": scrape_interval_ms, "seed": seed,
                 "trace": {"files": [str(p) for p in paths], "requests": len(reqs),
                           "replicas": trace.replicas, "max_lora": trace.max_lora,
                           "output_tokens_from_completions": trace.completions,
                           "rate": rate}}
    per_router: dict = {}
    own = (Runtime(cache_dir=Path.home() / ".cache" / "epick") if runtime is None
           else nullcontext(runtime))
    with own as runtime:
        # Both sets first: a bad candidate is refused before anything runs.
        sets = {"recorded": policy_set(runtime, trace)}
        if changes is not None and not changes.empty:
            sets["candidate"] = policy_set(runtime, trace, changes)
        for rname in [*sets, *(r for r in routers if r)]:
            if rname in sets:
                router = EpickRouter(sets[rname], seed=seed)
            else:
                router = make_router(rname, runtime, seed)
            t0 = time.perf_counter()
            s = fleet.run(reqs, router, scrape_interval_s=scrape_interval_ms / 1000).summary
            per_router[rname] = {
                "rate": [rate], "throughput_tok_s": [s.output_tok_s],
                "ttft_p50_s": [s.ttft_p50_s], "ttft_p90_s": [s.ttft_p90_s],
                "ttft_p99_s": [s.ttft_p99_s], "e2e_p50_s": [s.e2e_p50_s],
                "e2e_p90_s": [s.e2e_p90_s], "adapter_loads": [s.adapter_loads],
                "hit_rate": [s.prefix_cache_hit_rate],
                "decision_cpu_us": [getattr(router, "decision_us", 0.0)],
                "shed": [getattr(router, "failures", 0)]}
            if progress:
                progress(f"trace {rname:13s} tok/s {s.output_tok_s:8.0f}  ttft p90 "
                         f"{s.ttft_p90_s:7.3f}s  loads {s.adapter_loads:5d}  hit "
                         f"{s.prefix_cache_hit_rate:.2f}  ({time.perf_counter() - t0:.1f}s)")
    out["workloads"]["trace"] = per_router
    return out


def _tables(results: dict):
    from rich.table import Table

    tables = []
    for wname, per_router in results["workloads"].items():
        t = Table(title=f"{wname} (scrape every {results['scrape_interval_ms']:.0f} ms)")
        for c in ("router", "rate", "out tok/s", "TTFT p50", "TTFT p90", "TTFT p99",
                  "e2e p50", "adapter loads", "prefix hit", "decision µs"):
            t.add_column(c, justify="right")
        routers = list(per_router)
        rates = per_router[routers[0]]["rate"]
        for k, rate in enumerate(rates):
            for r in routers:
                row = per_router[r]
                t.add_row(r, f"{rate:g}", f"{row['throughput_tok_s'][k]:.0f}",
                          f"{row['ttft_p50_s'][k]:.3f}", f"{row['ttft_p90_s'][k]:.3f}",
                          f"{row['ttft_p99_s'][k]:.3f}", f"{row['e2e_p50_s'][k]:.2f}",
                          str(row["adapter_loads"][k]), f"{row['hit_rate'][k]:.2f}",
                          f"{row['decision_cpu_us'][k]:.0f}" if row["decision_cpu_us"][k] else "-",
                          end_section=(r == routers[-1]))
        tables.append(t)
    return tables


def plot(results: dict, folder: Path) -> list[Path]:
    """One PNG per workload: TTFT p90 and throughput vs rate, a line per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for wname, per_router in results["workloads"].items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r, row in per_router.items():
            style = "-" if r in ("epick", "legacy-v1") else "--"
            ax1.plot(row["rate"], row["ttft_p90_s"], style, marker="o", label=r)
            ax2.plot(row["rate"], row["throughput_tok_s"], style, marker="o", label=r)
        ax1.set(title=f"{wname}: TTFT p90", xlabel="request rate (QPS)", ylabel="seconds",
                yscale="log")
        ax2.set(title=f"{wname}: output throughput", xlabel="request rate (QPS)",
                ylabel="tokens/s")
        ax1.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{wname}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


SWEPT = ("ttft_p90_s", "throughput_tok_s", "adapter_loads", "hit_rate")
#: Swept where a workload has them (prefix-restart): None (not recovered) counts as inf.
SWEPT_IF_PRESENT = ("kv_evictions", "recovery_s", "hit_rate_before_restart",
                    "ttft_p90_after_restart_s", "recovery_fine_s", "hit_lost_after_restart",
                    "misses_added_by_restart")


def sweep_seeds(seeds, **kw) -> dict:
    """:func:`run` once per seed; per workload, router, rate and metric: every seed's
    value, the median and the worst (TTFT and adapter loads: largest; throughput and hit
    rate: smallest)."""
    import statistics

    runs = {seed: run(seed=seed, **kw) for seed in seeds}
    first = next(iter(runs.values()))
    out: dict = {"seeds": list(runs), "workloads": {}}
    for wname, per_router in first["workloads"].items():
        out["workloads"][wname] = {}
        for router, row in per_router.items():
            cell: dict = {"rate": row["rate"]}
            for metric in SWEPT + tuple(m for m in SWEPT_IF_PRESENT if m in row):
                per_rate = []
                for k in range(len(row["rate"])):
                    values = [runs[s]["workloads"][wname][router][metric][k] for s in runs]
                    if metric in ("recovery_s", "recovery_fine_s"):
                        values = [float("inf") if v is None else v for v in values]
                    worst = (max if metric in ("ttft_p90_s", "adapter_loads", "kv_evictions",
                                               "recovery_s", "ttft_p90_after_restart_s",
                                               "recovery_fine_s", "hit_lost_after_restart",
                                               "misses_added_by_restart")
                             else min)(values)
                    per_rate.append({"values": values, "median": statistics.median(values),
                                     "worst": worst})
                cell[metric] = per_rate
            out["workloads"][wname][router] = cell
    return out


def seed_table(results: dict) -> list[str]:
    """The sweep as text: median (worst) per router and rate."""
    lines = [f"seeds {results['seeds']}: median (worst)"]
    for wname, per_router in results["workloads"].items():
        lines.append(f"\n{wname}")
        lines.append(f"{'router':16} {'rate':>6} {'TTFT p90 s':>18} {'tok/s':>18} "
                     f"{'adapter loads':>16} {'hit rate':>14}")
        for router, cell in per_router.items():
            for k, rate in enumerate(cell["rate"]):
                p90, tok = cell["ttft_p90_s"][k], cell["throughput_tok_s"][k]
                loads, hit = cell["adapter_loads"][k], cell["hit_rate"][k]
                extra = ""
                if "kv_evictions" in cell:
                    ev = cell["kv_evictions"][k]
                    extra += f"  evictions {ev['median']:.0f} ({ev['worst']:.0f})"
                if "recovery_s" in cell:
                    rec, pre = cell["recovery_s"][k], cell["hit_rate_before_restart"][k]
                    after = cell["ttft_p90_after_restart_s"][k]
                    extra += (f"  hit before restart {pre['median']:.2f}  recovered after "
                              f"{rec['median']:g} s ({rec['worst']:g})  TTFT p90 after "
                              f"{after['median']:.3f} ({after['worst']:.3f})")
                if "recovery_fine_s" in cell:
                    fine, lost = cell["recovery_fine_s"][k], cell["hit_lost_after_restart"][k]
                    added = cell["misses_added_by_restart"][k]
                    extra += (f"  vs no restart, per {RESTART_FINE_WINDOW_S:g} s: recovered "
                              f"after {fine['median']:g} s ({fine['worst']:g})  hits lost in "
                              f"{RESTART_LOST_S:g} s {lost['median']:.3f} ({lost['worst']:.3f})"
                              f"  misses added {added['median']:g} ({added['worst']:g})")
                lines.append(
                    f"{router:16} {rate:>6g} {p90['median']:>9.3f} ({p90['worst']:.3f})"
                    f" {tok['median']:>9.0f} ({tok['worst']:.0f})"
                    f" {loads['median']:>8.0f} ({loads['worst']:.0f})"
                    f" {hit['median']:>7.2f} ({hit['worst']:.2f})" + extra)
    return lines


def _write_json(console, path: Path | None, results: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        console.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    ap = argparse.ArgumentParser(prog="epick bench quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a reduced run (< 3 minutes)")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--plots", type=Path, help="write one PNG per workload into this folder")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="the seed sweep: run seeds --seed .. --seed+N-1 and report, per "
                    "router and rate, the median and the worst (largest TTFT p90, smallest "
                    "throughput) over them")
    ap.add_argument("--scrape-interval-ms", type=float, default=50.0)
    ap.add_argument("--kv-delay-ms", type=float, default=10.0,
                    help="epick-precise: KV events reach its index this long after the step "
                    "that made them")
    ap.add_argument("--weights", help="epick's weights, e.g. load=1,prefix-cache=3,"
                    "lora-affinity=1 (default: DEFAULT_WEIGHTS)")
    ap.add_argument("--rates", help="override a workload's rates, e.g. shared-prefix=20:40:60")
    ap.add_argument("--slo-ms", type=int, metavar="MS",
                    help="every request's TTFT SLO in ms, and the attainment reported "
                    f"against it (default: the workload's own, heterogeneous "
                    f"{HETERO_SLO_TTFT_MS}; 0 = none)")
    ap.add_argument("--trace", action="append", metavar="LOG",
                    help="simulate a recorded decision log instead of the workloads")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=FILE.wasm",
                    help="with --trace: the candidate replaces (or adds) policy NAME")
    ap.add_argument("--params", action="append", default=[], metavar="NAME=JSON",
                    help="with --trace: params merged over the candidate's policy NAME")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="with --trace: output tokens of requests without a completion count")
    args = ap.parse_args(argv)
    if args.trace:
        return _main_trace(args)
    weights = None
    if args.weights:
        weights = {k: float(v) for k, v in (kv.split("=") for kv in args.weights.split(","))}
    rates = None
    if args.rates:
        rates = {k: tuple(float(r) for r in v.split(":"))
                 for k, v in (kv.split("=") for kv in args.rates.split(","))}
    console = Console(width=160)
    names = tuple(args.workloads.split(","))
    if OVERLOAD in names:  # flow control's workload (issue 26): its own runs and table
        from epick.bench import overload

        res = overload.run(quick=args.quick, seed=args.seed,
                           scrape_interval_ms=args.scrape_interval_ms, weights=weights,
                           progress=console.print)
        for line in overload.table(res):
            console.print(line)
        names = tuple(n for n in names if n != OVERLOAD)
        if not names:
            _write_json(console, args.json, {"overload": res})
            return 0
        args.workloads = ",".join(names)
    if args.seeds:
        results = sweep_seeds(range(args.seed, args.seed + args.seeds), quick=args.quick,
                              workloads=tuple(args.workloads.split(",")),
                              routers=tuple(args.routers.split(",")),
                              scrape_interval_ms=args.scrape_interval_ms, weights=weights,
                              rates=rates, kv_delay_ms=args.kv_delay_ms,
                              slo_ttft_ms=args.slo_ms)
        for line in seed_table(results):
            console.print(line)
        _write_json(console, args.json, results)
        return 0
    results = run(quick=args.quick, workloads=tuple(args.workloads.split(",")),
                  routers=tuple(args.routers.split(",")), seed=args.seed,
                  scrape_interval_ms=args.scrape_interval_ms, weights=weights, rates=rates,
                  progress=console.print, kv_delay_ms=args.kv_delay_ms,
                  slo_ttft_ms=args.slo_ms)
    for t in _tables(results):
        console.print(t)
    _write_json(console, args.json, results)
    if args.plots:
        for p in plot(results, args.plots):
            console.print(f"wrote {p}")
    return 0


def _main_trace(args) -> int:
    import sys

    from rich.console import Console

    from epick.decisions.cli import ArgumentError, parse_changes
    from epick.decisions.reader import LogError
    from epick.decisions.replay import ReplayError

    console = Console(width=160)
    routers = ("round-robin", "least-queue")
    if args.routers != ",".join(ROUTERS):
        routers = tuple(r for r in args.routers.split(",") if r)
    try:
        changes = parse_changes(args.policy, [args.weights] if args.weights else [],
                                args.params)
        results = run_trace(args.trace, changes, routers=routers, seed=args.seed,
                            scrape_interval_ms=args.scrape_interval_ms,
                            default_max_tokens=args.max_tokens, progress=console.print)
    except (ArgumentError, LogError, ReplayError, ValueError) as exc:
        print(f"epick bench quality: {exc}", file=sys.stderr)
        return 2
    tr = results["trace"]
    console.print(f"trace: {tr['requests']} requests at {tr['rate']:.1f}/s on "
                  f"{tr['replicas']} replicas (max_lora {tr['max_lora']}); output lengths "
                  f"from {tr['output_tokens_from_completions']} completion(s), else "
                  f"{args.max_tokens} tokens")
    for t in _tables(results):
        console.print(t)
    _write_json(console, args.json, results)
    return 0
