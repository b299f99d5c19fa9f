"""A replica's ``/metrics`` page, rendered as vLLM v1 renders it — and read back.

:class:`MetricsPage` keeps one ``prometheus_client`` registry per replica with vLLM's
metric names, HELP texts and labels (``vllm/v1/metrics/loggers.py``):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` — gauges labelled ``engine="0"`` and ``model_name``;
* ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` —
  present when LoRA is enabled; each record sets the series of the current label values to
  the current Unix time (``set_to_current_time``), so older label combinations stay on the
  page with older timestamps and the largest value is the current one. Adapter names are
  comma-joined without spaces, in order of first appearance. Deviation: real vLLM never
  drops an old combination; the sim keeps the :data:`LORA_SERIES_KEPT` most recent, so a
  long run's page stays small (a reader that takes the largest value sees no difference).
* ``vllm:cache_config_info{block_size, num_gpu_blocks, ...}`` — an info gauge set to 1.

Of the counters only ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
(prompt tokens looked up / found in the prefix cache) are rendered, for dashboards such as
``epick demo``'s hit rate; histograms are left out (they cost render and parse time on
every scrape and no routing signal reads them); the drivers' results carry those numbers.

The page's clock is ``clock_origin + replica time``. The LoRA series carries the time of
the replica's last engine step (vLLM records its scheduler stats once per step) and is
recorded once at startup with empty adapter labels.

:func:`parse_metrics` reads such a page (with ``prometheus_client``'s parser) into the
:class:`epick.abi.EndpointMetrics` a router would see.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from epick.abi import EndpointMetrics

from .config import ReplicaConfig
from .replica import Replica

__all__ = ["MetricsPage", "PageState", "parse_metrics", "LORA_SERIES_KEPT", "CONTENT_TYPE"]

LORA_SERIES_KEPT = 16
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PageState(NamedTuple):
    """What one scrape saw: everything the page shows, captured cheaply."""

    running: int
    waiting: int
    kv_usage: float
    lora_series: tuple[tuple[str, str, float], ...]
    """(running_lora_adapters, waiting_lora_adapters, Unix time) per series, oldest first."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache so far (``vllm:prefix_cache_queries``)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (``vllm:prefix_cache_hits``)."""


class _PrefixCounters:
    """Renders the page's two prefix-cache counters from the captured state."""

    def __init__(self, page: MetricsPage, labels: list[str], values: tuple[str, ...]):
        self._page, self._labels, self._values = page, labels, list(values)

    def describe(self):
        return []

    def collect(self):
        queries, hits = self._page._counts
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
             "queried tokens.", queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
             "tokens.", hits),
        ):
            fam = CounterMetricFamily(name, doc, labels=self._labels)
            fam.add_metric(self._values, value)
            yield fam


