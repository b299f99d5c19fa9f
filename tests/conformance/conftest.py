"""Fixtures for the conformance suite: the real runtime, shipped modules, built mutants."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from epick.config import BUILTIN_POLICY_DIR
from epick.runtime import Limits, Runtime

DIST = BUILTIN_POLICY_DIR


@pytest.fixture(scope="session")
def runtime():
    # 50 ms, not the 1 ms default: the deadline is wall-clock and this machine is shared.
    # The time-budget property is about the runtime's deadline, whatever it is.
    rt = Runtime(Limits(budget_ms=50.0))
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def shipped(runtime) -> Callable[[str], object]:
    """``shipped("load")``: the committed host/builtin/load.wasm, compiled."""
    cache: dict[str, object] = {}

    def get(name: str):
        path = DIST / f"{name}.wasm"
        if not path.is_file():
            pytest.skip(f"{path} is not built yet (python -m epick.policies_build)")
        if name not in cache:
            cache[name] = runtime.compile(path.read_bytes(), name=name)
        return cache[name]

    return get
