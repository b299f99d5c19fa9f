"""The config file: one versioned TOML document, decoded once, at the edge.

Every table is a frozen msgspec Struct that forbids unknown keys, so a typo is an error
that names the file, the path and the value, e.g.::

    epick.toml: Expected `float` <= 1.0 - at `$.admission.kv_threshold`

Cross-field rules live in ``__post_init__``; nothing downstream re-checks.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from epick.pool import EndpointSpec, kinds

#: One ``[[pool.sources]]`` table: any registered kind, chosen by its ``kind`` key.
SourceTable = Union[tuple(k.config for k in kinds().values())]  # noqa: UP007

__all__ = [
    "CONFIG_VERSION",
    "ConfigError",
    "Config",
    "ServerConfig",
    "PoolConfig",
    "PolicyConfig",
    "AdmissionConfig",
    "RuntimeConfig",
    "AdminConfig",
    "ExtProcConfig",
    "OpenAIConfig",
    "HttpConfig",
    "FlowControlConfig",
    "DecisionsConfig",
    "KvEventsConfig",
    "TracingConfig",
    "load",
    "loads",
    "resolve_module",
    "BUILTIN_POLICY_DIR",
]

CONFIG_VERSION = 1

#: Where the built-in policies (``module = "load"``) live: the package data of
#: ``epick.builtin`` (host/builtin/, written by `make policies`), in a checkout and in an
#: installed wheel alike. A folder on disk (pip installs wheels unpacked): the runtime and
#: the decision log read the modules by path.
BUILTIN_POLICY_DIR = Path(str(resources.files("epick.builtin")))

#: The environment variable that may carry the admin bearer token instead of the file.
ADMIN_TOKEN_ENV = "EPICK_ADMIN_TOKEN"

Address = Annotated[str, Meta(pattern=r"^\[?[A-Za-z0-9.:_-]*\]?:\d{1,5}$")]
#: An address, or "" to switch the listener off.
OptionalAddress = Annotated[str, Meta(pattern=r"^(\[?[A-Za-z0-9.:_-]*\]?:\d{1,5})?$")]
PositiveMs = Annotated[int, Meta(gt=0)]
Weight = Annotated[float, Meta(ge=0)]


class ConfigError(Exception):
    """The config file is unreadable or invalid. ``str()`` names the file and the path."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class _Table(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ServerConfig(_Table):
    listen: Address = "127.0.0.1:9002"
    fallbacks: Annotated[int, Meta(ge=0, le=64)] = 2
    """How many fallbacks a PickResponse carries after the primary."""
    metrics_listen: OptionalAddress = "127.0.0.1:9090"
    """Prometheus /metrics; empty disables it."""
    picker: Literal["max", "weighted-random"] = "max"
    """max: highest total, seeded random tie-break; weighted-random: P ∝ total."""
    work_conserving: bool = True
    """Never send a request to a replica with requests waiting while an eligible replica
    is idle (nothing running or waiting, nothing in flight from epick): the best idle one
    goes first instead (docs/design.md)."""
    decision_ttl_s: Annotated[float, Meta(gt=0)] = 600.0
    """How long a decision waits for its ReportCompletion before it is forgotten."""
    max_decisions: Annotated[int, Meta(gt=0)] = 100_000
    """Bound on remembered decisions (oldest forgotten first) so nothing leaks."""
    allow_pinning: bool = False
    """Let a request force its endpoint (``PickRequest.pin_endpoint``, the ext_proc header
    ``x-epick-pin-endpoint``). Off: such requests are refused, naming this setting."""
    session_header: Annotated[str, Meta(pattern=r"^[a-z0-9!#$%&'*+.^_`|~-]{1,128}$")] = (
        "x-session-id")
    """The request header that names a request's session (conversation) when
    ``PickRequest.session_id`` is empty; it reaches policies as ``Request.session_id``
    (the ``latency`` policy keeps a session on its endpoint until it saturates,
    docs/scoring.md). A lower-case HTTP header name: every front end passes header names
    in lower case."""
    loop_stall_warn_ms: Annotated[float, Meta(ge=0)] = 100.0
    """Log a warning naming what ran when the event loop is held longer than this (the
    lag itself is always measured: ``epick_event_loop_lag_seconds``); 0 = no warning."""
    workers: Annotated[int, Meta(ge=1, le=64)] = 1
    """Front-end worker processes for ``[ext_proc]`` and ``[http]`` (docs/performance.md).
    1: they are served by the service's own process, as the Pick API is. N > 1: N
    processes share their ports (SO_REUSEPORT) and do the per-request and per-chunk work;
    each hands only the decision to this process over a local socket, so policy state,
    in-flight counts and the decision log stay one whole. The gRPC Pick API stays here.
    Restarted when they die, stopped with the service."""
    frontend: Literal["python", "native", "auto"] = "auto"
    """Who serves ``[ext_proc]``: ``auto`` (the default) — ``native`` when the C++ worker is
    built (``make native``; ``EPICK_EXTPROC_BINARY``), else ``python`` (the wheel does not
    carry it), and ``python`` when ``[http]`` is on with ``workers`` > 1; said in one log
    line at start — or ``python`` (grpc.aio: in this process with 1 worker, in
    ``workers`` Python processes with more) or ``native``: ``workers`` processes of the C++
    worker ``epick-extproc`` (build it with ``make native``; docs/envoy.md), which hand
    each request's headers and body to this process to be read and decided by the same
    code, and do the per-chunk work (echo, TTFT, usage lines) outside Python. ``[http]``
    stays in this process with ``native``."""


