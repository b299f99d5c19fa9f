"""Endpoint sources: plugins that feed the pool's membership beside the static list.

The split follows the llm-d scheduler's plugin registry: a small protocol here (a source
is a config Struct tagged by ``kind`` plus a factory that turns it into a :class:`Source`),
one registry ``kind`` -> :class:`SourceKind`, and the runner (:class:`Sources`) that
owns every source task and merges what they report into one endpoint list.

Membership (decided here, documented in docs/discovery.md):

- the static ``[[pool.endpoints]]`` list is one source that never changes between config
  reloads; discovered endpoints are added after it, sources in config order;
- an address listed statically is the static spec (a discovered copy is dropped: the
  static spec wins); an address two sources both find is the first source's;
- the merged list goes through the pool's one membership door, ``Pool.set_endpoints``
  (the same call a config reload makes), so the pool keeps scraping as it does: an
  endpoint whose spec is unchanged keeps its metrics and back-off.

Every source task has an owner: :meth:`Sources.run`'s task group (started by the service
lifespan); cancelling it stops them all, and :meth:`Sources.update` stops a source whose
config left the file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import msgspec
from anyio.abc import TaskStatus

from epick.pool.spec import EndpointSpec, Engine

__all__ = ["Source", "SourceConfig", "SourceKind", "EndpointTemplate", "register", "kinds",
           "Sources", "Publish", "merge"]

log = logging.getLogger("epick.pool.sources")

#: A source reports its whole current set (never a delta) through this.
Publish = Callable[[Sequence[EndpointSpec]], None]


class EndpointTemplate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a discovered endpoint is, beside its address: the static spec's fields.

    ``metrics_url``, ``kv_events`` and ``kv_replay`` may say ``{host}`` (the discovered
    address's host) and ``{port}``; e.g. ``kv_events = "tcp://{host}:5557"``.
    """

    engine: Engine = "vllm"
    labels: dict[str, str] = {}
    models: list[str] | None = None
    adapters: list[str] | None = None
    discover: bool = True
    metrics_url: str | None = None
    kv_events: str = ""
    kv_replay: str = ""
    kv_topic: str = ""

    def spec(self, host: str, port: int) -> EndpointSpec:
        """The endpoint at ``host:port`` (an IPv6 host is bracketed in the address)."""
        shown = f"[{host}]" if ":" in host else host

        def fill(value: str) -> str:
            return value.replace("{host}", shown).replace("{port}", str(port))

        return EndpointSpec(
            address=f"{shown}:{port}", engine=self.engine, labels=dict(self.labels),
            models=self.models, adapters=self.adapters, discover=self.discover,
            metrics_url=fill(self.metrics_url) if self.metrics_url else None,
            kv_events=fill(self.kv_events), kv_replay=fill(self.kv_replay),
            kv_topic=self.kv_topic)


class SourceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                   tag_field="kind"):
    """Base of every ``[[pool.sources]]`` table; a subclass sets ``tag = "KIND"``."""

    def describe(self) -> str:
        """How logs and metrics name this source (``dns:NAME``)."""
        raise NotImplementedError


