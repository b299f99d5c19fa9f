"""Fixtures of the tracing tests: a real OpenTelemetry collector (rotel) for the module,
and an epick service that sends its spans there."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from epick_service import make_config, running  # noqa: E402
from otlp_receiver import Collector  # noqa: E402

from epick import config as cfg  # noqa: E402

MODEL = "m"


@pytest.fixture(scope="module")
def collector(tmp_path_factory) -> Iterator[Collector]:
    c = Collector(tmp_path_factory.mktemp("rotel"))
    try:
        yield c
    finally:
        c.close()


def traced_config(addresses, tmp: Path, collector: Collector, **tracing) -> cfg.Config:
    c = make_config(addresses, policies=("load", "prefix-cache"), tmp=tmp)
    return msgspec.structs.replace(
        c,
        ext_proc=cfg.ExtProcConfig(listen="127.0.0.1:0"),
        openai=cfg.OpenAIConfig(base_model=MODEL),
        http=cfg.HttpConfig(listen="127.0.0.1:0"),
        tracing=cfg.TracingConfig(**{"enabled": True, "endpoint": collector.grpc_endpoint,
                                     "sample_ratio": 1.0, "schedule_delay_ms": 20,
                                     **tracing}))


@pytest.fixture
def epick(tmp_path, collector) -> Iterator:
    """``epick(addresses, **tracing)``: a running service whose spans go to ``collector``."""
    with ExitStack() as stack:
        yield lambda addresses, **kw: stack.enter_context(
            running(traced_config(addresses, tmp_path, collector, **kw)))