class PoolConfig(_Table):
    scrape_interval_ms: PositiveMs = 50
    stale_after_ms: PositiveMs = 2000
    timeout_ms: PositiveMs = 5000
    stale_grace_ms: Annotated[float, Meta(ge=0)] = 3000
    """The last resort: while no endpoint is fresh, endpoints whose pages are only late
    (timed out or still coming: a busy engine, not a refused connection or an error page)
    are used on their last metrics this much past ``stale_after_ms``; 0 = off."""
    scrape_in: Literal["process", "loop"] = "process"
    """Fetch and parse pages in a child process (the event loop stays free for picks)
    or on the event loop itself."""
    scrape_worker_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    """The scrape worker's niceness (``scrape_in = "process"``): on a busy machine the
    kernel runs the picks first, and scraping still gets its share (a tenth of a core
    beside one busy process at 10). 0 = the service's own priority."""
    scrape_worker_cpus: list[Annotated[int, msgspec.Meta(ge=0)]] = []
    """CPUs the scrape worker may run on (``sched_setaffinity``); [] = the service's own.
    With the service pinned elsewhere (``taskset``, a cpuset), scraping no longer shares
    a core with the picks (docs/performance.md: p99 2.3x -> 1.3-1.4x with vs without)."""
    endpoints: list[EndpointSpec] = []
    sources: list[SourceTable] = []  # type: ignore[valid-type]
    """Endpoint sources beside ``endpoints`` (docs/discovery.md): ``kind = "dns"`` with
    ``name``, ``port`` (unset: SRV), ``resolver``, ``min_ttl_s``, ``max_ttl_s``,
    ``timeout_s`` and a ``template`` for the endpoints found; ``kind = "inference-pool"``
    with ``name``, ``namespace``, ``api_server`` / ``kubeconfig`` (neither: in-cluster) and
    a ``template``. A static endpoint's address wins over a discovered one."""

    def __post_init__(self) -> None:
        described = [s.describe() for s in self.sources]
        for name in described:
            if described.count(name) > 1 and not name.startswith("static:"):
                raise ValueError(f"pool.sources: {name} is listed twice")
        if self.scrape_worker_cpus:
            if len(set(self.scrape_worker_cpus)) != len(self.scrape_worker_cpus):
                raise ValueError(f"scrape_worker_cpus {self.scrape_worker_cpus} lists a CPU twice")
            # Not this process's own affinity: the service may be pinned elsewhere on
            # purpose (taskset), which is the point. A CPU the cgroup does not allow is
            # refused by the kernel in the worker, which says so and runs unpinned.
            count = os.cpu_count() or 1
            outside = sorted(c for c in self.scrape_worker_cpus if c >= count)
            if outside:
                raise ValueError(
                    f"scrape_worker_cpus: CPU {', '.join(map(str, outside))} does not exist "
                    f"(this machine has CPUs 0-{count - 1})")
        seen: set[str] = set()
        for spec in self.endpoints:
            if spec.address in seen:
                raise ValueError(f"endpoint {spec.address!r} is listed twice")
            seen.add(spec.address)


