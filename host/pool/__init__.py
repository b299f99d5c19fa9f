"""Endpoint discovery, metric scraping and the published pool view.

    from epick.pool import EndpointSpec, Pool

    pool = Pool([EndpointSpec(address="10.0.0.7:8000")])
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)      # returns after the first scrape round
        pool.view                     # epick.interfaces.PoolView

Modules: ``spec`` (EndpointSpec), ``parse`` (a /metrics page -> EndpointMetrics),
``pool`` (the scrape loops and the published view), ``reader`` (the seam a pool reads
through, given to it: ``Reader``, ``reader_for``), ``fetch`` (``HttpReader``: aiohttp, the
default), ``worker`` (``ScrapeWorker``: the same reads in a child process), ``errors``
(ScrapeError), ``sources`` (endpoint sources beside the static list: the registry
and the runner), ``dns`` (the DNS source), ``k8s`` (the Kubernetes InferencePool source;
``k8s_objects`` reads its objects).
"""

from epick.pool import dns as _dns  # noqa: F401  (registers kind = "dns")
from epick.pool import k8s as _k8s  # noqa: F401  (registers kind = "inference-pool")
from epick.pool.errors import SCRAPE_ERROR_KINDS, ScrapeError
from epick.pool.parse import ENGINE_METRICS, parse_metrics
from epick.pool.pool import MAX_BACKOFF_MS, EndpointStatus, Pool
from epick.pool.reader import SCRAPE_IN, Reader, reader_for
from epick.pool.sources import EndpointTemplate, SourceConfig, Sources, kinds
from epick.pool.spec import ENGINES, EndpointSpec

__all__ = [
    "EndpointSpec",
    "ENGINES",
    "Pool",
    "Reader",
    "reader_for",
    "SCRAPE_IN",
    "EndpointStatus",
    "MAX_BACKOFF_MS",
    "parse_metrics",
    "ENGINE_METRICS",
    "ScrapeError",
    "SCRAPE_ERROR_KINDS",
    "SourceConfig",
    "EndpointTemplate",
    "Sources",
    "kinds",
]
