"""Recording real decision logs for the tests (imported by conftest and the CLI tests).

:func:`record` runs the virtual-time simulated fleet (host/sim/) through epick's real
scheduler and WASM policies with a :class:`DecisionLog` attached, so a log holds what a
live service would write: changing snapshots, LoRA and shared-prefix traffic, and a
completion for every request (post_response hooks), interleaved as they happened.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from epick.bench.quality import DEFAULT_WEIGHTS, EpickRouter, wasm_set
from epick.decisions import DecisionLog


def workload(seconds: float = 8.0, qps: float = 20.0):
    from epick.sim import workload as wl

    reqs = (wl.multi_lora(qps=qps, duration_s=seconds, seed=1, adapters=15,
                          split=(0.6, 0.3, 0.1))
            + wl.shared_prefix(qps=qps, duration_s=seconds, seed=2))
    reqs.sort(key=lambda r: r.arrival_s)
    return [msgspec.structs.replace(r, request_id=f"r{i}") for i, r in enumerate(reqs)]


def record(runtime, path: Path, *, weights=None, seconds: float = 5.0, params=None, **log_kw):
    """Run the fleet with a log at ``path``; return (the router, the closed log).
    ``params``: policy name -> its params."""
    from epick.sim.config import DEFAULT_CONFIG
    from epick.sim.fleet import Fleet

    router = EpickRouter(wasm_set(runtime, weights or DEFAULT_WEIGHTS, params), seed=1)
    log = DecisionLog(path, **log_kw).attach(router.scheduler).start()
    try:
        fleet = Fleet(8, msgspec.structs.replace(DEFAULT_CONFIG, max_loras=3), seed=1)
        fleet.run(workload(seconds), router, scrape_interval_s=0.05)
    finally:
        log.close()
    return router, log