class PolicyConfig(_Table):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    module: Annotated[str, Meta(min_length=1)]
    """A path to a .wasm (relative to the config file) or a built-in name (``load``)."""
    weight: Weight = 1.0
    params: dict[str, object] = {}
    shadow: bool = False
    """Score beside the live set without changing picks."""


class AdmissionConfig(_Table):
    """Admission for SHEDDABLE requests (the v1 rule): keep endpoints under both."""

    queue_threshold: Annotated[int, Meta(ge=0)] = 5
    kv_threshold: Annotated[float, Meta(ge=0, le=1)] = 0.8


class RuntimeConfig(_Table):
    budget_ms: Annotated[float, Meta(gt=0, le=1000)] = 50.0
    """Wall-clock backstop of one policy call (epoch deadline); coarse on purpose."""
    memory_mb: Annotated[int, Meta(ge=1, le=4096)] = 64
    fuel: Annotated[int, Meta(ge=1000, le=10_000_000_000)] = 10_000_000
    """Instructions one request-path policy call may execute: the primary limit."""
    breaker_failures: Annotated[int, Meta(ge=1)] = 5
    breaker_cooldown_s: Annotated[float, Meta(ge=0)] = 10.0
    breaker_burn_ms: Annotated[float, Meta(gt=0)] = 100.0
    """Wall-clock time a policy's failing calls may take within any one second before the
    policy is benched (every stage's breaker opens for ``breaker_cooldown_s``): a policy
    that fails slowly cannot hold the picks' tail for more than a moment."""
    policy_dir: str = ""
    """Watched for .wasm files: a new or changed ``NAME.wasm`` is validated and swapped in
    for the policy called NAME (or added with weight 1). Empty disables watching."""
    cache_dir: str = ""
    """Compiled-module cache (by content hash). Empty: ``~/.cache/epick``."""


class AdminConfig(_Table):
    listen: OptionalAddress = "127.0.0.1:9003"
    """Empty disables the admin API."""
    token: str = ""
    """Bearer token; ``$EPICK_ADMIN_TOKEN`` wins when set. Without either, every admin call
    is refused."""
    require_conformance: bool = True
    """A module must pass ``epick conformance`` before it goes live."""
    allow_nonconformant_shadow: bool = False
    """Let a module that fails conformance run in shadow mode (never live)."""
    persist_dir: str = ""
    """Where policies loaded through the admin API are saved (NAME.wasm + NAME.json), so
    a restart loads them again (relative to the config file). Empty: they live until the
    process ends. Either way a config reload keeps them."""

    def effective_token(self) -> str:
        return os.environ.get(ADMIN_TOKEN_ENV) or self.token


Objective = Literal["critical", "standard", "sheddable"]


def _check_rewrites(key: str, rewrites: dict[str, str]) -> None:
    for source, target in rewrites.items():
        if not source or not target:
            raise ValueError(f"{key}: {source!r} = {target!r}: names must not be empty")


class OpenAIConfig(_Table):
    """How an OpenAI request becomes a Pick (:mod:`epick.api.openai_request`), for every
    front end that reads one: Envoy's ext_proc, the HTTP front end, the reference gateway
    (``python -m epick.gateway --config``). The same three keys under ``[ext_proc]`` still
    work; a key set in both places must have one value (else an error names both)."""

    base_model: str = ""
    """A body ``model`` equal to this is a base-model request; any other value names a LoRA
    adapter of it (vLLM's naming). Required when ``ext_proc.listen`` is set."""
    objectives: dict[str, Objective] = {}
    """Objective header value (``x-llm-d-inference-objective``) -> criticality. An
    objective not listed is standard; ``x-criticality`` wins over both."""
    model_rewrites: dict[str, str] = {}
    """Body ``model`` -> the model sent to the backend (and picked for); the header
    ``x-llm-d-model-name-rewrite`` wins over it."""

    def __post_init__(self) -> None:
        _check_rewrites("openai.model_rewrites", self.model_rewrites)


