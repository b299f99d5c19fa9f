"""examples/envoy/envoy-observer.yaml with a real Envoy, served by the native front end:
test_envoy_observer.py again with ``[server] frontend = "native"`` — requests land where
epick chose, the answer streams event by event, one report per request with its usage,
TTFT and status (the observer's, read by the C++ worker), a client that leaves reported
CANCELLED, no Envoy counter saying a stream to epick failed."""

from __future__ import annotations

import pytest
import test_envoy_observer
from native import collect

collect(test_envoy_observer, globals())

pytestmark = pytest.mark.parametrize("envoy_mode", ["observed"])


@pytest.fixture
def epick(native_epick):
    return native_epick
