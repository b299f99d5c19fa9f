"""Wiring for ``epick serve``: the index, tokenizer, hasher, routing seam and subscriber
built from a :class:`~epick.config.Config` — or nothing when no endpoint sets
``kv_events`` (then picks pay nothing for this feature)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from epick.config import Config, ConfigError
from epick.kv.hashing import BlockHasher, HashConfigError
from epick.kv.index import KvIndex
from epick.kv.metrics import KV_STATS
from epick.kv.routing import KvRouting
from epick.kv.subscriber import EventSource, KvSubscriber
from epick.kv.tokenize import TokenizerError, load_tokenizer
from epick.pool import EndpointSpec

__all__ = ["KvEvents", "sources"]


def sources(specs: Sequence[EndpointSpec]) -> list[EventSource]:
    return [EventSource(s.address, s.kv_events, s.kv_replay, s.kv_topic)
            for s in specs if s.kv_events]


class KvEvents:
    def __init__(self, routing: KvRouting, subscriber: KvSubscriber) -> None:
        self.routing = routing
        self.subscriber = subscriber
        self.index = routing.index

    @classmethod
    def from_config(cls, config: Config, config_path: Path | None = None) -> KvEvents | None:
        """Build it, or None when off; a bad tokenizer or hash setting is a ConfigError."""
        if not any(s.kv_events for s in config.pool.endpoints):
            return None
        kc = config.kv_events
        source = str(config_path or "config")
        base = config_path.parent if config_path is not None else None
        try:
            tokenizer = load_tokenizer(kc.tokenizer, base)
        except TokenizerError as exc:
            raise ConfigError(source, f"kv_events.tokenizer: {exc}") from None
        try:
            hasher = BlockHasher(kc.hash_algo, kc.hash_seed or None)
        except HashConfigError as exc:
            raise ConfigError(source, f"kv_events: {exc}") from None
        index = KvIndex(kc.max_blocks_per_endpoint)
        routing = KvRouting(index, tokenizer, hasher, block_size=kc.block_size,
                            lora_paths=kc.lora_paths)
        sub = KvSubscriber(index, replay_timeout_s=kc.replay_timeout_ms / 1000,
                           lora_discovery=kc.discover_lora_paths,
                           on_lora_paths=routing.set_lora_paths, on_drop=routing.forget)
        sub.set_endpoints(sources(config.pool.endpoints))
        KV_STATS.source = lambda: (sub.stats(), index)
        return cls(routing, sub)

    def set_endpoints(self, specs: Sequence[EndpointSpec]) -> None:
        self.subscriber.set_endpoints(sources(specs))