class ExtProcConfig(_Table):
    """The Envoy ext_proc adapter (docs/envoy.md): Envoy asks epick where each request goes."""

    listen: Address | Literal[""] = ""
    """Where the ``envoy.service.ext_proc.v3.ExternalProcessor`` server listens; empty = off."""
    base_model: str = ""
    """The older place of ``openai.base_model`` (still read; ``[openai]`` is the place)."""
    failure_mode: Literal["open", "closed"] = "closed"
    """When epick fails to decide (an internal error): ``open`` lets the request through
    without a destination (Envoy's default route takes it), ``closed`` answers 503."""
    fallbacks: Annotated[int, Meta(ge=0, le=64)] = 0
    """Endpoints after the primary in the header and metadata (at most
    ``[server].fallbacks``). 0 by default: Envoy's ORIGINAL_DST routes on one address."""
    metadata_namespace: Annotated[str, Meta(min_length=1)] = "envoy.lb"
    max_body_bytes: Annotated[int, Meta(ge=1024, le=15 << 20)] = 4 << 20
    """Largest request body epick reads (streamed or buffered); beyond it a 413."""
    expose_endpoint: bool = False
    """Tell the client which backend served it (``x-gateway-destination-endpoint`` on the
    response). Off by default: backend addresses stay inside."""
    conformance_hooks: bool = False
    """The upstream Gateway conformance suite's test hooks (docs/envoy.md): the request
    header ``test-epp-endpoint-selection`` restricts the pick to the listed endpoint IPs
    (``ip`` or ``ip:port``, comma-separated), and the response carries
    ``x-conformance-test-served-endpoint`` / ``-selected-endpoint``. Off by default: any
    client could steer its own request. For a gateway's conformance run only."""
    objectives: dict[str, Objective] = {}
    """The older place of ``openai.objectives``."""
    model_rewrites: dict[str, str] = {}
    """The older place of ``openai.model_rewrites``."""

    def __post_init__(self) -> None:
        _check_rewrites("ext_proc.model_rewrites", self.model_rewrites)


def _merge_openai(openai: OpenAIConfig, ext_proc: ExtProcConfig) -> OpenAIConfig:
    """``[openai]`` with ``[ext_proc]``'s older keys filled in; a key set to two different
    values is an error naming both (which one was meant cannot be guessed)."""
    merged = {}
    for key in ("base_model", "objectives", "model_rewrites"):
        new, old = getattr(openai, key), getattr(ext_proc, key)
        if new and old and new != old:
            raise ValueError(f"openai.{key} ({new!r}) and ext_proc.{key} ({old!r}) disagree: "
                             f"set it once, under [openai]")
        merged[key] = new or old
    return OpenAIConfig(**merged)


class HttpConfig(_Table):
    """The HTTP/JSON front end (docs/dataplanes.md): for data planes that cannot speak gRPC
    (NGINX njs, HAProxy Lua, any HTTP client). ``/v1/route`` translates OpenAI requests
    with the ``[openai]`` settings (``base_model``, ``objectives``, ``model_rewrites``)."""

    listen: OptionalAddress = ""
    """Where ``/v1/pick``, ``/v1/completion``, ``/v1/route`` and ``/health`` are served;
    empty = off."""
    max_body_bytes: Annotated[int, Meta(ge=1024, le=64 << 20)] = 8 << 20
    """Largest request body read (a JSON ``PickRequest`` or an OpenAI body); beyond it 413.
    The default leaves room for a 4 MiB prompt with JSON escapes."""


class DecisionsConfig(_Table):
    """The decision log (policies/DECISIONS.md): every pick, for ``epick replay``."""

    log: str = ""
    """The active log file (rotated ones sit beside it as ``LOG.<ms>``); empty = off.
    Relative to the config file's folder."""
    prompt: Literal["hashes", "full", "none"] = "hashes"
    """What is kept of a prompt: its block hash chain, the text itself, or nothing."""
    headers: list[str] = []
    """Request header names to record; none by default."""
    block_bytes: Annotated[int, Meta(ge=1, le=1 << 20)] = 64
    """Block size of the hash chain: the prefix-cache policy's ``block_size``."""
    max_blocks: Annotated[int, Meta(ge=0, le=1 << 20)] = 256
    """Hashes kept per prompt at most: the prefix-cache policy's ``max_blocks``."""
    max_file_mb: Annotated[float, Meta(gt=0)] = 64.0
    """A file is rotated when it reaches this size."""
    rotate_s: Annotated[float, Meta(gt=0)] = 3600.0
    """...or this age."""
    max_total_mb: Annotated[float, Meta(gt=0)] = 1024.0
    """Oldest rotated files are deleted while all files together are larger."""
    max_age_s: Annotated[float, Meta(gt=0)] = 86400.0
    """Rotated files older than this are deleted."""
    queue: Annotated[int, Meta(ge=1)] = 10_000
    """Records waiting for the writer at most; more are dropped (and counted), never
    waited for."""
    embed_modules: bool = True
    """Write each policy module's bytes into the log once per file (self-contained)."""
    compress: bool = True
    """zlib-compress the records (one stream per file, one chunk per batch)."""


