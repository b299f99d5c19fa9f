"""The Kubernetes InferencePool source (``kind = "inference-pool"``): the Ready pods an
upstream ``InferencePool`` (``inference.networking.k8s.io/v1``) selects, each at every
one of the pool's target ports (one endpoint per data-parallel rank).

How it follows the cluster (the informer pattern, by hand, over two watches):

1. **sync** — read the pool (a LIST with ``fieldSelector=metadata.name=NAME``) and the
   pods its selector matches (a LIST with ``labelSelector``); publish the set.
2. **watch** both from the lists' ``resourceVersion``; every pod event updates the set
   and publishes at once (no polling: a pod made Ready is offered within the event's
   delivery plus one scrape round), a pool event that changes the selector or the ports
   starts over at 1 with the new spec.
3. a watch that **breaks** (the server ends it — ``timeoutSeconds``, an apiserver
   restart —, a ``410 Gone``, a network error) starts over at 1: a full resync, so an
   event lost in the gap cannot leave a stale member. An error (the API unreachable,
   401/403, the pool missing or malformed) **keeps the last set**, counts
   ``epick_discovery_errors_total{source="inference-pool:NS/NAME",reason}``, logs (the first
   at WARNING, then at most once a minute) and retries with a back-off doubling from
   ``min_retry_s`` to ``max_retry_s``.

A malformed pod (a bad ``podIP``) is left as it was last seen and logged; a malformed
pool (no ``matchLabels``, no or a bad target port) is an error as above.

The client is kubernetes_asyncio (API paths, auth: in-cluster service account, a
kubeconfig, or a plain URL); responses are read raw (JSON dicts), not through its
generated models. The RBAC this needs — ``get``/``list``/``watch`` on ``pods`` and on
``inferencepools.inference.networking.k8s.io`` in the namespace — is :data:`RBAC_RULES`
(deploy/ ships it; a test checks they agree).
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Annotated, Any

import aiohttp
import anyio
from anyio.abc import TaskStatus
from msgspec import Meta

from epick import telemetry
from epick.pool.k8s_objects import (
    GROUP,
    PLURAL,
    VERSION,
    InvalidObject,
    PodState,
    PoolSpec,
    matches,
    parse_pod,
    parse_pool,
)
from epick.pool.sources import EndpointTemplate, Publish, SourceConfig, register
from epick.pool.spec import EndpointSpec

__all__ = ["InferencePoolSourceConfig", "InferencePoolSource", "ApiError", "RBAC_RULES",
           "FAILURE_LOG_EVERY_S"]

log = logging.getLogger("epick.pool.k8s")

#: After the first failure is logged, repeats are logged at most this often.
FAILURE_LOG_EVERY_S = 60.0

#: What the source asks the API server (apiGroup, resource, verbs): the minimal RBAC.
RBAC_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("", "pods", ("get", "list", "watch")),
    (GROUP, PLURAL, ("get", "list", "watch")),
)

_DNS_LABEL = r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$"  # or empty
_DNS_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class InferencePoolSourceConfig(SourceConfig, frozen=True, kw_only=True, tag="inference-pool"):
    """One ``[[pool.sources]]`` table with ``kind = "inference-pool"``."""

    name: Annotated[str, Meta(pattern=_DNS_NAME)]
    """The InferencePool's name."""
    namespace: Annotated[str, Meta(pattern=_DNS_LABEL)] = ""
    """Its namespace (pods are selected in it too); empty: the kubeconfig context's, or
    the service account's in a cluster; else ``default``."""
    api_server: str = ""
    """The API server's URL (``http://127.0.0.1:8001`` behind ``kubectl proxy``, tests);
    empty: ``kubeconfig`` if set, else the in-cluster service account."""
    kubeconfig: str = ""
    """A kubeconfig file (``~`` expanded); its ``context`` (empty: the current one)."""
    context: str = ""
    watch_timeout_s: Annotated[int, Meta(ge=1, le=3600)] = 300
    """Ask the server to end each watch after this long (then a resync)."""
    request_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """Bound on one LIST (and on connecting a watch)."""
    min_retry_s: Annotated[float, Meta(gt=0)] = 0.2
    """First retry after an error; doubles up to ``max_retry_s``."""
    max_retry_s: Annotated[float, Meta(gt=0)] = 30.0
    template: EndpointTemplate = EndpointTemplate()
    """Engine, labels, metrics URL, KV-event addresses of every endpoint found."""

    def __post_init__(self) -> None:
        where = f"pool.sources inference-pool {self.name!r}"
        if self.api_server and self.kubeconfig:
            raise ValueError(f"{where}: set api_server or kubeconfig, not both")
        if self.api_server and not self.api_server.startswith(("http://", "https://")):
            raise ValueError(f"{where}: api_server {self.api_server!r} is not an http(s) URL")
        if self.context and not self.kubeconfig:
            raise ValueError(f"{where}: context needs kubeconfig")
        if self.min_retry_s > self.max_retry_s:
            raise ValueError(f"{where}: min_retry_s {self.min_retry_s} is above "
                             f"max_retry_s {self.max_retry_s}")

    def describe(self) -> str:
        return f"inference-pool:{self.namespace or '-'}/{self.name}"


