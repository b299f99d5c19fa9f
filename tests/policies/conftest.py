"""Fixtures for the built-in policies: the real runtime and the committed .wasm files."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from epick.config import BUILTIN_POLICY_DIR
from epick.runtime import Limits, Runtime

DIST = BUILTIN_POLICY_DIR


@pytest.fixture(scope="session")
def runtime():
    # A generous budget: a shared 2-core machine must not turn a slow call into a failure;
    # the budget itself is the runtime's to test.
    rt = Runtime(Limits(budget_ms=500.0))
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def modules(runtime):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = runtime.compile((DIST / f"{name}.wasm").read_bytes(), name=name)
        return cache[name]

    return get


@pytest.fixture
def policy(modules) -> Callable[..., object]:
    """``policy("load", queue_weight=2)``: a fresh instance of a built-in policy."""

    def make(name: str, **params):
        return modules(name).instantiate(params)

    return make