class KvEventsConfig(_Table):
    """Precise prefix routing from the engines' KV-cache events (endpoints' ``kv_events``)."""

    tokenizer: str = ""
    """The model's tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``),
    relative to the config file, or ``bytes`` (the simulator's). Required when an endpoint
    sets ``kv_events``."""
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"
    """The engines' ``prefix_caching_hash_algo``."""
    hash_seed: str = ""
    """The engines' ``PYTHONHASHSEED``, if they set one (it seeds vLLM's NONE_HASH);
    empty = unset (vLLM's fixed default for sha256). Required for xxhash."""
    max_blocks_per_endpoint: Annotated[int, Meta(ge=1, le=1 << 26)] = 200_000
    """Index bound per endpoint; the oldest blocks are forgotten beyond it."""
    block_size: Annotated[int, Meta(ge=0)] = 0
    """Tokens per block; 0 = what each endpoint reports (``cache_config_info``)."""
    lora_paths: dict[str, str] = {}
    """Adapter name -> the path the engines loaded it from (vLLM hashes it into LoRA
    blocks); an endpoint's own ``/v1/models`` answer wins when ``discover_lora_paths``."""
    discover_lora_paths: bool = True
    replay_timeout_ms: PositiveMs = 5000

    def __post_init__(self) -> None:
        if self.hash_algo.startswith("xxhash") and not self.hash_seed:
            raise ValueError(
                f"kv_events.hash_algo {self.hash_algo!r} needs kv_events.hash_seed: unseeded "
                "vLLM engines hash with a random per-process seed (set PYTHONHASHSEED on "
                "them and the same value here)")


class WeightsConfig(_Table):
    """The weights stream (``EndpointPicker/WatchWeights``, docs/weights.md)."""

    threshold: Annotated[float, Meta(ge=0, le=1)] = 0.02
    """A new table is sent when some share moved by more than this (or the eligible set
    changed)."""
    min_interval_ms: Annotated[float, Meta(ge=0)] = 500.0
    """At most one table per (model, adapter, criticality) per this interval. 500 ms:
    with 1,000 subscribers and shares that move on every scrape, 100 ms costs the picks
    ×2.4 in p50, 250 ms ×0.9-1.19, 500 ms ×1.004-1.007 (docs/weights.md)."""
    rule: Literal["proportional", "softmax"] = "softmax"
    """Totals -> shares: softmax(total / temperature), or proportional to the weighted
    total. Softmax by default: on the simulated fleet (``epick bench weights --rules``)
    proportional shares spread nearly evenly (totals differ little) and route like
    round robin; softmax at 0.1 sends adapters where they are resident."""
    temperature: Annotated[float, Meta(gt=0)] = 0.1
    """The softmax rule's temperature (lower: more to the best endpoint)."""


