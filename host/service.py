"""`epick serve`: the service's lifespan — one task group owns everything that runs.

    Service.run()
      ├─ LoopWatch.run            the loop's lag (a metric) and a warning naming a stall
      ├─ Sources.run              [[pool.sources]] (DNS…) -> the pool's membership
      ├─ Pool.run                 scrape loops (started: after the first scrape round)
      ├─ grpc.aio servers         Pick API + health + reflection; Admin on its own port
      ├─ aiohttp server           [http]: the HTTP/JSON front end (epick.api.http)
      ├─ Hub + Workers            [server] workers > 1: ext_proc and [http] in N worker
      │                           processes (SO_REUSEPORT), deciding here over a Unix socket
      ├─ _health_loop             SERVING once an endpoint is fresh and policies are loaded
      ├─ _checkpoint_loop         policies' last good state, once a second, between picks
      ├─ _watch_config            file changes and SIGHUP -> reload (a bad file is refused)
      ├─ KvSubscriber             one ZMQ task per endpoint's KV events ([kv_events]; epick.kv)
      ├─ DecisionLog writer       [decisions] log: a thread the lifespan starts and joins
      └─ _watch_policy_dir        NAME.wasm created/changed -> validated hot swap

Before any of it, :meth:`Service.load_policies` compiles and vets the start-up policies
on worker threads (the health says SERVING only once they are live).

Everything runs on the one asyncio event-loop thread (anyio on the asyncio backend,
since grpc.aio needs asyncio), so the scheduler and every live WASM Store are only ever
touched from that thread (a policy is made, and given its predecessor's state, on a
worker before it goes live). Blocking work goes to workers: module reads, compiles,
conformance runs, admin saves to ``[admin] persist_dir``. The epoch ticker thread is owned by the Runtime and stopped
with it. Cancel the task group (Ctrl-C, SIGTERM, ``Service.stop``) to stop cleanly.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import grpc
import msgspec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from epick import telemetry
from epick.api.admin import MAX_REQUEST_BYTES, AdminService
from epick.api.decide import Decider
from epick.api.gen.epick.v1 import admin_pb2, admin_pb2_grpc, picker_pb2
from epick.api.grpc_server import PENDING_CALLS_OPTIONS
from epick.api.picker import PickerService
from epick.api.picker import add_to_server as add_picker_to_server
from epick.api.weights import WeightsHub
from epick.config import Config, ConfigError, load, resolve_module
from epick.interfaces import PluginError
from epick.kv.service import KvEvents
from epick.loopwatch import LoopWatch
from epick.policy_manager import PolicyManager, PolicyRejected, PolicySpec, read_module
from epick.policy_store import PolicyStore
from epick.pool import EndpointSpec, Pool, Sources, reader_for
from epick.runtime import Limits, Runtime
from epick.scheduler.assignments import Assignments
from epick.scheduler.filters import AdmissionFilter
from epick.scheduler.pickers import make_picker
from epick.scheduler.scheduler import Scheduler

__all__ = ["Service", "TelemetryRecorder", "ListenError"]

log = logging.getLogger("epick.service")

PICKER_SERVICE = picker_pb2.DESCRIPTOR.services_by_name["EndpointPicker"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: The Pick server's largest message (long prompts); the admin server has its own cap.
PICK_MAX_MESSAGE_BYTES = 33 << 20


class ListenError(OSError):
    """A listener could not bind: ``str()`` names the address, the config key and why."""


def _why_not(address: str) -> str | None:
    """Why ``address`` cannot be bound, asked of the OS directly (gRPC only says 'failed');
    ``None`` when it can. SO_REUSEADDR as the servers set it: a port left in TIME_WAIT by
    a previous run is free."""
    try:
        host, port = _host_port(address)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "the port is already in use by another process"
        return exc.strerror or str(exc)
    except ValueError:
        return "not a HOST:PORT address"
    return None


def _listen(bind, address: str, key: str) -> int:
    """``bind(address)`` -> port, or :class:`ListenError` naming ``key`` and the cause.

    Asks the OS first, so a busy port is one clear line rather than gRPC's log line
    and a traceback."""
    why = _why_not(address)
    port = 0
    if why is None:
        try:
            port = bind(address)
        except (RuntimeError, OSError):
            port = 0
    if not port:
        why = why or _why_not(address) or "the address cannot be bound"
        raise ListenError(f"cannot listen on {address} ({key}): {why}; "
                          f"free it or set another address") from None
    return port


def _reserve_port(address: str) -> socket.socket:
    """A socket bound (not listening) to ``address`` with SO_REUSEPORT: it holds the port
    (``:0`` becomes a concrete one) for the front-end workers, which bind it the same way
    and listen. Only listening sockets get connections, so this one never does."""
    host, port = _host_port(address)
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(infos[0][4])
    except OSError:
        sock.close()
        raise
    return sock


class TelemetryRecorder:
    """The scheduler's and API's view of :mod:`epick.telemetry` (pre-bound children)."""

    def __init__(self) -> None:
        self._total = telemetry.PICK_LATENCY.labels("total")
        self._stages = [telemetry.PICK_LATENCY.labels(s) for s in ("filter", "score", "pick",
                                                                    "hooks")]
        # Each stage's observe (a list's append), bound once.
        self._filter, self._score, self._pick, self._hooks = (c.observe for c in self._stages)
        #: outcome -> add one to ``epick_picks_total{outcome}``.
        self._outcomes = {o: telemetry.fast_inc(telemetry.PICKS.labels(o))
                          for o in telemetry.PICK_OUTCOMES}
        self._total_observe = self._total.observe
        self._total_waiting = self._total.waiting
        self._policy_latency = telemetry.Children(telemetry.POLICY_SCORE_LATENCY)
        self._policy_observe: dict[str, Callable[[float], None]] = {}
        self._policy_errors = telemetry.Children(telemetry.POLICY_ERRORS)
        self._shadow_agreement = telemetry.Children(telemetry.SHADOW_AGREEMENT)
        self._shadow_delta = telemetry.Children(telemetry.SHADOW_SCORE_DELTA)

    def pick_done(self, outcome: str, seconds: float) -> None:
        self._outcomes[outcome]()
        self._total_observe(seconds)
        # Every other pick-path child fills no faster than the total (one per pick):
        # when it is due, fold them all (a scrape folds them sooner).
        if len(self._total_waiting) >= telemetry.FOLD_AT:
            telemetry.fold_loop_histograms()

    def stages(self, filter_s: float, score_s: float, pick_s: float, hooks_s: float) -> None:
        self._filter(filter_s)
        self._score(score_s)
        self._pick(pick_s)
        self._hooks(hooks_s)

    def completion(self, status: int, prompt_tokens: int | None,
                   completion_tokens: int | None, ttft_s: float | None) -> None:
        telemetry.COMPLETIONS.labels(("ok", "error", "cancelled")[status]).inc()
        if prompt_tokens is not None:
            telemetry.COMPLETION_TOKENS.labels("prompt").inc(prompt_tokens)
        if completion_tokens is not None:
            telemetry.COMPLETION_TOKENS.labels("completion").inc(completion_tokens)
        if ttft_s is not None:
            telemetry.TTFT.observe(ttft_s)

    def policy_error(self, error: PluginError) -> None:
        self._policy_errors(error.plugin, error.kind).inc()

    def policy_latency(self, policy: str, seconds: float) -> None:
        observe = self._policy_observe.get(policy)
        if observe is None:
            observe = self._policy_observe[policy] = self._policy_latency(policy).observe
        observe(seconds)

    def shadow(self, policy: str, agree: bool, delta: float) -> None:
        self._shadow_agreement(policy, "true" if agree else "false").inc()
        self._shadow_delta(policy).observe(delta)


def _limits(config: Config) -> Limits:
    rc = config.runtime
    return Limits(
        budget_ms=rc.budget_ms,
        fuel=rc.fuel,
        memory_bytes=rc.memory_mb << 20,
        breaker_failures=rc.breaker_failures,
        breaker_cooldown_s=rc.breaker_cooldown_s,
        breaker_burn_ms=rc.breaker_burn_ms,
    )


def _tracer(config: Config):
    """The ``[tracing]`` span exporter (a :class:`epick.tracing.PickTracer`), or None when
    tracing is off (then the OpenTelemetry SDK is not even imported)."""
    tc = config.tracing
    if not tc.enabled:
        return None
    from epick.tracing import PickTracer

    return PickTracer(endpoint=tc.endpoint, service_name=tc.service_name,
                      sample_ratio=tc.sample_ratio, parent_based=tc.parent_based,
                      insecure=tc.insecure, headers=tc.headers, resource=tc.resource,
                      export_timeout_ms=tc.export_timeout_ms,
                      schedule_delay_ms=tc.schedule_delay_ms, max_queue=tc.max_queue)


def _decision_log(config: Config, config_path: Path | None):
    """The ``[decisions]`` log (not started), or None when it is off."""
    dc = config.decisions
    if not dc.log:
        return None
    from epick.decisions import DecisionLog

    path = Path(dc.log).expanduser()
    if not path.is_absolute() and config_path is not None:
        path = config_path.parent / path
    return DecisionLog(
        path, prompt=dc.prompt, headers=tuple(dc.headers), block_bytes=dc.block_bytes,
        max_blocks=dc.max_blocks, max_file_bytes=int(dc.max_file_mb * (1 << 20)),
        max_total_bytes=int(dc.max_total_mb * (1 << 20)), max_age_s=dc.max_age_s,
        rotate_s=dc.rotate_s, queue=dc.queue, embed_modules=dc.embed_modules,
        compress=dc.compress)


def _with_template_kv(config: Config) -> Config:
    """``config`` as :meth:`KvEvents.from_config` should see it: with KV events on when
    only a source's template sets ``kv_events`` (a stand-in endpoint turns it on; the
    service replaces the set with the real one at once)."""
    if any(e.kv_events for e in config.pool.endpoints):
        return config
    for source in config.pool.sources:
        template = getattr(source, "template", None)
        if template is not None and template.kv_events:
            probe = EndpointSpec(address="0.0.0.0:1", kv_events="discover")
            pool = msgspec.structs.replace(config.pool,
                                           endpoints=[*config.pool.endpoints, probe])
            return msgspec.structs.replace(config, pool=pool)
    return config


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _quiet_watchfiles() -> None:
    """watchfiles logs every filtered-out change at DEBUG. A log file beside the config
    (or in the policy folder) is such a change, so each line it logs caused the next:
    ~10 a second. Its INFO lines (a change we act on) stay; an explicit level wins."""
    watch_log = logging.getLogger("watchfiles")
    if watch_log.level == logging.NOTSET:
        watch_log.setLevel(logging.INFO)


class Service:
    """A running epick: build with a :class:`Config`, then ``await tg.start(svc.run)``.

    After ``started``, :attr:`port` / :attr:`admin_port` / :attr:`metrics_port` hold the
    bound ports (useful with ``:0`` in tests).
    """

    def __init__(self, config: Config, *, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.port = 0
        self.admin_port = 0
        self.metrics_port = 0
        self.ext_proc_port = 0
        self.http_port = 0
        cache = Path(config.runtime.cache_dir).expanduser() if config.runtime.cache_dir else (
            Path.home() / ".cache" / "epick")
        self.runtime = Runtime(limits=_limits(config), cache_dir=cache)
        pc = config.pool
        # What the host sent where: raised by picks, reset by the pool's good scrapes.
        assignments = Assignments()
        self.pool = Pool(pc.endpoints, scrape_interval_ms=pc.scrape_interval_ms,
                         stale_after_ms=pc.stale_after_ms, timeout_ms=pc.timeout_ms,
                         stale_grace_ms=pc.stale_grace_ms,
                         on_scrape=assignments.scraped,
                         reader=reader_for(pc.scrape_in, nice=pc.scrape_worker_nice,
                                           cpus=pc.scrape_worker_cpus))
        # KV-cache events (precise prefix routing): None unless an endpoint sets kv_events.
        self.kv = KvEvents.from_config(_with_template_kv(config), config_path)
        if self.kv is not None:
            self.kv.set_endpoints(pc.endpoints)
        self.scheduler = Scheduler(
            # The pool's view, read per pick: getattr from C, no lambda frame.
            functools.partial(getattr, self.pool, "view"),
            assignments=assignments,
            kv=self.kv.routing if self.kv is not None else None,
            pool_status=self.pool.status,
            fallbacks=config.server.fallbacks,
            admission=AdmissionFilter(config.admission.queue_threshold,
                                      config.admission.kv_threshold),
            picker=make_picker(config.server.picker),
            work_conserving=config.server.work_conserving,
            decision_ttl_s=config.server.decision_ttl_s,
            max_decisions=config.server.max_decisions,
        )
        wc = config.weights
        self.weights = WeightsHub(self.scheduler, threshold=wc.threshold,
                                  min_interval_ms=wc.min_interval_ms, rule=wc.rule,
                                  temperature=wc.temperature)
        # Endpoint sources feed the pool through its one membership door, the same
        # set_endpoints a config reload uses; the static list is always first and wins.
        self.sources = Sources(pc.endpoints, pc.sources, self._set_membership)
        self.manager = PolicyManager(
            self.runtime, self.scheduler,
            require_conformance=config.admin.require_conformance,
            allow_nonconformant_shadow=config.admin.allow_nonconformant_shadow,
        )
        self.recorder = TelemetryRecorder()
        self.scheduler.recorder = self.recorder
        telemetry.POLICY_STATS.source = lambda: [(e.name, e.plugin)
                                                 for e in self.scheduler.policies.entries]
        self.health = HealthServicer()
        self.loop_watch = LoopWatch(warn_s=config.server.loop_stall_warn_ms / 1e3,
                                    observe=telemetry.EVENT_LOOP_LAG.observe,
                                    on_stall=lambda _lag, _seen:
                                    telemetry.EVENT_LOOP_STALLS.inc())
        self.decisions = _decision_log(config, config_path)
        #: The ``[tracing]`` exporter, built by :meth:`run` (its export thread starts then).
        self.tracer = None
        if self.decisions is not None:
            self.decisions.attach(self.scheduler)
        self._cancel: anyio.CancelScope | None = None
        #: The pick path's :class:`~epick.api.decide.Decider` once serving (flow control).
        self._decider: Decider | None = None
        self.hub = None
        """The front-end workers' hub (``[server] workers`` > 1, ext_proc or HTTP on)."""
        self.workers = None
        """Their supervisor: ``workers.pids`` (index -> pid), ``workers.restarts``."""
        self.frontend = "python"
        """``[server] frontend`` as served (``auto`` resolved when the service starts)."""
        self._watchers_stop: anyio.Event | None = None
        self._serving: bool | None = None
        self._applied_policies: dict[str, tuple] = {}
        """Per config policy: its entry and module hash as last applied."""
        self._policies_loaded = False
        """Set by :meth:`load_policies`: the health says SERVING only after it."""
        self.store: PolicyStore | None = None
        if config.admin.persist_dir:
            self.store = PolicyStore(self._folder(config.admin.persist_dir))

    # -- policies from config ---------------------------------------------------------

    def _changed(self, applied: dict[str, tuple]) -> set[str]:
        """Config entries that differ from the last applied config (entry or module bytes)."""
        return {n for n, seen in applied.items() if self._applied_policies.get(n) != seen}

    def _policy_entries(self, config: Config) -> tuple[list[PolicySpec], dict[str, tuple]]:
        """The config's policies with their module bytes (reads files: off the loop), and
        what identifies each entry (for "changed since the last reload")."""
        entries = []
        applied: dict[str, tuple] = {}
        base = self.config_path.parent if self.config_path else None
        source = str(self.config_path or "config")
        for pc in config.policies:
            path = resolve_module(pc.module, base=base)
            try:
                wasm = read_module(path)
            except PolicyRejected as exc:
                raise ConfigError(source, f"policy {pc.name!r}: cannot read module {path}: "
                                  f"{exc.reason}") from None
            entries.append(PolicySpec(pc.name, wasm, dict(pc.params), pc.weight, pc.shadow,
                                      str(path)))
            if self.decisions is not None:
                self.decisions.add_module(wasm, pc.name)
            applied[pc.name] = (pc, hashlib.sha256(wasm).digest())
        return entries, applied

    def _folder(self, value: str) -> Path:
        folder = Path(value).expanduser()
        if not folder.is_absolute() and self.config_path is not None:
            folder = self.config_path.parent / folder
        return folder

    async def load_policies(self) -> None:
        """The start-up loads: the config's policies, then those saved in ``[admin]
        persist_dir``. Files are read and modules compiled and vetted on worker threads,
        so the loop stays free; each set goes live on the loop. Raises ConfigError naming
        the config policy that cannot load. :meth:`run` calls it (once) before it serves;
        call it first to get that error before the lifespan starts."""
        if self._policies_loaded:
            return
        entries, applied = await anyio.to_thread.run_sync(self._policy_entries, self.config)
        try:
            await self.manager.replace_all_async(entries, changed=self._changed(applied))
        except PolicyRejected as exc:
            raise ConfigError(str(self.config_path or "config"), str(exc)) from None
        self._applied_policies = applied
        if self.store is not None:
            await self._load_saved()
        self._policies_loaded = True

    async def _load_saved(self) -> None:
        """The admin loads saved in ``[admin] persist_dir``, made live again after the
        config's. One that no longer loads is logged and left on disk."""
        for name, wasm, saved in await self.store.off_loop(self.store.load_all):
            try:
                await self.manager.activate_async(name, wasm, saved.params,
                                                  weight=saved.weight, shadow=saved.shadow,
                                                  source="saved", gate=False)
            except PolicyRejected as exc:
                log.error("saved policy %r not loaded (left in %s): %s", name,
                          self.store.folder, exc)

    async def reload_async(self) -> bool:
        """Re-read the config file; apply it or keep the old one (True if applied). File
        reads, compiles and vetting run off the event loop (there is no blocking twin:
        a compile on the loop would stall every pick behind it)."""
        if self.config_path is None:
            return False
        try:
            new = await anyio.to_thread.run_sync(load, self.config_path)
            entries, applied = await anyio.to_thread.run_sync(self._policy_entries, new)
            kept = await self.manager.replace_all_async(entries,
                                                        changed=self._changed(applied))
            self._applied_policies = applied
        except ConfigError as exc:
            log.error("config reload refused, still serving the previous config: %s", exc)
            return False
        except PolicyRejected as exc:
            log.error("config reload refused, still serving the previous config: %s",
                      ConfigError(str(self.config_path), str(exc)))
            return False
        return self._apply_config(new, kept)

    def _apply_config(self, new: Config, kept: list[str]) -> bool:
        if new.server != self.config.server or new.admin != self.config.admin:
            log.warning("%s: [server]/[admin] changes need a restart; applying the rest",
                        self.config_path)
        if new.tracing != self.config.tracing:
            log.warning("%s: [tracing] changes need a restart; applying the rest",
                        self.config_path)
        if _limits(new) != _limits(self.config):
            # The runtime's limits are fixed when it is built: say so rather than ignore it.
            log.warning("%s: [runtime] limits (fuel, budget_ms, memory_mb, breaker_*) "
                        "need a restart; applying the rest", self.config_path)
        self.sources.update(new.pool.endpoints, new.pool.sources)
        if new.kv_events != self.config.kv_events or (
                self.kv is None and any(e.kv_events for e in new.pool.endpoints)):
            log.warning("%s: [kv_events] changes (or turning KV events on) need a restart",
                        self.config_path)
        self.scheduler.admission = AdmissionFilter(new.admission.queue_threshold,
                                                   new.admission.kv_threshold)
        self.weights.configure(new.weights)
        if self._decider is not None:
            self._decider.configure_flow(new.flow_control)
        self.config = new
        log.info("config reloaded from %s: %d endpoints, %d policies%s", self.config_path,
                 len(new.pool.endpoints), len(new.policies),
                 f"; kept {len(kept)} loaded while serving: {', '.join(kept)}" if kept else "")
        return True

    def _set_membership(self, specs: list[EndpointSpec]) -> None:
        """The merged endpoint set (static + sources) -> the pool and the KV subscriber."""
        self.pool.set_endpoints(specs)
        if self.kv is not None:
            self.kv.set_endpoints(specs)

    # -- lifespan ------------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. ``started`` fires once the ports are bound, the first
        scrape round is done and the policies are loaded."""
        self._watchers_stop = anyio.Event()
        try:
            await self.load_policies()
        except BaseException:
            self.runtime.close()
            raise
        options = [
            ("grpc.max_receive_message_length", PICK_MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # A burst of calls while the loop is busy waits in Core instead of being refused
            # or cancelled after 30 s (epick.api.grpc_server).
            *PENDING_CALLS_OPTIONS,
        ]
        server = grpc.aio.server(options=options)
        self.tracer = _tracer(self.config)
        picker = PickerService(self.scheduler, self.recorder,
                               allow_pinning=self.config.server.allow_pinning,
                               weights=self.weights, tracer=self.tracer,
                               session_header=self.config.server.session_header)
        add_picker_to_server(picker, server)  # Pick answers with bytes (epick.api.picker)
        # Flow control sits in the one pick path; a reload reconfigures it there.
        picker.decider.configure_flow(self.config.flow_control)
        self._decider = picker.decider
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (PICKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        self.port = _listen(server.add_insecure_port, self.config.server.listen,
                            "[server] listen")

        admin = None
        if self.config.admin.listen:
            # Bounded by the module cap: gRPC refuses a bigger LoadPolicy (RESOURCE_EXHAUSTED)
            # from its length prefix instead of receiving it while picks wait.
            admin = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.so_reuseport", 0),
            ])
            admin_pb2_grpc.add_AdminServicer_to_server(
                AdminService(self.manager, self.config.admin.effective_token(),
                             store=self.store), admin)
            reflection.enable_server_reflection((ADMIN_SERVICE, reflection.SERVICE_NAME), admin)
            self.admin_port = _listen(admin.add_insecure_port, self.config.admin.listen,
                                      "[admin] listen")

        ext_proc = None
        # [server] workers > 1: the front ends run in worker processes; this one holds
        # their ports (SO_REUSEPORT, not listening) and decides for them.
        reserved: list[socket.socket] = []
        # [server] frontend = "native": ext_proc in native workers (even one); [http] here.
        if self.config.ext_proc.listen:
            from epick.frontend.supervisor import resolve_frontend

            self.frontend, why = resolve_frontend(
                self.config.server.frontend, workers=self.config.server.workers,
                http=bool(self.config.http.listen))
            if self.config.server.frontend == "auto":
                log.info('[server] frontend = "auto": ext_proc served by the %s front end (%s)',
                         self.frontend, why)
        native = self.frontend == "native"
        in_workers = native or self.config.server.workers > 1 and bool(
            self.config.ext_proc.listen or self.config.http.listen)
        http_here = bool(self.config.http.listen) and (native or not in_workers)

        def reserve(address: str) -> int:
            reserved.append(_reserve_port(address))
            return reserved[-1].getsockname()[1]

        if in_workers:
            if self.config.ext_proc.listen:
                self.ext_proc_port = _listen(reserve, self.config.ext_proc.listen,
                                             "[ext_proc] listen")
            if self.config.http.listen and not http_here:
                self.http_port = _listen(reserve, self.config.http.listen, "[http] listen")
            self._make_workers(picker, native=native)
        elif self.config.ext_proc.listen:
            from epick.api.ext_proc import build_server  # xds protos load only when used

            def bind_ext_proc(_address: str) -> int:
                nonlocal ext_proc
                # The Pick API's decider: one pick path for every front end.
                ext_proc, port = build_server(picker.decider, self.config.ext_proc,
                                              self.config.openai, health=self.health)
                return port

            self.ext_proc_port = _listen(bind_ext_proc, self.config.ext_proc.listen,
                                         "[ext_proc] listen")

        http = None
        if http_here:
            from epick.api.http import HttpApi, HttpServer

            http = HttpServer(HttpApi(
                picker, healthy=lambda: bool(self._serving), openai=self.config.openai,
                max_body_bytes=self.config.http.max_body_bytes))
            self.http_port = _listen(http.bind, self.config.http.listen, "[http] listen")

        metrics = None
        if self.config.server.metrics_listen:
            def bind_metrics(address: str) -> int:
                nonlocal metrics
                metrics = telemetry.start_metrics_server(*_host_port(address))
                return metrics.port

            self.metrics_port = _listen(bind_metrics, self.config.server.metrics_listen,
                                        "[server] metrics_listen")

        if self.decisions is not None:
            self.decisions.start()
        try:
            await self._set_health(False)
            async with anyio.create_task_group() as tg:
                self._cancel = tg.cancel_scope
                await tg.start(self.loop_watch.run)
                # Sources first: their first answers join the pool's first scrape round.
                await tg.start(self.sources.run)
                await tg.start(self.pool.run)
                if self.kv is not None:
                    await tg.start(self.kv.subscriber.run)
                await server.start()
                if admin is not None:
                    await admin.start()
                if ext_proc is not None:
                    await ext_proc.start()
                if self.workers is not None:
                    await tg.start(self.hub.run)
                    await tg.start(self.workers.run)
                await tg.start(self.weights.run)
                await tg.start(picker.decider.run)
                if http is not None:
                    await http.start()
                tg.start_soon(self._health_loop)
                tg.start_soon(self._release_watchers_on_stop)
                tg.start_soon(self._checkpoint_loop)
                if self.config_path is not None:
                    tg.start_soon(self._watch_config)
                    # Signal handlers can only be installed from the main thread (tests
                    # run the service in a thread of its own; they use the file watcher).
                    if threading.current_thread() is threading.main_thread():
                        tg.start_soon(self._watch_sighup)
                if self.config.runtime.policy_dir:
                    tg.start_soon(self._watch_policy_dir)
                await self._update_health()
                log.info("epick serving Pick on port %d (admin %s, metrics %s)", self.port,
                         self.admin_port or "off", self.metrics_port or "off")
                task_status.started(self)
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await self.health.enter_graceful_shutdown()
                await server.stop(grace=1.0)
                if admin is not None:
                    await admin.stop(grace=0.5)
                if ext_proc is not None:
                    await ext_proc.stop(grace=1.0)
                if http is not None:
                    await http.stop()
                if metrics is not None:
                    metrics.close()
                for sock in reserved:
                    sock.close()
                if self.hub is not None:
                    shutil.rmtree(self.hub.path.parent, ignore_errors=True)
                if self.decisions is not None:
                    await anyio.to_thread.run_sync(self.decisions.close)
                if self.tracer is not None:  # flushes what is queued, stops its thread
                    await anyio.to_thread.run_sync(self.tracer.shutdown)
                self.runtime.close()

    def _make_workers(self, picker: PickerService, *, native: bool = False) -> None:
        """The hub (a Unix socket in a private folder) and the workers' supervisor
        (``native``: the C++ ext_proc workers; FileNotFoundError when it is not built)."""
        from epick.frontend import Hub, Workers
        from epick.frontend.supervisor import native_binary
        from epick.frontend.worker import WorkerSpec

        def resolved(address: str, port: int) -> str:  # the reserved port, not :0
            if not address:
                return ""
            host, _ = _host_port(address)
            return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

        binary = native_binary() if native else None  # said before anything starts
        folder = Path(tempfile.mkdtemp(prefix="epick-frontend-"))
        ext_proc = (msgspec.structs.replace(
            self.config.ext_proc, listen=resolved(self.config.ext_proc.listen,
                                                  self.ext_proc_port))
            if self.config.ext_proc.listen else None)
        http = "" if native else resolved(self.config.http.listen, self.http_port)
        level = logging.getLogger().getEffectiveLevel()
        hub = str(folder / "hub.sock")
        command = None
        if native:
            def command(i: int) -> list[str]:
                return [str(binary), "--index", str(i), "--hub", hub,
                        "--listen", ext_proc.listen,
                        "--max-body-bytes", str(ext_proc.max_body_bytes),
                        "--metadata-namespace", ext_proc.metadata_namespace,
                        "--expose-endpoint", str(int(ext_proc.expose_endpoint)),
                        "--conformance-hooks", str(int(ext_proc.conformance_hooks))]
        self.workers = Workers(
            self.config.server.workers,
            lambda i: WorkerSpec(index=i, hub=hub, ext_proc=ext_proc,
                                 openai=self.config.openai, log_level=level, http_listen=http,
                                 http_max_body_bytes=self.config.http.max_body_bytes),
            command=command)
        self.hub = Hub(picker, folder / "hub.sock", on_hello=self.workers.hello,
                       ext_proc=self.config.ext_proc if native else None,
                       openai=self.config.openai)

    def stop(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()

    async def _set_health(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        # Envoy (and upstream's picker protocol) health-checks the ext_proc service by name.
        ext_proc = (EXT_PROC_SERVICE,) if self.config.ext_proc.listen else ()
        for name in ("", PICKER_SERVICE, *ext_proc, "readiness"):
            await self.health.set(name, status)
        if self.hub is not None:
            self.hub.set_health(serving)
        # Upstream's probe names: `liveness` is "the process answers", not "ready".
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        log.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    async def _update_health(self) -> None:
        await self._set_health(self._policies_loaded and self.pool.ready()
                               and len(self.scheduler.policies) > 0)

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(0.1)
            await self._update_health()

    async def _release_watchers_on_stop(self) -> None:
        """Wake the file watchers' threads when the service stops.

        watchfiles waits in a thread for up to 5 s and only then sees a cancellation,
        so a SIGTERM took 3-8 s; its stop event ends the wait within ``step`` (50 ms).
        """
        try:
            await anyio.sleep_forever()
        finally:
            self._watchers_stop.set()

    async def _checkpoint_loop(self) -> None:
        """Policies' state checkpoints (for recovery after a trap), off the request path."""
        while True:
            await anyio.sleep(1.0)
            await self.manager.checkpoint_each()

    async def _watch_config(self) -> None:
        import watchfiles

        _quiet_watchfiles()
        path = self.config_path
        async for _changes in watchfiles.awatch(path.parent, debounce=200, step=50,
                                                watch_filter=lambda _c, p: Path(p) == path,
                                                stop_event=self._watchers_stop):
            log.info("config file changed: %s", path)
            await self.reload_async()

    async def _watch_sighup(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                log.info("SIGHUP: reloading %s", self.config_path)
                await self.reload_async()

    async def _watch_policy_dir(self) -> None:
        import watchfiles

        _quiet_watchfiles()
        folder = Path(self.config.runtime.policy_dir).expanduser()
        if not folder.is_absolute() and self.config_path is not None:
            folder = self.config_path.parent / folder
        folder.mkdir(parents=True, exist_ok=True)
        async for changes in watchfiles.awatch(
            folder, debounce=200, step=50,
            watch_filter=lambda c, p: p.endswith(".wasm") and c != watchfiles.Change.deleted,
            stop_event=self._watchers_stop,
        ):
            for _change, p in sorted(changes):
                await self.hot_load(Path(p), inside=folder)

    async def hot_load(self, path: Path, *, inside: Path | None = None) -> bool:
        """Validate ``path`` and swap it in as policy ``path.stem``; False if refused.

        The file is read on a worker thread; with ``inside`` (the watched folder) only a
        regular file directly in it is read (see :func:`read_module`)."""
        name = path.stem
        try:
            wasm = await anyio.to_thread.run_sync(
                functools.partial(read_module, path, inside=inside))
            if self.decisions is not None:
                self.decisions.add_module(wasm, name)
            current = self.scheduler.policies
            params = self.manager.active[name].params if name in self.manager.active else {}
            shadow = current.get(name).shadow if name in current else False
            await self.manager.activate_async(name, wasm, params, shadow=shadow,
                                              source=str(path))
        except PolicyRejected as exc:
            log.error("hot swap refused, the running policy stays: %s", exc)
            return False
        return True
