"""`epick serve`: the service's lifespan — one task group owns everything that runs.

    Service.run()
      ├─ Pool.run                 scrape loops (started: after the first scrape round)
      ├─ grpc.aio servers         Pick API + health + reflection; Admin on its own port
      ├─ _health_loop             SERVING once an endpoint is fresh and policies are loaded
      ├─ _checkpoint_loop         policies' last good state, once a second, between picks
      ├─ _watch_config            file changes and SIGHUP -> reload (a bad file is refused)
      ├─ DecisionLog writer       [decisions] log: a thread the lifespan starts and joins
      └─ _watch_policy_dir        NAME.wasm created/changed -> validated hot swap

Everything runs on the one asyncio event-loop thread (anyio on the asyncio backend,
since grpc.aio needs asyncio), so the scheduler and every WASM Store are only ever
touched from that thread. The epoch ticker thread is owned by the Runtime and stopped
with it. Cancel the task group (Ctrl-C, SIGTERM, ``Service.stop``) to stop cleanly.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import anyio
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from epick import telemetry
from epick.api.admin import MAX_MODULE_BYTES, AdminService
from epick.api.gen.epick.v1 import admin_pb2, admin_pb2_grpc, picker_pb2, picker_pb2_grpc
from epick.api.picker import PickerService
from epick.config import Config, ConfigError, load, resolve_module
from epick.policy_manager import PolicyManager, PolicyRejected, read_module
from epick.pool import Pool
from epick.runtime import Limits, Runtime
from epick.scheduler.filters import AdmissionFilter
from epick.scheduler.framework import PluginError
from epick.scheduler.picker import make_picker
from epick.scheduler.scheduler import Scheduler

__all__ = ["Service", "TelemetryRecorder"]

log = logging.getLogger("epick.service")

PICKER_SERVICE = picker_pb2.DESCRIPTOR.services_by_name["EndpointPicker"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class TelemetryRecorder:
    """The scheduler's and API's view of :mod:`epick.telemetry` (pre-bound children)."""

    def __init__(self, manager: PolicyManager | None = None) -> None:
        self.manager = manager
        self._total = telemetry.PICK_LATENCY.labels("total")
        self._stages = [telemetry.PICK_LATENCY.labels(s) for s in ("filter", "score", "pick",
                                                                    "hooks")]
        self._outcomes = {o: telemetry.PICKS.labels(o) for o in telemetry.PICK_OUTCOMES}
        self._policy_latency: dict[str, object] = {}

    def pick_done(self, outcome: str, seconds: float) -> None:
        self._outcomes[outcome].inc()
        self._total.observe(seconds)

    def stages(self, filter_s: float, score_s: float, pick_s: float, hooks_s: float) -> None:
        for child, seconds in zip(self._stages, (filter_s, score_s, pick_s, hooks_s)):
            child.observe(seconds)

    def policy_error(self, error: PluginError) -> None:
        telemetry.POLICY_ERRORS.labels(error.plugin, error.kind).inc()

    def policy_latency(self, policy: str, seconds: float) -> None:
        child = self._policy_latency.get(policy)
        if child is None:
            child = self._policy_latency[policy] = telemetry.POLICY_SCORE_LATENCY.labels(policy)
        child.observe(seconds)

    def shadow(self, policy: str, agree: bool, delta: float) -> None:
        telemetry.SHADOW_AGREEMENT.labels(policy, "true" if agree else "false").inc()
        telemetry.SHADOW_SCORE_DELTA.labels(policy).observe(delta)
        if self.manager is not None and policy in self.manager.active:
            info = self.manager.active[policy]
            info.shadow_calls += 1
            info.shadow_agree += agree


def _limits(config: Config) -> Limits:
    rc = config.runtime
    return Limits(
        budget_ms=rc.budget_ms,
        memory_bytes=rc.memory_mb << 20,
        breaker_failures=rc.breaker_failures,
        breaker_cooldown_s=rc.breaker_cooldown_s,
    )


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


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


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
        cache = Path(config.runtime.cache_dir).expanduser() if config.runtime.cache_dir else (
            Path.home() / ".cache" / "epick")
        self.runtime = Runtime(limits=_limits(config), cache_dir=cache)
        pc = config.pool
        self.pool = Pool(pc.endpoints, scrape_interval_ms=pc.scrape_interval_ms,
                         stale_after_ms=pc.stale_after_ms, timeout_ms=pc.timeout_ms)
        self.scheduler = Scheduler(
            lambda: self.pool.snapshot,
            fallbacks=config.server.fallbacks,
            admission=AdmissionFilter(config.admission.queue_threshold,
                                      config.admission.kv_threshold),
            picker=make_picker(config.server.picker),
            decision_ttl_s=config.server.decision_ttl_s,
            max_decisions=config.server.max_decisions,
        )
        self.manager = PolicyManager(
            self.runtime, self.scheduler,
            require_conformance=config.admin.require_conformance,
            allow_nonconformant_shadow=config.admin.allow_nonconformant_shadow,
        )
        self.recorder = TelemetryRecorder(self.manager)
        self.scheduler.recorder = self.recorder
        self.health = HealthServicer()
        self.decisions = _decision_log(config, config_path)
        if self.decisions is not None:
            self.decisions.attach(self.scheduler)
        self._cancel: anyio.CancelScope | None = None
        self._serving: bool | None = None
        self._load_policies(config)

    # -- policies from config ---------------------------------------------------------

    def _load_policies(self, config: Config) -> None:
        """All config policies or none (raises ConfigError naming the policy)."""
        entries = []
        base = self.config_path.parent if self.config_path else None
        source = str(self.config_path or "config")
        for pc in config.policies:
            path = resolve_module(pc.module, base=base)
            try:
                wasm = read_module(path)
            except PolicyRejected as exc:
                raise ConfigError(source, f"policy {pc.name!r}: cannot read module {path}: "
                                  f"{exc.reason}") from None
            entries.append((pc.name, wasm, dict(pc.params), pc.weight, pc.shadow, str(path)))
            if self.decisions is not None:
                self.decisions.add_module(wasm, pc.name)
        try:
            self.manager.replace_all(entries)
        except PolicyRejected as exc:
            raise ConfigError(source, str(exc)) from None

    def reload(self) -> bool:
        """Re-read the config file; apply it or keep the old one. True if applied."""
        if self.config_path is None:
            return False
        try:
            new = load(self.config_path)
            if new.server != self.config.server or new.admin != self.config.admin:
                log.warning("%s: [server]/[admin] changes need a restart; applying the rest",
                            self.config_path)
            self._load_policies(new)
        except ConfigError as exc:
            log.error("config reload refused, still serving the previous config: %s", exc)
            return False
        self.pool.set_endpoints(new.pool.endpoints)
        self.scheduler.admission = AdmissionFilter(new.admission.queue_threshold,
                                                   new.admission.kv_threshold)
        self.config = new
        log.info("config reloaded from %s: %d endpoints, %d policies", self.config_path,
                 len(new.pool.endpoints), len(new.policies))
        return True

    # -- lifespan ------------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. ``started`` fires once the ports are bound, the first
        scrape round is done and the policies are loaded."""
        options = [
            ("grpc.max_receive_message_length", MAX_MODULE_BYTES + (1 << 20)),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        picker_pb2_grpc.add_EndpointPickerServicer_to_server(
            PickerService(self.scheduler, self.recorder), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (PICKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        self.port = server.add_insecure_port(self.config.server.listen)
        if not self.port:
            raise OSError(f"cannot listen on {self.config.server.listen}")

        admin = None
        if self.config.admin.listen:
            admin = grpc.aio.server(options=options)
            admin_pb2_grpc.add_AdminServicer_to_server(
                AdminService(self.manager, self.config.admin.effective_token()), admin)
            reflection.enable_server_reflection((ADMIN_SERVICE, reflection.SERVICE_NAME), admin)
            self.admin_port = admin.add_insecure_port(self.config.admin.listen)
            if not self.admin_port:
                raise OSError(f"cannot listen on {self.config.admin.listen}")

        ext_proc = None
        if self.config.ext_proc.listen:
            from epick.api.ext_proc import build_server  # xds protos load only when used

            ext_proc, self.ext_proc_port = build_server(
                self.scheduler, self.config.ext_proc, health=self.health,
                telemetry=self.recorder)

        metrics = None
        if self.config.server.metrics_listen:
            host, port = _host_port(self.config.server.metrics_listen)
            metrics = telemetry.start_metrics_server(host, port)
            self.metrics_port = metrics.port

        if self.decisions is not None:
            self.decisions.start()
        try:
            await self._set_health(False)
            async with anyio.create_task_group() as tg:
                self._cancel = tg.cancel_scope
                await tg.start(self.pool.run)
                await server.start()
                if admin is not None:
                    await admin.start()
                if ext_proc is not None:
                    await ext_proc.start()
                tg.start_soon(self._health_loop)
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
                if metrics is not None:
                    metrics.close()
                if self.decisions is not None:
                    await anyio.to_thread.run_sync(self.decisions.close)
                self.runtime.close()

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
        for name in ("", PICKER_SERVICE, *ext_proc):
            await self.health.set(name, status)
        log.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    async def _update_health(self) -> None:
        await self._set_health(self.pool.ready() and len(self.scheduler.policies) > 0)

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(0.1)
            await self._update_health()

    async def _checkpoint_loop(self) -> None:
        """Policies' state checkpoints (for recovery after a trap), off the request path."""
        while True:
            await anyio.sleep(1.0)
            self.manager.checkpoint_all()

    async def _watch_config(self) -> None:
        import watchfiles

        path = self.config_path
        async for _changes in watchfiles.awatch(path.parent, debounce=200, step=50,
                                                watch_filter=lambda _c, p: Path(p) == path):
            log.info("config file changed: %s", path)
            self.reload()

    async def _watch_sighup(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                log.info("SIGHUP: reloading %s", self.config_path)
                self.reload()

    async def _watch_policy_dir(self) -> None:
        import watchfiles

        folder = Path(self.config.runtime.policy_dir).expanduser()
        if not folder.is_absolute() and self.config_path is not None:
            folder = self.config_path.parent / folder
        folder.mkdir(parents=True, exist_ok=True)
        async for changes in watchfiles.awatch(
            folder, debounce=200, step=50,
            watch_filter=lambda c, p: p.endswith(".wasm") and c != watchfiles.Change.deleted,
        ):
            for _change, p in sorted(changes):
                await self.hot_load(Path(p))

    async def hot_load(self, path: Path) -> bool:
        """Validate ``path`` and swap it in as policy ``path.stem``; False if refused."""
        name = path.stem
        try:
            wasm = read_module(path)
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