class TracingConfig(_Table):
    """OpenTelemetry tracing of decisions (docs/tracing.md): one span per pick, exported
    over OTLP/gRPC; the caller's W3C ``traceparent`` is its parent. Off by default."""

    enabled: bool = False
    endpoint: Annotated[str, Meta(pattern=r"^https?://\S+$")] = "http://127.0.0.1:4317"
    """The OTLP/gRPC receiver (a collector)."""
    insecure: bool = True
    """Plain-text gRPC to ``endpoint`` (false: TLS with the system's roots)."""
    headers: dict[str, str] = {}
    """Sent with every export (e.g. an API key a hosted collector wants)."""
    service_name: Annotated[str, Meta(min_length=1)] = "epick"
    """The spans' ``service.name`` resource attribute."""
    resource: dict[str, str] = {}
    """More resource attributes (``deployment.environment``, ``service.instance.id``...)."""
    sample_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.01
    """Share of picks traced (by trace id, so every service of a trace agrees)."""
    parent_based: bool = True
    """A pick whose caller sent a ``traceparent`` follows its sampled flag instead of
    ``sample_ratio`` (the W3C way: a trace is whole or absent)."""
    schedule_delay_ms: Annotated[int, Meta(ge=1)] = 1000
    """How often queued spans are exported."""
    max_queue: Annotated[int, Meta(ge=1)] = 2048
    """Spans waiting for export at most; beyond it new ones are dropped (never waited for)."""
    export_timeout_ms: PositiveMs = 10_000
class FlowControlConfig(_Table):
    """Flow control (docs/flow-control.md): hold requests in epick while every endpoint is
    saturated, dispatch them by priority band, fairness id and deadline. Reloadable."""

    enabled: bool = False
    """Off: every pick goes straight to the scheduler (the path costs nothing extra)."""
    ttl_ms: Annotated[int, Meta(gt=0, le=3_600_000)] = 30_000
    """Longest a request waits; the caller's deadline (gRPC) wins when sooner. Then
    RESOURCE_EXHAUSTED / 429 ``evicted-ttl``."""
    queue_threshold: Annotated[int, Meta(ge=1)] = 5
    """An endpoint is saturated when its scraped queue plus the picks epick sent it since
    that scrape reach this."""
    kv_threshold: Annotated[float, Meta(gt=0, le=1)] = 0.8
    """...or when its KV-cache use reaches this. Stale metrics count as saturated."""
    max_in_flight: Annotated[int, Meta(ge=0)] = 0
    """...or when the requests epick picked for it and has not seen complete reach this
    (0: no such cap). Set to the engines' batch size (vLLM ``max_num_seqs``) so that a
    dispatched request starts at once and the rest wait in epick, in order."""
    max_in_flight_endpoints: dict[str, Annotated[int, Meta(ge=0)]] = {}
    """Endpoint address -> its own ``max_in_flight`` (0: no cap), for replicas of
    different sizes; an address not listed takes ``max_in_flight``."""
    reserved_in_flight: Annotated[int, Meta(ge=0)] = 0
    """The pool's last free slots under ``max_in_flight`` (summed over the endpoints with
    room) kept for urgent requests: bands at or above ``protected_priority`` and, with
    ``precedence = "fairness"``, flows below their fair share of recent dispatches
    (0: none), while requests wait in epick (a request arriving while none wait takes
    any slot: unsaturated, the reserve costs nothing). Urgent requests then find a free
    slot instead of waiting for the next completion."""
    max_requests: Annotated[int, Meta(ge=1)] = 1000
    """Requests one priority band holds; one more is refused (``rejected-queue-full``)."""
    max_bytes: Annotated[int, Meta(ge=1)] = 256 << 20
    """Prompt bytes one priority band holds."""
    starvation_limit: Annotated[int, Meta(ge=0)] = 16
    """A waiting band passed over this many dispatches in a row is served next (0: strict
    priority, a low band may wait until its TTL)."""
    urgent_placement: Literal["scheduler", "least-busy"] = "scheduler"
    """Where an urgent request (see ``reserved_in_flight``) may go: ``scheduler``: any
    endpoint with room; ``least-busy``: only those with room and the fewest picks since
    their last scrape, then the fewest in flight (its prefill shares the engine's next
    steps with the fewest others). The scheduler chooses among them; in a pool whose
    endpoints serve different models it may find none for the request's model."""
    precedence: Literal["priority", "fairness"] = "priority"
    """What orders first. ``priority``: bands strictly first (with the starvation guard),
    then flows take turns within a band. ``fairness``: bands at or above
    ``protected_priority`` still go first; below it, the flows (fairness ids) take turns
    first and each flow's own highest band goes -- a tenant's lower bands no longer wait
    behind another tenant's higher ones."""
    protected_priority: int = 1
    """Bands at or above this (CRITICAL's 1) are urgent (``reserved_in_flight``,
    ``urgent_placement``); with ``precedence = "fairness"`` they also go strictly first,
    across all flows."""
    fairness: Literal["round-robin", "weighted"] = "round-robin"
    """How flows (fairness ids) of one band take turns."""
    fairness_weights: dict[str, Annotated[float, Meta(gt=0)]] = {}
    """``weighted``: fairness id -> weight (unlisted: 1)."""
    ordering: Literal["edf", "fcfs"] = "edf"
    """Within a flow: ``edf`` = earliest deadline first (``slo_ttft_ms`` after arrival,
    else its TTL: arrival order when no request carries an SLO); ``fcfs`` = arrival."""
    objectives: dict[str, int] = {}
    """Objective header value (``x-llm-d-inference-objective``) -> priority band, for a
    request without ``priority``; an objective not listed falls back to its criticality
    (CRITICAL 1, STANDARD 0, SHEDDABLE -1)."""
    poll_ms: Annotated[int, Meta(ge=1, le=1000)] = 5
    """How often waiting requests re-check for room (and expire) while any wait."""
    metrics_max_flows: Annotated[int, Meta(ge=1, le=10_000)] = 32
    """Fairness ids with their own metric label; later ones are counted as ``other``."""