class MetricsPage:
    """One replica's page. :meth:`capture` is cheap (a tuple); :meth:`render` formats a
    captured state with ``prometheus_client`` (about 0.1 ms), so a driver can capture at
    every scrape and render only the captures someone reads."""

    def __init__(self, replica: Replica, *, clock_origin: float, engine: str = "0") -> None:
        cfg: ReplicaConfig = replica.config
        self._replica = replica
        self._origin = clock_origin
        reg = self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name", "engine"]
        values = (cfg.model, engine)
        self._running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            labels, registry=reg).labels(*values)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            labels, registry=reg).labels(*values)
        self._kv = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            labels, registry=reg).labels(*values)
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": engine,
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "prefix_caching_hash_algo": "sha256",
        }
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            list(info), registry=reg).labels(**info).set(1)
        self._max_lora = str(cfg.max_loras)
        self._lora: Gauge | None = None
        # (running, waiting) -> Unix time of its last record, least recent first.
        self._history: OrderedDict[tuple[str, str], float] = OrderedDict()
        if cfg.max_loras > 0:
            self._lora = Gauge(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
            self._history[("", "")] = clock_origin  # recorded once at startup
        self._rendered: PageState | None = None
        self._text = b""
        self._counts = (0, 0)  # (prefix queries, prefix hits) of the state being rendered
        reg.register(_PrefixCounters(self, labels, values))

    def record(self) -> None:
        """Record the LoRA series as vLLM does after an engine step: the current
        (running, waiting) adapter labels get the time of the replica's last step.

        The HTTP driver calls this after every step; the virtual-time driver only at
        scrapes (where it is cheaper and what a reader sees differs only in which
        short-lived label combinations are on the page)."""
        if self._lora is None:
            return
        r = self._replica
        hist = self._history
        combo = (",".join(r.running_adapters()), ",".join(r.waiting_adapters()))
        at = self._origin + r.last_step_at
        if hist.get(combo, -1.0) < at:
            hist[combo] = at
            hist.move_to_end(combo)
            while len(hist) > LORA_SERIES_KEPT:
                hist.popitem(last=False)

    def capture(self) -> PageState:
        """The replica's state now (the LoRA series recorded first)."""
        r = self._replica
        self.record()
        series = tuple((run, wait, t) for (run, wait), t in self._history.items())
        return PageState(r.num_running, r.num_waiting, r.kv.usage, series,
                         r.prompt_tokens_queried, r.prompt_tokens_cached)

    def render(self, state: PageState | None = None) -> bytes:
        """The page for ``state`` (default: a fresh :meth:`capture`)."""
        if state is None:
            state = self.capture()
        if state == self._rendered:
            return self._text
        self._counts = (state.prefix_queries, state.prefix_hits)
        self._running.set(state.running)
        self._waiting.set(state.waiting)
        self._kv.set(state.kv_usage)
        if self._lora is not None:
            self._lora.clear()
            for running, waiting, at in state.lora_series:
                self._lora.labels(self._max_lora, waiting, running).set(at)
        self._rendered = state
        self._text = generate_latest(self.registry)
        return self._text

    def endpoint_metrics(
        self, state: PageState, address: str, previous: EndpointMetrics | None = None
    ) -> EndpointMetrics:
        """What :func:`parse_metrics` returns for ``render(state)``, without the text
        round trip (~0.2 ms saved per read; tests check the two agree)."""
        cfg = self._replica.config
        running: tuple[str, ...] = ()
        waiting: tuple[str, ...] = ()
        found = False
        best = -1.0
        for run, wait, at in state.lora_series:
            if (run or wait) and at > best:
                best, running, waiting, found = at, _names(run), _names(wait), True
        if not found and previous is not None:
            running, waiting = previous.running_adapters, previous.waiting_adapters
        return EndpointMetrics(
            address=address, waiting=state.waiting, running=state.running,
            kv_usage=state.kv_usage, running_adapters=running, waiting_adapters=waiting,
            max_lora=cfg.max_loras if self._lora is not None else 0,
            num_gpu_blocks=cfg.num_gpu_blocks, block_size=cfg.block_size,
        )


def _names(label: str) -> tuple[str, ...]:
    return tuple(n for n in (p.strip() for p in label.split(",")) if n)


def parse_metrics(
    text: str | bytes, address: str, previous: EndpointMetrics | None = None
) -> EndpointMetrics:
    """Read a vLLM page into what a router sees.

    LoRA rule (DESIGN.md): the ``lora_requests_info`` series with the largest value is
    current, skipping series whose adapter labels are both empty; when no such series
    exists the adapter sets of ``previous`` are kept (an idle server still holds its last
    adapters). ``max_lora`` comes from the newest series of any kind.

    Raises
    ------
    ValueError
        The text is not Prometheus exposition format (message names ``address``).
    """
    if isinstance(text, bytes):
        text = text.decode()
    fields: dict[str, object] = {}
    best = -1.0
    best_any = -1.0
    try:
        for fam in text_string_to_metric_families(text):
            name = fam.name
            for s in fam.samples:
                if name == "vllm:num_requests_waiting":
                    fields["waiting"] = int(s.value)
                elif name == "vllm:num_requests_running":
                    fields["running"] = int(s.value)
                elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                    fields["kv_usage"] = float(s.value)
                elif name == "vllm:lora_requests_info":
                    lab = s.labels
                    if s.value > best_any:
                        best_any = s.value
                        fields["max_lora"] = int(lab.get("max_lora", "0") or 0)
                    running = _names(lab.get("running_lora_adapters", ""))
                    waiting = _names(lab.get("waiting_lora_adapters", ""))
                    if (running or waiting) and s.value > best:
                        best = s.value
                        fields["running_adapters"] = running
                        fields["waiting_adapters"] = waiting
                elif name == "vllm:cache_config_info":
                    fields["block_size"] = int(s.labels.get("block_size", "0") or 0)
                    blocks = s.labels.get("num_gpu_blocks", "0")
                    fields["num_gpu_blocks"] = int(blocks) if blocks.isdigit() else 0
    except ValueError as exc:
        raise ValueError(f"{address}: not a Prometheus metrics page: {exc}") from None
    if best < 0 and previous is not None:
        fields["running_adapters"] = previous.running_adapters
        fields["waiting_adapters"] = previous.waiting_adapters
    return EndpointMetrics(address=address, **fields)  # type: ignore[arg-type]
