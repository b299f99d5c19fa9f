"""Fixtures of the decision-log tests: a runtime, and logs recorded from real picks."""

from __future__ import annotations

import pytest
from decision_logs import record as record_log

from epick.runtime import Limits, Runtime


@pytest.fixture(scope="session")
def runtime():
    """One runtime for recording and replaying, with a generous budget: on a loaded
    machine a 1 ms budget can time a call out live but not in the replay (or the other
    way round), and these tests are about exactness, not budgets."""
    with Runtime(Limits(budget_ms=500.0)) as rt:
        yield rt


@pytest.fixture
def record(runtime):
    """``record(path, weights=None, seconds=5, **log_kw)`` -> (the router, the closed log)."""
    return lambda path, **kw: record_log(runtime, path, **kw)
