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
    with VllmFleet(replicas=2, max_loras=2) as f:
        yield f
