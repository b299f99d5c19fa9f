"""The epick config of the data-plane tests: [http] on a free port, the replicas' base model."""

from __future__ import annotations

from pathlib import Path

import msgspec

from epick import config as cfg

BASE_MODEL = "base"


def make_config(addresses, tmp: Path, *, policies=("load",), server=None,
                **openai) -> cfg.Config:
    # Generous staleness: a busy machine must not make a live replica look stale.
    return msgspec.convert({
        "version": 1,
        "server": {"listen": "127.0.0.1:0", "metrics_listen": "", **(server or {})},
        "pool": {"scrape_interval_ms": 20, "stale_after_ms": 5000, "timeout_ms": 2000,
                 "endpoints": [{"address": a} for a in addresses]},
        "policies": [{"name": p, "module": p} for p in policies],
        "runtime": {"cache_dir": str(tmp / "cache")},
        "admin": {"listen": ""},
        "http": {"listen": "127.0.0.1:0"},
        "openai": {"base_model": BASE_MODEL, **openai},
    }, cfg.Config)