class ApiError(Exception):
    """The API server answered with an error status (or an ERROR watch event)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class _Resync(Exception):
    """A watch ended or the pool's spec changed: list again (no back-off, not an error)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, InvalidObject):
        return "invalid"
    if isinstance(exc, ApiError):
        return "not-found" if exc.status == 404 else "forbidden" if exc.status in (
            401, 403) else "api"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return "network"
    return "error"


async def _api_client(config: InferencePoolSourceConfig):
    """A kubernetes_asyncio ApiClient for the configured cluster, and the namespace."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig

    cfg = client.Configuration()
    namespace = config.namespace
    if config.api_server:
        cfg.host = config.api_server.rstrip("/")
    elif config.kubeconfig:
        import os
        loader = await kconfig.load_kube_config(
            config_file=os.path.expanduser(config.kubeconfig), context=config.context or None,
            client_configuration=cfg, persist_config=False)
        if not namespace:  # the context's own namespace, as kubectl takes it
            context = (loader.current_context or {}).get("context") or {}
            namespace = context.get("namespace") or ""
    else:
        kconfig.load_incluster_config(client_configuration=cfg)
        if not namespace:
            try:
                with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                    namespace = f.read().strip()
            except OSError:
                pass
    api = client.ApiClient(configuration=cfg)
    api.user_agent = "epick (pool.sources inference-pool)"  # who asks, in the API's audit log
    return api, namespace or "default"


class InferencePoolSource:
    """Runs one :class:`InferencePoolSourceConfig` (see the module docstring)."""

    def __init__(self, config: InferencePoolSourceConfig, *, clock=time.monotonic) -> None:
        self.config = config
        self.name = config.describe()
        self._clock = clock
        self.namespace = config.namespace or "default"
        self.pool: PoolSpec | None = None
        self.pods: dict[str, PodState] = {}
        self.failures = 0
        self.resyncs = 0
        self._logged_at = -math.inf
        self._gauge = telemetry.DISCOVERY_ENDPOINTS.labels(self.name)
        self._publish: Publish = lambda specs: None
        self._published: tuple[EndpointSpec, ...] | None = None

    # -- the loop -----------------------------------------------------------------------

    async def run(self, publish: Publish, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._publish = publish
        started = False

        def first_attempt() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        try:
            api, self.namespace = await _api_client(self.config)
        except Exception as exc:  # no in-cluster env, bad kubeconfig: say so, stay up
            self._failed(exc)
            first_attempt()
            await anyio.sleep_forever()
            return
        try:
            async with api:
                from kubernetes_asyncio import client
                self._core = client.CoreV1Api(api)
                self._custom = client.CustomObjectsApi(api)
                while True:
                    began = anyio.current_time()
                    try:
                        await self._sync_and_watch(first_attempt)
                    except _Resync as why:
                        self.resyncs += 1
                        log.debug("source %s: resync (%s)", self.name, why)
                        if anyio.current_time() - began < 1.0:  # never spin on a server
                            await anyio.sleep(self.config.min_retry_s)  # that ends watches
                        continue
                    except Exception as exc:
                        self._failed(exc)
                        first_attempt()
                        await anyio.sleep(min(self.config.min_retry_s
                                              * 2 ** min(self.failures - 1, 30),
                                              self.config.max_retry_s))
        finally:
            telemetry.DISCOVERY_ENDPOINTS.remove(self.name)

    async def _sync_and_watch(self, first_attempt) -> None:
        pool, pool_rv = await self._list_pool()
        pods, pods_rv = await self._list_pods(pool)
        self.pool, self.pods = pool, pods
        if self.failures:
            log.info("source %s: recovered after %d failures", self.name, self.failures)
            self.failures = 0
        self._emit()
        first_attempt()
        broke: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            async def guard(watch, *args) -> None:
                try:
                    await watch(*args)
                    broke.append(_Resync(f"{watch.__name__} ended"))
                except Exception as exc:
                    broke.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(guard, self._watch_pool, pool, pool_rv)
            tg.start_soon(guard, self._watch_pods, pool, pods_rv)
        raise broke[0] if broke else _Resync("cancelled")

    # -- API calls (raw JSON) -------------------------------------------------------------

    async def _json(self, call, *args, **kwargs) -> Any:
        with anyio.fail_after(self.config.request_timeout_s):
            resp = await call(*args, _preload_content=False, **kwargs)
            async with resp:
                body = await resp.read()
        data = self._decode(body, resp.status)
        return data

    @staticmethod
    def _decode(body: bytes, status: int) -> Any:
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {"message": body[:200].decode("utf-8", "replace")}
        if not 200 <= status <= 299:
            msg = data.get("message", "") if isinstance(data, dict) else str(data)[:200]
            raise ApiError(status, msg)
        return data

    async def _list_pool(self) -> tuple[PoolSpec, str]:
        cfg = self.config
        where = f"{self.namespace}/{cfg.name}"
        data = await self._json(self._custom.list_namespaced_custom_object, GROUP, VERSION,
                                self.namespace, PLURAL,
                                field_selector=f"metadata.name={cfg.name}")
        items = [i for i in data.get("items") or []
                 if isinstance(i, dict) and (i.get("metadata") or {}).get("name") == cfg.name]
        if not items:
            raise ApiError(404, f"InferencePool {where} not found")
        return parse_pool(items[0], where), str((data.get("metadata") or {})
                                                .get("resourceVersion", ""))

    async def _list_pods(self, pool: PoolSpec) -> tuple[dict[str, PodState], str]:
        data = await self._json(self._core.list_namespaced_pod, self.namespace,
                                label_selector=pool.label_selector)
        pods: dict[str, PodState] = {}
        for item in data.get("items") or []:
            try:
                pod = parse_pod(item)
            except InvalidObject as exc:
                self._bad_object(exc)
                name = ((item.get("metadata") or {}).get("name")
                        if isinstance(item, dict) else None)
                if isinstance(name, str) and name in self.pods:  # kept as last seen
                    pods[name] = self.pods[name]
                continue
            if matches(pool, pod):
                pods[pod.name] = pod
        return pods, str((data.get("metadata") or {}).get("resourceVersion", ""))

    async def _stream(self, call, *args, resource_version: str, **kwargs):
        """The events of one watch, as dicts, until the server ends it."""
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.watch_timeout_s + cfg.request_timeout_s,
                                        connect=cfg.request_timeout_s)
        with anyio.fail_after(cfg.request_timeout_s):
            # "true" as kubectl sends it (the client would send "True": the API server
            # takes both, the emulator only the former).
            resp = await call(*args, watch="true", _preload_content=False,
                              timeout_seconds=cfg.watch_timeout_s, allow_watch_bookmarks="true",
                              resource_version=resource_version or None,
                              _request_timeout=timeout, **kwargs)
        async with resp:
            if not 200 <= resp.status <= 299:
                self._decode(await resp.read(), resp.status)
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    raise InvalidObject(f"watch sent a line that is not JSON: "
                                        f"{line[:200]!r}") from None
                if not isinstance(event, dict):
                    raise InvalidObject(f"watch sent {event!r}, not an event")
                if event.get("type") == "ERROR":  # e.g. 410 Gone: the version is too old
                    obj = event.get("object") or {}
                    raise ApiError(int(obj.get("code", 500)), str(obj.get("message", obj)))
                yield event

    async def _watch_pool(self, pool: PoolSpec, rv: str) -> None:
        cfg = self.config
        where = f"{self.namespace}/{cfg.name}"
        async for event in self._stream(
                self._custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                PLURAL, field_selector=f"metadata.name={cfg.name}", resource_version=rv):
            obj = event.get("object")
            if not isinstance(obj, dict) or (obj.get("metadata") or {}).get("name") != cfg.name:
                continue
            kind = event.get("type")
            if kind == "DELETED":
                raise ApiError(404, f"InferencePool {where} was deleted")
            if kind in ("ADDED", "MODIFIED"):
                new = parse_pool(obj, where)  # invalid: an error, the last set kept
                if (new.match_labels, new.ports) != (pool.match_labels, pool.ports):
                    log.info("source %s: the pool's selector or ports changed", self.name)
                    raise _Resync("the pool changed")

    async def _watch_pods(self, pool: PoolSpec, rv: str) -> None:
        async for event in self._stream(self._core.list_namespaced_pod, self.namespace,
                                        label_selector=pool.label_selector,
                                        resource_version=rv):
            kind = event.get("type")
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                continue  # BOOKMARK
            try:
                pod = parse_pod(event.get("object"))
            except InvalidObject as exc:
                self._bad_object(exc)  # the pod stays as last seen
                continue
            if kind == "DELETED" or not matches(pool, pod):
                self.pods.pop(pod.name, None)
            else:
                self.pods[pod.name] = pod
            self._emit()

    # -- membership -----------------------------------------------------------------------

    def endpoints(self) -> list[EndpointSpec]:
        """Every Ready member pod at every target port, pods by name, ports in pool order."""
        if self.pool is None:
            return []
        template: EndpointTemplate = self.config.template
        out: dict[str, EndpointSpec] = {}
        for name in sorted(self.pods):
            pod = self.pods[name]
            if not pod.ready:
                continue
            for port in self.pool.ports:
                spec = template.spec(pod.ip, port)
                out.setdefault(spec.address, spec)
        return list(out.values())

    def _emit(self) -> None:
        specs = tuple(self.endpoints())
        if specs == self._published:
            return
        self._published = specs
        self._gauge.set(len(specs))
        self._publish(specs)

    # -- errors -------------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        reason = _reason(exc)
        telemetry.DISCOVERY_ERRORS.labels(self.name, reason).inc()
        now = self._clock()
        if self.failures == 1 or now - self._logged_at >= FAILURE_LOG_EVERY_S:
            self._logged_at = now
            kept = len(self._published or ())
            log.log(logging.WARNING if self.failures == 1 else logging.INFO,
                    "source %s: %s (%d in a row, %s); keeping the last %d endpoints",
                    self.name, exc or type(exc).__name__, self.failures, reason, kept)

    def _bad_object(self, exc: InvalidObject) -> None:
        telemetry.DISCOVERY_ERRORS.labels(self.name, "invalid").inc()
        log.error("source %s: %s; that pod is kept as last seen", self.name, exc)


register(InferencePoolSourceConfig, InferencePoolSource)