class Source(Protocol):
    """A running source: reports its full endpoint set whenever it may have changed."""

    async def run(self, publish: Publish, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Discover until cancelled. Calls ``task_status.started()`` after the first
        attempt (published or failed); a failure keeps the last set and never ends it."""
        ...


@dataclass(frozen=True)
class SourceKind:
    kind: str
    config: type[SourceConfig]
    factory: Callable[[SourceConfig], Source]


_REGISTRY: dict[str, SourceKind] = {}


def register(config: type[SourceConfig], factory: Callable[[SourceConfig], Source]) -> None:
    """Add a source kind; its ``kind`` is the config class's tag."""
    kind = config.__struct_config__.tag
    if not isinstance(kind, str):
        raise TypeError(f"{config.__name__} needs a string tag (its `kind`)")
    if kind in _REGISTRY and _REGISTRY[kind].config is not config:
        raise ValueError(f"source kind {kind!r} is registered twice")
    _REGISTRY[kind] = SourceKind(kind, config, factory)


def kinds() -> dict[str, SourceKind]:
    """The registered kinds (the built-ins are registered by importing :mod:`epick.pool`)."""
    return dict(_REGISTRY)


def merge(static: Sequence[EndpointSpec],
          found: Sequence[tuple[str, Sequence[EndpointSpec]]]) -> list[EndpointSpec]:
    """Static specs first, then each source's, an address kept once (the first wins)."""
    merged = {s.address: s for s in static}
    for _name, specs in found:
        for spec in specs:
            merged.setdefault(spec.address, spec)
    return list(merged.values())


@dataclass(eq=False)
class _Running:
    config: SourceConfig
    name: str
    scope: anyio.CancelScope
    specs: tuple[EndpointSpec, ...] = ()


class Sources:
    """The runner: owns one task per configured source and applies the merged set.

    ``apply`` is the membership door (the service passes ``Pool.set_endpoints`` plus the
    KV subscriber's); it is called on this event loop, once per change.
    """

    def __init__(self, static: Sequence[EndpointSpec], configs: Sequence[SourceConfig],
                 apply: Callable[[list[EndpointSpec]], None]) -> None:
        self._static = list(static)
        self._configs = list(configs)
        self._apply = apply
        self._running: list[_Running] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._applied: list[EndpointSpec] | None = None

    @property
    def endpoints(self) -> list[EndpointSpec]:
        """The merged set as last applied (static first)."""
        return list(self._applied if self._applied is not None else self._static)

    def found(self) -> dict[str, tuple[EndpointSpec, ...]]:
        """Per running source (``dns:NAME``): what it reports now."""
        return {r.name: r.specs for r in self._running}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every source until cancelled; ``started`` once each made its first attempt."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                for config in self._configs:
                    await self._start(config)
                self._publish()
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._tg = None
                tg.cancel_scope.cancel()

    def update(self, static: Sequence[EndpointSpec], configs: Sequence[SourceConfig]) -> None:
        """A config reload: the new static list at once; sources by equality of their
        table — an unchanged one keeps running (and its set), a removed one stops and
        its endpoints leave, a new one starts (its endpoints arrive with its first
        answer). Call on the event loop."""
        self._static = list(static)
        configs = list(configs)
        keep: list[_Running] = []
        new: list[SourceConfig] = []
        unmatched = list(self._running)
        for config in configs:
            match = next((r for r in unmatched if r.config == config), None)
            if match is not None:
                unmatched.remove(match)
                keep.append(match)
            else:
                new.append(config)
        for gone in unmatched:
            gone.scope.cancel()
            log.info("source %s removed by the config", gone.name)
        self._running = keep
        self._configs = configs
        if self._tg is not None:
            for config in new:
                self._tg.start_soon(self._start, config)
        self._publish()

    async def _start(self, config: SourceConfig) -> None:
        assert self._tg is not None
        kind = _REGISTRY[config.__struct_config__.tag]
        try:
            source = kind.factory(config)
        except Exception as exc:  # e.g. no system resolver: say so, serve the rest
            log.error("source %s cannot start: %s", config.describe(), exc)
            return
        running = _Running(config, config.describe(), anyio.CancelScope())
        self._running.append(running)

        def publish(specs: Sequence[EndpointSpec]) -> None:
            specs = tuple(specs)
            if running not in self._running or specs == running.specs:
                return
            running.specs = specs
            self._publish()

        async def own(*, task_status: TaskStatus[None]) -> None:
            with running.scope:
                await source.run(publish, task_status=task_status)

        await self._tg.start(own, name=f"epick.pool source {running.name}")

    def _publish(self) -> None:
        merged = merge(self._static, [(r.name, r.specs) for r in self._running])
        if merged == self._applied:
            return
        try:
            self._apply(merged)
        except ValueError as exc:  # the door refused it: keep serving the last set
            log.error("endpoint sources: membership not applied: %s", exc)
            return
        self._applied = merged



class StaticSourceConfig(SourceConfig, frozen=True, kw_only=True, tag="static"):
    """``kind = "static"``: a fixed list, like ``[[pool.endpoints]]`` (which is this
    source, conceptually, always first); here for a list kept beside the others."""

    endpoints: list[EndpointSpec] = []

    def describe(self) -> str:
        return f"static:{len(self.endpoints)}"


class StaticSource:
    def __init__(self, config: StaticSourceConfig) -> None:
        self.config = config

    async def run(self, publish: Publish, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        publish(self.config.endpoints)
        task_status.started()
        await anyio.sleep_forever()


register(StaticSourceConfig, StaticSource)
