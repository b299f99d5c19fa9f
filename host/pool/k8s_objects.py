"""Reading the two Kubernetes objects the InferencePool source watches, as the API sends
them (JSON dicts): an ``InferencePool`` (``inference.networking.k8s.io/v1``) and a
``Pod`` (``v1``). Pure functions; every refusal is an :class:`InvalidObject` naming the
object and the field.

The InferencePool's shape is upstream's (gateway-api-inference-extension,
``api/v1/inferencepool_types.go``)::

    spec:
      selector: {matchLabels: {app: vllm}}          # required, only matchLabels
      targetPorts: [{number: 8000}, {number: 8001}]  # 1..8; one per data-parallel rank
      endpointPickerRef: {name: epick, portNumber: 9002, failureMode: FailClose}

A pod is a member when it is in the pool's namespace, its labels include every
``matchLabels`` pair, it has a ``status.podIP``, its ``Ready`` condition is ``True`` and it
is not being deleted (``metadata.deletionTimestamp``) — the rules of upstream's picker.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["InvalidObject", "PoolSpec", "PodState", "parse_pool", "parse_pod", "matches",
           "GROUP", "VERSION", "PLURAL", "MAX_TARGET_PORTS"]

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
#: Upstream's schema allows at most this many target ports.
MAX_TARGET_PORTS = 8

# Kubernetes' label key (optional DNS-subdomain prefix + name) and value rules.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


class InvalidObject(ValueError):
    """An object the source cannot use; the message names it and the field."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What membership needs from an InferencePool."""

    match_labels: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]
    resource_version: str = ""

    @property
    def label_selector(self) -> str:
        """The ``labelSelector`` query the API server filters pods with."""
        return ",".join(f"{k}={v}" for k, v in self.match_labels)


@dataclass(frozen=True, slots=True)
class PodState:
    name: str
    ip: str
    ready: bool
    labels: tuple[tuple[str, str], ...]


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidObject(f"{where} must be an object, got {type(value).__name__}")
    return value


def parse_pool(obj: Any, where: str) -> PoolSpec:
    """The selector and target ports of one InferencePool (``where``: ``ns/name``)."""
    obj = _dict(obj, f"InferencePool {where}")
    api_version = obj.get("apiVersion", f"{GROUP}/{VERSION}")
    if api_version != f"{GROUP}/{VERSION}":
        raise InvalidObject(f"InferencePool {where}: apiVersion {api_version!r} is not "
                            f"{GROUP}/{VERSION}")
    spec = _dict(obj.get("spec"), f"InferencePool {where}: spec")
    selector = _dict(spec.get("selector"), f"InferencePool {where}: spec.selector")
    labels = selector.get("matchLabels")
    if not isinstance(labels, dict) or not labels:
        raise InvalidObject(f"InferencePool {where}: spec.selector.matchLabels must be a "
                            "non-empty map of labels (upstream's v1 selects by matchLabels "
                            "only)")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.match(key):
            raise InvalidObject(f"InferencePool {where}: spec.selector.matchLabels key "
                                f"{key!r} is not a label key")
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            raise InvalidObject(f"InferencePool {where}: spec.selector.matchLabels.{key} "
                                f"value {value!r} is not a label value")
    targets = spec.get("targetPorts")
    if not isinstance(targets, list) or not 1 <= len(targets) <= MAX_TARGET_PORTS:
        raise InvalidObject(f"InferencePool {where}: spec.targetPorts must list 1 to "
                            f"{MAX_TARGET_PORTS} ports, got {targets!r}")
    ports: list[int] = []
    for i, target in enumerate(targets):
        number = target.get("number") if isinstance(target, dict) else None
        if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
            raise InvalidObject(f"InferencePool {where}: spec.targetPorts[{i}].number must "
                                f"be a port (1-65535), got {number!r}")
        if number in ports:
            raise InvalidObject(f"InferencePool {where}: spec.targetPorts[{i}].number "
                                f"{number} is listed twice")
        ports.append(number)
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return PoolSpec(tuple(sorted(labels.items())), tuple(ports),
                    str(meta.get("resourceVersion", "")))


def parse_pod(obj: Any) -> PodState:
    """One Pod's name, IP, readiness and labels; InvalidObject if it is malformed."""
    obj = _dict(obj, "Pod")
    meta = _dict(obj.get("metadata"), "Pod metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidObject(f"Pod without metadata.name: {str(obj)[:200]}")
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        raise InvalidObject(f"Pod {name}: metadata.labels must be a map")
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        raise InvalidObject(f"Pod {name}: status must be an object")
    ip = status.get("podIP") or ""
    if ip:
        try:
            ipaddress.ip_address(ip)
        except (ValueError, TypeError):
            raise InvalidObject(f"Pod {name}: status.podIP {ip!r} is not an IP "
                                "address") from None
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        raise InvalidObject(f"Pod {name}: status.conditions must be a list")
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
                for c in conditions)
    deleting = bool(meta.get("deletionTimestamp"))
    return PodState(name, ip, bool(ip) and ready and not deleting,
                    tuple(sorted((str(k), str(v)) for k, v in labels.items())))


def matches(pool: PoolSpec, pod: PodState) -> bool:
    """The pod's labels include every pair of the pool's selector."""
    labels = dict(pod.labels)
    return all(labels.get(k) == v for k, v in pool.match_labels)
