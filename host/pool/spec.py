"""What the configuration says about one model-server replica."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

import msgspec

__all__ = ["EndpointSpec", "Engine", "ENGINES", "METRICS_PATH"]

_ZMQ_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}|ipc://.+)$")

Engine = Literal["vllm", "sglang", "trtllm"]
ENGINES: tuple[str, ...] = ("vllm", "sglang", "trtllm")

#: Where each engine serves Prometheus text. trtllm-serve's ``/metrics`` is JSON iteration
#: stats; its Prometheus page is ``/prometheus/metrics`` (mounted with
#: ``return_perf_metrics``; queue/KV gauges need ``enable_iter_perf_stats``).
METRICS_PATH: dict[str, str] = {"vllm": "/metrics", "sglang": "/metrics", "trtllm": "/prometheus/metrics"}


class EndpointSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One replica: where it serves, where its metrics are, and what it may serve.

    ``address`` is the endpoint's identity everywhere (snapshot, policies, telemetry):
    two specs with the same address are the same endpoint.
    """

    address: str
    """``host:port`` the gateway routes to, e.g. ``10.0.0.7:8000`` or ``[::1]:8000``."""
    metrics_url: str | None = None
    """Where to scrape; ``None`` means ``http://{address}`` + the engine's metrics path
    (``/metrics``; ``/prometheus/metrics`` for trtllm)."""
    engine: Engine = "vllm"
    """Which model server, hence which metric names (host/pool/parse.py, ``ENGINE_METRICS``)."""
    labels: dict[str, str] = {}
    models: list[str] | None = None
    """Models it serves; ``None`` = what the engine reports (page labels, ``/v1/models``)."""
    adapters: list[str] | None = None
    """LoRA adapters pinned to it; ``None`` = what the engine reports (``/v1/models``)."""
    discover: bool = True
    """Learn served models and adapters from the engine when not pinned."""
    kv_events: str = ""
    """Its engine's KV-cache event publisher (vLLM ``--kv-events-config`` endpoint), e.g.
    ``tcp://10.0.0.7:5557``, or ``discover`` (ask its ``/kv_event_sources``); empty = off."""
    kv_replay: str = ""
    """Its replay socket (``replay_endpoint``), to fill sequence gaps; empty = none."""
    kv_topic: str = ""
    """The publisher's topic; empty = every topic on that socket."""

    def __post_init__(self) -> None:
        _check_address(self.address)
        if self.metrics_url is not None:
            parts = urlsplit(self.metrics_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(
                    f"metrics_url {self.metrics_url!r} of endpoint {self.address!r} is not "
                    "an http(s) URL (e.g. 'http://10.0.0.7:8000/metrics')"
                )
        for key, value in (("kv_events", self.kv_events), ("kv_replay", self.kv_replay)):
            if value and value != "discover" and not _ZMQ_ENDPOINT.match(value):
                raise ValueError(
                    f"{key} {value!r} of endpoint {self.address!r} is not a ZMQ endpoint "
                    "(e.g. 'tcp://10.0.0.7:5557', 'ipc:///run/kv.sock')"
                    + (" or 'discover'" if key == "kv_events" else ""))
        if self.kv_replay and not self.kv_events:
            raise ValueError(f"kv_replay of endpoint {self.address!r} needs kv_events")
        if self.kv_replay == "discover" or (self.kv_events == "discover" and self.kv_replay):
            raise ValueError(f"endpoint {self.address!r}: kv_events = 'discover' finds the "
                             "replay socket too; leave kv_replay empty")
        # A typed decoder has already checked the Literal; this catches direct construction.
        if self.engine not in ENGINES:
            raise ValueError(
                f"engine {self.engine!r} of endpoint {self.address!r} is not one of "
                f"{', '.join(ENGINES)}"
            )

    @property
    def url(self) -> str:
        """The effective metrics URL."""
        return self.metrics_url or f"http://{self.address}{METRICS_PATH[self.engine]}"

    @property
    def models_url(self) -> str:
        """The OpenAI ``/v1/models`` listing, on the serving address."""
        scheme = urlsplit(self.metrics_url).scheme if self.metrics_url else "http"
        return f"{scheme}://{self.address}/v1/models"


def _check_address(address: str) -> None:
    problem = None
    if not isinstance(address, str) or "/" in address or "@" in address or " " in address:
        problem = "is not host:port"
    else:
        try:
            parts = urlsplit(f"//{address}")
            port = parts.port  # raises ValueError when out of range or not a number
        except ValueError:
            problem = "has an invalid port"
        else:
            if not parts.hostname:
                problem = "has no host"
            elif port is None:
                problem = "has no port"
            elif port == 0:
                problem = "has an invalid port"
    if problem:
        raise ValueError(
            f"endpoint address {address!r} {problem}: expected 'host:port', "
            "e.g. '10.0.0.7:8000' or '[::1]:8000'"
        )
