"""Helpers for the simulator tests: drive one replica to idle in virtual time."""

from __future__ import annotations

import pytest

from epick.sim.replica import EngineRequest, Replica


def _drain(replica: Replica, until: float = float("inf")) -> list[EngineRequest]:
    """Advance ``replica`` event by event until idle (or ``until``); return finished requests."""
    done: list[EngineRequest] = []
    while (t := replica.next_event_time()) is not None and t <= until:
        done.extend(replica.advance(t).finished)
    return done


@pytest.fixture
def prompt400() -> str:
    return "abcd" * 400  # exactly 400 tokens, 25 full blocks


@pytest.fixture(name="drain")
def drain_fixture():
    """``drain(replica, until=inf)``: run a replica to idle, return what finished."""
    return _drain
