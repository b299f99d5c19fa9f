"""epick.sim — a simulated vLLM fleet, faithful enough that routing quality shows.

One replica model (:class:`Replica`: continuous batching, paged KV cache with automatic
prefix caching and preemption, LoRA slots) under two drivers:

* virtual time — :class:`Fleet` runs a workload through a :class:`Router` in a
  discrete-event loop (minutes of traffic in seconds of CPU) and returns
  :class:`Results`;
* real time — :func:`serve_fleet` puts N replicas behind real HTTP servers (vLLM's
  ``/metrics`` and OpenAI-compatible completions); ``python -m epick.sim serve``.

Calibration constants and their sources: :class:`ReplicaConfig` and host/sim/README.md.
This package imports nothing from the epick host except :mod:`epick.abi`.
"""

from .config import DEFAULT_CONFIG, ReplicaConfig, load_config
from .fleet import CLOCK_ORIGIN, CompletionListener, Fleet, FleetView, Router
from .metrics import MetricsPage, PageState
from .replica import EngineRequest, Replica, RequestRejected
from .results import ReplicaStats, RequestRecord, Results, Summary
from .routers import LeastQueueRouter, RandomRouter, RoundRobinRouter
from .server import REPLICA_HEADER, FleetServer, serve_fleet
from .workload import SimRequest, adapter_names, multi_lora, shared_prefix, zero_hit

__all__ = [
    "DEFAULT_CONFIG", "ReplicaConfig", "load_config",
    "CLOCK_ORIGIN", "CompletionListener", "Fleet", "FleetView", "Router",
    "MetricsPage", "PageState",
    "EngineRequest", "Replica", "RequestRejected",
    "ReplicaStats", "RequestRecord", "Results", "Summary",
    "LeastQueueRouter", "RandomRouter", "RoundRobinRouter",
    "REPLICA_HEADER", "FleetServer", "serve_fleet",
    "SimRequest", "adapter_names", "multi_lora", "shared_prefix", "zero_hit",
]
