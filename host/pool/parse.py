"""Turn one model server's ``/metrics`` page into what the pool knows of the endpoint.

:func:`parse_page` gives a :class:`ScrapedPage`: the :class:`epick.abi.EndpointMetrics`
policies see, plus host-only facts (sleeping, served model names, the LoRA format seen).
:func:`parse_metrics` is the same, returning only the metrics.

The text is parsed by prometheus_client's parser; this module picks the samples
(what real engines emit: the captured pages in tests/pool/fixtures/) and checks their values.

Value rules (decided here, once):

- Queue and running counts must be finite and >= 0; a negative or NaN count is an
  error, not clamped, because it means a broken exporter, and a clamped 0 would attract
  traffic to it. Fractional counts are rounded to the nearest integer.
- KV-cache use must be finite and in [0, 1]. Up to 1e-6 above 1 (float rounding) is
  clamped to 1; anything beyond that is an error (a percentage exporter, most likely).
- Several series of one metric: vLLM data-parallel ``engine="0"``, ``"1"``… and SGLang
  ``dp_rank`` are summed (counts) or maxed (KV use: the busiest engine decides whether a
  request fits). SGLang with ``--enable-priority-scheduling`` writes the total under
  ``priority=""`` *and* one series per priority: when a family has ``priority=""``
  series, only those count (summing all would double the queue).
- A sample line the parser refuses is skipped and named in ``ScrapedPage.skipped``; the
  rest of the page still counts. A required metric (queue, running, KV) that is missing
  or holds an impossible value fails the whole page (:class:`ScrapeError`); an optional
  one (LoRA, geometry, sleep, deferred) with a bad value is skipped and named.
- ``vllm:lora_requests_info`` (value = Unix time of the record; the largest is current;
  vLLM never drops old label sets, so a long-lived page carries hundreds). Only the
  newest series naming an adapter (with none, the newest) is handed to the parser; for the others
  only the value is read (a string split), so old series cost ~1 µs each:

  * **current vLLM** (0.1x+, seen on 0.32): every adapter with an in-flight request is in
    BOTH ``running_lora_adapters`` and ``waiting_lora_adapters`` (equal lists), and a
    request deferred for want of a slot is in neither. Read as: ``running_adapters`` =
    the newest non-empty list (the adapters resident — an idle server still holds the
    adapters it last ran, upstream PR #423), ``waiting_adapters`` = () (the engine does
    not name them), ``deferred`` = ``num_requests_waiting_by_reason{reason="deferred"}``.
  * **older vLLM**: disjoint running / waiting lists, read as they are.

  A series naming no adapter (both adapter labels empty or absent) is skipped, as seed 002
  (upstream PR #423) does: the newest series that names one decides; with none on the
  page, the previous scrape's sets and ``max_lora`` stand (an idle server still holds the
  adapters it last ran). A series without a ``max_lora`` label keeps the previous value.
  A malformed series (say ``max_lora="four"``) is skipped and named, and the previous
  sets and ``max_lora`` stand too: a broken line must not make a LoRA server look LoRA-less.

  The format is decided from the newest non-empty series: "older" if its running and
  waiting sets differ, else "current" (an older server whose only adapter both runs and
  waits reads as current: the same resident set, with nothing named waiting). ``max_lora`` is a server constant, read from the
  series the sets come from (from the newest series only while nothing is known yet). A LoRA-enabled vLLM that has served no adapter yet declares the family
  (``# TYPE``) with no sample: ``max_lora`` is then read as 1 — the lower bound vLLM
  guarantees (``--max-loras`` >= 1) — or the previous scrape's value, so a fresh replica
  has room instead of looking LoRA-less.
- Geometry: vLLM ``cache_config_info{block_size, num_gpu_blocks}`` labels; SGLang
  ``sglang:page_size`` / ``sglang:num_pages``; TensorRT-LLM
  ``trtllm_kv_cache_tokens_per_block`` / ``trtllm_kv_cache_max_blocks``. Absent, empty
  or ``None`` (vLLM before the KV cache is profiled) means 0 = unknown.
- ``vllm:engine_sleep_state{sleep_state="awake"}`` 0 means the engine sleeps: it shows
  queue 0 and KV 0, so it would look like the best target; the pool keeps it out.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from epick.abi import EndpointMetrics
from epick.pool.errors import ScrapeError

__all__ = [
    "parse_metrics",
    "parse_page",
    "ScrapedPage",
    "EngineMetricNames",
    "ENGINE_METRICS",
]

# Float rounding can put a "full" cache a hair above 1.
_KV_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    """The sample names one engine exports; ``kv`` lists alternatives, first present wins."""

    waiting: str
    running: str
    kv: tuple[str, ...]
    lora_info: str | None = None
    cache_config_info: str | None = None
    waiting_by_reason: str | None = None
    sleep_state: str | None = None
    block_size: str | None = None
    """A gauge holding tokens per KV block (engines without ``cache_config_info``)."""
    num_blocks: str | None = None
    """A gauge holding the number of KV blocks."""
    lora_slots: str | None = None
    """A gauge holding the adapter slot count (SGLang), read as ``max_lora``."""

    def all(self) -> tuple[str, ...]:
        optional = (
            self.cache_config_info, self.waiting_by_reason, self.sleep_state,
            self.block_size, self.num_blocks, self.lora_slots,
        )
        return (self.waiting, self.running, *self.kv, *(n for n in optional if n))


ENGINE_METRICS: dict[str, EngineMetricNames] = {
    "vllm": EngineMetricNames(
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        # Newer vLLM renamed gpu_cache_usage_perc; prefer the new name when both exist.
        kv=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora_info="vllm:lora_requests_info",
        cache_config_info="vllm:cache_config_info",
        waiting_by_reason="vllm:num_requests_waiting_by_reason",
        sleep_state="vllm:engine_sleep_state",
    ),
    "sglang": EngineMetricNames(
        waiting="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv=("sglang:token_usage",),
        block_size="sglang:page_size",
        num_blocks="sglang:num_pages",
        lora_slots="sglang:lora_pool_slots_total",
    ),
    "trtllm": EngineMetricNames(
        waiting="trtllm_num_requests_waiting",
        running="trtllm_num_requests_running",
        kv=("trtllm_kv_cache_utilization",),
        block_size="trtllm_kv_cache_tokens_per_block",
        num_blocks="trtllm_kv_cache_max_blocks",
    ),
}

_RUNNING = "running_lora_adapters"
_WAITING = "waiting_lora_adapters"
_EMPTY_RUNNING = 'running_lora_adapters=""'
_EMPTY_WAITING = 'waiting_lora_adapters=""'


@dataclass(frozen=True, slots=True)
class ScrapedPage:
    """One page, read: the metrics policies see and what only the host uses."""

    metrics: EndpointMetrics
    models: tuple[str, ...] = ()
    """``model_name`` label values on the queue/running series (served model names)."""
    sleeping: bool = False
    """The engine reports it is asleep (vLLM sleep mode): not a candidate."""
    lora_format: str = "none"
    """``none`` (no LoRA family), ``declared`` (LoRA on, no series yet), ``idle`` (only
    series naming no adapter), ``kept`` (the series was malformed: the last values stand),
    ``current`` (equal running/waiting lists) or ``older`` (disjoint)."""
    lora_series: int = 0
    """How many ``lora_requests_info`` series the page carries (it only grows)."""
    skipped: tuple[str, ...] = field(default=())
    """Sample lines or optional metrics left out, each with the reason."""


def parse_metrics(
    text: str,
    *,
    engine: str,
    url: str,
    previous: EndpointMetrics | None,
    address: str | None = None,
) -> EndpointMetrics:
    """Parse a Prometheus text page; only the metrics (see :func:`parse_page`)."""
    return parse_page(text, engine=engine, url=url, previous=previous, address=address).metrics


def parse_page(
    text: str,
    *,
    engine: str,
    url: str,
    previous: EndpointMetrics | None,
    address: str | None = None,
) -> ScrapedPage:
    """Parse a Prometheus text page from ``url`` into what the pool knows of the endpoint.

    Parameters
    ----------
    text:
        The page body.
    engine:
        ``vllm``, ``sglang`` or ``trtllm``: which names to read.
    url:
        Where the page came from; only used in error messages and for the default address.
    previous:
        The endpoint's last good metrics, or ``None``: supplies the LoRA adapter sets and
        ``max_lora`` when the page's series name no adapter or are malformed, and
        ``max_lora`` for a LoRA-enabled page with no series yet.
    address:
        The endpoint's ``host:port``; defaults to ``previous.address``, else the URL's.

    Raises
    ------
    ScrapeError
        The page is not Prometheus text (``kind="parse"``), lacks the queue, running or KV
        metric (``"missing-metric"``) or holds a value outside its domain
        (``"invalid-value"``); the message names ``url`` and the metric.
    ValueError
        ``engine`` is unknown (a programming error: specs are validated).
    """
    names = ENGINE_METRICS.get(engine)
    if names is None:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINE_METRICS)}")
    if address is None:
        address = previous.address if previous is not None else urlsplit(url).netloc
    if "\x00" in text:  # binary junk; the parser's own message for it is empty
        raise ScrapeError(url, "not Prometheus text format: NUL byte in page", kind="parse")
    lines, lora_lines = _relevant_lines(text, names.all(), names.lora_info)
    skipped: list[str] = []
    samples = _samples_by_name(lines, url, skipped)

    waiting = _count(samples, names.waiting, url)
    running = _count(samples, names.running, url)
    kv = _kv_usage(samples, names.kv, url)
    models = _models(samples, names)

    lora = _Lora()
    if names.lora_info is not None:
        declared = f"# TYPE {names.lora_info} " in text
        try:
            lora = _lora(lora_lines, names.lora_info, url, previous, declared, skipped)
        except ScrapeError as err:
            # The series is skipped and named; what the endpoint last had stands (seed 002).
            skipped.append(f"{names.lora_info}: {err.reason}")
            lora = _kept(previous, fmt="kept")
    elif names.lora_slots is not None and names.lora_slots in samples:
        lora.max_lora = _optional_int(samples, names.lora_slots, skipped)

    block_size = num_blocks = 0
    if names.cache_config_info is not None and names.cache_config_info in samples:
        # One series per engine; dp ranks share the config, so the last is as good as any.
        labels = samples[names.cache_config_info][-1][0]
        try:
            block_size = _int_label(labels, "block_size", names.cache_config_info, url)
            num_blocks = _int_label(labels, "num_gpu_blocks", names.cache_config_info, url)
        except ScrapeError as err:
            skipped.append(f"{names.cache_config_info}: {err.reason}")
            block_size = num_blocks = 0
    if names.block_size is not None:
        block_size = _optional_int(samples, names.block_size, skipped)
    if names.num_blocks is not None:
        num_blocks = _optional_int(samples, names.num_blocks, skipped, total=True)

    deferred = 0
    if names.waiting_by_reason is not None:
        for labels, value in samples.get(names.waiting_by_reason, ()):
            if labels.get("reason") == "deferred" and math.isfinite(value) and value >= 0:
                deferred += round(value)
    sleeping = False
    if names.sleep_state is not None and names.sleep_state in samples:
        awake = [v for labels, v in samples[names.sleep_state] if labels.get("sleep_state") == "awake"]
        sleeping = bool(awake) and all(v == 0 for v in awake)

    metrics = EndpointMetrics(
        address=address,
        waiting=waiting,
        running=running,
        kv_usage=kv,
        running_adapters=lora.running,
        waiting_adapters=lora.waiting,
        max_lora=lora.max_lora,
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        deferred=deferred,
    )
    return ScrapedPage(
        metrics=metrics,
        models=models,
        sleeping=sleeping,
        lora_format=lora.format,
        lora_series=len(lora_lines),
        skipped=tuple(skipped),
    )


_Series = list[tuple[dict[str, str], float]]


def _relevant_lines(
    text: str, prefixes: tuple[str, ...], lora_name: str | None
) -> tuple[list[str], list[str]]:
    """The sample lines of the metrics we read, and the LoRA info lines apart.

    A real vLLM page has ~600 lines, mostly histograms we never look at; parsing all of
    them costs ~6 ms a page against ~0.2 ms for these few. Comment lines go too: samples
    are read by name, not family type. This is line selection, not parsing: every kept
    line goes to the real parser (the LoRA lines after :func:`_lora` picks the newest).
    """
    keep: list[str] = []
    lora: list[str] = []
    for line in text.splitlines():
        if lora_name is not None and line.startswith(lora_name):
            lora.append(line)
        elif line.startswith(prefixes):
            keep.append(line)
    return keep, lora


@functools.lru_cache(maxsize=8192)
def _parse_line(line: str) -> tuple[tuple[str, dict[str, str], float], ...]:
    """One sample line through prometheus_client's parser, remembered.

    Most of what we read is the same from one scrape to the next (``cache_config_info``
    with its ~20 labels, the LoRA info line, idle counts) and the label parser is most of
    a page's cost: a real busy vLLM page took 362 µs to parse without this and 102 µs
    with it (same process, best of 5). The labels dicts are shared: read, never mutate.
    """
    return tuple(
        (sample.name, sample.labels, float(sample.value))
        for family in text_string_to_metric_families(line)
        for sample in family.samples
    )


def _samples_by_name(lines: list[str], url: str, skipped: list[str]) -> dict[str, _Series]:
    """Sample name -> [(labels, value)], in page order; bad lines are skipped and named."""
    out: dict[str, _Series] = {}
    first_error: str | None = None
    for line in lines:
        try:
            parsed = _parse_line(line)
        except Exception as exc:  # the parser raises bare ValueError/IndexError/TypeError
            detail = str(exc).strip() or type(exc).__name__
            first_error = first_error or detail
            skipped.append(f"line {line[:120]!r}: {detail}")
            continue
        for name, labels, value in parsed:
            out.setdefault(name, []).append((labels, value))
    if not out and first_error is not None:
        raise ScrapeError(url, f"not Prometheus text format: {first_error}", kind="parse")
    return out


def _series(samples: dict[str, _Series], name: str, url: str) -> _Series:
    series = samples.get(name)
    if not series:
        raise ScrapeError(url, f"missing {name}{_hint(samples)}", kind="missing-metric")
    return _totals(series)


def _totals(series: _Series) -> _Series:
    """The series that add up to the total: only ``priority=""`` ones when present."""
    if any("priority" in labels for labels, _ in series):
        total = [(labels, v) for labels, v in series if labels.get("priority", "") == ""]
        if total:
            return total
    return series


def _hint(samples: dict[str, _Series]) -> str:
    # Nothing we know at all: likely the wrong URL, engine or an error page.
    return "" if samples else " (no known metric on the page: wrong engine or URL?)"


def _count(samples: dict[str, _Series], name: str, url: str) -> int:
    total = 0.0
    for _, value in _series(samples, name, url):
        if not math.isfinite(value) or value < 0:
            raise ScrapeError(
                url, f"{name} is {value!r}; expected a count >= 0", kind="invalid-value"
            )
        total += value
    return round(total)


def _kv_usage(samples: dict[str, _Series], names: Iterable[str], url: str) -> float:
    names = tuple(names)
    name = next((n for n in names if samples.get(n)), None)
    if name is None:
        raise ScrapeError(
            url, f"missing {' or '.join(names)}{_hint(samples)}", kind="missing-metric"
        )
    worst = 0.0
    for _, value in _totals(samples[name]):
        if not math.isfinite(value) or not 0.0 <= value <= 1.0 + _KV_TOLERANCE:
            raise ScrapeError(
                url, f"{name} is {value!r}; expected a fraction in [0, 1]", kind="invalid-value"
            )
        worst = max(worst, value)
    return min(worst, 1.0)


def _models(samples: dict[str, _Series], names: EngineMetricNames) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for name in (names.running, names.waiting):
        for labels, _ in samples.get(name, ()):
            model = labels.get("model_name", "")
            if model:
                seen[model] = None
    return tuple(seen)


def _optional_int(
    samples: dict[str, _Series], name: str, skipped: list[str], *, total: bool = False
) -> int:
    """A gauge read as an integer >= 0 (summed over dp ranks when ``total``); 0 if absent."""
    series = samples.get(name)
    if not series:
        return 0
    values = [v for _, v in _totals(series)]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        skipped.append(f"{name}: {values!r} is not a count >= 0")
        return 0
    return round(sum(values) if total else max(values))


def _split(value: str) -> tuple[str, ...]:
    return tuple(part for part in (p.strip() for p in value.split(",")) if part)


@dataclass(slots=True)
class _Lora:
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_lora: int = 0
    format: str = "none"


def _line_value(line: str) -> float:
    """The sample value of a ``name{labels} value [timestamp]`` line; NaN if unreadable."""
    close = line.rfind("}")
    rest = line[close + 1 :].split() if close >= 0 else line.split()[1:]
    try:
        return float(rest[0])
    except (IndexError, ValueError):
        return math.nan


def _adapterless(line: str) -> bool:
    """A series naming no adapter: both adapter labels empty or absent (seed 002 skips it)."""
    return (_EMPTY_RUNNING in line or f'{_RUNNING}="' not in line) and (
        _EMPTY_WAITING in line or f'{_WAITING}="' not in line
    )


def _kept(previous: EndpointMetrics | None, max_lora: int = 0, fmt: str = "idle") -> _Lora:
    """What the endpoint last had (seed 002: an idle server still holds what it last ran)."""
    if previous is None:
        return _Lora(max_lora=max_lora, format=fmt)
    return _Lora(
        previous.running_adapters, previous.waiting_adapters,
        previous.max_lora if previous.max_lora > 0 else max_lora, fmt,
    )


def _lora(
    lines: list[str],
    name: str,
    url: str,
    previous: EndpointMetrics | None,
    declared: bool,
    skipped: list[str],
) -> _Lora:
    if not lines:
        if not declared:
            return _Lora()
        # LoRA is on but nothing was served yet: at least one slot, all free.
        keep = previous.max_lora if previous is not None and previous.max_lora > 0 else 1
        return _Lora(max_lora=keep, format="declared")
    # One pass, no parsing: the value (a timestamp) of each line, and whether it is empty.
    newest: tuple[float, str] | None = None
    newest_busy: tuple[float, str] | None = None
    for line in lines:
        ts = _line_value(line)
        if ts != ts:  # NaN cannot be ordered; never "the newest"
            continue
        if newest is None or ts > newest[0]:
            newest = (ts, line)
        if (newest_busy is None or ts > newest_busy[0]) and not _adapterless(line):
            newest_busy = (ts, line)
    if newest is None:
        raise ScrapeError(url, f"{name} has no series with a timestamp value", kind="invalid-value")
    if newest_busy is None:
        # Only adapter-less series: nothing has run yet, or the server went idle. Seed 002
        # skips such series, so the last sets and max_lora stand; with nothing known yet,
        # the newest series' max_lora still says how many slots there are.
        if previous is not None and previous.max_lora > 0:
            return _kept(previous)
        return _kept(previous, _int_label(_labels_of(newest[1], url, skipped), "max_lora", name, url))
    busy_labels = _labels_of(newest_busy[1], url, skipped)
    max_lora = _int_label(busy_labels, "max_lora", name, url)
    if max_lora == 0 and previous is not None:
        max_lora = previous.max_lora  # no max_lora label on this series: the last value stands
    running = _split(busy_labels.get(_RUNNING, ""))
    # Current vLLM writes the same list twice; older vLLM, disjoint running/waiting sets.
    older = set(running) != set(_split(busy_labels.get(_WAITING, "")))
    if older:
        return _Lora(running, _split(busy_labels.get(_WAITING, "")), max_lora, "older")
    return _Lora(running, (), max_lora, "current")


def _labels_of(line: str, url: str, skipped: list[str]) -> dict[str, str]:
    try:
        for _, labels, _ in _parse_line(line):
            return labels
    except Exception as exc:
        raise ScrapeError(url, f"not Prometheus text format: {exc}", kind="parse") from exc
    return {}


def _int_label(labels: dict[str, str], label: str, name: str, url: str) -> int:
    raw = labels.get(label, "").strip()
    if raw in ("", "None"):
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ScrapeError(
            url,
            f'{name}{{{label}="{raw}"}} is not an integer >= 0',
            kind="invalid-value",
        )
    return value
