"""The pool reads the simulator's vLLM pages exactly as the simulator says a router would.

The simulator renders pages with prometheus_client the way vLLM v1 does and predicts the
EndpointMetrics a router sees (``MetricsPage.endpoint_metrics``); the pool's parser must
agree, or simulated routing would not be the routing epick does.
"""

from __future__ import annotations

import msgspec
import pytest

from epick.abi import EndpointMetrics
from epick.pool import parse_metrics
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.metrics import MetricsPage, PageState
from epick.sim.replica import Replica

ADDRESS = "10.0.0.7:8000"
PREVIOUS = EndpointMetrics(address=ADDRESS, running_adapters=("old",), waiting_adapters=("w",))

STATES = {
    "idle-startup": PageState(0, 0, 0.0, (("", "", 1000.0),)),
    "busy": PageState(7, 3, 0.625, (("", "", 1000.0), ("a,b", "c", 1001.5))),
    "newest-wins": PageState(2, 0, 0.1, (("a", "", 1001.0), ("b", "", 1003.0), ("c", "", 1002.0))),
    "idle-after-busy": PageState(0, 0, 0.0, (("a", "", 1001.0), ("", "", 1002.0))),
    "full": PageState(64, 200, 1.0, (("a,b,c,d", "e,f", 1009.0),)),
}


@pytest.mark.parametrize("previous", [None, PREVIOUS], ids=["first-scrape", "with-previous"])
@pytest.mark.parametrize("state", list(STATES.values()), ids=list(STATES))
def test_pool_parse_agrees_with_the_simulators_prediction(state, previous):
    page = MetricsPage(Replica(msgspec.structs.replace(DEFAULT_CONFIG, max_loras=4)),
                       clock_origin=1000.0)
    text = page.render(state).decode()
    got = parse_metrics(text, engine="vllm", url=f"http://{ADDRESS}/metrics", previous=previous)
    assert got == page.endpoint_metrics(state, ADDRESS, previous)


def test_pool_parse_agrees_on_a_page_without_lora():
    # Only on a first scrape: with previous adapter sets the two differ on purpose. The sim
    # keeps them; the pool reads "no lora_requests_info at all" as LoRA disabled (empty
    # sets) — the previous sets can only be left over from before a restart.
    page = MetricsPage(Replica(msgspec.structs.replace(DEFAULT_CONFIG, max_loras=0)),
                       clock_origin=1000.0)
    state = PageState(1, 2, 0.5, ())
    got = parse_metrics(page.render(state).decode(), engine="vllm",
                        url=f"http://{ADDRESS}/metrics", previous=None)
    assert got == page.endpoint_metrics(state, ADDRESS, None)
