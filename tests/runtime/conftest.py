"""Fixtures for the runtime tests: a Runtime, and a loader of the .wat test modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from wat_modules import wasm

from epick.runtime import Limits, Runtime


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    """A Runtime with a generous budget (the machine is shared); tests of the budget
    itself make their own."""
    with Runtime(Limits(budget_ms=50.0)) as rt:
        yield rt


@pytest.fixture
def load(runtime: Runtime) -> Callable[..., object]:
    """``load(name, **subst)``: compile ``wat/<name>.wat`` on the ``runtime`` fixture."""

    def compile_wat(name: str, **subst: object):
        return runtime.compile(wasm(name, **subst), name=name)

    return compile_wat
