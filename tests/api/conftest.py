"""Fixtures of the API tests: ``serve`` starts a real epick service (tests/epick_service.py)."""

from __future__ import annotations

import pytest
from epick_service import Running, make_config, running


@pytest.fixture
def serve(tmp_path):
    """``serve(addresses, **kw)`` -> a :class:`Running` service (stopped at teardown)."""
    stack = []

    def start(addresses, **kw) -> Running:
        cm = running(make_config(addresses, tmp=tmp_path, **kw))
        stack.append(cm)
        return cm.__enter__()

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
