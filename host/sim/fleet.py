"""The virtual-time driver: a discrete-event loop over N replicas, a router and a scraper.

Minutes of traffic run in seconds of CPU: nothing sleeps; the loop jumps from one event
to the next. Events at the same instant run in this order: engine steps ending, then
scrapes, then arrivals — so a scrape sees the state after the step that ended with it,
and a router sees every scrape taken up to its request's arrival.

Routing signals are stale the way a real scraper makes them: every replica is scraped
every ``scrape_interval_s`` (each with its own random phase, from the fleet's seed), and
the router sees only the pages as last scraped — the rendered vLLM text and the
:class:`epick.abi.EndpointMetrics` parsed from it.

KV-cache events (``run(..., kv_events=listener)``): every replica publishes vLLM's events
(:mod:`epick.sim.replica`), one batch per engine step, numbered per replica from 0 as a
vLLM publisher numbers them; ``listener(address, seq, batch)`` gets each batch
``kv_event_delay_s`` after the step that made it (the subscriber's lag). Events at one
instant run steps, scrapes, event deliveries, restarts, then arrivals.

Restarts (``run(..., restarts=[(t, i), ...])``): at virtual time ``t`` replica ``i``
loses everything, as an engine that restarts does — its requests in flight are aborted
and its prefix cache emptied (``AllBlocksCleared`` when events are on) — and the client
retries each aborted request at once through the router (TTFT still counts from the
first arrival). The process and its counters stay (a sleep/wake, not a new process).

Example::

    fleet = Fleet(10, DEFAULT_CONFIG, seed=1)
    res = fleet.run(multi_lora(qps=50, duration_s=60), RandomRouter(seed=1))
    print(res.summary.ttft_p90_s)
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from epick.abi import EndpointMetrics

from .config import DEFAULT_CONFIG, ReplicaConfig
from .metrics import MetricsPage, PageState
from .replica import EngineRequest, Replica
from .results import ReplicaStats, RequestRecord, Results, summarize
from .workload import SimRequest

__all__ = ["Fleet", "FleetView", "Router", "CompletionListener", "FinishListener",
           "KvEventListener", "CLOCK_ORIGIN"]

CLOCK_ORIGIN = 1_700_000_000.0
"""Unix time of virtual t = 0 (what the pages' LoRA timestamps count from)."""


@runtime_checkable
class Router(Protocol):
    """Picks the replica for each request."""

    def route(self, req: SimRequest, view: FleetView) -> int:
        """Return the index (0 ≤ i < len(view)) of the replica that serves ``req``.

        Called once per request at its arrival time; ``view`` is valid only during the
        call (it keeps changing as the run goes on)."""
        ...


@runtime_checkable
class CompletionListener(Protocol):
    """Optional second method of a router: told when each request finishes."""

    def on_complete(self, req: SimRequest, replica: int) -> None: ...


@runtime_checkable
class FinishListener(Protocol):
    """Optional instead of ``on_complete``: told when each request finishes, with what it
    measured (its TTFT, token counts); ``record`` is None for a request a restart aborted."""

    def on_finished(self, req: SimRequest, replica: int, record: RequestRecord | None) -> None: ...


#: ``listener(address, seq, batch)``: one replica's ``epick.kv.events.KVEventBatch``.
KvEventListener = Callable[[str, int, Any], None]


class FleetView:
    """The routing signals as last scraped; what a router may look at."""

    def __init__(self, addresses: tuple[str, ...], pages: list[MetricsPage]) -> None:
        self.addresses = addresses
        """``host:port`` of each replica (virtual: ``10.0.0.<i+1>:8000``)."""
        self.now = 0.0
        """Virtual time of the current event."""
        self._pages = pages
        self._states: list[PageState | None] = [None] * len(pages)
        self._scraped_at = [-math.inf] * len(pages)
        self._texts: list[bytes | None] = [None] * len(pages)
        self._parsed = [EndpointMetrics(address=a) for a in addresses]
        self._previous: list[EndpointMetrics | None] = [None] * len(pages)
        self.version = 0
        """Bumped by every scrape: a router may rebuild derived state only when it moves."""

    def __len__(self) -> int:
        return len(self.addresses)

    def scraped_at(self, i: int) -> float:
        """Virtual time of replica ``i``'s last scrape (-inf before the first)."""
        return self._scraped_at[i]

    def metrics_text(self, i: int) -> bytes:
        """Replica ``i``'s ``/metrics`` page as last scraped (vLLM's text format)."""
        text = self._texts[i]
        if text is None:
            state = self._states[i]
            text = self._pages[i].render(state) if state is not None else b""
            self._texts[i] = text
        return text

    def metrics(self, i: int) -> EndpointMetrics:
        """Replica ``i``'s last scrape as a router reads it: exactly what
        ``epick.pool.parse.parse_metrics(metrics_text(i), engine="vllm", url=...,
        previous=<the scrape before>, address=addresses[i])`` gives, built from the
        captured state without the text round trip."""
        return self._parsed[i]

    def all_metrics(self) -> tuple[EndpointMetrics, ...]:
        return tuple(self.metrics(i) for i in range(len(self.addresses)))

    def _scrape(self, i: int, now: float) -> None:
        # Capture now; render the text only when somebody reads it.
        state = self._pages[i].capture()
        previous = self._previous[i] = self._parsed[i]
        self._parsed[i] = self._pages[i].endpoint_metrics(state, self.addresses[i], previous)
        self._states[i] = state
        self._scraped_at[i] = now
        self._texts[i] = None
        self.version += 1


_STEP, _SCRAPE, _KV, _RESTART = 0, 1, 2, 3


class Fleet:
    """N replicas, identical unless ``configs`` gives each its own (a heterogeneous fleet:
    different speeds and KV sizes). :meth:`run` starts each run from empty replicas, so one
    Fleet can compare routers on the same workload; the same seed gives the same run."""

    def __init__(self, n_replicas: int, config: ReplicaConfig = DEFAULT_CONFIG, seed: int = 0,
                 *, configs: Sequence[ReplicaConfig] | None = None) -> None:
        if n_replicas < 1:
            raise ValueError(f"n_replicas must be >= 1, got {n_replicas}")
        if configs is not None and len(configs) != n_replicas:
            raise ValueError(f"configs has {len(configs)} entries for {n_replicas} replicas")
        self.n_replicas = n_replicas
        self.config = config
        self.configs: tuple[ReplicaConfig, ...] = (
            tuple(configs) if configs is not None else (config,) * n_replicas)
        """Replica i's config (all ``config`` unless ``configs`` was given)."""
        self.seed = seed
        self.addresses = tuple(f"10.0.0.{i + 1}:8000" for i in range(n_replicas))

    def run(
        self, workload: Iterable[SimRequest], router: Router, scrape_interval_s: float = 0.05,
        *, kv_events: KvEventListener | None = None, kv_event_delay_s: float = 0.0,
        restarts: Iterable[tuple[float, int]] = (),
    ) -> Results:
        """Serve ``workload`` (in arrival order) to completion, routed by ``router``.

        ``kv_events``, ``kv_event_delay_s`` and ``restarts``: see the module docstring.

        Raises
        ------
        ValueError
            The workload is out of order, the router returned something other than a
            replica index (the message names the router, the request and the value), or
            a restart names no replica or a negative time.
        epick.sim.replica.RequestRejected
            A request can never fit a replica (too long for ``max_model_len``/KV cache).
        """
        if scrape_interval_s <= 0:
            raise ValueError(f"scrape_interval_s must be positive, got {scrape_interval_s}")
        if kv_event_delay_s < 0:
            raise ValueError(f"kv_event_delay_s must be >= 0, got {kv_event_delay_s}")
        n = self.n_replicas
        restarts = sorted(restarts)
        for t, i in restarts:
            if not (isinstance(i, int) and 0 <= i < n) or not t >= 0:
                raise ValueError(f"restart ({t!r}, {i!r}): expected (time >= 0, replica in [0, {n}))")
        cpu0 = time.process_time()
        heap: list[tuple[float, int, int, int]] = []
        seq = 0
        kv_batches: dict[int, tuple[int, object]] = {}
        kv_seq = [0] * n

        def publisher(i: int):
            from epick.kv.events import KVEventBatch

            def publish(events: list) -> None:
                nonlocal seq
                seq += 1
                batch = KVEventBatch(ts=CLOCK_ORIGIN + view.now, events=events, data_parallel_rank=0)
                kv_batches[seq] = (kv_seq[i], batch)
                kv_seq[i] += 1
                heapq.heappush(heap, (view.now + kv_event_delay_s, _KV, seq, i))

            return publish

        replicas = [Replica(self.configs[i], report_tokens=False,
                            kv_events=publisher(i) if kv_events is not None else None)
                    for i in range(n)]
        pages = [MetricsPage(r, clock_origin=CLOCK_ORIGIN) for r in replicas]
        view = FleetView(self.addresses, pages)
        on_complete = getattr(router, "on_complete", None)
        on_finished = getattr(router, "on_finished", None)
        rng = random.Random(self.seed)

        next_step: list[float | None] = [None] * n
        for i in range(n):
            view._scrape(i, 0.0)
            heapq.heappush(heap, (rng.uniform(0, scrape_interval_s), _SCRAPE, i, i))
        for k, (t, i) in enumerate(restarts):
            heapq.heappush(heap, (t, _RESTART, k, i))

        def reschedule(i: int) -> None:
            nonlocal seq
            t = replicas[i].next_event_time()
            if t != next_step[i]:
                next_step[i] = t
                if t is not None:
                    seq += 1
                    heapq.heappush(heap, (t, _STEP, seq, i))

        records: list[RequestRecord | None] = []
        served = [0] * n
        busy = 0  # requests in flight across the fleet

        def finish(i: int, req: EngineRequest) -> None:
            nonlocal busy
            busy -= 1
            idx, sreq = req.handle  # type: ignore[misc]
            assert req.first_token_at is not None and req.finished_at is not None
            records[idx] = RequestRecord(
                request_id=sreq.request_id, group=sreq.group, adapter=sreq.adapter,
                replica=i, arrival_s=sreq.arrival_s,
                ttft_s=req.first_token_at - sreq.arrival_s,
                e2e_s=req.finished_at - sreq.arrival_s,
                prompt_tokens=req.prompt_tokens, output_tokens=req.output_tokens,
                cached_tokens=req.cached_tokens, adapter_loads=req.adapter_loads,
                preemptions=req.preemptions,
            )
            if on_finished is not None:
                on_finished(sreq, i, records[idx])
            elif on_complete is not None:
                on_complete(sreq, i)

        def dispatch(sreq: SimRequest, idx: int, t: float) -> None:
            """Route ``sreq`` (record slot ``idx``) at ``t`` and submit it."""
            nonlocal busy
            view.now = t
            i = router.route(sreq, view)
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
                raise ValueError(
                    f"router {type(router).__name__} returned {i!r} for request "
                    f"{sreq.request_id!r}; expected an int in [0, {n})"
                )
            replicas[i].submit(
                sreq.request_id, sreq.prompt, sreq.max_tokens, t,
                adapter=sreq.adapter, cache_salt=sreq.cache_salt, handle=(idx, sreq),
            )
            served[i] += 1
            busy += 1
            reschedule(i)

        def restart(i: int, t: float) -> None:
            nonlocal busy
            aborted = replicas[i].sleep(1)
            replicas[i].wake_up()
            reschedule(i)
            for req in aborted:
                busy -= 1
                idx, sreq = req.handle  # type: ignore[misc]
                if on_finished is not None:
                    on_finished(sreq, i, None)  # the router's request ended (failed)
                elif on_complete is not None:
                    on_complete(sreq, i)
                dispatch(sreq, idx, t)  # the client retries

        def run_until(t_limit: float) -> None:
            """Process every step and scrape event up to and including ``t_limit``."""
            while heap and heap[0][0] <= t_limit:
                t, kind, key, i = heapq.heappop(heap)
                view.now = t
                if kind == _STEP:
                    if next_step[i] != t:
                        continue  # superseded
                    next_step[i] = None
                    out = replicas[i].advance(t)
                    for req in out.finished:
                        finish(i, req)
                    reschedule(i)
                elif kind == _SCRAPE:
                    view._scrape(i, t)
                    if busy or pending_arrivals:
                        heapq.heappush(heap, (t + scrape_interval_s, _SCRAPE, i, i))
                elif kind == _KV:
                    kv_seqno, batch = kv_batches.pop(key)
                    kv_events(self.addresses[i], kv_seqno, batch)  # type: ignore[misc]
                else:
                    restart(i, t)

        pending_arrivals = True
        last_arrival = -math.inf
        for sreq in workload:
            t = sreq.arrival_s
            if t < last_arrival:
                raise ValueError(
                    f"workload is not in arrival order: {sreq.request_id!r} at {t} "
                    f"after a request at {last_arrival}"
                )
            last_arrival = t
            run_until(t)
            records.append(None)
            dispatch(sreq, len(records) - 1, t)
        pending_arrivals = False
        # Drain: scrapes keep going while requests are in flight, so listeners and any
        # late reader still see fresh pages; the loop ends when the fleet is idle.
        while busy:
            if not heap:
                raise RuntimeError(f"{busy} requests in flight but no replica has work (sim bug)")
            run_until(heap[0][0])

        done = tuple(r for r in records if r is not None)
        stats = tuple(
            ReplicaStats(
                address=self.addresses[i], requests=served[i],
                adapter_loads=replicas[i].lora.loads,
                adapter_disk_loads=replicas[i].lora.disk_loads,
                preemptions=replicas[i].preemptions, steps=replicas[i].steps,
                kv_evictions=replicas[i].kv.evictions,
            )
            for i in range(n)
        )
        return Results(
            records=done, summary=summarize(done), replicas=stats,
            cpu_s=time.process_time() - cpu0,
        )