class Config(_Table):
    version: int
    server: ServerConfig = ServerConfig()
    pool: PoolConfig = PoolConfig()
    policies: list[PolicyConfig] = []
    admission: AdmissionConfig = AdmissionConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    admin: AdminConfig = AdminConfig()
    ext_proc: ExtProcConfig = ExtProcConfig()
    openai: OpenAIConfig = OpenAIConfig()
    """The effective OpenAI settings: ``[openai]`` merged with ``[ext_proc]``'s older keys."""
    http: HttpConfig = HttpConfig()
    decisions: DecisionsConfig = DecisionsConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    weights: WeightsConfig = WeightsConfig()
    tracing: TracingConfig = TracingConfig()
    flow_control: FlowControlConfig = FlowControlConfig()

    def __post_init__(self) -> None:
        # One place for the OpenAI settings: what every front end reads is config.openai.
        msgspec.structs.force_setattr(self, "openai", _merge_openai(self.openai, self.ext_proc))
        if self.ext_proc.listen and not self.openai.base_model:
            raise ValueError("openai.base_model is required when ext_proc.listen is set "
                             "(ext_proc.base_model, its older place, works too)")
        kv = [e.address for e in self.pool.endpoints if e.kv_events]
        kv += [s.describe() for s in self.pool.sources
               if getattr(getattr(s, "template", None), "kv_events", "")]
        if kv and not self.kv_events.tokenizer:
            raise ValueError(f"kv_events.tokenizer is required: endpoint {kv[0]!r} sets "
                             "kv_events (a tokenizer folder, or 'bytes' for the simulator)")
        if self.version != CONFIG_VERSION:
            raise ValueError(
                f"unsupported config version {self.version}; this epick reads version "
                f"{CONFIG_VERSION}"
            )
        if (self.admin.persist_dir and self.runtime.policy_dir
                and Path(self.admin.persist_dir) == Path(self.runtime.policy_dir)):
            raise ValueError(
                f"admin.persist_dir and runtime.policy_dir are the same folder "
                f"({self.admin.persist_dir!r}): the policy-folder watcher would reload every "
                "saved policy; use two folders"
            )
        names = [p.name for p in self.policies]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"policy name {name!r} is used twice")


def loads(text: str | bytes, *, source: str = "<config>") -> Config:
    """Decode and validate a config document; raise :class:`ConfigError` naming ``source``."""
    try:
        return msgspec.toml.decode(text, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(source, f"not valid TOML: {exc}") from None


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate the config file at ``path``."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    return loads(text, source=str(path))


def resolve_module(module: str, *, base: Path | None = None) -> Path:
    """Where the .wasm for a ``module`` value lives.

    A bare name without ``/`` or ``.wasm`` is a built-in (``BUILTIN_POLICY_DIR/NAME.wasm``);
    anything else is a path, relative to ``base`` (the config file's folder).
    """
    if "/" not in module and not module.endswith(".wasm"):
        return BUILTIN_POLICY_DIR / f"{module}.wasm"
    path = Path(module).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return path
